"""The run summary: its one definition, built from the ranks' rows.

A summary is the ``dtprofile.summary/1`` dict (docs/summary.md). :func:`build_summary`
makes it from per-rank rows of step averages (:func:`rank_row`); the model and the
advisor then fill ``projection``, ``recommendations`` and ``advice``.
:class:`Report` wraps one for people: ``str(report)`` is the terminal report
(:mod:`dtprofile.render`), ``report.to_dict()`` the JSON object. The file it is written
to and read back from is :mod:`dtprofile.summary_file`'s (its names are exported here too).

>>> averages = {"step": 10.0, "data_wait": 3.0, "comm_exposed": 1.0, "overhead": 4.0}
>>> rows = [rank_row(0, 10, averages, 0, {})]
>>> meta = {"world_size": 1, "device": "cpu", "device_name": "cpu", "backend": None,
...         "steps_total": 15, "data_wait_source": "loader", "comm_source": None,
...         "timing": "perf_counter", "run": {}}
>>> from dtprofile.options import Options
>>> summary = build_summary(rows, meta, Options(warmup_steps=5), analyze=False)
>>> summary["schema"], summary["per_step_ms"]["compute"], round(summary["ratios"]["R_O"], 3)
('dtprofile.summary/1', 6.0, 0.667)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, cast

from . import __version__, render
from ._values import median
from .analysis.advice import analyze as analyze_summary
from .analysis.advice.thresholds import (
    STRAGGLER_MIN_EXCESS_FRACTION,
    STRAGGLER_MIN_EXCESS_MS,
    STRAGGLER_MIN_EXCESS_STEP_FRACTION,
)
from .analysis.mesh_comm import comm_by_dim
from .analysis.perf_model import alpha, paper_r_o, projected_speedup
from .analysis.rank_spread import rank_spread
from .analysis.uncertainty import (
    BLOCK_FIELDS,
    BLOCKS,
    PROBE_SAMPLES,
    block_key,
    probe_key,
    run_intervals,
    run_shifts,
)
from .capture.windows import FIELDS, TIME_FIELDS
from .mesh_keys import COLL_KEYS
from .run_history import earlier_runs, job_key
from .summary_file import (
    SCHEMA,
    SUMMARY_NAME,
    SUMMARY_RESERVE_BYTES,
    SummaryError,
    load_summary,
    reserve_summary_space,
    write_summary,
    write_summary_with_reserve,
)

__all__ = [
    "SCHEMA",
    "OVERHEAD_PARTS",
    "SUMMARY_NAME",
    "SUMMARY_RESERVE_BYTES",
    "Report",
    "SummaryError",
    "build_summary",
    "load_summary",
    "peer_waits",
    "rank_row",
    "reserve_summary_space",
    "write_summary",
    "write_summary_with_reserve",
]


log = logging.getLogger(__name__)

#: The phases of T_C a probe step's own figures give.
PROBE_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


def rank_row(
    rank: int,
    steps: int,
    averages: dict[str, Any],
    probe_steps: int,
    probe_averages: dict[str, Any],
    alone_steps: int = 0,
    alone_averages: dict[str, Any] | None = None,
    blocks: list[dict[str, Any]] | None = None,
    probe_samples: list[dict[str, Any]] | None = None,
    collectives: dict[str, float | None] | None = None,
    pipeline_stage: int | None = None,
    pipeline_wait: float | None = None,
) -> dict[str, Any]:
    """One rank's figures as a flat dict, the row :func:`build_summary` takes.

    Args:
        rank: The rank's global rank.
        steps: Steady-state steps the averages cover.
        averages: The window's averages in ms (``Window.averages``: ``step``,
            ``data_wait``, ... and ``step_all``, the mean over every step).
        probe_steps: Probe steps measured (compute without overlapping communication).
        probe_averages: The probe steps' averages in ms (ignored when ``probe_steps`` is 0).
        alone_steps: Probe steps whose passes ran one rank at a time (the others waiting).
        alone_averages: Their averages in ms.
        blocks: The averages of consecutive blocks of the steps
            (:func:`~dtprofile.capture.windows.block_averages`), for the intervals
            (:mod:`dtprofile.analysis.uncertainty`).
        probe_samples: The latest probe steps' own figures (``compute``, ``comm_total``).
        collectives: The mesh's collectives per step, under
            :data:`~dtprofile.mesh_keys.COLL_KEYS` (None: no mesh; the keys are None).
        pipeline_stage: The index of the first pipeline stage this rank runs (None: no pipeline).
        pipeline_wait: What its steady steps waited for the pipeline's neighbours, ms a step.

    Returns:
        ``rank``, ``steps``, every field of ``dtprofile.capture.records.FIELDS``, ``step_all``,
        the probe's ``probe_steps``, ``probe_step``, ``probe_compute``, ``probe_comm`` and
        ``probe_passes`` (forward + backward), and ``alone_steps``, ``alone_passes``.

    Example:
        >>> row = rank_row(1, 30, {"step": 12.5}, 0, {})
        >>> row["rank"], row["step"], row["probe_compute"]
        (1, 12.5, None)
    """
    row: dict[str, Any] = {"rank": rank, "steps": steps}
    row.update({k: averages.get(k) for k in FIELDS})
    alone_averages = cast("dict[str, Any]", alone_averages) if alone_steps else {}  # given with alone_steps
    # The probes whose passes ran alone measured communication as the others did, and
    # count as probe steps; compute (T_C) is the others', whose passes ran together.
    row["probe_steps"] = probe_steps + alone_steps
    row["probe_step"] = probe_averages.get("step") if probe_steps else None
    row["probe_compute"] = probe_averages.get("compute") if probe_steps else None
    row["probe_comm"] = _weighted(
        [
            (probe_averages.get("comm_total") if probe_steps else None, probe_steps),
            (alone_averages.get("comm_total"), alone_steps),
        ]
    )
    row["probe_passes"] = _passes_ms(probe_averages) if probe_steps else None
    for phase in PROBE_PHASES:  # (T_C's parts where T_C is the probe steps')
        row[f"probe_{phase}"] = probe_averages.get(phase) if probe_steps else None
    row["alone_steps"] = alone_steps
    row["alone_passes"] = _passes_ms(alone_averages) if alone_steps else None
    for i in range(BLOCKS):
        block = blocks[i] if blocks is not None and i < len(blocks) else {}
        row.update({block_key(i, f): block.get(f) for f in BLOCK_FIELDS})
    for i in range(PROBE_SAMPLES):
        sample = probe_samples[i] if probe_samples is not None and i < len(probe_samples) else {}
        row[probe_key(i, "compute")] = sample.get("compute")
        row[probe_key(i, "comm")] = sample.get("comm_total")
    row.update({k: (collectives or {}).get(k) for k in COLL_KEYS})
    row["pipeline_stage"] = pipeline_stage
    row["pipeline_wait"] = pipeline_wait
    row["step_all"] = averages.get("step_all")
    row["comm_timed_steps"] = averages.get("comm_timed_steps")
    row["backward_timed_steps"] = averages.get("backward_timed_steps")
    if not row["comm_timed_steps"] and row["probe_comm"] is not None:
        # No step timed its buckets (DDP without a hook): communication's total is the
        # probe steps' all-reduce, timed alone; never below what the steps waited for it.
        exposed = averages.get("comm_exposed")
        row["comm_total"] = max(row["probe_comm"], exposed) if exposed is not None else row["probe_comm"]
        row["comm_timed_steps"] = row["probe_steps"]
    return row


def _weighted(values: list[tuple[float | None, int]]) -> float | None:
    """The mean of averages over their step counts (None and NaN left out)."""
    kept = [(v, n) for v, n in values if n and v is not None and math.isfinite(v)]
    total = sum(n for _, n in kept)
    return sum(v * n for v, n in kept) / total if total else None


def _passes_ms(averages: dict[str, Any]) -> float | None:
    forward, backward = averages.get("forward"), averages.get("backward")
    return None if forward is None or backward is None else forward + backward


def _alone(rows: list[dict[str, Any]], compute_ms: float | None) -> dict[str, Any]:
    """What the ranks' passes (forward and backward) took one at a time, the others
    waiting, against together, on the probe steps: what running beside the other ranks
    costs on a host they share (``sharing_slowdown``, never below 0), and T_C with the
    passes alone (``compute_alone_ms``)."""
    pairs = [
        (r["alone_passes"], r["probe_passes"])
        for r in rows
        if r.get("alone_steps") and r.get("alone_passes") is not None and r.get("probe_passes")
    ]
    out: dict[str, Any] = {
        "alone_steps": _min_count(rows, "alone_steps") or 0,
        "passes_ms": None,
        "passes_alone_ms": None,
        "sharing_slowdown": None,
        "compute_alone_ms": None,
    }
    if not pairs:
        return out
    ratio = min(1.0, cast(float, median([alone / together for alone, together in pairs])))  # pairs: not empty
    out["passes_ms"] = median([together for _, together in pairs])
    out["passes_alone_ms"] = median([alone for alone, _ in pairs])
    out["sharing_slowdown"] = 1.0 / ratio - 1.0 if ratio > 0 else None
    if compute_ms is not None:
        out["compute_alone_ms"] = max(0.0, compute_ms - (1.0 - ratio) * out["passes_ms"])
    return out


def _min_count(rows: list[dict[str, Any]], key: str) -> int | None:
    counts: list[Any] = [r.get(key) for r in rows if r.get(key) is not None]
    return int(min(counts)) if counts else None


def _with_probe(row: dict[str, Any]) -> dict[str, Any]:
    """Use compute measured alone (probe steps) as T_C; the rest of the step is T_O.

    Without a probe, compute = step - data_wait - comm_exposed: communication that
    backward hid is counted as free although it slowed backward down (a lower bound on
    communication's cost). With a probe, the slowdown shows as ``comm_interference``.
    """
    row = dict(row)
    row["comm_interference"] = None
    probe_compute, step = row.get("probe_compute"), row.get("step")
    if step is not None and row.get("overhead") is not None:
        # Rounding aside, the window's averages add up already (they average the same steps).
        row["compute"] = step - row["overhead"]
    if probe_compute is None or step is None or row.get("compute") is None:
        return row
    compute = min(probe_compute, row["compute"])
    row["comm_interference"] = row["compute"] - compute
    row["compute"] = compute
    row["overhead"] = step - compute
    # T_C's parts from the same steps as T_C, so that the breakdown adds up: forward and
    # backward as the probe steps ran them (without communication beside them).
    probe_parts: list[Any] = [row.get(f"probe_{phase}") for phase in PROBE_PHASES]
    if all(v is not None for v in probe_parts) and sum(probe_parts) <= compute * (1 + 1e-9):
        row.update(zip(PROBE_PHASES, probe_parts, strict=False))
    return row


def _overlap(comm_exposed: float | None, comm_total: float | None, comm_source: str | None) -> float | None:
    """The share of communication backward hid, ``1 - exposed / total``, where both were
    timed on the same steps; None on the probe path, where the total is the all-reduce timed
    alone on probe steps and the exposed wait comes from the synchronised ones."""
    if comm_source == "ddp_probe" or not comm_total or comm_exposed is None:
        return None
    return 1.0 - comm_exposed / comm_total


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    value = num / den
    return value if math.isfinite(value) else None


#: A rank waits in the collectives for a slower rank when it spends longer than that
#: rank outside backward (data, forward, optimizer, host work) and arrives earlier; such a
#: wait is taken out of the network's figures once it exceeds all of these (below them it
#: is noise between balanced ranks). They are the straggler advice's thresholds, so that a
#: wait taken out of the network's figures always has a finding that names the slow rank.
PEER_WAIT_MIN_MS = STRAGGLER_MIN_EXCESS_MS
PEER_WAIT_MIN_STEP_FRACTION = STRAGGLER_MIN_EXCESS_STEP_FRACTION
#: Of the waiting rank's busy time (its step less its exposed communication).
PEER_WAIT_MIN_BUSY_FRACTION = STRAGGLER_MIN_EXCESS_FRACTION


def _float_nan_as_none(value: Any) -> float | None:
    """``float(value)``, except that None and NaN (not measured) are None.

    Unlike :func:`dtprofile._values.finite`, an infinity stays a number, and a bool or
    numeric text is converted as ``float()`` converts it.
    """
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def peer_waits(rows: list[dict[str, Any]]) -> list[float] | None:
    """Per rank, the ms of its exposed communication spent waiting for a slower rank.

    In a synchronous collective every rank finishes when the last one has joined: a rank
    that arrives early waits there, and that wait is its peer's slowness, not the
    network's. A rank's wait is the lesser of its exposed communication beyond the least
    any rank had, and how much less time it spent outside backward (``step -
    comm_exposed - backward``) than the slowest rank did. Time inside backward is not
    counted: communication overlapping it slows it too, unevenly across ranks, and that
    is the network's cost.

    Args:
        rows: The ranks' rows (:func:`rank_row`), with ``step``, ``comm_exposed`` and
            ``backward`` in ms.

    Returns:
        One wait in ms per row, 0.0 below the noise thresholds (``PEER_WAIT_MIN_*``); None
        with fewer than two ranks or a rank whose figures are missing.

    Example:
        >>> rows = [{"step": 32.0, "comm_exposed": 31.0, "backward": 0.6},   # waits
        ...         {"step": 32.0, "comm_exposed": 0.6, "backward": 0.6}]    # loads 30 ms longer
        >>> peer_waits(rows)
        [30.4, 0.0]
        >>> peer_waits([{"step": 905.0, "comm_exposed": 715.0, "backward": 172.0},  # backward slowed
        ...             {"step": 905.0, "comm_exposed": 845.0, "backward": 38.0}])  # by the all-reduce
        [0.0, 0.0]
    """
    figures = [tuple(_float_nan_as_none(r.get(k)) for k in ("step", "comm_exposed", "backward")) for r in rows]
    if len(rows) < 2 or any(v is None for f in figures for v in f):
        return None
    measured = cast("list[tuple[float, float, float]]", figures)  # none is None: checked above
    least_exposed = min(exposed for _, exposed, _ in measured)
    outside = [step - exposed - backward for step, exposed, backward in measured]
    slowest = max(outside)
    waits = []
    for (step, exposed, _), mine in zip(measured, outside, strict=False):
        wait = min(exposed - least_exposed, slowest - mine)
        noise = max(
            PEER_WAIT_MIN_MS, PEER_WAIT_MIN_STEP_FRACTION * step, PEER_WAIT_MIN_BUSY_FRACTION * (step - exposed)
        )
        waits.append(round(wait, 9) if wait > noise else 0.0)
    return waits


def _beyond_the_wire(rows: list[dict[str, Any]], waits: list[float] | None) -> list[float] | None:
    """Per rank, its wait for a slower rank, where the probe steps timed the whole
    all-reduce alone (DDP's own all-reduce, no hook): a wait after backward longer than
    that all-reduce and DDP's broadcast of the buffers together is not the wire's. The
    excess waited for a rank still in its backward (or for DDP's own work after it), and
    the projection must not scale it with the link; it counts with the wait
    :func:`peer_waits` found, the larger of the two.

    Example:
        >>> rows = [{"step": 20.0, "comm_exposed": 8.1, "probe_comm": 2.6, "comm_buffers": 0.0},
        ...         {"step": 20.0, "comm_exposed": 2.0, "probe_comm": 2.5, "comm_buffers": 0.0}]
        >>> [round(w, 3) for w in _beyond_the_wire(rows, [0.0, 0.0])]
        [5.5, 0.0]
    """
    out = list(waits) if waits is not None else [0.0] * len(rows)
    for i, row in enumerate(rows):
        exposed, wire = _float_nan_as_none(row.get("comm_exposed")), _float_nan_as_none(row.get("probe_comm"))
        step = _float_nan_as_none(row.get("step"))
        if exposed is None or wire is None or step is None:
            continue
        excess = exposed - wire - (_float_nan_as_none(row.get("comm_buffers")) or 0.0)
        if excess > max(PEER_WAIT_MIN_MS, PEER_WAIT_MIN_STEP_FRACTION * step):
            out[i] = max(out[i] or 0.0, round(excess, 9))
    return out


#: What T_O is made of, in per_step_ms (comm_peer_wait and comm_interference when present).
OVERHEAD_PARTS: tuple[str, ...] = ("data_wait", "comm_exposed", "comm_peer_wait", "comm_interference")


def _add_up(per_step: dict[str, Any]) -> None:
    """Make the cluster's T_O the sum of its parts and T_C the step less T_O.

    Each figure is a median over ranks, and medians of different ranks do not add up
    (with three or more ranks, each may come from another rank); the breakdown must.
    """
    if per_step.get("step") is None or per_step.get("overhead") is None:
        return
    per_step["overhead"] = sum(per_step[k] for k in OVERHEAD_PARTS if per_step.get(k) is not None)
    per_step["compute"] = per_step["step"] - per_step["overhead"]


def _gradient_comm_ms(rows: list[dict[str, Any]], waits: list[float] | None, from_probe: bool) -> float | None:
    """The gradients' own communication, the median over ranks (what the bandwidth is
    measured on): ``comm_total`` less DDP's buffer broadcast, and less what the rank
    waited for a slower one outside that broadcast. ``from_probe``: the totals are the
    probe steps' communication alone, which no wait for a slower rank is in."""
    values: list[float | None] = []
    for i, row in enumerate(rows):
        total = _float_nan_as_none(row.get("probe_comm" if from_probe else "comm_total"))
        if total is None:
            values.append(None)
            continue
        buffers = _float_nan_as_none(row.get("comm_buffers")) or 0.0
        wait = waits[i] if waits is not None and waits[i] is not None and not from_probe else 0.0
        values.append(max(0.0, total - buffers - max(0.0, wait - buffers)))
    return median(values)


def _network_ms(row: dict[str, Any], key: str, wait: float, from_probe: bool) -> float | None:
    """``row[key]`` less what the rank waited for a slower one: the network's part. A total
    from the probe steps (communication alone, the ranks met first) holds no such wait;
    it is kept, but never below the exposed wait that is left."""
    value = _float_nan_as_none(row.get(key))
    if value is None:
        return None
    if key == "comm_total" and from_probe and _float_nan_as_none(row.get("probe_comm")) is not None:
        exposed = _float_nan_as_none(row.get("comm_exposed")) or 0.0
        return cast(float, max(row["probe_comm"], exposed - wait))  # probe_comm: a float, checked above
    return max(0.0, value - wait)


def build_summary(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    options: Any,
    *,
    complete: bool = True,
    analyze: bool = True,
    intervals: bool = True,
) -> dict[str, Any]:
    """The summary dict from per-rank rows and the run's metadata.

    Each figure of the cluster is the median over ranks; the overhead is the sum of its
    parts' medians (so that the breakdown adds up), and what a rank waited for a slower
    one is taken out of the network's figures (``comm_peer_wait``).

    Args:
        rows: One :func:`rank_row` per rank, in any order.
        meta: The run's metadata: ``world_size``, ``device``, ``device_name``,
            ``backend``, ``steps_total``, ``data_wait_source``, ``comm_source``,
            ``timing``, ``run`` (and optionally ``steps_skipped_update``,
            ``steps_without_backward``, ``steps_with_eval_forwards``,
            ``comm_unmeasured``, ``parts_disabled``).
        options: The run's :class:`dtprofile.Options`.
        complete: False for a summary of a run still going (an interval's).
        analyze: Fill ``projection``, ``recommendations`` and ``advice`` with the model
            and the advisor; False leaves the paper's projection only and no advice.
        intervals: With ``analyze``, also the ``uncertainty`` intervals (120 replicates
            of the summary: a log interval's summary, built beside the training, leaves
            them out; the final one and a report have them).

    Returns:
        The ``dtprofile.summary/1`` dict (docs/summary.md).

    Example:
        See the module's example.
    """
    measured = rows  # (as the ranks sent them: the intervals' replicates start from these)
    rows = sorted((_with_probe(r) for r in rows), key=lambda r: r["rank"])
    from_probe = meta.get("comm_source") == "ddp_probe"
    per_step, ranks, waits = _cluster_per_step(rows, from_probe)
    world = meta["world_size"]
    grad_bytes = median([r.get("grad_bytes") for r in rows])
    grad_comm = _gradient_comm_ms(rows, waits, from_probe)
    algbw = _ratio(grad_bytes, grad_comm / 1e3 if grad_comm else None)
    algbw_GBps = algbw / 1e9 if algbw is not None else None
    busbw_GBps = algbw_GBps * 2 * (world - 1) / world if algbw_GBps is not None and world > 1 else None
    comm_total, comm_exposed = per_step["comm_total"], per_step["comm_exposed"]
    probe = _probe_figures(rows, per_step)
    summary = {
        "schema": SCHEMA,
        "dtprofile_version": __version__,
        "complete": complete,
        "device": meta["device"],
        "device_name": meta["device_name"],
        "backend": meta["backend"],
        "world_size": world,
        "steps_profiled": int(min((r["steps"] for r in rows), default=0)),
        # Of them, the steps comm_total, the overlap and the bandwidths come from: those
        # that timed every gradient bucket (DDP's hook: bucket_timing_every), or the
        # probe steps (comm_source "ddp_probe").
        "comm_timed_steps": _min_count(rows, "comm_timed_steps"),
        # Of them, the steps the backward figure comes from (without a process group, a
        # sample: backward_timing_every).
        "backward_timed_steps": _min_count(rows, "backward_timed_steps"),
        "step_ms_all_steps": median([r.get("step_all") for r in rows]),
        "steps_total": meta["steps_total"],
        "steps_skipped_update": meta.get("steps_skipped_update", 0),
        "steps_without_backward": meta.get("steps_without_backward", 0),
        "steps_with_eval_forwards": meta.get("steps_with_eval_forwards", 0),
        "warmup_steps": options.warmup_steps,
        "data_wait_source": meta["data_wait_source"],
        "comm_source": meta["comm_source"],
        "comm_unmeasured": meta.get("comm_unmeasured"),
        # A DeviceMesh's dimensions and their roles, and its collectives per dimension.
        "mesh": meta.get("mesh"),
        "comm_by_dim": comm_by_dim(rows, meta.get("mesh")),
        "pipeline": meta.get("pipeline"),
        "timing": meta["timing"],
        "per_step_ms": per_step,
        "ranks": ranks,
        "rank_spread": rank_spread(ranks, (meta.get("run") or {}).get("ranks_per_host")),
        "ratios": {
            "R_O": _ratio(per_step["overhead"], per_step["compute"]),
            "data_fraction": _ratio(per_step["data_wait"], per_step["step"]),
            "comm_fraction": _ratio(comm_exposed, per_step["step"]),
            "comm_overlap": _overlap(comm_exposed, comm_total, meta["comm_source"]),
        },
        "grad_bytes": int(grad_bytes) if grad_bytes is not None else None,
        "algbw_GBps": algbw_GBps,
        "busbw_GBps": busbw_GBps,
        "probe": probe,
        # Why probe steps stopped for the run (the loop's passes are not plain ones), or None.
        "probes_stopped": (meta["run"].get("ddp") or {}).get("probes_stopped"),
        # How T_C (per_step_ms.compute) was obtained: "probe" (compute measured alone on
        # the probe steps, communication's interference taken out) or "residual" (the
        # step less data wait and exposed communication).
        "compute_source": "probe" if probe is not None and probe["compute_ms"] is not None else "residual",
        "run": meta["run"],
        "options": options.to_dict(),
        "parts_disabled": meta.get("parts_disabled", {}),
        "projection": _paper_projection(per_step, options.project_gpus, world),
        "recommendations": {},
        "advice": [],
    }
    if analyze:
        try:
            summary["uncertainty"] = (
                run_intervals(
                    measured,
                    lambda replicate: build_summary(replicate, meta, options, analyze=False),
                    _pooled_shifts(summary, options),
                )
                if intervals
                else None
            )
        except Exception as exc:  # the figures stand without their intervals
            log.debug("dtprofile: no intervals: %r", exc)
            summary["uncertainty"] = None
        summary = analyze_summary(summary)
    return summary


def _pooled_shifts(summary: Mapping[str, Any], options: Any) -> list[dict[str, float]]:
    """The factors that move the intervals' replicates by the spread between this run and
    earlier runs of the same job in its log directory (``pool_runs`` of them)."""
    earlier = earlier_runs(getattr(options, "logdir", None), job_key(summary), getattr(options, "pool_runs", 0))
    return run_shifts(summary["per_step_ms"], earlier)


def _cluster_per_step(
    rows: list[dict[str, Any]], from_probe: bool
) -> tuple[dict[str, Any], list[dict[str, Any]], list[float] | None]:
    """``(per_step_ms, ranks, peer waits)`` of :func:`build_summary` from the ranks' rows.

    Each figure is the median over ranks. The cluster's communication figures are the
    network's: what each rank waited for a slower one is taken out of them and reported
    on its own (the straggler advice names the rank); each rank's own entry keeps what
    it measured.
    """
    keys = TIME_FIELDS + ("comm_interference",)
    per_step = {k: median([r.get(k) for r in rows]) for k in keys}
    if per_step["comm_interference"] is None:
        per_step.pop("comm_interference")
    ranks = [
        {
            "rank": r["rank"],
            "steps": r["steps"],
            **({"host": r["host"]} if r.get("host") else {}),
            **({"pipeline_stage": int(r["pipeline_stage"])} if r.get("pipeline_stage") is not None else {}),
            **({"pipeline_wait": r["pipeline_wait"]} if r.get("pipeline_wait") is not None else {}),
            **{k: r.get(k) for k in per_step},
        }
        for r in rows
    ]
    if any(r.get("probe_steps") for r in rows):
        for entry, r in zip(ranks, rows, strict=False):
            entry["probe_compute"] = r.get("probe_compute") if r.get("probe_steps") else None
    waits = peer_waits(rows)
    if from_probe and len(rows) > 1:
        waits = _beyond_the_wire(rows, waits)
    per_step["comm_peer_wait"] = median(waits) if waits is not None else None
    if waits is not None:
        for entry, w in zip(ranks, waits, strict=False):
            entry["comm_peer_wait"] = w
    if waits is not None and any(waits):
        for key in ("comm_total", "comm_exposed", "comm_buffers"):
            per_step[key] = median([_network_ms(r, key, w, from_probe) for r, w in zip(rows, waits, strict=False)])
    _add_up(per_step)
    return per_step, ranks, waits


def _probe_figures(rows: list[dict[str, Any]], per_step: dict[str, Any]) -> dict[str, Any] | None:
    """The summary's ``probe`` object: the probe steps' figures, medians over the ranks
    that had any (None: no probe step)."""
    probe_rows = [r for r in rows if r.get("probe_steps")]
    if not probe_rows:
        return None
    return {
        "steps": int(min(r["probe_steps"] for r in probe_rows)),
        "step_ms": median([r["probe_step"] for r in probe_rows]),
        "compute_ms": median([r["probe_compute"] for r in probe_rows]),
        "comm_ms": median([r["probe_comm"] for r in probe_rows]),
        "overlap_slowdown_ms": per_step.get("comm_interference"),
        **_alone(probe_rows, per_step.get("compute")),
    }


def _paper_projection(per_step: dict[str, Any], gpus: tuple[int, ...], world_size: int) -> dict[str, Any]:
    """The paper's alpha and speedup only (the model replaces this when it runs)."""
    r_o = _ratio(per_step["overhead"], per_step["compute"])
    r_o = None if r_o is None else paper_r_o(r_o, max(1, world_size))
    return {
        "gpus": list(gpus),
        "alpha_paper": [alpha(r_o, g) if r_o is not None else None for g in gpus],
        "speedup_paper": [projected_speedup(r_o, g) if r_o is not None else None for g in gpus],
    }


class Report:
    """A profiled run's findings: ``str()`` for people, ``to_dict()`` for machines.

    A thin wrapper of the summary dict; the texts are :mod:`dtprofile.render`'s.

    Args:
        summary: A summary dict (docs/summary.md).

    Example:
        >>> r = Report.from_dict({"schema": "dtprofile.summary/1", "per_step_ms": {}, "ratios": {}})
        >>> print(r)
        dtprofile report
        <BLANKLINE>
        No steady-state steps measured.
        <BLANKLINE>
        R_O = T_O / T_C = -
        >>> r.to_dict()["schema"]
        'dtprofile.summary/1'
    """

    def __init__(self, summary: dict[str, Any]) -> None:
        if not isinstance(summary, dict):
            raise TypeError(
                f"summary must be a dict (a dtprofile summary, docs/summary.md), got {type(summary).__name__}"
            )
        self._summary = summary

    @classmethod
    def from_dict(cls, summary: dict[str, Any]) -> Report:
        """A report of a summary read back (``json.load`` of ``dtprofile_summary.json``)."""
        return cls(summary)

    def to_dict(self) -> dict[str, Any]:
        """The summary itself (docs/summary.md), as written to ``dtprofile_summary.json``."""
        return self._summary

    def __getitem__(self, key: str) -> Any:
        return self._summary[key]

    @property
    def per_step_ms(self) -> dict[str, Any]:
        """Per-step times in ms (``step``, ``forward``, ``comm_exposed``, ...; null: not measured)."""
        return self._summary.get("per_step_ms") or {}

    @property
    def ratios(self) -> dict[str, Any]:
        """``R_O`` = T_O / T_C and the shares of the step (``data_fraction``, ...)."""
        return self._summary.get("ratios") or {}

    @property
    def advice(self) -> list[dict[str, Any]]:
        """The findings, most severe first (docs/advice.md)."""
        return self._summary.get("advice") or []

    def __repr__(self) -> str:
        ratio = self.ratios.get("R_O")
        return f"<dtprofile.Report world_size={self._summary.get('world_size')} R_O={ratio}>"

    def __str__(self) -> str:
        return render.format_report(self._summary)

    def _repr_markdown_(self) -> str:
        """Jupyter shows the report as the Markdown written to TensorBoard's Text tab."""
        return render.advice_markdown(self._summary)
