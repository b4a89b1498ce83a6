"""What the dtprofile tab shows, as JSON, from the runs under a log directory.

Each function takes the log directory TensorBoard was started with and returns a plain
dict the frontend draws; a request it cannot answer (a run that is not there, a bad
what-if value, a summary that cannot be read) raises :class:`ViewError` with a message
the tab shows. Figures that were not measured are None, never zero.

Example:
    >>> import json, os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> s = {"schema": "dtprofile.summary/1", "world_size": 2, "per_step_ms": {"step": 10.0, "compute": 8.0,
    ...      "forward": 3.0, "backward": 4.0, "optimizer": 1.0, "data_wait": 2.0, "overhead": 2.0}}
    >>> with open(os.path.join(d, "dtprofile_summary.json"), "w") as fh:
    ...     json.dump(s, fh)
    >>> [r["run"] for r in run_index(d)["runs"]]
    ['.']
    >>> [(p["key"], p["ms"]) for p in run_view(d, ".")["step"]["parts"]][:3]
    [('data_wait', 2.0), ('forward', 3.0), ('backward', 4.0)]
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .._values import finite, get
from ..analysis.advice import advise
from ..analysis.checks import parse_gpu_list
from ..analysis.compare import compare_summaries
from ..analysis.perf_model import parse_bandwidth
from ..analysis.projection import project_summary
from ..analysis.recommendations import recommend
from ..render.layout import RANKS_LISTED, comm_by_dim_lines, mesh_text, pipeline_lines, rank_spread_lines
from ..render.numbers import fmt
from ..render.views import (
    finding_parts,
    format_evidence,
    projection_caption,
    run_caption,
    scaling_question,
    sorted_findings,
)
from ..runs import Run, RunError, find_runs, is_event_file, walk_logdir
from ..sinks.tags import TIME_KEYS
from ..summary_file import SUMMARY_NAME

__all__ = ["STEP_PARTS", "ViewError", "compare_view", "project_view", "run_index", "run_view"]

#: The parts a step is made of, in the order the bars stack them, with their labels.
#: They add up to the step: compute (forward, backward, optimizer, other) + overhead
#: (data wait, exposed communication, waiting for a slower rank, communication's slowdown
#: of compute).
STEP_PARTS: tuple[tuple[str, str], ...] = (
    ("data_wait", "data wait"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("other", "other compute"),
    ("comm_exposed", "exposed communication"),
    ("comm_peer_wait", "waiting for a slower rank"),
    ("comm_interference", "communication slowing compute"),
)

# What-if limits: the largest device (and node) count, and how many counts, a request
# may ask for (the two-level model's cost grows with both).
_MAX_GPUS = 1 << 16
_MAX_GPU_COUNTS = 32


class ViewError(ValueError):
    """A request the tab answers with this message instead of figures."""


# ----------------------------------------------------------------------------- runs
# The runs found under each log directory, with the files they were read from: a request
# reads them again only when a summary or event file changed (reading event files of a
# large log directory takes seconds).
_found: dict[str, tuple[tuple[Any, ...], tuple[list[Any], list[str]]]] = {}
_found_lock = threading.Lock()


def _fingerprint(logdir: str) -> tuple[Any, ...]:
    """The summaries' and event files' paths, sizes and modification times."""
    files = []
    for dirpath, filenames in walk_logdir(logdir):
        for name in filenames:
            if name == SUMMARY_NAME or is_event_file(name):
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                files.append((dirpath, name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(files))


def _runs(logdir: str) -> tuple[list[Any], list[str]]:
    key = os.path.abspath(logdir)
    fingerprint = _fingerprint(logdir) if os.path.isdir(logdir) else ()
    with _found_lock:
        cached = _found.get(key)
    if cached is not None and cached[0] == fingerprint and fingerprint:
        return cached[1]
    try:
        found = find_runs(logdir)
    except RunError as exc:
        raise ViewError(str(exc)) from None
    with _found_lock:
        _found[key] = (fingerprint, found)
    return found


def _label(run: Run, logdir: str) -> str:
    return run.label(logdir)


def _find(logdir: str, label: str) -> tuple[Any, list[Any]]:
    """The run named ``label``, and every run under ``logdir``."""
    runs, errors = _runs(logdir)
    for run in runs:
        if _label(run, logdir) == label:
            return run, runs
    broken = [e for e in errors if e.startswith(os.path.join(logdir, label, ""))]
    if broken:
        raise ViewError(broken[0])
    raise ViewError(f"run {label!r} not found under {logdir}")


def run_index(logdir: str) -> dict[str, Any]:
    """The runs under ``logdir``, each with a line that tells them apart.

    Returns:
        ``{"runs": [{"run", "caption", "world_size", "complete", "source"}], "errors": [...]}``;
        ``errors`` holds one line per file that could not be read as a run.
    """
    runs, errors = _runs(logdir)
    listed = []
    for run in sorted(runs, key=lambda r: _label(r, logdir)):
        s = run.summary
        listed.append(
            {
                "run": _label(run, logdir),
                "caption": run_caption(s),
                "world_size": get(s, "world_size"),
                "complete": get(s, "complete"),
                "source": run.source,
            }
        )
    return {"runs": listed, "errors": errors}


# ----------------------------------------------------------------------------- one run
def _finding(f: Mapping[str, Any]) -> dict[str, Any]:
    severity, title, fid, _ = finding_parts(f)
    evidence = f.get("evidence")
    return {
        "id": fid,
        "severity": severity.lower(),
        "title": title,
        "evidence": format_evidence(evidence) if evidence else "",
        "action": f.get("action") or "",
        "gain": f.get("expected_gain") or "",
    }


def _parts(per: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The step's parts (ms), those measured, adding up to the step.

    ``other`` is compute less its named phases. With probe steps, compute (T_C) is
    measured without the reduction beside backward, and what that reduction cost is its
    own part (``comm_interference``): the backward that ordinary steps measured holds it,
    so the bar's backward is shortened by what exceeds T_C.
    """
    values = {key: finite(get(per, key)) for key, _ in STEP_PARTS if key != "other"}
    compute = finite(get(per, "compute"))
    named = [values[k] for k in ("forward", "backward", "optimizer")]
    if compute is not None and all(v is not None for v in named):
        forward, backward, optimizer = cast(list[float], named)  # none is None: checked above
        other = compute - sum((forward, backward, optimizer))
        values["other"] = max(0.0, other)
        if other < 0:
            values["backward"] = max(0.0, backward + other)
    return [
        {"key": key, "label": label, "ms": values.get(key)} for key, label in STEP_PARTS if values.get(key) is not None
    ]


