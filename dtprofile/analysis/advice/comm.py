"""Rules about gradient communication: exposed all-reduce time and needless synchronisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ..._values import finite, get
from ..phases import step_parts_ms
from .readings import Readings
from .registry import Finding, rule, severity_band
from .thresholds import BUFFER_BROADCAST_SHARE, COMM_BOUND_FRACTION, CRITICAL_FRACTION
from .wording import borderline_severity, gain_text, job_words, measured_gain, noise_words, percent

__all__ = ["accumulation_sync", "comm_bound"]


@rule("comm_bound", order=300)
def comm_bound(r: Readings) -> Finding | None:
    """Exposed communication at least :data:`COMM_BOUND_FRACTION` of the step: how to shrink it.

    ``high`` from :data:`CRITICAL_FRACTION`, else ``medium``. DDP's buffer broadcast leads when
    it holds :data:`BUFFER_BROADCAST_SHARE` of the wait; then compression fitting the backend
    and hook, FSDP's mixed precision, compiling outside DDP, bucket views.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    # Within the run's noise of the threshold (the interval reaches it): raised all the
    # same, low, so that the same job profiled again does not flip its verdict on noise.
    # (a mesh's dimensions and a pipeline's waits are tp_comm_exposed's, dp_comm_exposed's and
    # pipeline_bubble's: here DDP's across replicas, what the readings leave of the rest)
    if r.mesh is not None and r.mesh.dp_comm_waited_ms is not None:
        return None
    borderline = r.mesh is None and not r.comm_bound and r.reaches("comm_fraction", COMM_BOUND_FRACTION)
    if not (r.comm_bound or borderline) or r.comm_exposed is None or r.comm_fraction is None:
        return None
    overlap = finite(get(r.ratios, "comm_overlap"))
    evidence: dict[str, Any] = {
        "comm_exposed_ms": r.comm_exposed,
        "comm_total_ms": r.comm_total,
        "step_ms": r.step,
        "comm_fraction": r.comm_fraction,
        "comm_overlap": overlap,
        "grad_bytes": finite(get(r.summary, "grad_bytes")),
        "busbw_GBps": finite(get(r.summary, "busbw_GBps")),
        "world_size": r.world_size,
        "threshold": COMM_BOUND_FRACTION,
    }
    gain = None
    if r.comm_total is not None and r.phases is not None and r.step is not None:
        # Compressing gradients to 16 bits halves the bytes and so the all-reduce time.
        halved = step_parts_ms(r.phases, 1.0, r.comm_total / 2.0)
        now = step_parts_ms(r.phases, 1.0, r.comm_total)
        gain = measured_gain(r.step, now["step"], halved["step"])
    ddp = get(r.run_info, "ddp")
    hook_name = str(get(ddp, "comm_hook") or "")
    fewer_syncs = _fewer_syncs(r)
    if r.fsdp is not None:
        action = _fsdp_comm_action(r.fsdp, evidence)
    elif get(r.summary, "backend") == "gloo":
        # Gloo sums 16-bit gradients on the CPU slowly (a bf16 hook measured 1.1-2.8x slower
        # here), and PowerSGD's collectives stall under it: compression does not pay.
        gain = None
        evidence["backend"] = "gloo"
        action = (
            f"{fewer_syncs}; with gloo, compressing hooks (bf16, PowerSGD) cost more than they "
            "save: on GPUs use the NCCL backend, where they do"
        )
    elif "powersgd" in hook_name.lower():
        gain = None  # compressed already, harder than 16 bits do
        evidence["comm_hook"] = hook_name
        action = (
            f"gradients are already compressed ({hook_name}): a lower matrix_approximation_rank "
            f"compresses further, at some cost in accuracy; {fewer_syncs}"
        )
    elif get(ddp, "compressed_16bit"):
        gain = None  # the gradients already cross in 16 bits
        evidence["comm_hook"] = get(ddp, "comm_hook")
        action = (
            f"gradients already cross in 16 bits ({get(ddp, 'comm_hook')}); PowerSGD compresses "
            "further, at some cost in accuracy: dtprofile.timed_hook(powerSGD_hook) with "
            "PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1000) "
            "(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)"
        )
    elif r.lightning:
        action = (
            "DDPStrategy(ddp_comm_hook=dtprofile.timed_hook(torch.distributed.algorithms."
            "ddp_comm_hooks.default_hooks.bf16_compress_hook)) (halves grad_bytes on the wire, "
            "still timed by dtprofile; Lightning registers it on CUDA)"
        )
    elif r.hf_trainer:
        # TrainingArguments reach DDP's bucket size, buffers and unused-parameter search,
        # not a communication hook (the Trainer makes the DDP model inside train()).
        action = (
            f"{fewer_syncs}; TrainingArguments(ddp_bucket_cap_mb=...) larger buckets start fewer "
            "all-reduces; the Trainer sets no communication hook (gradient compression needs an "
            "Accelerate or plain loop)"
        )
    else:
        action = (
            "model.register_comm_hook(None, dtprofile.timed_hook(torch.distributed.algorithms."
            "ddp_comm_hooks.default_hooks.bf16_compress_hook)) (halves grad_bytes on the wire, "
            "still timed by dtprofile)"
        )
    action = _ddp_settings_first(r, ddp, action, evidence)
    action += "; see also batch_headroom and network_bandwidth"
    waits_for, action, gain = _buffers_first(r, ddp, action, evidence, gain)
    title = (
        f"Communication-bound: {r.comm_exposed:.1f} ms of the step waits for "
        f"{waits_for} ({percent(r.comm_fraction)}, threshold "
        f"{percent(COMM_BOUND_FRACTION)}"
        + (noise_words(r) if borderline else "")
        + (job_words(r, "comm_fraction"))
        + ")"
    )
    severity = borderline_severity(r) if borderline else "high" if r.comm_fraction >= CRITICAL_FRACTION else "medium"
    span = r.span("comm_fraction")
    if span is not None:
        evidence["comm_fraction_range"] = span
    return Finding("comm_bound", severity, title, evidence, action, gain)


