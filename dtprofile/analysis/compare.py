"""Two runs side by side: did the change pay off, and was the projection right?

``compare_summaries(baseline, candidate)`` is pure (two summaries in, one dict out):

- ``per_step_ms`` and ``ratios``: each quantity in both runs and the change;
- ``throughput``: samples per second in each run (per-device batch x micro-batches x
  ranks / step) and the measured speedup, which counts a changed batch or GPU count;
  ``basis`` says what the speedup is: ``samples_per_s``, or ``step_time`` (a run's batch
  size is unknown, as in one rebuilt from event files: the ratio of the step times, the
  same samples per step assumed);
- ``projection_check``: when the two runs differ in GPU count, what the baseline's
  projection (the performance model) predicted for the candidate's GPU count (weak scaling when the per-device batch
  is the same, strong when the global batch is) against what the candidate measured;
- ``advice``: the finding ids the change resolved, those it introduced, those left;
- ``different_jobs``: what says the runs are different jobs (gradient bytes, parameter
  count, model class), not one job before and after a change; empty when nothing does.

>>> base = {"per_step_ms": {"step": 40.0}, "world_size": 1,
...         "run": {"batch_size": 32, "micro_batches": 1}, "advice": [{"id": "data_bound"}]}
>>> cand = {"per_step_ms": {"step": 20.0}, "world_size": 1,
...         "run": {"batch_size": 32, "micro_batches": 1}, "advice": [{"id": "healthy"}]}
>>> out = compare_summaries(base, cand)
>>> out["throughput"]["speedup"], out["advice"]["resolved"]
(2.0, ['data_bound'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._values import finite, get
from .projection import project_summary

__all__ = [
    "compare_summaries",
    "job_differences",
    "COMPARED_TIMES",
    "COMPARED_RATIOS",
    "MEANING_CHANGES",
    "SAME_JOB_MAX_GRAD_BYTES_RATIO",
    "SAME_JOB_MAX_PARAM_CHANGE",
]

COMPARED_TIMES: tuple[str, ...] = (
    "step",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "comm_total",
    "comm_exposed",
    "comm_buffers",
    "comm_peer_wait",
    "compute",
    "overhead",
)
COMPARED_RATIOS: tuple[str, ...] = ("R_O", "data_fraction", "comm_fraction", "comm_overlap")


def _change(before: Any, after: Any, unit_key: str) -> dict[str, Any]:
    """One quantity in both runs, its change (under ``unit_key``) and the relative change."""
    a, b = finite(before), finite(after)
    delta = b - a if a is not None and b is not None else None
    return {
        "baseline": a,
        "candidate": b,
        unit_key: delta,
        "delta_fraction": delta / a if delta is not None and a else None,
    }


def _samples_per_step(summary: Mapping[str, Any]) -> float | None:
    """Samples per optimizer step over all ranks, or None when the batch is unknown."""
    run_info = get(summary, "run")
    batch = finite(get(run_info, "batch_size"))
    micro = finite(get(run_info, "micro_batches")) or 1.0
    world = finite(get(summary, "world_size")) or 1.0
    return batch * micro * world if batch else None


def _throughput(summary: Mapping[str, Any]) -> float | None:
    """Samples per second, or None when the batch or the step is unknown."""
    samples, step = _samples_per_step(summary), finite(get(get(summary, "per_step_ms"), "step"))
    return samples / step * 1e3 if samples and step else None


def _finding_ids(summary: Mapping[str, Any]) -> list[str]:
    """The ids of the summary's findings, in its order."""
    advice = get(summary, "advice")
    if not isinstance(advice, list):
        return []
    return [str(f["id"]) for f in advice if isinstance(f, Mapping) and f.get("id")]