def _straggler(summary: Mapping[str, Any]) -> int | None:
    """The rank the straggler finding names, if any."""
    for f in get(summary, "advice") or []:
        if isinstance(f, Mapping) and f.get("id") == "straggler":
            rank = get(f.get("evidence"), "rank")
            if isinstance(rank, (int, float)) and not isinstance(rank, bool):
                return int(rank)
    return None


def _step_view(summary: Mapping[str, Any]) -> dict[str, Any]:
    per = get(summary, "per_step_ms") or {}
    slow = _straggler(summary)
    ranks: list[dict[str, Any]] = []
    for entry in get(summary, "ranks") or []:
        if isinstance(entry, Mapping):
            rank = entry.get("rank")
            ranks.append(
                {
                    "rank": rank,
                    "step_ms": finite(entry.get("step")),
                    "parts": _parts(entry),
                    "straggler": slow is not None and rank == slow,
                }
            )
    shown_of = None
    if len(ranks) > RANKS_LISTED:  # (a bar each for the slowest and the fastest, the rest as a distribution)
        shown_of = len(ranks)
        timed = sorted((r for r in ranks if r["step_ms"] is not None), key=lambda r: -float(r["step_ms"]))
        half = RANKS_LISTED // 2
        keep = {id(r) for r in timed[:half] + timed[-half:] + [r for r in ranks if r["straggler"]]}
        ranks = [r for r in ranks if id(r) in keep]
    return {
        "step_ms": finite(get(per, "step")),
        "parts": _parts(per),
        "ranks": ranks,
        "straggler": slow,
        "ranks_total": shown_of,
        "spread": rank_spread_lines(summary) if shown_of else [],
    }


