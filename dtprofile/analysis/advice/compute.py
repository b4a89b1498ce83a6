"""Rules about how the step computes: idle GPU, a serial optimizer, host work, threads, cuDNN."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._values import finite, get, median
from .readings import Readings
from .registry import Finding, rule, severity_band
from .thresholds import (
    CPU_THREADS_UNDERUSED_FRACTION,
    CPU_THREADS_UNDERUSED_MIN_CPUS,
    HOST_WORK_FRACTION,
    LAUNCH_BOUND_UTIL_PERCENT,
    OPTIMIZER_SERIAL_FRACTION,
    OPTIMIZER_SERIAL_HIGH_FRACTION,
)
from .wording import gain_text, percent

__all__ = ["cpu_threads", "cudnn_benchmark", "host_work", "launch_bound", "optimizer_serial"]

#: The telemetry's names for GPU utilisation (percent), first found wins.
_UTILISATION_KEYS = ("gpu_util_percent", "util_percent", "utilization_percent", "sm_util_percent", "gpu_utilization")


def _telemetry_util(telemetry: Any) -> float | None:
    """GPU utilisation (percent) from the telemetry: its own figure, else the ranks' median."""
    keys = _UTILISATION_KEYS
    for key in keys:
        value = finite(get(telemetry, key))
        if value is not None:
            return value
    per_rank = get(telemetry, "ranks")
    if isinstance(per_rank, list):
        return median(next((finite(get(x, k)) for k in keys if finite(get(x, k)) is not None), None) for x in per_rank)
    return None


