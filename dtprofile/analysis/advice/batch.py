"""Rules about memory and the batch: a bigger per-device batch, capped by the critical batch."""

from __future__ import annotations

from typing import cast

from ..._values import finite, get
from .readings import Readings
from .registry import Finding, rule
from .thresholds import BATCH_GROWTH_FACTORS, BATCH_HEADROOM_MIN_RATIO, COMM_BOUND_FRACTION, WARNING_FRACTION
from .wording import measured_gain

__all__ = ["batch_headroom"]


@rule("batch_headroom", order=700)
def batch_headroom(r: Readings) -> Finding | None:
    """Device memory allows at least :data:`BATCH_HEADROOM_MIN_RATIO` x the batch, or a bigger
    batch would hide the communication: the batch to use, capped by memory and by the
    critical batch size.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if r.batch_size is None or r.batch_size <= 0 or r.step is None:
        return None
    if r.mesh is not None and r.mesh.pp > 1:  # (a pipeline's microbatches: pipeline_bubble speaks of them)
        return None
    batch = int(r.batch_size)
    cap = r.critical_per_device()
    critical = get(r.recommendations, "critical_batch_size")
    max_batch = finite(get(r.recommendations, "max_batch_size"))
    evidence = {
        "batch_size": batch,
        "max_batch_size": max_batch,
        "critical_batch_size": critical,
        "critical_batch_per_device": cap,
        "R_O": r.r_o,
        "comm_fraction": r.comm_fraction,
        "device": r.device,
    }
    suggested: int | None
    if r.device == "cuda" and max_batch is not None and max_batch >= BATCH_HEADROOM_MIN_RATIO * batch:
        suggested = int(max_batch)
        reason = "device memory"
    elif r.comm_bound:
        suggested, reason = None, "communication"
        for factor in BATCH_GROWTH_FACTORS:
            parts = r.batch_step_ms(factor)
            if parts is None:
                return None
            suggested = batch * factor
            if parts["step"] > 0 and parts["comm_exposed"] / parts["step"] < COMM_BOUND_FRACTION:
                break
        suggested = cast(int, suggested)  # set: BATCH_GROWTH_FACTORS is not empty
        if r.device == "cuda" and max_batch is not None:
            suggested = min(suggested, int(max_batch))
    else:
        return None
    if cap is not None and suggested > cap:
        if cap <= batch:
            title = (
                f"The batch ({batch} per device) is at or past the critical batch size "
                f"({critical:.0f} global): a bigger batch would hide {reason} "
                "overhead but cost more samples to reach the same loss"
            )
            return Finding("batch_headroom", "info", title, evidence, f"batch_size={batch} (keep)", None)
        suggested = cap
    if suggested <= batch:
        return None
    growth = suggested / batch
    gain = None
    parts, now = r.batch_step_ms(growth), r.batch_step_ms(1.0)
    if parts is not None and now is not None:
        gain = measured_gain(r.step, now["step"], parts["step"], samples_factor=growth)
    overhead = r.r_o if r.r_o is not None else 0.0
    severity = "low" if (r.comm_bound or overhead >= WARNING_FRACTION) else "info"
    why = (
        "memory allows it"
        if reason == "device memory"
        else f"it hides {r.hide_name} under more compute"
        if r.mesh is None
        # (a mesh's activations grow with the batch: what the batch spreads is the rest)
        else "it spreads the step's fixed costs (the optimizer, host work, data-parallel collectives) over more samples"
    )
    capped = " (capped by the critical batch size)" if cap is not None and suggested == cap else ""
    title = f"Bigger per-device batch: {batch} -> {suggested}{capped}; {why}"
    if r.hf_trainer:
        action = f"batch_size={suggested} per device (TrainingArguments(per_device_train_batch_size={suggested}))"
    elif get(r.run_info, "num_workers") is None:
        # No DataLoader was seen: the loop draws its own batches (nanoGPT's get_batch, say).
        action = f"the batch your loop draws per device and micro-step: {suggested} (it is {batch} now)"
    else:
        action = f"batch_size={suggested} per device (DataLoader(batch_size={suggested}))"
    if r.micro_batches > 1:
        action += (
            f"; or, for the same global batch per update, keep it and accumulate more: "
            f"{int(r.micro_batches)} micro-batches an update now"
        )
    action += "; scale the learning rate with it"
    if gain:
        # The performance model scales forward and backward with the batch, as on a fully used GPU.
        gain += (
            "; compute taken to grow in proportion to the batch (a device with spare "
            "capacity grows it less: the gain is then larger, the communication hides less)"
        )
    evidence["suggested_batch_size"] = suggested
    return Finding("batch_headroom", severity, title, evidence, action, gain)
