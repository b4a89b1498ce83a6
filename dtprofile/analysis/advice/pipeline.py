"""Rules for a pipeline-parallel run: the bubble, stages of unequal compute, and what the
stages send each other.

The figures come from :func:`dtprofile.analysis.pipeline_plan.pipeline_view` (the
summary's ``pipeline`` and the ranks' figures, each stage's the median over its replicas) and its model of the step
at other microbatch and stage counts.
"""

from __future__ import annotations

from typing import Any

from ..._values import finite, get
from ..pipeline_plan import layout_words, pipeline_view, stage_words, step_at
from ..rank_spread import RANKS_LISTED
from .readings import Readings
from .registry import Finding, rule
from .thresholds import COMM_BOUND_FRACTION, CRITICAL_FRACTION, MICROBATCH_MIN_GAIN, STRAGGLER_MIN_EXCESS_FRACTION
from .wording import measured_gain, percent


def _bubble_at(view: dict[str, Any], microbatches: int) -> float:
    """The bubble's share in theory at ``microbatches``: (p - 1)/(m v + p - 1), scaled by
    the measured bubble slots (k) of a zero-bubble schedule."""
    p, v, k = int(view["stages"]), int(view.get("stages_per_rank", 1)), float(view.get("bubble_slots", 1.0))
    return k * (p - 1) / (microbatches * v + k * (p - 1)) if p > 1 else 0.0


def _more_microbatches(view: dict[str, Any], samples: float | None) -> int:
    """The microbatch count with the shortest projected step among the run's doubled (which
    keeps the batch divisible as it was), up to the bubble's share in theory at
    :data:`COMM_BOUND_FRACTION` once more, and no more than a microbatch of one sample
    allows; the run's own when none is :data:`MICROBATCH_MIN_GAIN` shorter (the host work
    each microbatch brings outweighs the bubble it saves)."""
    m = int(view["microbatches"])
    most = m * int(samples) if samples else 64 * m
    counts, more = [], 2 * m
    while more <= most:
        counts.append(more)
        if _bubble_at(view, more) <= COMM_BOUND_FRACTION:
            break
        more *= 2
    if not counts:
        return m
    best = min(counts, key=lambda c: step_at(view, microbatches=c))
    return best if step_at(view, microbatches=best) <= (1 - MICROBATCH_MIN_GAIN) * step_at(view) else m


