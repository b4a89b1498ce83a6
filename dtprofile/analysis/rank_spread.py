"""The ranks' figures as distributions, and per node: what a person with a thousand ranks
reads instead of a thousand bars.

:func:`rank_spread` turns the summary's per-rank entries (``ranks``) into, per figure,
its median, 10th and 90th percentiles, its least and greatest value and the ranks that
hold them; and each node's median busy time and the slowest node, named by its host. The
nodes are the ranks' hosts where the rows name them (``host``: every rank's hostname,
read by rank 0 at stop) and there are two or more; else, where the launcher said how
many ranks share a node (``LOCAL_WORLD_SIZE``, the summary's ``run.ranks_per_host``;
torchrun, Lightning and Accelerate place a node's ranks contiguously), blocks of that
many ranks. Framework-free: numbers in, numbers out, bounded whatever the rank count (the
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
from typing import Any, cast

import numpy as np

from .._values import finite

__all__ = ["MAX_NODES_LISTED", "RANKS_LISTED", "SPREAD_FIELDS", "in_node", "node_label", "rank_spread"]

#: Up to this many ranks, each rank is read on its own (the tab's bars, the scalars and the
#: evidence per rank); more are read as a distribution (:func:`rank_spread`).
RANKS_LISTED = 16

#: The per-rank figures summarised.
SPREAD_FIELDS: tuple[str, ...] = ("step", "compute", "forward", "backward", "data_wait", "comm_exposed")
#: Nodes listed by their median step (the slowest first); the rest are in the percentiles.
MAX_NODES_LISTED = 8
#: The slowest node's ranks listed one by one where they are not contiguous (by host).
MAX_MEMBERS_LISTED = 64


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


def _host_nodes(ranks: Sequence[Mapping[str, Any]]) -> dict[str, list[int]] | None:
    """The ranks by host (``host``, the summary's rows on rank 0 at stop), where every rank
    names one and they name two or more; else None (then LOCAL_WORLD_SIZE decides: several
    emulated nodes on one machine share a hostname)."""
    hosts: dict[str, list[int]] = {}
    for entry in ranks:
        rank, host = entry.get("rank"), entry.get("host")
        if not isinstance(rank, int):
            continue
        if not isinstance(host, str) or not host:
            return None
        hosts.setdefault(host, []).append(rank)
    return hosts if len(hosts) >= 2 else None


def _busy_by_rank(ranks: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Each rank's busy time (step less exposed communication). Ranks of a pipeline's
    stages (``pipeline_stage``) differ by design: each is taken relative to its stage's
    median, around the median rank's, so that a node is slow for what it does, not for
    the stage it holds (``stage_imbalance`` speaks of the stages)."""
    busy: dict[int, float] = {}
    stage_of: dict[int, Any] = {}
    for entry in ranks:
        rank, step = entry.get("rank"), finite(entry.get("step"))
        if isinstance(rank, int) and step is not None:
            busy[rank] = step - (finite(entry.get("comm_exposed")) or 0.0)
            stage_of[rank] = entry.get("pipeline_stage")
    stages = {s for s in stage_of.values() if s is not None}
    if len(stages) < 2 or not busy:
        return busy
    overall = statistics.median(busy.values())
    by_stage: dict[Any, list[float]] = {}
    for rank, ms in busy.items():
        by_stage.setdefault(stage_of[rank], []).append(ms)
    medians = {stage: statistics.median(v) for stage, v in by_stage.items()}
    return {rank: ms - medians[stage_of[rank]] + overall for rank, ms in busy.items()}


def _nodes(ranks: Sequence[Mapping[str, Any]], per_node: int | None) -> dict[str, Any] | None:
    """Each node's median busy time, the slowest listed first. A node is a host where the
    ranks' hosts are known (numbered by their lowest rank), else ``rank // per_node``.

    Busy is the step less the exposed communication: synchronous collectives make every
    rank's step as long as the slowest's, so a slow node shows in what its ranks do, not
    in their steps (the ranks that wait for it wait in their exposed communication)."""
    hosts = _host_nodes(ranks)
    names: list[str] = []
    node_of: dict[int, int] = {}
    if hosts is not None:
        names = sorted(hosts, key=lambda h: min(hosts[h]))
        node_of = {r: node for node, host in enumerate(names) for r in hosts[host]}
    elif not per_node:
        return None
    by_node: dict[int, list[float]] = {}
    busy = _busy_by_rank(ranks)
    for rank, ms in busy.items():
        by_node.setdefault(node_of[rank] if hosts is not None else rank // cast(int, per_node), []).append(ms)
    if len(by_node) < 2:
        return None
    medians = sorted(((statistics.median(v), node) for node, v in by_node.items()), reverse=True)
    overall = statistics.median(m for m, _ in medians)
    slowest_ms, slowest = medians[0]
    out: dict[str, Any] = {
        "source": "hosts" if hosts is not None else "local_world_size",
        "ranks_per_node": per_node,
        "count": len(by_node),
        "median_busy_ms": overall,
        "slowest": {"node": slowest, "busy_ms": slowest_ms, "excess_ms": slowest_ms - overall},
        "listed": [{"node": node, "busy_ms": ms} for ms, node in medians[:MAX_NODES_LISTED]],
    }
    if hosts is None:
        out["slowest"]["ranks"] = [
            slowest * cast(int, per_node),
            slowest * cast(int, per_node) + cast(int, per_node) - 1,
        ]
        return out
    counts = [len(hosts[h]) for h in names]
    out["ranks_per_node"] = statistics.median_low(counts)  # (the usual node's; uneven ones are rare)
    members = sorted(hosts[names[slowest]])
    out["slowest"].update(host=names[slowest], ranks=[members[0], members[-1]], rank_count=len(members))
    if members[-1] - members[0] + 1 != len(members):  # not contiguous: which ones (bounded)
        out["slowest"]["members"] = members[:MAX_MEMBERS_LISTED]
    for listed in out["listed"]:
        listed["host"] = names[listed["node"]]
    return out


def node_label(node: Mapping[str, Any]) -> str:
    """A node of ``rank_spread.nodes`` (its ``slowest``) in words: its host where known.

    Example:
        >>> node_label({"node": 77, "ranks": [616, 623]})
        'node 77 (ranks 616-623)'
        >>> node_label({"node": 3, "host": "gpu-17", "ranks": [1, 13], "rank_count": 3, "members": [1, 5, 13]})
        'host gpu-17 (node 3, ranks 1, 5, 13)'
    """
    first, last = (list(node.get("ranks") or []) + [None, None])[:2]
    members = node.get("members")
    if isinstance(members, list) and members:
        count = node.get("rank_count") or len(members)
        more = count - len(members) if isinstance(count, int) else 0
        ranks = "ranks " + ", ".join(map(str, members)) + (f" and {more} more" if more > 0 else "")
    else:
        ranks = f"ranks {first}-{last}"
    host = node.get("host")
    return f"host {host} (node {node.get('node')}, {ranks})" if host else f"node {node.get('node')} ({ranks})"


def in_node(node: Mapping[str, Any], rank: Any) -> bool:
    """Whether ``rank`` is one of the ranks of a node of ``rank_spread.nodes``."""
    bounds = node.get("ranks")
    if not isinstance(rank, int) or not isinstance(bounds, list) or len(bounds) != 2:
        return False
    members = node.get("members")
    if isinstance(members, list) and len(members) == node.get("rank_count"):
        return rank in members
    if isinstance(members, list):  # (its ranks, cut short: one beyond them may be another host's)
        return False
    return bool(bounds[0] <= rank <= bounds[1])


def rank_spread(ranks: Sequence[Mapping[str, Any]], ranks_per_host: Any = None) -> dict[str, Any] | None:
    """The summary's ``rank_spread``: per figure of :data:`SPREAD_FIELDS` its distribution
    over the ranks (``median``, ``p10``, ``p90``, ``min`` and ``max`` with ``min_rank`` and
    ``max_rank``), and ``nodes`` where the ranks' hosts, or else ``ranks_per_host``, split
    them into two or more nodes (``nodes.source``: ``hosts`` or ``local_world_size``); None
    for fewer than two ranks.

    Args:
        ranks: The summary's per-rank entries (``rank``, ``host`` where known, and the
            per-step figures).
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
    out["nodes"] = _nodes(ranks, int(per_node) if per_node and per_node >= 1 else None)
    return out
