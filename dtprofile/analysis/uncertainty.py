"""How much a run's figures would move if the same job were profiled again.

A step's time varies from step to step, and neighbouring steps vary together (a slow
phase of the machine, a loader's workers handing over batches in pairs). So each rank's
steady steps are cut into :data:`BLOCKS` consecutive blocks (the *batch means* method,
for series whose neighbours are correlated), and each block is averaged as the whole
run is (:func:`~dtprofile.capture.windows.averages`). A *replicate* of the run draws,
for every rank, that many blocks with replacement (and its probe steps likewise), and
averages them; the cluster's figures follow from the replicate's ranks exactly as from
the run's (medians over ranks, the probe's compute, the wait for a slower rank), and so
do the projection and the recommendations. Over :data:`REPLICATES` replicates the
central :data:`LEVEL` of each figure's values is its interval.

The intervals hold the run's own variation, over steps, blocks and ranks: a longer run
(more steps a block) narrows them. They do not hold what changes between runs that this
run never saw (another node, another day's network).

The arithmetic here is framework-free: rows in, numbers out. The keys each rank's row
carries are :data:`BLOCK_KEYS` and :data:`PROBE_KEYS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._values import parse_finite

__all__ = [
    "BLOCKS",
    "BLOCK_FIELDS",
    "BLOCK_KEYS",
    "LEVEL",
    "PROBE_SAMPLES",
    "PROBE_KEYS",
    "REPLICATES",
    "block_key",
    "probe_key",
    "replicate_rows",
    "interval",
    "intervals_of",
    "run_intervals",
]

#: Blocks of consecutive steps each rank's steady steps are cut into.
BLOCKS = 8
#: Probe steps (the latest) each rank keeps one by one for the replicates.
PROBE_SAMPLES = 8
#: Replicates drawn; the seed is fixed, so the same rows give the same intervals.
REPLICATES = 120
#: The central share of the replicates' values an interval holds.
LEVEL = 0.9
#: The per-step figures each block carries (``per_step_ms``'s measured parts).
BLOCK_FIELDS: tuple[str, ...] = (
    "step",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "comm_total",
    "comm_exposed",
    "compute",
    "overhead",
    "data_transfer",
    "comm_buffers",
)
#: A probe step's figures kept one by one.
PROBE_FIELDS: tuple[str, ...] = ("compute", "comm")


def block_key(index: int, field: str) -> str:
    """The row key of block ``index``'s ``field``: ``"block3_step"``."""
    return f"block{index}_{field}"


def probe_key(index: int, field: str) -> str:
    """The row key of kept probe step ``index``'s ``field``: ``"probe_sample2_compute"``."""
    return f"probe_sample{index}_{field}"


BLOCK_KEYS: tuple[str, ...] = tuple(block_key(i, f) for i in range(BLOCKS) for f in BLOCK_FIELDS)
PROBE_KEYS: tuple[str, ...] = tuple(probe_key(i, f) for i in range(PROBE_SAMPLES) for f in PROBE_FIELDS)


def _columns(row: Mapping[str, Any], count: int, key: Any, fields: Sequence[str]) -> np.ndarray | None:
    """The row's samples as an array (samples x fields; NaN where not measured), the
    samples that hold a step figure only; None when there are fewer than two."""
    data = np.array([[_number(row.get(key(i, f))) for f in fields] for i in range(count)], dtype=float)
    data = data[np.isfinite(data[:, 0])]
    return data if len(data) >= 2 else None


def _number(value: Any) -> float:
    """``value`` as a float, NaN where it is not a finite number (not measured)."""
    number = parse_finite(value)
    return np.nan if number is None else number


def replicate_rows(rows: Sequence[Mapping[str, Any]], rng: np.random.Generator) -> list[dict[str, Any]] | None:
    """One replicate of the ranks' rows: each rank's averages replaced by the mean of
    its blocks drawn with replacement (and its probe figures by its probe steps drawn
    likewise); None when no rank has blocks.

    Args:
        rows: The ranks' rows (:func:`dtprofile.summary.rank_row`), with their
            :data:`BLOCK_KEYS` and :data:`PROBE_KEYS`.
        rng: The generator drawing the blocks.

    Returns:
        New rows, the other keys as they were.

    Example:
        >>> row = {"rank": 0, "step": 10.0, **{block_key(i, "step"): 8.0 + i for i in range(BLOCKS)}}
        >>> rep = replicate_rows([row], np.random.default_rng(0))[0]
        >>> 5.0 <= rep["step"] <= 15.0 and rep["rank"] == 0
        True
    """
    out, any_blocks = [], False
    for row in rows:
        new = dict(row)
        blocks = _columns(row, BLOCKS, block_key, BLOCK_FIELDS)
        if blocks is not None:
            any_blocks = True
            drawn = blocks[rng.integers(0, len(blocks), len(blocks))]
            # A mean of n blocks drawn from n varies by (n - 1) / n of the true mean's
            # variance: each draw's distance from the blocks' mean is widened to match.
            widen = math.sqrt(len(blocks) / (len(blocks) - 1))
            for j, field in enumerate(BLOCK_FIELDS):
                column, every = drawn[:, j], blocks[:, j]
                column, every = column[np.isfinite(column)], every[np.isfinite(every)]
                if column.size and new.get(field) is not None:
                    new[field] = max(0.0, float(new[field] + widen * (column.mean() - every.mean())))
            # (each part moved on its own: the step holds them as the run's does)
            if new.get("step") is not None and new.get("overhead") is not None:
                new["step"] = max(new["step"], new["overhead"])
        probes = _columns(row, PROBE_SAMPLES, probe_key, PROBE_FIELDS)
        if probes is not None and new.get("probe_compute") is not None:
            drawn = probes[rng.integers(0, len(probes), len(probes))]
            widen = math.sqrt(len(probes) / (len(probes) - 1))
            before = new["probe_compute"]
            new["probe_compute"] = max(0.0, float(before + widen * (drawn[:, 0].mean() - probes[:, 0].mean())))
            for phase in ("probe_forward", "probe_backward", "probe_optimizer"):  # (T_C's parts, in proportion)
                if new.get(phase) is not None and before:
                    new[phase] = new[phase] * new["probe_compute"] / before
            comm, every = drawn[:, 1][np.isfinite(drawn[:, 1])], probes[:, 1][np.isfinite(probes[:, 1])]
            if comm.size and new.get("probe_comm") is not None:
                new["probe_comm"] = max(0.0, float(new["probe_comm"] + widen * (comm.mean() - every.mean())))
        out.append(new)
    return out if any_blocks else None