def _buffers_first(
    r: Readings, ddp: Any, action: str, evidence: dict[str, Any], gain: str | None
) -> tuple[str, str, str | None]:
    """``(what the step waits for, the action, the gain)``, led by DDP's buffer broadcast
    before forward where it holds :data:`BUFFER_BROADCAST_SHARE` of the exposed wait."""
    waits_for = r.comm_name
    buffers = r.comm_buffers or 0.0
    if r.fsdp is None and buffers >= BUFFER_BROADCAST_SHARE * cast(float, r.comm_exposed):  # comm_bound: measured
        # DDP's buffer broadcast before forward: nothing hides it, and no gradient change
        # shortens it; the step need not make it.
        waits_for = f"communication, {buffers:.1f} ms of it DDP's buffer broadcast before forward"
        evidence["comm_buffers_ms"] = buffers
        evidence["buffer_broadcast_bytes"] = finite(get(ddp, "buffer_broadcast_bytes"))
        skip = (
            "DDPStrategy(broadcast_buffers=False)"
            if r.lightning
            else "TrainingArguments(ddp_broadcast_buffers=False)"
            if r.hf_trainer
            else "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])"
            if r.accelerate
            else "DistributedDataParallel(model, broadcast_buffers=False) (torch >= 2.13: forward_sync_buffers=False)"
        )
        action = (
            f"{skip} skips the broadcast of the module's buffers (BatchNorm's running statistics) "
            "from rank 0 before every forward: each rank then keeps its own statistics (they are "
            "used in eval mode: evaluate and checkpoint on rank 0, or broadcast them once before); "
            f"for the gradients: {action}"
        )
        if r.comm_total is not None and r.phases is not None and r.step is not None:
            without = step_parts_ms(r.phases, 1.0, max(0.0, r.comm_total - buffers))
            now = step_parts_ms(r.phases, 1.0, r.comm_total)
            gain = measured_gain(r.step, now["step"], without["step"])
    return waits_for, action, gain