def _projection_check(
    baseline: Mapping[str, Any], candidate: Mapping[str, Any], measured_speedup: float | None
) -> dict[str, Any] | None:
    """The baseline's projection at the candidate's GPU count against the candidate's run."""
    g_base, g_cand = finite(get(baseline, "world_size")), finite(get(candidate, "world_size"))
    if g_base is None or g_cand is None or g_base == g_cand:
        return None
    b_run_info, c_run_info = get(baseline, "run"), get(candidate, "run")
    per_device = [
        (finite(get(info, "batch_size")) or 0.0) * (finite(get(info, "micro_batches")) or 1.0)
        for info in (b_run_info, c_run_info)
    ]
    check: dict[str, Any] = {"baseline_gpus": int(g_base), "candidate_gpus": int(g_cand)}
    if per_device[0] and per_device[0] == per_device[1]:
        scaling = "weak"
    elif per_device[0] and per_device[0] * g_base == per_device[1] * g_cand:
        scaling = "strong"
    else:
        check["skipped"] = "the per-device batch changed and the global batch did too: neither weak nor strong scaling"
        return check
    try:
        proj = project_summary(baseline, gpus=[g_base, g_cand], scaling=scaling)
    except (ValueError, TypeError, KeyError) as exc:
        check["skipped"] = f"the baseline cannot be projected ({exc})"
        return check
    predicted_step = (proj.get("step_ms") or [None, None])[1]
    base_step = finite(get(get(baseline, "per_step_ms"), "step"))
    if predicted_step is None or predicted_step <= 0 or not base_step:
        check["skipped"] = "the baseline's model has no step time (nothing measured)"
        return check
    # The projection's step at the candidate's GPU count (as in the baseline's report),
    # against the baseline's measured step. Weak scaling: each device keeps its batch, so
    # throughput grows with G / step; strong: the global batch is fixed.
    predicted = (base_step / predicted_step) * (g_cand / g_base if scaling == "weak" else 1.0)
    check.update(
        {
            "scaling": scaling,
            "bandwidth_source": proj.get("bandwidth_source"),
            "predicted_step_ms": predicted_step,
            "measured_step_ms": finite(get(get(candidate, "per_step_ms"), "step")),
            "predicted_speedup": predicted,
            "measured_speedup": measured_speedup,
            "error": (predicted / measured_speedup - 1.0) if measured_speedup else None,
        }
    )
    return check


#: Two runs are taken for different jobs when their gradient bytes differ by more than
#: this factor (a 16-bit against a 32-bit run of one model differ by 2) ...
SAME_JOB_MAX_GRAD_BYTES_RATIO = 2.5
#: ... or their parameter counts by more than this fraction (a changed head, not a new model).
SAME_JOB_MAX_PARAM_CHANGE = 0.1