@rule("pipeline_bubble", order=320)
def pipeline_bubble(r: Readings) -> Finding | None:
    """A pipeline stage waits for its neighbours for at least :data:`COMM_BOUND_FRACTION` of
    the step: more microbatches, an interleaved or zero-bubble schedule, fewer stages."""
    view = pipeline_view(r.summary)
    if view is None or view["bubble_fraction"] < COMM_BOUND_FRACTION:
        return None
    m, p, v = int(view["microbatches"]), int(view["stages"]), int(view["stages_per_rank"])
    theory = view["bubble_fraction_theory"]
    more = _more_microbatches(view, r.batch_size)  # (run.batch_size: a microbatch's samples)
    at_more = step_at(view, microbatches=more) if more > m else None
    evidence = {
        "schedule": view["schedule"],
        "stages": p,
        "stages_per_rank": v,
        "microbatches": m,
        "bubble_fraction": view["bubble_fraction"],
        "bubble_fraction_theory": theory,
        "bubble_model": view["bubble_model"],
        "wait_ms": [f["wait_ms"] for f in view["stage_figures"][:RANKS_LISTED]],  # (bounded: the first stages')
        "step_ms": view["step_ms"],
        "step_ms_at_more_microbatches": at_more,
        "more_microbatches": more,
        "threshold": COMM_BOUND_FRACTION,
    }
    memory = {
        "ScheduleGPipe": f"GPipe keeps every microbatch's activations until its backward, so each stage holds "
        f"{more} smaller ones instead of {m}: the same bytes in total; Schedule1F1B holds at most {p} at a time",
        "Schedule1F1B": f"1F1B holds at most {p} microbatches' activations at a time, however many there are",
    }.get(str(view["schedule"]), "each microbatch's activations are smaller, and more of them are in flight")
    bubble = f": the bubble falls to {percent(_bubble_at(view, more))}" + (
        " with equal stages" if theory is not None else " (the run's measured bubble slots)"
    )
    host = view.get("per_microbatch_ms") or 0.0
    steps = (
        [
            f"n_microbatches={more} (from {m}){bubble}, {at_more:.1f} ms a step projected, each microbatch "
            f"{m / more:.2g}x the size now (the batch must split into {more}); {memory}"
        ]
        if at_more is not None
        else [
            f"more microbatches would not pay here: each brings {host:.2f} ms of the schedule's host work to "
            "every slot, more than the bubble it takes away (fewer Python calls a microbatch: a compiled stage, "
            "larger layers a stage)"
        ]
    )
    if v == 1 and view["bubble_model"] == "theory":  # (the interleaved and zero-bubble schedules are next)
        interleaved = step_at(view, virtual=2)
        evidence["step_ms_interleaved_2"] = interleaved
        steps.append(
            f"an interleaved schedule (ScheduleInterleaved1F1B with 2 stages a rank, each rank's layers in 2 "
            f"chunks: the bubble (p - 1)/(2m + p - 1) = {percent((p - 1) / (2 * m + p - 1))}, {interleaved:.1f} ms "
            "a step projected, before its extra transfers) or a zero-bubble one (ScheduleInterleavedZeroBubble, "
            "ScheduleZBVZeroBubble: the weight gradients fill it)"
        )
    if p > 2:
        half = p // 2 if p % 2 == 0 else p - 1  # (an odd count: one stage fewer)
        fewer = step_at(view, stages=half)
        evidence["step_ms_at_half_stages"] = fewer  # (the name kept: at ``fewer_stages`` stages)
        evidence["fewer_stages"] = half
        steps.append(
            f"fewer stages ({half}, each {p / half:.3g}x the layers: {fewer:.1f} ms a step, projected) with the "
            "GPUs freed as data-parallel replicas, where the model fits"
        )
    in_theory = f"; {percent(theory)} in theory with equal stages" if theory is not None else ""
    # Waits that none of the schedule's changes would shorten are mostly a slower stage's
    # (stage_imbalance's), or the host work each microbatch brings: no lead finding then.
    changes = {
        f"{more} microbatches": at_more,
        "the interleaved schedule": evidence.get("step_ms_interleaved_2"),
        f"{evidence.get('fewer_stages')} stages": evidence.get("step_ms_at_half_stages"),
    }
    projected = {name: ms for name, ms in changes.items() if ms}
    best = min(projected, key=lambda name: projected[name]) if projected else None
    gain_share = max(0.0, 1 - projected[best] / step_at(view)) if best is not None else 0.0
    pays = gain_share >= MICROBATCH_MIN_GAIN
    uneven = view["imbalance"] is not None and view["imbalance"] >= 1 + STRAGGLER_MIN_EXCESS_FRACTION
    title = (
        f"Pipeline bubble: each stage waits {percent(view['bubble_fraction'])} of the step for its neighbours "
        f"({layout_words(view)}{in_theory})"
        + ("" if pays or not uneven else "; mostly for the slower stage: see stage_imbalance")
    )
    # As much as the best of its changes would gain: a person fixes the larger cause first.
    severity = ("high" if gain_share >= CRITICAL_FRACTION else "medium") if pays else "low"
    gain = measured_gain(view["step_ms"], step_at(view), projected[best]) if best is not None and pays else None
    return Finding("pipeline_bubble", severity, title, evidence, "; ".join(steps), gain and f"{gain} with {best}")