@rule("launch_bound", order=800)
def launch_bound(r: Readings) -> Finding | None:
    """GPU utilisation below :data:`LAUNCH_BOUND_UTIL_PERCENT` with neither data wait nor
    communication to blame: kernel launches set the pace.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if r.device != "cuda":
        return None
    util = _telemetry_util(get(r.run_info, "telemetry"))
    if util is None or util >= LAUNCH_BOUND_UTIL_PERCENT or r.data_bound or r.comm_bound:
        return None
    evidence = {
        "gpu_util_percent": util,
        "threshold_percent": LAUNCH_BOUND_UTIL_PERCENT,
        "data_fraction": r.data_fraction,
        "comm_fraction": r.comm_fraction,
        "step_ms": r.step,
    }
    bigger = f"batch_size={int(r.batch_size) * 2}" if r.batch_size else "a bigger batch_size"
    title = (
        f"Launch-bound: GPU busy {util:.0f}% of the time (< "
        f"{LAUNCH_BOUND_UTIL_PERCENT:.0f}%) with no data or communication wait to blame"
    )
    action = (
        f'torch.compile(model, mode="reduce-overhead") (CUDA graphs), or {bigger} to give each kernel launch more work'
    )
    return Finding("launch_bound", "medium", title, evidence, action, None)


@rule("optimizer_serial", order=900)
def optimizer_serial(r: Readings) -> Finding | None:
    """The optimizer step above :data:`OPTIMIZER_SERIAL_FRACTION` of compute, which every
    replica repeats: fuse it, or shard it.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if r.optimizer is None or r.compute is None or r.compute <= 0:
        return None
    share = r.optimizer / r.compute
    if share <= OPTIMIZER_SERIAL_FRACTION:
        return None
    evidence = {
        "optimizer_ms": r.optimizer,
        "compute_ms": r.compute,
        "share": share,
        "threshold": OPTIMIZER_SERIAL_FRACTION,
        "world_size": r.world_size,
    }
    severity = "medium" if share > OPTIMIZER_SERIAL_HIGH_FRACTION else "low"
    opt = get(r.run_info, "optimizer")
    cls = get(opt, "class")
    if cls and get(opt, "fused_on"):  # already fused: only sharding is left
        fused = f"{cls} is fused already"
    elif cls and get(opt, "fused"):
        fused = f"{cls}(..., fused=True)" + ("" if get(opt, "foreach_on") else " (or foreach=True)")
    elif cls and get(opt, "foreach"):
        fused = f"{cls}(..., foreach=True)"
    else:  # the user's own optimizer: say what the fast ones are
        fused = "a fused optimizer step (torch.optim's Adam, AdamW, SGD and Adagrad take fused=True)" + (
            f" instead of {cls}" if cls else ""
        )
    sharded = r.fsdp is not None and (
        (finite(get(r.fsdp, "all_gathers")) or 0) > 0 or (finite(get(r.fsdp, "reduce_scatters")) or 0) > 0
    )
    if sharded or get(opt, "zero"):
        # FSDP or ZeRO already steps each rank's shard only: nothing left to shard.
        title = (
            f"Optimizer step is {percent(share)} of compute ({r.optimizer:.1f} ms), on this "
            f"rank's shard of the parameters ({'FSDP' if sharded else 'ZeroRedundancyOptimizer'})"
        )
        if get(opt, "fused_on"):
            fused += (
                "; it steps this rank's shard only: a bigger per-device batch spreads it over "
                "more samples (see batch_headroom)"
            )
        return Finding("optimizer_serial", severity, title, evidence, fused, None)
    if cls == "LBFGS":
        # Its step runs a line search over the closure: ZeRO would search each rank's shard
        # apart, and the ranks' closures (each an all-reduce) would fall out of step.
        title = (
            f"Optimizer step is {percent(share)} of compute ({r.optimizer:.1f} ms, LBFGS's own work "
            "between its closure calls)"
        )
        action = (
            "LBFGS(..., max_iter=..., history_size=...) smaller: fewer iterations and a shorter "
            "history per step; it cannot be sharded (ZeroRedundancyOptimizer would run each rank's "
            "line search on its own shard)"
        )
        return Finding("optimizer_serial", severity, title, evidence, action, None)
    if r.fsdp is not None:
        title = (
            f"Optimizer step is {percent(share)} of compute ({r.optimizer:.1f} ms): every "
            "replica repeats it on the whole model, so it does not shrink with more GPUs"
        )
        action = (
            f"{fused}; with several GPUs shard it: fully_shard with the ranks on the "
            "mesh's shard dimension (HSDP: a shard dimension > 1) steps each rank's shard only"
        )
    else:
        # One process measured: nothing repeats it yet; say what more GPUs would do.
        repeats = (
            f"every one of the {r.world_size} ranks repeats it, so it does not shrink"
            if r.world_size >= 2
            else "under DDP every rank would repeat it, so it would not shrink"
        )
        title = f"Optimizer step is {percent(share)} of compute ({r.optimizer:.1f} ms): {repeats} with more GPUs"
        action = (
            f"{fused}; with several GPUs shard it: from torch.distributed.optim import "
            "ZeroRedundancyOptimizer; ZeroRedundancyOptimizer(model.parameters(), "
            f"optimizer_class={cls or 'torch.optim.AdamW'})"
        )
    gain = None
    if r.world_size >= 2 and r.step:
        saved = r.optimizer * (1.0 - 1.0 / r.world_size)
        gain = (
            f"ZeRO at {r.world_size} ranks: "
            + (gain_text(r.step, r.step - saved) or "")
            + ", less the parameter broadcast it adds after each step"
        )
    return Finding("optimizer_serial", severity, title, evidence, action, gain)


