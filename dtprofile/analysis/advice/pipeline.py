"""Rules for a pipeline-parallel run: the bubble, and stages of unequal compute.

The figures come from :func:`dtprofile.analysis.pipeline_plan.pipeline_view` (the
summary's ``pipeline`` and the ranks' figures, a stage a rank) and its model of the step
at other microbatch and stage counts.
"""

from __future__ import annotations

from typing import Any

from ..pipeline_plan import pipeline_view, step_at
from .readings import Readings
from .registry import Finding, rule
from .thresholds import COMM_BOUND_FRACTION, CRITICAL_FRACTION, STRAGGLER_MIN_EXCESS_FRACTION
from .wording import measured_gain, percent


def _more_microbatches(view: dict[str, Any], samples: float | None) -> int:
    """The microbatch count, the run's doubled until the bubble (p - 1) / (m + p - 1) with
    equal stages is at most :data:`COMM_BOUND_FRACTION` (doubling keeps the batch
    divisible as it was), and no more than a microbatch of one sample allows."""
    p, m = int(view["stages"]), int(view["microbatches"])
    most = m * int(samples) if samples else None
    more = 2 * m
    while (p - 1) / (more + p - 1) > COMM_BOUND_FRACTION and (most is None or 2 * more <= most):
        more *= 2
    return more if most is None else min(more, max(most, m))


@rule("pipeline_bubble", order=320)
def pipeline_bubble(r: Readings) -> Finding | None:
    """A pipeline stage waits for its neighbours for at least :data:`COMM_BOUND_FRACTION` of
    the step: more microbatches, an interleaved or zero-bubble schedule, fewer stages."""
    view = pipeline_view(r.summary)
    if view is None or view["bubble_fraction"] < COMM_BOUND_FRACTION:
        return None
    m, p = int(view["microbatches"]), int(view["stages"])
    more = _more_microbatches(view, r.batch_size)  # (run.batch_size: a microbatch's samples)
    if more <= m:
        return None
    at_more = step_at(view, microbatches=more)
    evidence = {
        "schedule": view["schedule"],
        "stages": p,
        "microbatches": m,
        "bubble_fraction": view["bubble_fraction"],
        "bubble_fraction_theory": view["bubble_fraction_theory"],
        "wait_ms": [f["wait_ms"] for f in view["stage_figures"]],
        "step_ms": view["step_ms"],
        "step_ms_at_more_microbatches": at_more,
        "more_microbatches": more,
        "threshold": COMM_BOUND_FRACTION,
    }
    memory = (
        f"GPipe keeps every microbatch's activations until its backward, so each stage holds {more} "
        f"smaller ones instead of {m}: the same bytes in total; Schedule1F1B holds at most {p} at a time"
        if view["schedule"] == "ScheduleGPipe"
        else f"1F1B holds at most {p} microbatches' activations at a time, however many there are"
    )
    steps = [
        f"n_microbatches={more} (from {m}): the bubble (p - 1)/(m + p - 1) falls to "
        f"{percent((p - 1) / (more + p - 1))} with equal stages, each microbatch {m / more:.2g}x the size now "
        f"(the batch must split into {more}); {memory}",
        "an interleaved schedule (ScheduleInterleaved1F1B with 2+ stages a rank: the bubble shrinks by "
        "the stages a rank holds) or a zero-bubble one (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble: "
        "the weight gradients fill it)",
    ]
    if p > 2:
        fewer = step_at(view, stages=p // 2)
        evidence["step_ms_at_half_stages"] = fewer
        steps.append(
            f"fewer stages ({p // 2}, each twice the layers: {fewer:.1f} ms a step, projected) with the "
            "GPUs freed as data-parallel replicas, where the model fits"
        )
    title = (
        f"Pipeline bubble: each stage waits {percent(view['bubble_fraction'])} of the step for its neighbours "
        f"({view['schedule']}, {p} stages, {m} microbatches"
        + (
            f"; {percent(view['bubble_fraction_theory'])} in theory with equal stages)"
            if view["bubble_fraction_theory"] is not None
            else ")"
        )
    )
    severity = "high" if view["bubble_fraction"] >= CRITICAL_FRACTION else "medium"
    gain = measured_gain(view["step_ms"], step_at(view), at_more)
    return Finding("pipeline_bubble", severity, title, evidence, "; ".join(steps), gain)


@rule("stage_imbalance", order=330)
def stage_imbalance(r: Readings) -> Finding | None:
    """The slowest stage computes at least :data:`STRAGGLER_MIN_EXCESS_FRACTION` more than
    the median stage: every slot of the schedule is as long as it, so move layers off it."""
    view = pipeline_view(r.summary)
    if view is None or view["imbalance"] is None or view["imbalance"] < 1 + STRAGGLER_MIN_EXCESS_FRACTION:
        return None
    figures = view["stage_figures"]
    slow = next(f for f in figures if f["rank"] == view["slowest_stage"])
    fast = min(figures, key=lambda f: f["compute_ms"])
    move_ms = slow["compute_ms"] - view["mean_compute_ms"]  # (to the mean: every stage alike)
    balanced = step_at(view, balanced=True)
    evidence = {
        "slowest_stage_rank": slow["rank"],
        "stage_compute_ms": [f["compute_ms"] for f in figures],
        "imbalance": view["imbalance"],
        "step_ms": view["step_ms"],
        "balanced_step_ms": balanced,
        "move_ms": move_ms,
    }
    title = (
        f"Unequal pipeline stages: rank {slow['rank']}'s stage computes {slow['compute_ms']:.1f} ms a step, "
        f"{view['imbalance']:.2f}x the median stage's, and sets every slot's length"
    )
    action = (
        f"move about {move_ms:.1f} ms of forward + backward a step (of {slow['compute_ms']:.1f}) of layers from "
        f"rank {slow['rank']}'s stage to rank {fast['rank']}'s ({fast['compute_ms']:.1f} ms): split the model "
        "where the stages' measured times even out (pipeline(..., split_spec=...) or the modules each "
        "PipelineStage is given)"
    )
    gain = measured_gain(view["step_ms"], step_at(view), balanced)
    return Finding("stage_imbalance", "medium", title, evidence, action, gain)