def interval(values: Iterable[Any], level: float = LEVEL) -> list[float] | None:
    """The central ``level`` of ``values`` (None and non-finite left out) as ``[low,
    high]``; None when fewer than half of them are numbers.

    >>> [round(v, 6) for v in interval(range(101))]
    [5.0, 95.0]
    """
    values = list(values)
    numbers = [v for v in (parse_finite(x) for x in values) if v is not None]
    if not numbers or len(numbers) * 2 < len(values):
        return None
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(numbers, [tail, 100 - tail])
    return [float(low), float(high)]


def intervals_of(series: Sequence[Sequence[Any]], level: float = LEVEL) -> list[list[float] | None]:
    """:func:`interval` of each position of equal-length ``series`` (one per replicate):
    a projection's list per device count, for instance."""
    if not series:
        return []
    width = max(len(s) for s in series)
    return [interval((s[i] if i < len(s) else None for s in series), level) for i in range(width)]


def run_intervals(
    rows: Sequence[Mapping[str, Any]], summarize: Callable[[list[dict[str, Any]]], Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The summary's ``uncertainty``: :data:`REPLICATES` replicates of the ranks' rows, each
    made into a summary by ``summarize``, projected and recommended from exactly as the
    run is.

    Args:
        rows: The ranks' rows as they were gathered (with their blocks and probe samples).
        summarize: Rows -> a summary without its analysis (``build_summary(...,
            analyze=False)``); it may raise ArithmeticError or ValueError for a replicate
            the model cannot take, which is left out.

    Returns:
        ``level``, ``replicates``, ``blocks_per_rank``, and the intervals of
        ``per_step_ms``, ``ratios``, ``algbw_GBps``, the projection's ``step_ms``,
        ``speedup`` and ``efficiency`` per G and the recommended ``gpus`` and
        ``bandwidth_needed_Gbps`` (docs/summary.md); None without blocks (a short run).
    """
    from .projection import project_summary
    from .recommendations import recommend

    rng = np.random.default_rng(0)
    per_step: dict[str, list[Any]] = {}
    ratios: dict[str, list[Any]] = {}
    algbw, projections, recommended, needed = [], [], [], []
    for _ in range(REPLICATES):
        replicate = replicate_rows(rows, rng)
        if replicate is None:
            return None
        try:
            summary = summarize(replicate)
        except (ArithmeticError, ValueError):  # a replicate the model cannot take: left out
            continue
        for key, value in summary["per_step_ms"].items():
            per_step.setdefault(key, []).append(value)
        for key in ("R_O", "data_fraction", "comm_fraction"):
            ratios.setdefault(key, []).append(summary["ratios"].get(key))
        algbw.append(summary.get("algbw_GBps"))
        try:
            projection = project_summary(summary)
            rec = recommend(summary, projection)
        except (ArithmeticError, ValueError):
            continue
        projections.append(projection)
        recommended.append(rec.get("gpus"))
        needed.append(rec.get("bandwidth_needed_Gbps"))
    if not projections:
        return None
    gpus = list(projections[0].get("gpus") or [])
    blocks = [sum(1 for i in range(BLOCKS) if r.get(block_key(i, "step")) is not None) for r in rows]
    return {
        "level": LEVEL,
        "replicates": REPLICATES,
        "blocks_per_rank": min(blocks),
        "per_step_ms": {k: interval(v) for k, v in per_step.items()},
        "ratios": {k: interval(v) for k, v in ratios.items()},
        "algbw_GBps": interval(algbw),
        "projection": {
            "gpus": gpus,
            "scaling": projections[0].get("scaling"),
            **{k: intervals_of([p.get(k) or [] for p in projections]) for k in ("step_ms", "speedup", "efficiency")},
        },
        "recommendations": {"gpus": interval(recommended), "bandwidth_needed_Gbps": interval(needed)},
    }