@rule("host_work", order=1000)
def host_work(r: Readings) -> Finding | None:
    """Compute outside forward, backward and the optimizer step at least
    :data:`HOST_WORK_FRACTION` of the step: where such work hides in the loop.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if (
        r.step is None
        or r.compute is None
        or r.forward is None
        or r.backward is None
        or r.optimizer is None
        or not 0 < r.compute <= r.step
    ):
        return None
    other = r.compute - (r.forward + r.backward + r.optimizer)
    share = other / r.step
    if share < HOST_WORK_FRACTION:
        return None
    evidence = {
        "other_ms": other,
        "step_ms": r.step,
        "compute_ms": r.compute,
        "forward_ms": r.forward,
        "backward_ms": r.backward,
        "optimizer_ms": r.optimizer,
        "share": share,
        "threshold": HOST_WORK_FRACTION,
    }
    title = (
        f"Work between the phases: {other:.1f} ms of a {r.step:.1f} ms step ({percent(share)}) "
        "is outside forward, backward and the optimizer step"
    )
    pipe = get(r.summary, "pipeline")
    if isinstance(pipe, Mapping) and pipe.get("schedule"):
        action = (
            f"a pipeline stage's work besides its passes is mostly the schedule's own ({pipe['schedule']}'s "
            "Python between microbatches, the activations' copies for the transfers), paid once a microbatch "
            "and stage a rank: fewer, larger microbatches or stages a rank, larger layers a stage, a compiled "
            "stage; then the loop's own work between the schedule's step and the update (.item(), logging)"
        )
    elif r.lightning:
        action = (
            "it runs in Lightning's loop around your training_step: logging (self.log(..., "
            "on_step=False), or a larger Trainer(log_every_n_steps=...)), on_before_optimizer_step "
            "hooks (gradient norms: every N steps instead) and gradient clipping (gradient_clip_val), "
            "checkpoints saved every few steps (ModelCheckpoint(every_n_train_steps=...)), your "
            "on_train_batch_* hooks and callbacks, .item() calls, a loss computed outside forward"
        )
    elif r.hf_trainer:
        action = (
            "it runs in the Trainer's loop around forward and backward (evaluation and checkpoint "
            "saves are already left out): gradient clipping and its norm (max_grad_norm), the token "
            "count gathered across ranks for the loss (average_tokens_across_devices), callbacks' "
            "on_step_* hooks, a compute_loss or a collator that works outside the model, .item() calls"
        )
    else:
        action = (
            "find it in the loop between the phases: .item() calls and logging every step (every N "
            "steps instead), metrics (keep them on the device), the batch's move to the device "
            "(x.to(device, non_blocking=True) from a DataLoader with pin_memory=True), a loss, "
            "gradient penalty or clipping computed outside the model, another model's forward (a "
            "teacher), another optimizer's step (pass every optimizer: dtprofile.profile(model, "
            "[opt_a, opt_b])), checkpoints, zero_grad()"
        )
    gain = gain_text(r.step, r.step - other)
    gain = gain and gain + " if all of it moved out of the step"
    return Finding("host_work", severity_band(share, HOST_WORK_FRACTION), title, evidence, action, gain)


@rule("cpu_threads", order=1200)
def cpu_threads(r: Readings) -> Finding | None:
    """CPU training with more compute threads per rank than CPUs (medium), or fewer than
    :data:`CPU_THREADS_UNDERUSED_FRACTION` of them (low).

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    threads, cpus = finite(get(r.run_info, "torch_threads")), finite(get(r.run_info, "cpus_per_rank"))
    if r.device != "cpu" or threads is None or cpus is None or cpus < 1:
        return None
    per_rank = max(1, int(cpus))
    evidence = {"torch_threads": int(threads), "cpus_per_rank": cpus, "world_size": r.world_size, "device": r.device}
    action = f"torch.set_num_threads({per_rank}) in each rank (or OMP_NUM_THREADS={per_rank} before torchrun)"
    if threads > cpus:
        who = (
            "the ranks oversubscribe the cores and slow each other down"
            if r.world_size > 1
            else "the threads oversubscribe the cores and wait for each other"
        )
        title = f"{int(threads)} compute threads per rank on {cpus:g} CPUs per rank: {who}"
        return Finding("cpu_threads", "medium", title, evidence, action, None)
    if cpus >= CPU_THREADS_UNDERUSED_MIN_CPUS and threads < CPU_THREADS_UNDERUSED_FRACTION * cpus:
        title = (
            f"{int(threads)} compute thread(s) per rank on {cpus:g} CPUs per rank: "
            f"{cpus - threads:g} cores per rank sit idle during compute"
        )
        return Finding("cpu_threads", "low", title, evidence, action, None)
    return None


@rule("cudnn_benchmark", order=1300)
def cudnn_benchmark(r: Readings) -> Finding | None:
    """A convolutional model on CUDA with cuDNN's autotuning off.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if r.device != "cuda" or get(r.run_info, "has_conv") is not True or get(r.run_info, "cudnn_benchmark") is not False:
        return None
    evidence = {"has_conv": True, "cudnn_benchmark": False, "device": r.device}
    title = "Convolutional model with cuDNN autotuning off: the fastest convolution algorithms are not being chosen"
    action = "torch.backends.cudnn.benchmark = True (input shapes fixed; with varying shapes it re-tunes per shape)"
    return Finding("cudnn_benchmark", "low", title, evidence, action, None)
