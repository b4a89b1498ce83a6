"""A pipeline-parallel run: its stages, its bubble, and what more microbatches or another
stage count would give.

A schedule of p stages and m microbatches (GPipe, 1F1B) runs each stage's m forwards and
backwards in m + p - 1 slots of one microbatch's time: (p - 1) / (m + p - 1) of the step
is the *bubble*, where a stage waits for its neighbour, at its start and its end. The
slowest stage sets every slot's length. dtprofile measures each stage's compute
(forward and backward over the step's microbatches, the ranks' rows) and what it waited
for its neighbours (the point-to-point waits: exposed communication,
:mod:`dtprofile.capture.pipeline`).

The model here (framework-free): a step of ``m'`` microbatches on ``p'`` balanced stages,
the global batch fixed, takes ``(S (p / p') / m' + h) (m' + p' - 1) + F``: each of its
m' + p' - 1 slots one microbatch's share of S, the slowest stage's measured compute for
the whole batch, and h, the host work each microbatch brings whatever its size (the
schedule's own, the transfers' copies: a stage's compute besides its passes and its
update, over m); F, the step's part that does not pipeline (the update), read off the
measured step at (m, p). Equal stages are its assumption; the measured imbalance says how far off it is.

Example:
    >>> s = {"world_size": 2, "pipeline": {"schedule": "ScheduleGPipe", "stages": 2, "microbatches": 4},
    ...      "per_step_ms": {"step": 92.0},
    ...      "ranks": [{"rank": 0, "step": 92.0, "forward": 24.0, "backward": 48.0, "comm_exposed": 18.0},
    ...                {"rank": 1, "step": 92.0, "forward": 24.0, "backward": 48.0, "comm_exposed": 18.0}]}
    >>> view = pipeline_view(s)
    >>> view["bubble_fraction_theory"], round(view["bubble_fraction"], 3)
    (0.2, 0.196)
    >>> round(step_at(view, microbatches=8), 1)
    83.0
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from .._values import finite, get

__all__ = ["ONE_SLOT_SCHEDULES", "bubble_theory", "pipeline_projection", "pipeline_view", "step_at"]

#: Schedules whose bubble is (p - 1) / (m + p - 1) of the step with equal stages.
ONE_SLOT_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleLoopedBFS")
#: Microbatch counts and stage counts the projection covers (the run's own added).
PROJECT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
PROJECT_STAGES = (1, 2, 4, 8, 16)


def bubble_theory(schedule: str | None, stages: int, microbatches: int) -> float | None:
    """The bubble's share of the step for equal stages: (p - 1) / (m + p - 1) for GPipe and
    1F1B; None for a schedule whose share this formula does not give (interleaved, zero
    bubble).

    Example:
        >>> bubble_theory("Schedule1F1B", 4, 8)
        0.2727272727272727
    """
    if schedule not in ONE_SLOT_SCHEDULES or stages < 1 or microbatches < 1:
        return None
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_view(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run's pipeline: its schedule, stages and microbatches, each stage's figures (the
    ranks', in rank order: a stage a rank), the bubble measured and in theory, and the
    imbalance (the slowest stage's compute over the median's); None without a pipeline.

    Args:
        summary: A run summary with ``pipeline`` (rank 0's schedule and waits) and ``ranks``.

    Returns:
        ``schedule``, ``stages``, ``microbatches``, ``stage_figures`` (per stage: rank,
        forward_ms, backward_ms, compute_ms = forward + backward, wait_ms, step_ms),
        ``bubble_fraction`` (the median stage's waits over its step), ``bubble_fraction_theory``,
        ``slowest_stage``, ``imbalance``, ``per_microbatch_ms`` (h), ``fixed_ms`` (the step's
        part that does not pipeline).
    """
    pipe = get(summary, "pipeline")
    stages = int(finite(get(pipe, "stages")) or 0)
    microbatches = int(finite(get(pipe, "microbatches")) or 0)
    if stages < 2 or microbatches < 1:
        return None
    figures = []
    for entry in get(summary, "ranks") or []:
        forward, backward = finite(get(entry, "forward")), finite(get(entry, "backward"))
        step = finite(get(entry, "step"))
        if forward is None or backward is None or step is None or step <= 0:
            continue
        wait = finite(get(entry, "comm_exposed")) or 0.0
        # The stage's work besides its passes and its update (the schedule's own host work a
        # microbatch, the transfers' copies): it comes with every microbatch.
        busy = finite(get(entry, "compute"))
        host = max(0.0, busy - forward - backward - (finite(get(entry, "optimizer")) or 0.0)) if busy else 0.0
        figures.append(
            {
                "rank": get(entry, "rank"),
                "forward_ms": forward,
                "backward_ms": backward,
                "compute_ms": forward + backward,
                "wait_ms": wait,
                "step_ms": step,
                "host_ms": host,
            }
        )
    if not figures:
        return None
    computes = [f["compute_ms"] for f in figures]
    slowest = max(range(len(figures)), key=lambda i: computes[i])
    step = finite(get(get(summary, "per_step_ms"), "step")) or statistics.median(f["step_ms"] for f in figures)
    schedule = get(pipe, "schedule")
    theory = bubble_theory(schedule, stages, microbatches)
    # The slot model holds for one stage a rank (GPipe, 1F1B); an interleaved or zero-bubble
    # schedule's step is not (m + p - 1) slots: its projection is left out.
    per_microbatch = max(f["host_ms"] for f in figures) / microbatches
    slots = (computes[slowest] / microbatches + per_microbatch) * (microbatches + stages - 1)
    slots = slots if theory is not None else step
    median_compute = statistics.median(computes)
    return {
        "schedule": schedule,
        "stages": stages,
        "microbatches": microbatches,
        "stage_figures": figures,
        "bubble_fraction": statistics.median(f["wait_ms"] / f["step_ms"] for f in figures),
        "bubble_fraction_theory": theory,
        "slowest_stage": figures[slowest]["rank"],
        "imbalance": computes[slowest] / median_compute if median_compute > 0 else None,
        "slowest_compute_ms": computes[slowest],
        "mean_compute_ms": sum(computes) / len(computes),
        "step_ms": step,
        "per_microbatch_ms": per_microbatch,
        "fixed_ms": max(0.0, step - slots),
    }


