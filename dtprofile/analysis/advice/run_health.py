"""Rules about the run's steps as a whole: enough of them measured, all alike, all updating.

Also the two findings about the advice itself: ``insufficient_data`` (a gate: no step
was measured, so nothing else is judged) and ``healthy`` (a verdict: nothing was found,
and why).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._values import finite, get
from ...capture.windows import TRIM_FRACTION
from .readings import Readings
from .registry import Finding, rule, severity_rank
from .thresholds import (
    COMM_BOUND_FRACTION,
    CRITICAL_FRACTION,
    DATA_BOUND_FRACTION,
    EVAL_FORWARDS_STEP_FRACTION,
    FEW_STEPS,
    GAP_DATA_WAIT_FLOOR_MS,
    RARE_LONG_STEPS_FRACTION,
    SKIPPED_UPDATE_FRACTION,
    SKIPPED_UPDATE_MIN_STEPS,
    SKIPPED_UPDATE_PERSISTENT_FRACTION,
)
from .wording import percent

__all__ = [
    "eval_forwards_in_steps",
    "few_steps",
    "healthy",
    "insufficient_data",
    "rare_long_steps",
    "skipped_updates",
    "varying_steps",
]


@rule("insufficient_data", order=100, kind="gate")
def insufficient_data(r: Readings) -> Finding | None:
    """No steady-state step was measured: the only finding, since nothing else can be judged.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None when a step was measured.
    """
    if r.step is not None:
        return None
    return Finding(
        "insufficient_data",
        "info",
        "No steady-state step was measured: nothing to advise",
        {"steps_profiled": get(r.summary, "steps_profiled"), "steps_total": get(r.summary, "steps_total")},
        "run more steps than warmup_steps (options.warmup_steps)",
        None,
    )


@rule("healthy", order=100, kind="verdict")
def healthy(r: Readings, found: Sequence[Finding]) -> Finding | None:
    """No check found anything ``low`` or worse: say why, with the numbers.

    With several ranks and communication unmeasured, the title says so and the action is
    how to measure it.

    Args:
        r: The summary's readings.
        found: The checks' findings.

    Returns:
        The finding, or None when a check found a problem.
    """
    if any(severity_rank(f.severity) < severity_rank("info") for f in found):
        return None
    largest = r.largest_projected_gpus()
    eff = r.projected(largest, "efficiency") if largest is not None else None
    evidence = {
        "step_ms": r.step,
        "data_fraction": r.data_fraction,
        "comm_fraction": r.comm_fraction,
        "R_O": r.r_o,
        "data_threshold": DATA_BOUND_FRACTION,
        "comm_threshold": COMM_BOUND_FRACTION,
        "largest_projected_gpus": largest,
        "efficiency_at_largest": eff,
        "recommended_gpus": get(r.recommendations, "gpus"),
        "bandwidth_source": get(r.projection, "bandwidth_source"),
    }
    parts = [f"step {r.step:.1f} ms"]
    if (
        r.data_fraction is not None
        and r.data_fraction >= DATA_BOUND_FRACTION
        and r.data_wait is not None
        and not r.data_bound
    ):  # under the gap floor
        parts.append(f"gap before forward {r.data_wait * 1e3:.0f} us (< {GAP_DATA_WAIT_FLOOR_MS * 1e3:.0f} us)")
    elif r.data_fraction is not None:
        parts.append(f"data wait {percent(r.data_fraction)} (< {percent(DATA_BOUND_FRACTION)})")
    if r.comm_fraction is not None:
        parts.append(f"exposed communication {percent(r.comm_fraction)} (< {percent(COMM_BOUND_FRACTION)})")
    if r.r_o is not None:
        parts.append(f"R_O {r.r_o:.3f}")
    if eff is not None:
        parts.append(f"projected efficiency {eff:.2f} at {largest} GPUs ({r.bandwidth_note()})")
    unmeasured = get(r.summary, "comm_unmeasured")
    if r.world_size > 1 and r.comm_total is None and unmeasured:
        # Nothing flagged in what was measured, but communication was not: not a verdict.
        evidence["comm_unmeasured"] = unmeasured
        title = "No overhead found in what was measured; gradient communication was not measured: " + ", ".join(parts)
        return Finding("healthy", "info", title, evidence, f"measure communication to judge it: {unmeasured}", None)
    title = "Healthy: " + ", ".join(parts)
    return Finding("healthy", "info", title, evidence, "no change needed", None)


@rule("skipped_updates", order=1400)
def skipped_updates(r: Readings) -> Finding | None:
    """At least :data:`SKIPPED_UPDATE_FRACTION` of the steps after warm-up (and
    :data:`SKIPPED_UPDATE_MIN_STEPS`) updated nothing: the loss scaler found inf/NaN gradients.

    ``high`` from :data:`CRITICAL_FRACTION`, ``medium`` from
    :data:`SKIPPED_UPDATE_PERSISTENT_FRACTION` (the skips persist), else ``low``.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    skipped = finite(get(r.summary, "steps_skipped_update"))
    total, warmup = finite(get(r.summary, "steps_total")), finite(get(r.summary, "warmup_steps")) or 0.0
    if skipped is None or total is None or skipped < SKIPPED_UPDATE_MIN_STEPS:
        return None
    steady = max(total - warmup, skipped)
    share = skipped / steady
    if share < SKIPPED_UPDATE_FRACTION:
        return None
    severity = (
        "high" if share >= CRITICAL_FRACTION else "medium" if share >= SKIPPED_UPDATE_PERSISTENT_FRACTION else "low"
    )
    evidence = {
        "steps_skipped_update": int(skipped),
        "steps_after_warmup": int(steady),
        "share": share,
        "threshold": SKIPPED_UPDATE_FRACTION,
    }
    sync = "" if r.world_size < 2 else f" and {'gradient all-reduce' if r.fsdp is None else r.sync_name}"
    title = (
        f"{int(skipped)} of {int(steady)} steps ({percent(share)}) updated nothing: inf/NaN "
        "gradients, so the loss scaler skipped optimizer.step(); each still cost a full "
        f"forward{',' if sync else ' and'} backward{sync}"
    )
    # The scaler settles within its first few back-offs and then skips ~1 step in 2000:
    # at 5% the gradients themselves overflow, and bf16 (no scaler to skip such a step)
    # would write the inf/NaN into the weights.
    causes = (
        "check the inputs for inf/NaN (torch.isfinite(x).all()), lower the learning rate, clip "
        "gradients (scaler.unscale_(optimizer), then torch.nn.utils.clip_grad_norm_)"
    )
    if share >= SKIPPED_UPDATE_PERSISTENT_FRACTION:
        action = (
            f"the skips persist, so the gradients themselves overflow: {causes}; switching to bf16 "
            "before that would write the inf/NaN into the weights"
        )
    else:
        action = (
            "with fp16 keep torch.amp.GradScaler's defaults (growth_interval=2000 skips ~0.05% of "
            "steps once the scale settles); skips that persist come from the gradients themselves: "
            f"{causes}; bf16 where the GPU supports it (torch.autocast(dtype=torch.bfloat16), "
            "Lightning precision='bf16-mixed') needs no loss scaling"
        )
    gain = f"{1.0 / (1.0 - share):.2f}x useful updates per second" if share < 1.0 else None
    return Finding("skipped_updates", severity, title, evidence, action, gain)