@rule("stage_imbalance", order=330)
def stage_imbalance(r: Readings) -> Finding | None:
    """The slowest stage computes at least :data:`STRAGGLER_MIN_EXCESS_FRACTION` more than
    the median stage: every slot of the schedule is as long as it, so move layers off it."""
    view = pipeline_view(r.summary)
    if view is None or view["imbalance"] is None or view["imbalance"] < 1 + STRAGGLER_MIN_EXCESS_FRACTION:
        return None
    figures = view["stage_figures"]
    slow = next(f for f in figures if f["stage"] == view["slowest_stage_index"])
    fast = min(figures, key=lambda f: f["compute_ms"])
    move_ms = slow["compute_ms"] - view["mean_compute_ms"]  # (to the mean: every stage alike)
    balanced = step_at(view, balanced=True)
    evidence = {
        "slowest_stage_rank": slow["rank"],
        "slowest_stage_index": slow["stage"],
        "stage_compute_ms": [f["compute_ms"] for f in figures],
        "imbalance": view["imbalance"],
        "step_ms": view["step_ms"],
        "balanced_step_ms": balanced,
        "move_ms": move_ms,
    }
    title = (
        f"Unequal pipeline stages: {stage_words(slow)} computes {slow['compute_ms']:.1f} ms a step, "
        f"{view['imbalance']:.2f}x the median stage's, and sets every slot's length"
    )
    action = (
        f"move about {move_ms:.1f} ms of forward + backward a step (of {slow['compute_ms']:.1f}) of layers from "
        f"{stage_words(slow)} to {stage_words(fast)} ({fast['compute_ms']:.1f} ms): split the model "
        "where the stages' measured times even out (pipeline(..., split_spec=...) or the modules each "
        "PipelineStage is given)"
    )
    gain = measured_gain(view["step_ms"], step_at(view), balanced)
    severity = "high" if balanced <= (1 - CRITICAL_FRACTION) * step_at(view) else "medium"  # (as pipeline_bubble's)
    return Finding("stage_imbalance", severity, title, evidence, action, gain)


@rule("pipeline_transfer", order=335)
def pipeline_transfer(r: Readings) -> Finding | None:
    """What the stages send each other (each microbatch's activations forward, their
    gradients back) takes at least :data:`COMM_BOUND_FRACTION` of the step: its bytes over
    a link that was measured, set or read from NVML; over an assumed one, as much of the
    send waits as the bytes explain (a send also waits for its receiver to be ready: a
    slower neighbour's time, not the transfer's)."""
    view = pipeline_view(r.summary)
    if view is None:
        return None
    pipe = get(r.summary, "pipeline")
    nbytes, send_ms = finite(get(pipe, "bytes")), finite(get(pipe, "send_wait_ms")) or 0.0
    gbps = finite(get(r.projection, "bandwidth_GBps"))
    if not nbytes or not gbps:
        return None
    source = get(r.projection, "bandwidth_source")
    # (rank 0's launches, its sends and receives: each byte crosses its link once)
    wire_ms = nbytes / (gbps * 1e9) * 1e3
    known_link = source in ("measured", "user", "nvml")
    transfer_ms = wire_ms if known_link else min(send_ms, wire_ms)
    step = view["step_ms"]
    if transfer_ms < COMM_BOUND_FRACTION * step:
        return None
    chunks = int(view["microbatches"]) * int(view["stages_per_rank"])
    per_microbatch_mb = nbytes / 1e6 / chunks / 2  # (each way: an activation forward, its gradient back)
    evidence = {
        "bytes": nbytes,
        "bytes_per_microbatch": nbytes / chunks / 2,
        "send_wait_ms": send_ms,
        "wire_ms": wire_ms,
        "bandwidth_GBps": gbps,
        "bandwidth_source": source,
        "transfer_ms": transfer_ms,
        "step_ms": step,
        "share": transfer_ms / step,
        "threshold": COMM_BOUND_FRACTION,
    }
    title = (
        f"Pipeline transfers: rank 0's stage moves {nbytes / 1e6:.1f} MB a step (about {per_microbatch_mb:.2f} MB "
        f"each way a microbatch), {wire_ms:.1f} ms at {gbps:.3g} GB/s ({source}), {percent(transfer_ms / step)} of "
        f"the step" + ("" if known_link else f"; its sends waited {send_ms:.1f} ms")
    )
    action = (
        "make what crosses between stages smaller or faster: cut the model where the activation is smallest "
        "(after a down-projection, not inside a wide MLP), send it in bf16 (the stage under torch.autocast, or "
        "a bf16 model), keep neighbouring stages on one node (NVLink) with the data-parallel dimension across "
        "nodes; a schedule that overlaps sends with compute (Schedule1F1B, interleaved) hides part of it"
    )
    gain = measured_gain(step, step, step - transfer_ms)
    return Finding("pipeline_transfer", "medium", title, evidence, action, gain and gain + " if it were hidden")