def _comm_view(summary: Mapping[str, Any]) -> dict[str, Any]:
    per = get(summary, "per_step_ms") or {}
    projection = get(summary, "projection") or {}
    grad = finite(get(summary, "grad_bytes"))
    return {
        "source": get(summary, "comm_source"),
        "unmeasured": get(summary, "comm_unmeasured"),
        "total_ms": finite(get(per, "comm_total")),
        "exposed_ms": finite(get(per, "comm_exposed")),
        "overlap": finite(get(get(summary, "ratios"), "comm_overlap")),
        "grad_MB": None if grad is None else grad / 1e6,
        "busbw_GBps": finite(get(summary, "busbw_GBps")),
        "link_GBps": finite(get(projection, "bandwidth_GBps")),
        "link_source": get(projection, "bandwidth_source"),
        # A DeviceMesh: its dimensions, and each one's collectives per step (kind, waited).
        "mesh": mesh_text(summary),
        "by_dim": comm_by_dim_lines(summary),
    }


def _pipeline_view(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """A pipeline's lines (the report's), each stage's forward, backward and waits a step
    for the tab's bars, and one step's timeline (each stage's events, in ms from the
    step's start); None without a pipeline."""
    lines = pipeline_lines(summary)
    if not lines:
        return None
    pipe = get(summary, "pipeline")
    stages = [
        {
            "rank": get(f, "rank"),
            "label": f"rank {get(f, 'rank')}" if not get(f, "ranks") else f"stage {get(f, 'stage')}",
            "forward_ms": finite(get(f, "forward_ms")),
            "backward_ms": finite(get(f, "backward_ms")),
            "wait_ms": finite(get(f, "wait_ms")),
        }
        for f in (get(pipe, "stage_figures") or [])[:RANKS_LISTED]
    ]
    timeline = get(pipe, "timeline")
    rows = [
        {"label": f"stage {get(r, 'stage')} (rank {get(r, 'rank')})", "events": get(r, "events") or []}
        for r in (get(timeline, "stages") or [])[:RANKS_LISTED]
    ]
    step = get(timeline, "step")
    return {
        "lines": lines,
        "stages": stages,
        "timeline": {
            "caption": (f"step {step}" if step is not None else "the stages' latest sampled steps")
            + f", {fmt(get(timeline, 'step_ms'))} ms",
            "step_ms": finite(get(timeline, "step_ms")),
            "stages": rows,
        }
        if rows
        else None,
    }


def _same_job(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two runs of one job: the same model (class and size) and per-device batch."""
    keys = ("model_class", "param_count", "batch_size")
    ra, rb = get(a, "run") or {}, get(b, "run") or {}
    return all(get(ra, k) is not None and get(ra, k) == get(rb, k) for k in keys)


def _scaling_view(
    summary: Mapping[str, Any],
    projection: Mapping[str, Any],
    runs: Sequence[Any],
    logdir: str,
    recommendations: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    gpus = list(get(projection, "gpus") or [])
    speedup = list(get(projection, "speedup") or [None] * len(gpus))
    paper = list(get(projection, "speedup_paper") or [None] * len(gpus))
    efficiency = list(get(projection, "efficiency") or [None] * len(gpus))
    if recommendations is None:
        recommendations = get(summary, "recommendations") or {}
    target = finite(get(recommendations, "target_efficiency")) or finite(
        get(get(summary, "options"), "target_efficiency")
    )
    measured = _measured_points(summary, projection, runs, logdir)
    # The run's own projection carries its intervals (a what-if's does not: its inputs are
    # the user's, not the run's).
    ranges = get(get(summary, "uncertainty"), "projection")
    own = list(get(ranges, "gpus") or []) == gpus and get(ranges, "scaling") == get(projection, "scaling")
    return {
        "gpus": gpus,
        "linear": [float(g) for g in gpus],
        "alpha": paper,
        "refined": speedup,
        "efficiency": efficiency,
        "efficiency_range": list(get(ranges, "efficiency") or []) if own else None,
        "alpha_efficiency": [None if s is None or not g else s / g for s, g in zip(paper, gpus, strict=False)],
        "target_efficiency": target,
        "recommended_gpus": get(recommendations, "gpus"),
        "recommended_gpus_range": get(recommendations, "gpus_range") if own else None,
        "scaling_question": scaling_question(summary) if own else None,
        "world_size": get(summary, "world_size"),
        "scaling": get(projection, "scaling"),
        "caption": projection_caption(projection),
        # What G counts: GPUs, or a mesh's data-parallel replicas of tp GPUs each.
        "axis": _axis(projection),
        "measured": measured,
    }


def _axis(projection: Mapping[str, Any]) -> str:
    """The scaling charts' G: ``"GPUs"``, or ``"replicas (of 2 GPUs)"`` for a mesh's or a
    pipeline's projection (each replica's GPUs: its tensor-parallel degree times its stages)."""
    mesh = get(projection, "mesh")
    per = finite(get(mesh, "gpus_per_replica")) or finite(get(mesh, "tp"))
    return "GPUs" if per is None else f"replicas (of {int(per)} GPU{'' if per == 1 else 's'})"


def _measured_points(
    summary: Mapping[str, Any], projection: Mapping[str, Any], runs: Sequence[Any], logdir: str
) -> list[dict[str, Any]]:
    """The runs of the same job under the log directory (this one included), as points on
    the scaling chart: their speedup over one device (a measured one-rank run's step,
    else this run's projection to 1)."""
    same = [r for r in runs if _same_job(summary, r.summary) and finite(get(get(r.summary, "per_step_ms"), "step"))]
    if not same:
        return []
    one = [finite(get(get(r.summary, "per_step_ms"), "step")) for r in same if get(r.summary, "world_size") == 1]
    reference = one[0] if one else None
    if reference is None:
        gpus, steps = list(get(projection, "gpus") or []), list(get(projection, "step_ms") or [])
        reference = finite(steps[gpus.index(1)]) if 1 in gpus and gpus.index(1) < len(steps) else None
    if reference is None:
        return []
    strong = get(projection, "scaling") == "strong"
    points = []
    for run in same:
        g = get(run.summary, "world_size")
        step = finite(get(get(run.summary, "per_step_ms"), "step"))
        if not isinstance(g, int) or g < 1 or not step:
            continue
        # Weak scaling: G devices do G times the work in a step; strong: the same work.
        speedup = reference / step * (1 if strong else g)
        points.append({"run": _label(run, logdir), "gpus": g, "speedup": speedup, "efficiency": speedup / g})
    return sorted(points, key=lambda p: p["gpus"])


def _over_time(path: str, source: str) -> dict[str, Any]:
    """The breakdown per logged interval, from the run's ``dtprofile/time/*`` scalars."""
    directory = os.path.dirname(path) if source == "summary" else path
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea

        acc = ea.EventAccumulator(
            directory, size_guidance={ea.SCALARS: 0, ea.TENSORS: 1, ea.IMAGES: 1, ea.HISTOGRAMS: 1, ea.AUDIO: 1}
        )
        acc.Reload()
        tags = set(acc.Tags().get("scalars", []))
    except Exception as exc:  # a half-written or foreign event file: the other views stand
        return {"steps": [], "series": {}, "error": f"cannot read the event files ({type(exc).__name__}: {exc})"}
    scalars: dict[str, dict[int, float]] = {}
    for name in TIME_KEYS:
        tag = f"dtprofile/time/{name}"
        if tag in tags:
            scalars[name] = {e.step: e.value for e in acc.Scalars(tag) if math.isfinite(e.value)}
    steps = sorted(scalars.get("step", {}))
    # Each interval's step split as the bars split it (other compute derived the same way).
    rows = [_parts({name: values.get(s) for name, values in scalars.items()}) for s in steps]
    series = {key: [next((p["ms"] for p in row if p["key"] == key), None) for row in rows] for key, _ in STEP_PARTS}
    return {
        "steps": steps,
        "step_ms": [scalars["step"][s] for s in steps],
        "series": {k: v for k, v in series.items() if any(x is not None for x in v)},
        "labels": dict(STEP_PARTS),
    }


def run_view(logdir: str, label: str) -> dict[str, Any]:
    """Everything the tab shows for one run.

    Args:
        logdir: TensorBoard's log directory.
        label: The run, as :func:`run_index` names it.

    Returns:
        ``{"run", "caption", "verdict", "findings", "step", "comm", "pipeline", "scaling",
        "over_time", "whatif"}``: the most severe finding first (``verdict``), the others after it.

    Raises:
        ViewError: the run is not there or cannot be read.
    """
    run, runs = _find(logdir, label)
    summary = run.summary
    advice = get(summary, "advice")
    if advice is None and run.source != "summary":
        # A run still going (or killed) has only its event files: the advice from what they hold.
        try:
            advice = advise(summary)
        except Exception:  # a partial summary too thin to judge: no findings, the figures stand
            advice = []
    findings = [_finding(f) for f in sorted_findings(advice or [])]
    projection = get(summary, "projection") or {}
    if not get(projection, "gpus"):
        try:
            projection = project_summary(summary)
        except (ValueError, TypeError, KeyError):
            projection = {}
    batch = get(get(summary, "run"), "batch_size")
    options = get(summary, "options") or {}
    return {
        "run": label,
        "caption": run_caption(summary),
        "complete": get(summary, "complete"),
        "source": run.source,
        "verdict": findings[0] if findings else None,
        "findings": findings[1:],
        "ratios": get(summary, "ratios") or {},
        "step": _step_view(summary),
        "comm": _comm_view(summary),
        "pipeline": _pipeline_view(summary),
        "scaling": _scaling_view(summary, projection, runs, logdir),
        "over_time": _over_time(run.path, run.source),
        "whatif": {
            "gpus": list(get(projection, "gpus") or []),
            "bandwidth": None,
            "nodes": None,
            "scaling": get(projection, "scaling") or get(options, "scaling") or "weak",
            "batch": batch if isinstance(batch, int) else None,
        },
    }


# ----------------------------------------------------------------------------- what-if
def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = parse_gpu_list(text)
    except ValueError as exc:
        raise ViewError(f"gpus: {exc}") from None
    if gpus[-1] > _MAX_GPUS or len(gpus) > _MAX_GPU_COUNTS:
        raise ViewError(f"gpus: expected at most {_MAX_GPU_COUNTS} counts of at most {_MAX_GPUS}, got {text!r}")
    return gpus


def _positive_int(name: str, text: str | None) -> int | None:
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= _MAX_GPUS:
        raise ViewError(f"{name}: expected a whole number from 1 to {_MAX_GPUS}, got {text!r}")
    return value


def project_view(
    logdir: str,
    label: str,
    *,
    gpus: str | None = None,
    bandwidth: str | None = None,
    nodes: str | None = None,
    scaling: str | None = None,
    batch: str | None = None,
) -> dict[str, Any]:
    """The run's projection with what-if settings, computed as ``dtprofile project`` does.

    Args:
        logdir: TensorBoard's log directory.
        label: The run.
        gpus: Device counts, ``"1,2,4,8"``.
        bandwidth: A link speed, ``"25Gbit"``, ``"10GB/s"``; empty: the run's.
        nodes: Nodes for the two-level all-reduce; empty: one flat ring.
        scaling: ``"weak"`` or ``"strong"``; empty: the run's.
        batch: The per-device batch; empty: the run's.

    Returns:
        The scaling view (as in :func:`run_view`) of the new projection, and the projection.

    Raises:
        ViewError: a value is not accepted (the message names it and what is), or the run
            cannot be projected.
    """
    run, runs = _find(logdir, label)
    kwargs: dict[str, Any] = {}
    if gpus:
        kwargs["gpus"] = _parse_gpus(gpus)
    if bandwidth and bandwidth.strip():
        try:
            kwargs["bandwidth"] = parse_bandwidth(bandwidth.strip())
        except (ValueError, TypeError) as exc:
            raise ViewError(f"bandwidth: {exc}") from None
    kwargs["nodes"] = _positive_int("nodes", nodes)
    if scaling:
        if scaling not in ("weak", "strong"):
            raise ViewError(f"scaling: expected 'weak' or 'strong', got {scaling!r}")
        kwargs["scaling"] = scaling
    kwargs["batch"] = _positive_int("batch", batch)
    try:
        projection = project_summary(run.summary, **kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        raise ViewError(str(exc)) from None
    # The GPU count to recommend under the what-if: the same rule as the run's own.
    recommendations = recommend(run.summary, projection)
    return {"scaling": _scaling_view(run.summary, projection, runs, logdir, recommendations), "projection": projection}


def compare_view(logdir: str, baseline: str, candidate: str) -> dict[str, Any]:
    """Two runs side by side, as ``dtprofile compare``."""
    base, _ = _find(logdir, baseline)
    cand, _ = _find(logdir, candidate)  # (the runs read once: the second lookup is the cached one)
    return {"baseline": baseline, "candidate": candidate, **compare_summaries(base.summary, cand.summary)}