@rule("varying_steps", order=1600)
def varying_steps(r: Readings) -> Finding | None:
    """The steady-state steps had different micro-batch counts (``run.micro_batches_seen``):
    the averages blend step sizes.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    seen = get(r.run_info, "micro_batches_seen")
    if not isinstance(seen, list) or len(seen) <= 1:
        return None
    counts = ", ".join(str(int(c)) for c in seen[:-1]) + f" and {int(seen[-1])}"
    schedule = (
        "GradientAccumulationScheduler, or epochs that accumulate_grad_batches does not divide"
        if r.lightning
        else "a changing accumulation, or a partial one at each epoch's end"
    )
    return Finding(
        "varying_steps",
        "info",
        f"Steps of several sizes: {counts} micro-batches per optimizer step ({schedule}); the averages "
        f"mix them, and throughput counts the most common ({int(r.micro_batches)})",
        {"micro_batches_seen": seen, "micro_batches": r.micro_batches},
        "read the figures as a blend, or profile each setting in a run of its own",
        None,
    )


@rule("rare_long_steps", order=1700)
def rare_long_steps(r: Readings) -> Finding | None:
    """The steps the averages leave out (the slowest by step time) held a share of the
    run's time: a phase every N updates (an RL rollout, a periodic evaluation outside
    Lightning, a checkpoint) is in no figure. Info: a loaded machine's hiccups look alike.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    summary = r.summary
    all_ms = finite(get(summary, "step_ms_all_steps"))
    steps = finite(get(summary, "steps_profiled")) or 0
    if all_ms is None or r.step is None or all_ms <= 0 or steps < FEW_STEPS:
        return None
    share = (all_ms - r.step) / all_ms
    if share < RARE_LONG_STEPS_FRACTION:
        return None
    trimmed = percent(TRIM_FRACTION)
    return Finding(
        "rare_long_steps",
        "info",
        f"Rare long steps: the run spent {all_ms:.1f} ms a step in all, the averages {r.step:.1f} ms; "
        f"{percent(share)} of its time is in the {trimmed} slowest steps, which every figure leaves out",
        {
            "step_ms": r.step,
            "step_ms_all_steps": all_ms,
            "share": share,
            "trim_fraction": TRIM_FRACTION,
            "threshold": RARE_LONG_STEPS_FRACTION,
        },
        "find what those steps do: work every N updates (an RL rollout or environment phase, an "
        "evaluation of another model such as an EMA copy, a checkpoint), a memory or garbage-collection "
        "pause, or a busy machine; time that work on its own, or profile a run whose steps all do the "
        "same work",
        None,
    )