def _fewer_syncs(r: Readings) -> str:
    """How this loop sends its gradients less often per sample, in its own knobs."""
    text = "bigger per-rank batches or gradient accumulation under no_sync() send the gradients less often per sample"
    passes = finite(get(r.run_info, "sync_passes"))
    if r.micro_batches > 1 and passes == 1:
        # The loop accumulates already, synchronising once an update: its factor is the knob.
        factor = int(r.micro_batches)
        text = (
            f"bigger per-rank batches, or more accumulation: {factor} micro-batches an update now, "
            f"{2 * factor} would send the gradients half as often per sample"
        )
    if r.hf_trainer:
        text = (
            "a bigger per_device_train_batch_size or gradient_accumulation_steps sends the gradients "
            "less often per sample"
        )
    elif r.accelerate:
        text = (
            "bigger per-rank batches or Accelerator(gradient_accumulation_steps=...) with "
            "accelerator.accumulate(model) send the gradients less often per sample"
        )
    return text


def _ddp_settings_first(r: Readings, ddp: Any, action: str, evidence: dict[str, Any]) -> str:
    """``action`` with the DDP settings that make the exposed wait longer than it need be
    put before it (a model compiled inside DDP) or after it (gradient copies into the
    buckets), each said in the entry point this loop uses."""
    if get(ddp, "compiled_inside") and not r.lightning:
        # Compiled inside DDP, backward is one graph: every bucket is ready at its end and
        # no all-reduce overlaps it. Compiled outside, Dynamo's DDPOptimizer splits the
        # graph at the buckets (a CPU run: exposed 3.9-6 ms inside, 1.1 ms outside).
        evidence["compiled_inside_ddp"] = True
        action = (
            "torch.compile(DDP(model)) rather than DDP(torch.compile(model)): compiled inside DDP, "
            "backward is one graph and every gradient bucket is ready only at its end, so no "
            "all-reduce overlaps it; compiled outside, the graph is split at the buckets; then " + action
        )
    if get(ddp, "gradient_as_bucket_view") is False and not r.hf_trainer:  # (not a TrainingArguments setting)
        # Without it DDP copies every gradient into its buckets during backward and back
        # afterwards: work that only synchronisation costs.
        view = (
            "DDPStrategy(gradient_as_bucket_view=True)"
            if r.lightning
            else "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])"
            if r.accelerate
            else "DistributedDataParallel(model, gradient_as_bucket_view=True)"
        )
        action += f"; {view} (no gradient copies into the buckets)"
        evidence["gradient_as_bucket_view"] = False
    return action


def _fsdp_comm_action(fsdp: Mapping[str, Any], evidence: dict[str, Any]) -> str:
    """What shrinks a sharded step's communication: 16-bit collectives, fewer gathers."""
    fsdp1 = get(fsdp, "api") == "FSDP1"
    if fsdp1:
        action = (
            "FullyShardedDataParallel(module, mixed_precision=MixedPrecision(param_dtype="
            "torch.bfloat16, reduce_dtype=torch.bfloat16)) (halves the bytes of every collective "
            "FSDP issues)"
        )
    else:
        action = (
            "fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.bfloat16)) (halves the bytes of every collective FSDP issues)"
        )
    units, gathers = finite(get(fsdp, "units")), finite(get(fsdp, "all_gathers"))
    evidence.update(
        {
            "fsdp_units": units,
            "all_gathers_per_step": gathers,
            "reduce_scatters_per_step": finite(get(fsdp, "reduce_scatters")),
            "replica_all_reduces_per_step": finite(get(fsdp, "replica_all_reduces")),
        }
    )
    if units is not None and gathers is not None and gathers > units:
        # Units resharded after forward gather their parameters again for backward.
        regathered = int(gathers - units)
        keep = (
            "FullyShardedDataParallel(..., sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)"
            if fsdp1
            else "fully_shard(..., reshard_after_forward=False)"
        )
        action += (
            f"; {keep} on the units that gather "
            f"again in backward ({regathered} all-gathers per step) if their unsharded "
            "parameters fit in memory between forward and backward"
        )
    return action