def step_at(
    view: Mapping[str, Any], microbatches: int | None = None, stages: int | None = None, balanced: bool = False
) -> float:
    """The step (ms) at ``microbatches`` and ``stages`` (default: the run's), the global
    batch fixed; ``balanced``: the stages' compute evened out (the mean stage's instead of
    the slowest's).

    Example:
        >>> v = {"stages": 2, "microbatches": 4, "slowest_compute_ms": 72.0, "mean_compute_ms": 72.0,
        ...      "fixed_ms": 2.0}
        >>> step_at(v), step_at(v, microbatches=1)
        (92.0, 146.0)
    """
    m = microbatches or int(view["microbatches"])
    p = stages or int(view["stages"])
    if m < 1 or p < 1:
        raise ValueError(f"microbatches and stages must be >= 1, got {m} and {p}")
    compute = view["mean_compute_ms"] if balanced or p != view["stages"] else view["slowest_compute_ms"]
    per_stage = compute * view["stages"] / p
    # Each slot: one microbatch's share of the stage's compute, and the host work every
    # microbatch brings whatever its size (measured: it does not shrink with m).
    per_slot = per_stage / m + view.get("per_microbatch_ms", 0.0)
    return float(per_slot * (m + p - 1) + view["fixed_ms"])


def pipeline_projection(view: Mapping[str, Any]) -> dict[str, Any] | None:
    """The step over microbatch counts (the run's stages) and over stage counts (the run's
    microbatches; the model's layers spread evenly over them), and with the stages
    balanced: the summary's ``pipeline.projection``.

    Returns:
        ``{"microbatches": [...], "step_ms_by_microbatches": [...], "stages": [...],
        "step_ms_by_stages": [...], "balanced_step_ms": ...}``; a stage count's GPUs
        are that many per replica, its throughput per GPU the step's inverse over them.
        None for a schedule the slot model does not hold for (interleaved, zero bubble).
    """
    if view.get("bubble_fraction_theory") is None:
        return None
    ms = sorted(set(PROJECT_MICROBATCHES) | {int(view["microbatches"])})
    ps = sorted(set(PROJECT_STAGES) | {int(view["stages"])})
    return {
        "microbatches": ms,
        "step_ms_by_microbatches": [step_at(view, microbatches=m) for m in ms],
        "stages": ps,
        "step_ms_by_stages": [step_at(view, stages=p) for p in ps],
        "balanced_step_ms": step_at(view, balanced=True),
    }
