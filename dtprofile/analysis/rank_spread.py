"""The ranks' figures as distributions, and per node: what a person with a thousand ranks
reads instead of a thousand bars.

:func:`rank_spread` turns the summary's per-rank entries (``ranks``) into, per figure,
its median, 10th and 90th percentiles, its least and greatest value and the ranks that
hold them; and, where the launcher said how many ranks share a node
(``LOCAL_WORLD_SIZE``, the summary's ``run.ranks_per_host``; torchrun, Lightning and
Accelerate place a node's ranks contiguously), each node's median step and the slowest
node. Framework-free: numbers in, numbers out, bounded whatever the rank count (the
nodes listed are the slowest :data:`MAX_NODES_LISTED`).

Example:
    >>> ranks = [{"rank": r, "step": 10.0 + (r == 5) * 4.0} for r in range(8)]
    >>> spread = rank_spread(ranks, ranks_per_host=4)
    >>> spread["step"]["max"], spread["step"]["max_rank"], spread["nodes"]["slowest"]["node"]
    (14.0, 5, 1)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._values import finite

__all__ = ["MAX_NODES_LISTED", "RANKS_LISTED", "SPREAD_FIELDS", "rank_spread"]

#: Up to this many ranks, each rank is read on its own (the tab's bars, the scalars and the
#: evidence per rank); more are read as a distribution (:func:`rank_spread`).
RANKS_LISTED = 16

#: The per-rank figures summarised.
SPREAD_FIELDS: tuple[str, ...] = ("step", "compute", "forward", "backward", "data_wait", "comm_exposed")
#: Nodes listed by their median step (the slowest first); the rest are in the percentiles.
MAX_NODES_LISTED = 8


def _distribution(values: list[tuple[float, Any]]) -> dict[str, Any]:
    numbers = np.array([v for v, _ in values], dtype=float)
    low, high = int(np.argmin(numbers)), int(np.argmax(numbers))
    p10, p50, p90 = np.percentile(numbers, [10, 50, 90])
    return {
        "median": float(p50),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(numbers[low]),
        "min_rank": values[low][1],
        "max": float(numbers[high]),
        "max_rank": values[high][1],
    }


def _nodes(ranks: Sequence[Mapping[str, Any]], per_node: int) -> dict[str, Any] | None:
    """Each node's median busy time (node = rank // per_node), the slowest listed first.

    Busy is the step less the exposed communication: synchronous collectives make every
    rank's step as long as the slowest's, so a slow node shows in what its ranks do, not
    in their steps (the ranks that wait for it wait in their exposed communication)."""
    by_node: dict[int, list[float]] = {}
    for entry in ranks:
        rank, step = entry.get("rank"), finite(entry.get("step"))
        busy = None if step is None else step - (finite(entry.get("comm_exposed")) or 0.0)
        if isinstance(rank, int) and busy is not None:
            by_node.setdefault(rank // per_node, []).append(busy)
    if len(by_node) < 2:
        return None
    medians = sorted(((statistics.median(v), node) for node, v in by_node.items()), reverse=True)
    overall = statistics.median(m for m, _ in medians)
    slowest_ms, slowest = medians[0]
    return {
        "ranks_per_node": per_node,
        "count": len(by_node),
        "median_busy_ms": overall,
        "slowest": {
            "node": slowest,
            "ranks": [slowest * per_node, slowest * per_node + per_node - 1],
            "busy_ms": slowest_ms,
            "excess_ms": slowest_ms - overall,
        },
        "listed": [{"node": node, "busy_ms": ms} for ms, node in medians[:MAX_NODES_LISTED]],
    }


def rank_spread(ranks: Sequence[Mapping[str, Any]], ranks_per_host: Any = None) -> dict[str, Any] | None:
    """The summary's ``rank_spread``: per figure of :data:`SPREAD_FIELDS` its distribution
    over the ranks (``median``, ``p10``, ``p90``, ``min`` and ``max`` with ``min_rank`` and
    ``max_rank``), and ``nodes`` where ``ranks_per_host`` splits the ranks into two or more
    nodes; None for fewer than two ranks.

    Args:
        ranks: The summary's per-rank entries (``rank`` and the per-step figures).
        ranks_per_host: The ranks a node holds (``run.ranks_per_host``), or None.

    Returns:
        The spread, bounded whatever the rank count.
    """
    if len(ranks) < 2:
        return None
    out: dict[str, Any] = {"ranks": len(ranks)}
    for field in SPREAD_FIELDS:
        values = [(v, entry.get("rank")) for entry in ranks if (v := finite(entry.get(field))) is not None]
        if len(values) >= 2:
            out[field] = _distribution(values)
    per_node = finite(ranks_per_host)
    out["nodes"] = _nodes(ranks, int(per_node)) if per_node and per_node >= 1 else None
    return out