@rule("accumulation_sync", order=1100)
def accumulation_sync(r: Readings) -> Finding | None:
    """Gradient accumulation that synchronises on more than one micro-batch of a step.

    Severity by the communication that could be saved, as a share of the step. Not
    raised when a batch has more backward passes than micro-batches (several losses).

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    passes = finite(get(r.run_info, "sync_passes"))
    if passes is None or passes < 2 or r.micro_batches < 2 or not r.comm_total or not r.step:
        return None
    if passes > r.micro_batches:  # several backward passes per batch (a GAN's losses): not accumulation
        return None
    wasted = (passes - 1) / passes
    saved_ms = r.comm_total * wasted  # at most: the communication of every pass but the last
    grad_mb = (finite(get(r.summary, "grad_bytes")) or 0.0) / 1e6
    evidence = {
        "micro_batches": int(r.micro_batches),
        "sync_passes": int(passes),
        "comm_total_ms": r.comm_total,
        "grad_MB_per_step": grad_mb,
        "step_ms": r.step,
    }
    severity = severity_band(saved_ms / r.step, 0.0)
    severity = "low" if severity == "info" else severity
    scatters = r.fsdp is not None and (finite(get(r.fsdp, "reduce_scatters")) or 0) > 0
    verb = "reduce-scatters" if scatters else "all-reduces"
    title = (
        f"Gradient accumulation {verb} on {int(passes)} of {int(r.micro_batches)} "
        f"micro-batches; only the last one's result is used"
    )
    if r.fsdp is not None and get(r.fsdp, "api") == "FSDP1":
        action = (
            "run the first micro-batches' backward under model.no_sync() (FSDP1's, on the root "
            f"FullyShardedDataParallel), so only the last backward {verb}; unsharded gradients "
            "are kept in between"
        )
    elif r.fsdp is not None and r.lightning:
        # The Trainer's ModelParallelStrategy does not hold FSDP2's reduction back itself.
        action = (
            "in training_step, before backward, on the module you gave fully_shard last (self, "
            "or e.g. self.model): .set_requires_gradient_sync((batch_idx + 1) % "
            "self.trainer.accumulate_grad_batches == 0 or self.trainer.is_last_batch), so only "
            f"the last micro-batch {verb} (FSDP2 under ModelParallelStrategy)"
        )
    elif r.fsdp is not None:
        action = (
            "model.set_requires_gradient_sync(False) before the first micro-batches and "
            f"True before the last backward, so only it {verb} (FSDP2)"
        )
        if scatters and (finite(get(r.fsdp, "replica_all_reduces")) or 0) > 0:
            # HSDP: the middle way keeps gradients sharded (memory) and skips only the
            # all-reduce across replicas, which usually crosses the slower link.
            action += (
                "; or, to keep the gradients sharded between micro-batches, only "
                "model.set_requires_all_reduce(False) (True before the last backward): each "
                "micro-batch still reduce-scatters, only the last all-reduces across replicas"
            )
    else:
        # DDP decides during the forward whether the backward synchronises: the forward
        # must run under no_sync() too (a backward alone under it still all-reduced).
        action = (
            "run the first micro-batches' forward and backward under model.no_sync() (with "
            "ddp.no_sync(): loss = loss_fn(ddp(x), y); loss.backward()) and the last one outside "
            "it, so only its backward synchronises; Lightning's accumulate_grad_batches does "
            "this itself"
        )
    gain = f"{wasted:.0%} less gradient traffic ({grad_mb * wasted:.3g} MB per step), up to " + (
        gain_text(r.step, r.step - saved_ms) or f"{saved_ms:.1f} ms per step"
    )
    return Finding("accumulation_sync", severity, title, evidence, action, gain)
