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
(more steps a block) narrows them. What moves a whole run (where the ranks' threads
landed, the network's load that hour) shows only across runs: given earlier runs of the
same job (:mod:`dtprofile.run_history`), each replicate is moved as a whole to the
pooled runs' mean and then by one pooled run's distance from it (:func:`run_shifts`, on a
log scale, figure by figure), so the intervals hold where the job's next run falls: the
spread between runs, centred on the job rather than on this run (whose point figures
stay its own, and may lie off-centre in them).

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
    "MAX_INTERVAL_RANKS",
    "PROBE_SAMPLES",
    "PROBE_KEYS",
    "REPLICATES",
    "block_key",
    "probe_key",
    "replicate_rows",
    "run_shifts",
    "spread_ranks",
    "comparable",
    "interval",
    "intervals_of",
    "run_intervals",
]

#: Blocks of consecutive steps each rank's steady steps are cut into.
BLOCKS = 8
#: Probe steps (the latest) each rank keeps one by one for the replicates.
PROBE_SAMPLES = 8
#: Ranks the replicates draw from, at most: a larger run's intervals come from this many
#: spread evenly over its ranks' step times (the slowest and the fastest among them). A
#: median over fewer ranks varies more: the intervals are wider than the whole run's,
#: never narrower, and building them costs the same at 64 ranks as at 4,096.
MAX_INTERVAL_RANKS = 64
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


#: Row fields moved with a pooled figure other than their own name's: T_C's probe figures
#: with ``compute``, the probe's communication with ``comm_total``.
_SHIFTED_WITH: dict[str, str] = {
    "probe_compute": "compute",
    "probe_forward": "compute",
    "probe_backward": "compute",
    "probe_optimizer": "compute",
    "probe_comm": "comm_total",
}


#: An earlier run is pooled only where its step is within this ratio of this run's ...
SAME_RUN_STEP_RATIO = 1.25
#: ... and its data wait, exposed communication and overhead each within this share of the
#: step of this run's: a larger change is the job changed (advice followed), not noise.
#: Runs of one job on a shared 2-core machine moved by up to 15% of the step, and each
#: part by up to 5% of it (benchmarks/repeatability.py, quiet against loaded).
SAME_RUN_SHARE = 0.10
_SHARES = ("data_wait", "comm_exposed", "overhead")