def _ratio_text(a: float, b: float) -> str:
    """How many times the larger of two positive numbers is the smaller, as a person writes it."""
    ratio = max(a, b) / min(a, b)
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def job_differences(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[str]:
    """What says the two runs are not the same job after a change.

    Args:
        baseline: The first run's summary.
        candidate: The second run's summary.

    Returns:
        Each difference as a phrase (gradient bytes, parameter count, model class); empty
        when nothing does, or when the runs do not say.

    Example:
        >>> job_differences({"grad_bytes": 4e6}, {"grad_bytes": 4e9})
        ['gradient bytes 1,000x apart (4e+06 vs 4e+09)']
    """
    out = []
    b_grad, c_grad = finite(get(baseline, "grad_bytes")), finite(get(candidate, "grad_bytes"))
    if b_grad and c_grad and max(b_grad, c_grad) > SAME_JOB_MAX_GRAD_BYTES_RATIO * min(b_grad, c_grad):
        out.append(f"gradient bytes {_ratio_text(b_grad, c_grad)} apart ({b_grad:.3g} vs {c_grad:.3g})")
    b_run_info, c_run_info = get(baseline, "run"), get(candidate, "run")
    b_par, c_par = finite(get(b_run_info, "param_count")), finite(get(c_run_info, "param_count"))
    if b_par and c_par and abs(b_par - c_par) > SAME_JOB_MAX_PARAM_CHANGE * max(b_par, c_par):
        out.append(f"parameter counts {b_par:,.0f} vs {c_par:,.0f}")
    b_cls, c_cls = get(b_run_info, "model_class"), get(c_run_info, "model_class")
    if isinstance(b_cls, str) and isinstance(c_cls, str) and b_cls != c_cls:
        out.append(f"model classes {b_cls} vs {c_cls}")
    return out


#: What changed meaning, within the same schema, in each minor release.
MEANING_CHANGES: dict[tuple[int, int], str] = {
    (0, 2): (
        "since 0.2 per-rank figures are 5%-trimmed means (medians before), and comm_total / "
        "comm_exposed leave out comm_peer_wait: part of the change may be the definitions"
    ),
    (0, 3): (
        "since 0.3 every figure averages the same steps (trimmed by step time), T_O is the sum of "
        "its parts' medians over ranks, comm_exposed holds the wait of every backward pass that "
        "reduced (accumulation without no_sync()), and Lightning's data wait includes "
        "on_before_batch_transfer and leaves out checkpoints, epoch ends and tuner trial steps"
    ),
    (0, 4): (
        "since 0.4 DDP's buffer broadcast before forward is communication (comm_buffers, part of "
        "comm_exposed and comm_total; before, part of forward), the optimizer phase leaves out "
        "passes inside optimizer.step(closure) and Lightning's on_before_optimizer_step hooks and "
        "clipping (now other compute), and micro_batches counts the batches fetched per step"
    ),
    (0, 5): (
        "since 0.5 the paper's alpha_paper / speedup_paper take R_O / world_size (T_C of the global "
        "batch on one device; before, the per-rank R_O), and a what-if bandwidth scales the "
        "all-reduce's fixed part like its traffic instead of per ring hop"
    ),
    (0, 6): (
        "since 0.6 an update the loss scaler skipped is told by the scaler (skips before the "
        "first real update, and with zero_grad(set_to_none=False), are steps of their own, no "
        "longer folded into one long step), and a projection over nodes (--nodes) takes the "
        "inter-node bandwidth as each node's link, shared by its GPUs, unless link_per='gpu'"
    ),
}


def _major_minor(version: Any) -> tuple[int, int]:
    """(major, minor) of a version string; (0, 0) when unknown."""
    try:
        major, minor = str(version).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return (0, 0)


def compare_summaries(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The change from ``baseline`` to ``candidate``: see the module's docstring for each key.

    Args:
        baseline: The run before the change (a ``dtprofile.summary/1`` dict).
        candidate: The run after it.

    Returns:
        ``dtprofile_version``, ``different_jobs``, ``per_step_ms``, ``ratios``,
        ``world_size``, ``batch_size``, ``throughput``, ``projection_check`` and
        ``advice``.

    Raises:
        TypeError: when either is not a mapping.
    """
    for name, value in (("baseline", baseline), ("candidate", candidate)):
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{name} must be a dtprofile summary (a dict, e.g. Report.to_dict() or the "
                f"JSON of dtprofile_summary.json), got {type(value).__name__}"
            )
    b_per, c_per = get(baseline, "per_step_ms"), get(candidate, "per_step_ms")
    b_rat, c_rat = get(baseline, "ratios"), get(candidate, "ratios")
    b_thr, c_thr = _throughput(baseline), _throughput(candidate)
    speedup = c_thr / b_thr if b_thr and c_thr else None
    basis = "samples_per_s" if speedup is not None else None
    if speedup is None and get(baseline, "world_size") == get(candidate, "world_size"):
        # Batch unknown in a run: the same work per step is assumed, and "basis" says so.
        b_step, c_step = finite(get(b_per, "step")), finite(get(c_per, "step"))
        speedup = b_step / c_step if b_step and c_step else None
        basis = "step_time" if speedup is not None else None
    b_ids, c_ids = _finding_ids(baseline), _finding_ids(candidate)
    versions = {"baseline": get(baseline, "dtprofile_version"), "candidate": get(candidate, "dtprofile_version")}
    if None not in versions.values() and _major_minor(versions["baseline"]) != _major_minor(versions["candidate"]):
        older, newer = sorted((_major_minor(versions["baseline"]), _major_minor(versions["candidate"])))
        changes = [text for release, text in sorted(MEANING_CHANGES.items()) if older < release <= newer]
        versions["note"] = f"made by dtprofile {versions['baseline']} and {versions['candidate']}: " + (
            "; ".join(changes) or "the figures' definitions may differ"
        )
    return {
        "dtprofile_version": versions,
        # Unrelated runs (another model): the changes below are not a change's effect.
        "different_jobs": job_differences(baseline, candidate),
        "per_step_ms": {k: _change(get(b_per, k), get(c_per, k), "delta_ms") for k in COMPARED_TIMES},
        "ratios": {k: _change(get(b_rat, k), get(c_rat, k), "delta") for k in COMPARED_RATIOS},
        "world_size": {"baseline": get(baseline, "world_size"), "candidate": get(candidate, "world_size")},
        "batch_size": {
            "baseline": get(get(baseline, "run"), "batch_size"),
            "candidate": get(get(candidate, "run"), "batch_size"),
        },
        "throughput": {
            "baseline_samples_per_s": b_thr,
            "candidate_samples_per_s": c_thr,
            "speedup": speedup,
            "basis": basis,
        },
        "projection_check": _projection_check(baseline, candidate, speedup),
        # A run rebuilt from TensorBoard events has no advice record: nothing to compare.
        "advice": (
            {
                "resolved": [i for i in b_ids if i not in c_ids],
                "new": [i for i in c_ids if i not in b_ids],
                "remaining": [i for i in c_ids if i in b_ids],
            }
            if all(isinstance(get(x, "advice"), list) for x in (baseline, candidate))
            else None
        ),
    }