@rule("eval_forwards_in_steps", order=1800)
def eval_forwards_in_steps(r: Readings) -> Finding | None:
    """The profiled model ran in eval mode under no_grad in most steps: dtprofile leaves
    such passes out as evaluation, which a per-step teacher pass (self-distillation, a
    target network) is not.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    summary = r.summary
    count = finite(get(summary, "steps_with_eval_forwards")) or 0
    steady = (finite(get(summary, "steps_total")) or 0) - (finite(get(r.options, "warmup_steps")) or 0)
    if steady < FEW_STEPS or count < EVAL_FORWARDS_STEP_FRACTION * steady:
        return None
    return Finding(
        "eval_forwards_in_steps",
        "info",
        f"The profiled model ran in eval mode under no_grad in {int(count)} of {int(steady)} steps: "
        "dtprofile leaves such passes out of the step as evaluation, so their time is in no figure",
        {
            "steps_with_eval_forwards": int(count),
            "steps_after_warmup": int(steady),
            "threshold": EVAL_FORWARDS_STEP_FRACTION,
        },
        "if that pass is part of training (a self-distillation teacher, a target network), run it in train "
        "mode under no_grad (it then counts as compute of the step), or through a module of its own; "
        "evaluation every step is better done every N steps",
        None,
    )


@rule("few_steps", order=1900)
def few_steps(r: Readings) -> Finding | None:
    """Fewer than :data:`FEW_STEPS` steady-state steps in the whole run: the findings rest
    on little data. An interval's window is short by design: only a run with few steps in
    all is noted.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    steps = finite(get(r.summary, "steps_profiled"))
    steady = (finite(get(r.summary, "steps_total")) or 0) - (finite(get(r.options, "warmup_steps")) or 0)
    if steps is None or not 0 < steps < FEW_STEPS or steady >= FEW_STEPS:
        return None
    return Finding(
        "few_steps",
        "info",
        f"Only {int(steps)} steady-state step{'s' if steps != 1 else ''} measured: the findings rest on little data",
        {
            "steps_profiled": int(steps),
            "steps_total": get(r.summary, "steps_total"),
            "warmup_steps": get(r.options, "warmup_steps"),
            "threshold": FEW_STEPS,
        },
        f"profile at least {FEW_STEPS} steps after the warm-up",
        None,
    )