def comparable(current: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether ``other``'s ``per_step_ms`` could be this run's job again rather than the
    job changed (:data:`SAME_RUN_STEP_RATIO`, :data:`SAME_RUN_SHARE`).

    Example:
        >>> comparable({"step": 40.0, "data_wait": 2.0}, {"step": 44.0, "data_wait": 4.0})
        True
        >>> comparable({"step": 40.0, "data_wait": 2.0}, {"step": 44.0, "data_wait": 12.0})
        False
    """
    step, other_step = parse_finite(current.get("step")), parse_finite(other.get("step"))
    if not step or not other_step or step <= 0 or other_step <= 0:
        return False
    if max(step, other_step) > SAME_RUN_STEP_RATIO * min(step, other_step):
        return False
    for part in _SHARES:
        a, b = parse_finite(current.get(part)), parse_finite(other.get(part))
        if a is not None and b is not None and abs(a / step - b / other_step) > SAME_RUN_SHARE:
            return False
    return True


def run_shifts(current: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The factors that move this run's replicates to where the job's runs fall, figure by
    figure: to the pooled runs' mean (this run's figures and earlier runs' of the same job,
    on a log scale: a run 10% slower moves every figure by the same ratio, whatever its
    size), then by one pooled run's distance from that mean.

    Args:
        current: This run's ``per_step_ms``.
        earlier: Earlier runs' ``per_step_ms`` (:func:`dtprofile.run_history.earlier_runs`);
            those not :func:`comparable` with this run (the job changed) are left out.

    Returns:
        One ``{figure: factor}`` per pooled run (this one first); a figure missing or
        not positive in any run is left out of all. ``[]`` without earlier runs.

    Example:
        >>> shifts = run_shifts({"step": 10.0}, [{"step": 12.0}, {"step": 8.0}])
        >>> [round(s["step"], 3) for s in shifts]
        [1.006, 1.301, 0.733]
    """
    earlier = [run for run in earlier if comparable(current, run)]
    if not earlier:
        return []
    runs = [current, *earlier]
    n = len(runs)
    # The spread of n runs about their mean understates the spread between runs by (n - 1) / n,
    # and the mean itself is uncertain by 1 / n of it: a next run's distance from the mean
    # varies by (n + 1) / (n - 1) of the runs' sample spread.
    widen = math.sqrt((n + 1) / (n - 1))
    shifts: list[dict[str, float]] = [{} for _ in runs]
    for figure in {k for run in runs for k in run}:
        values = [parse_finite(run.get(figure)) for run in runs]
        if any(v is None or v <= 0 for v in values):
            continue
        logs = np.log(np.array(values, dtype=float))
        mean = logs.mean()
        # Replicates move from this run's figure to the job's (the pooled mean), then by one
        # run's distance from it: the next run of the job, not this one, is what a decision
        # is about, and runs of one job then read one interval.
        for shift, value in zip(shifts, logs, strict=True):
            shift[figure] = float(math.exp(mean - logs[0] + widen * (value - mean)))
    return shifts


def _shift_row(row: dict[str, Any], factors: Mapping[str, float]) -> None:
    """Move a replicate row's figures by one pooled run's ``factors`` (:func:`run_shifts`)."""
    for key in (*BLOCK_FIELDS, *_SHIFTED_WITH):
        factor = factors.get(_SHIFTED_WITH.get(key, key))
        value = parse_finite(row.get(key))
        if factor is not None and value is not None:
            row[key] = value * factor
    if row.get("step") is not None and row.get("overhead") is not None:
        row["step"] = max(row["step"], row["overhead"])


def replicate_rows(
    rows: Sequence[Mapping[str, Any]], rng: np.random.Generator, shifts: Sequence[Mapping[str, float]] = ()
) -> list[dict[str, Any]] | None:
    """One replicate of the ranks' rows: each rank's averages replaced by the mean of
    its blocks drawn with replacement (and its probe figures by its probe steps drawn
    likewise); None when no rank has blocks.

    Args:
        rows: The ranks' rows (:func:`dtprofile.summary.rank_row`), with their
            :data:`BLOCK_KEYS` and :data:`PROBE_KEYS`.
        rng: The generator drawing the blocks.
        shifts: Pooled runs' factors (:func:`run_shifts`): the replicate draws one and
            moves every rank's figures by it; empty: this run's variation alone.

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
    if shifts and any_blocks:
        factors = shifts[int(rng.integers(0, len(shifts)))]  # (one run's move, for every rank alike)
        for new in out:
            _shift_row(new, factors)
    return out if any_blocks else None


def spread_ranks(rows: Sequence[Mapping[str, Any]], most: int) -> list[Mapping[str, Any]]:
    """At most ``most`` of the ranks' rows, at evenly spaced places in the order of their
    step times (the fastest and the slowest kept); all of them when there are no more.

    Example:
        >>> rows = [{"rank": r, "step": float(r % 7)} for r in range(100)]
        >>> picked = spread_ranks(rows, 5)
        >>> [row["step"] for row in picked]
        [0.0, 1.0, 3.0, 5.0, 6.0]
    """
    if len(rows) <= most:
        return list(rows)
    ordered = sorted(rows, key=lambda r: (_number(r.get("step")), r.get("rank", 0)))
    places = np.linspace(0, len(ordered) - 1, most).round().astype(int)
    return [ordered[i] for i in sorted(set(places.tolist()))]


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
    rows: Sequence[Mapping[str, Any]],
    summarize: Callable[[list[dict[str, Any]]], Mapping[str, Any]],
    shifts: Sequence[Mapping[str, float]] = (),
) -> dict[str, Any] | None:
    """The summary's ``uncertainty``: :data:`REPLICATES` replicates of the ranks' rows, each
    made into a summary by ``summarize``, projected and recommended from exactly as the
    run is.

    Args:
        rows: The ranks' rows as they were gathered (with their blocks and probe samples).
        summarize: Rows -> a summary without its analysis (``build_summary(...,
            analyze=False)``); it may raise ArithmeticError or ValueError for a replicate
            the model cannot take, which is left out.
        shifts: Earlier runs of the same job pooled (:func:`run_shifts`), or none.

    Returns:
        ``level``, ``replicates``, ``blocks_per_rank``, ``pooled_runs`` (the earlier
        runs pooled), ``ranks_drawn`` (at most :data:`MAX_INTERVAL_RANKS`), and the intervals of
        ``per_step_ms``, ``ratios``, ``algbw_GBps``, the projection's ``step_ms``,
        ``speedup`` and ``efficiency`` per G and the recommended ``gpus`` and
        ``bandwidth_needed_Gbps`` (docs/summary.md); None without blocks (a short run).
    """
    from .projection import project_summary
    from .recommendations import recommend

    rows = spread_ranks(rows, MAX_INTERVAL_RANKS)
    rng = np.random.default_rng(0)
    per_step: dict[str, list[Any]] = {}
    ratios: dict[str, list[Any]] = {}
    algbw, projections, recommended, needed = [], [], [], []
    for _ in range(REPLICATES):
        replicate = replicate_rows(rows, rng, shifts)
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
        "pooled_runs": max(len(shifts) - 1, 0),
        "ranks_drawn": len(rows),
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
