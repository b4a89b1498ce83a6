"""Advice: rules that turn a run summary into findings (pure functions, no torch).

A finding is a dict with a stable ``id``, a ``severity`` (``high`` > ``medium`` > ``low``
> ``info``), a one-line ``title``, the ``evidence`` (the measured numbers that triggered
it), the ``action`` (which argument to change, to what) and the ``expected_gain`` (the
model's estimate, or None). :func:`advise` returns them most severe first;
:func:`analyze` fills a summary's ``projection``, ``recommendations`` and ``advice``;
:func:`format_findings` renders them for a terminal.

Rules never raise on a well-formed summary with missing measurements (nulls anywhere,
zero steps, world_size 1): a rule without its numbers stays silent.
"""

from __future__ import annotations

import copy
import math
import statistics
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import model, recorder

__all__ = [
    "BATCH_GROWTH_FACTORS",
    "BATCH_HEADROOM_MIN_RATIO",
    "BUFFER_BROADCAST_SHARE",
    "COMM_BOUND_FRACTION",
    "CRITICAL_FRACTION",
    "CPU_THREADS_UNDERUSED_FRACTION",
    "DATA_BOUND_FRACTION",
    "EVAL_FORWARDS_STEP_FRACTION",
    "IDENTICAL_DATA_MAX_B",
    "LAUNCH_BOUND_UTIL_PERCENT",
    "OPTIMIZER_SERIAL_FRACTION",
    "OPTIMIZER_SERIAL_HIGH_FRACTION",
    "RARE_LONG_STEPS_FRACTION",
    "SEVERITY_ORDER",
    "SKIPPED_UPDATE_FRACTION",
    "SKIPPED_UPDATE_MIN_STEPS",
    "STANDARD_LINK_Gbps",
    "STRAGGLER_MIN_EXCESS_FRACTION",
    "STRAGGLER_MIN_EXCESS_MS",
    "STRAGGLER_MIN_EXCESS_STEP_FRACTION",
    "WARNING_FRACTION",
    "advise",
    "analyze",
    "json_safe",
    "format_findings",
    "fsdp_collectives",
]

#: Most severe first; :func:`advise` sorts by it.
SEVERITY_ORDER: tuple[str, ...] = ("high", "medium", "low", "info")

# --------------------------------------------------------------------------- thresholds

#: Data wait above this share of the step is data-bound: the PyTorch profiler's
#: TensorBoard plugin flagged data loading above 5% of the step.
DATA_BOUND_FRACTION = model.DATA_WAIT_HIDDEN_FRACTION
#: When the batch's transfer to the device is at least this share of the data wait, the
#: data advice is about the transfer hooks, not the loader's workers.
TRANSFER_BOUND_SHARE = 0.5
#: DDP's buffer broadcast holding this share of the exposed communication leads the
#: ``comm_bound`` advice (``broadcast_buffers=False``).
BUFFER_BROADCAST_SHARE = 0.25
#: The slowest steps the averages leave out holding this share of the run's time or more:
#: ``rare_long_steps`` names the gap (5%: what the trim alone removes from even steps is
#: well under it).
RARE_LONG_STEPS_FRACTION = 0.05
#: The profiled model in eval mode under no_grad in at least this share of the steps: not
#: an occasional evaluation (``eval_forwards_in_steps``).
EVAL_FORWARDS_STEP_FRACTION = 0.5
#: Fewer steady-state steps than this: a ``few_steps`` note says the findings rest on little data.
FEW_STEPS = 10
#: Without ``prof.loader`` the data wait is the gap between steps, and that holds some
#: tens of microseconds of framework dispatch (the optimizer's and the module's hooks,
#: zero_grad) however fast the data comes: below this it is not called data-bound.
GAP_DATA_WAIT_FLOOR_MS = 0.1
#: Compute outside forward, backward and the optimizer step (host work in the loop: logging,
#: .item(), metrics, moving batches) above this share of the step is named (the warning band).
HOST_WORK_FRACTION = 0.10
#: Exposed communication above this share of the step is communication-bound: the same
#: plugin flagged exposed communication above 10%.
COMM_BOUND_FRACTION = 0.10
#: Severity bands for a share of the step (TraceML: 10% warning, 20% critical). A share
#: at or above CRITICAL_FRACTION is ``high``, at or above WARNING_FRACTION ``medium``.
WARNING_FRACTION = 0.10
CRITICAL_FRACTION = 0.20
#: Straggler: the slow rank's busy time (step minus exposed communication: data wait +
#: compute) must exceed the median of the other ranks' by more than 10% AND by more than
#: 1 ms. Per-rank averages of a healthy run differ by a few percent (timer jitter, core
#: placement on a shared CPU); 10% is TraceML's warning band, and the 1 ms floor keeps
#: sub-millisecond steps from flagging on scheduler noise.
STRAGGLER_MIN_EXCESS_FRACTION = 0.10
STRAGGLER_MIN_EXCESS_MS = 1.0
# ... and by at least this share of the step: on machines shared with other work, a few
# percent of imbalance comes and goes (seen on the two-namespace bench).
STRAGGLER_MIN_EXCESS_STEP_FRACTION = 0.05
# A phase is named as where the straggler loses its time only if it holds at least this
# share of the excess; otherwise the time lies between the phases (host work).
STRAGGLER_PHASE_SHARE = 0.5
#: Launch-bound: device utilisation below 50% (the profiler plugin's GPU-utilisation
#: rule) while neither data wait nor communication explains the idle time.
LAUNCH_BOUND_UTIL_PERCENT = 50.0
#: Optimizer step above 20% of compute is worth fusing or sharding (DDP replicates it on
#: every rank, so it does not shrink with more devices); above 40% it is ``medium``.
OPTIMIZER_SERIAL_FRACTION = 0.20
OPTIMIZER_SERIAL_HIGH_FRACTION = 0.40
#: Updates skipped by a loss scaler (inf/NaN gradients): torch.amp.GradScaler's dynamic
#: scale grows every ``growth_interval=2000`` steps and backs off once, so by design it
#: skips about 1 step in 2000 (0.05%); 20x that is a problem worth naming. At 5% and 20%
#: of the steps the wasted work takes the usual severity bands.
SKIPPED_UPDATE_FRACTION = 0.01
SKIPPED_UPDATE_MIN_STEPS = 3  # a couple of back-offs right after warm-up are the scale settling
#: Above this share the skips are not the scale settling (a few back-offs) but overflowing gradients.
SKIPPED_UPDATE_PERSISTENT_FRACTION = 0.05
#: Identical data on every rank: the gradient noise scale measured between the local and
#: the all-reduced buckets, B_simple = tr(Sigma) / |G|^2, is in samples and is at least of
#: order one for different batches; below a thousandth of a sample the ranks computed the
#: same gradient (no DistributedSampler, or every rank reads the same shard).
IDENTICAL_DATA_MAX_B = 1e-3
#: CPU training: intra-op threads per rank below half the CPUs a rank has (and at least 4
#: of them) leave cores idle; torchrun sets OMP_NUM_THREADS=1 for several ranks per node.
CPU_THREADS_UNDERUSED_FRACTION = 0.5
#: Memory headroom worth reporting: the batch could at least double.
BATCH_HEADROOM_MIN_RATIO = 2.0
#: Per-device batch multipliers tried when a bigger batch should hide communication.
BATCH_GROWTH_FACTORS: tuple[int, ...] = (2, 4, 8, 16)
#: Common link speeds (Ethernet / InfiniBand), to name one that meets a need.
STANDARD_LINK_Gbps: tuple[float, ...] = (1, 10, 25, 40, 50, 100, 200, 400, 800)

_PHASES = ("data_wait", "forward", "backward", "optimizer")


# --------------------------------------------------------------------------- helpers


def _num(value: Any) -> float | None:
    return model._num(value)


def _get(mapping: Any, key: str) -> Any:
    return mapping.get(key) if isinstance(mapping, Mapping) else None


def _finding(id: str, severity: str, title: str, evidence: dict, action: str,
             expected_gain: Any = None) -> dict:
    return {"id": id, "severity": severity, "title": title, "evidence": evidence,
            "action": action, "expected_gain": expected_gain}


def _band(fraction: float, low: float) -> str:
    """Severity of a share of the step: high >= 20%, medium >= 10%, low >= ``low``."""
    if fraction >= CRITICAL_FRACTION:
        return "high"
    if fraction >= WARNING_FRACTION:
        return "medium"
    return "low" if fraction >= low else "info"


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _gain(step_ms: float, new_step_ms: float, samples_factor: float = 1.0) -> str | None:
    """'step A -> B ms (Nx throughput)'; throughput counts ``samples_factor`` x samples."""
    if new_step_ms <= 0 or step_ms <= 0:
        return None
    speed = samples_factor * step_ms / new_step_ms
    return f"step {step_ms:.1f} -> {new_step_ms:.1f} ms ({speed:.2f}x throughput)"


def _measured_gain(r: "_Run", model_now_ms: float, model_new_ms: float,
                   samples_factor: float = 1.0) -> str | None:
    """The model's change of the step, applied to the measured step: the model rebuilds
    the step from its parts and can differ from the median measured (probe steps'
    interference, medians of parts that do not add up), and the gain starts from the
    step the report shows."""
    if r.step is None:
        return _gain(model_now_ms, model_new_ms, samples_factor)
    return _gain(r.step, r.step + model_new_ms - model_now_ms, samples_factor)


def _standard_link(gbps: float) -> str:
    for speed in STANDARD_LINK_Gbps:
        if speed >= gbps:
            return f"{speed:g} Gbit/s"
    return f"{gbps:.0f} Gbit/s"


def _gpus(n: Any) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _median(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class _Run:
    """The numbers the rules read, pulled out of a summary once, None where missing."""

    def __init__(self, summary: Mapping[str, Any]) -> None:
        self.summary = summary
        self.per = _get(summary, "per_step_ms") or {}
        self.ratios = _get(summary, "ratios") or {}
        self.run = _get(summary, "run") or {}
        self.options = _get(summary, "options") or {}
        self.device = _get(summary, "device")
        self.world_size = model._world_size(summary)
        for key in ("step", "data_wait", "forward", "backward", "optimizer", "comm_total",
                    "comm_exposed", "compute", "overhead", "data_transfer", "comm_buffers"):
            setattr(self, key, _num(_get(self.per, key)))
        self.target = (_num(_get(self.options, "target_efficiency"))
                       or model.DEFAULT_TARGET_EFFICIENCY)
        self.data_fraction = _num(_get(self.ratios, "data_fraction"))
        if self.data_fraction is None:
            self.data_fraction = self._share(self.data_wait)
        self.comm_fraction = _num(_get(self.ratios, "comm_fraction"))
        if self.comm_fraction is None:
            self.comm_fraction = self._share(self.comm_exposed)
        self.r_o = model._r_o(summary)
        self.batch_size = _num(_get(self.run, "batch_size"))
        self.micro_batches = _num(_get(self.run, "micro_batches")) or 1.0
        self.projection = _get(summary, "projection")
        if not isinstance(self.projection, Mapping) or "gpus" not in self.projection:
            self.projection = model.project_summary(summary)
        self.rec = _get(summary, "recommendations")
        if not isinstance(self.rec, Mapping):
            self.rec = model.recommend(summary, self.projection)
        self.phases = model.phases_from_summary(summary)
        # A sharded model (FSDP2) communicates by all-gather and reduce-scatter (HSDP and
        # FSDP's replicate: all-reduce across replicas as well).
        self.fsdp = _get(self.run, "fsdp") if _get(summary, "comm_source") == "fsdp" else None
        self.comm_name = fsdp_collectives(self.fsdp) if self.fsdp is not None else "the gradient all-reduce"
        # What every rank waits in for the others, in a sentence's words.
        self.sync_name = "FSDP's collectives" if self.fsdp is not None else "the all-reduce"
        self.hide_name = self.sync_name  # what more compute per step hides
        if self.fsdp is None and (_num(_get(_get(self.run, "ddp"), "buffer_broadcast_bytes")) or 0) > 0:
            self.sync_name = "DDP's buffer broadcast before forward and the all-reduce"
        # Lightning users change the Trainer's and the strategy's arguments, not the loop.
        self.lightning = _get(self.run, "framework") == "lightning"

    def _share(self, part: float | None) -> float | None:
        if part is None or self.step is None or self.step <= 0:
            return None
        share = part / self.step
        return share if math.isfinite(share) else None

    @property
    def comm_bound(self) -> bool:
        return self.comm_fraction is not None and self.comm_fraction >= COMM_BOUND_FRACTION

    @property
    def data_bound(self) -> bool:
        if self.data_fraction is None or self.data_fraction < DATA_BOUND_FRACTION:
            return False
        gap = _get(self.summary, "data_wait_source") == "gap"
        return not (gap and self.data_wait is not None and self.data_wait < GAP_DATA_WAIT_FLOOR_MS)

    def critical_per_device(self) -> int | None:
        """The critical (global) batch size as a per-device, per-micro-batch batch."""
        critical = _num(_get(self.rec, "critical_batch_size"))
        if critical is None:
            critical = model.critical_batch_size(self.run)
        if critical is None or critical <= 0:
            return None
        return max(1, math.floor(critical / (self.world_size * self.micro_batches)))

    def batch_step_ms(self, factor: float) -> dict[str, float] | None:
        """The step at ``factor`` x the per-device batch, same devices (model.step_parts_ms)."""
        if self.phases is None:
            return None
        return model.step_parts_ms(self.phases, factor, self.comm_total or 0.0)

    def bandwidth_note(self) -> str:
        source = _get(self.projection, "bandwidth_source")
        gbps = (_num(_get(self.projection, "bandwidth_GBps")) or 0.0) * 8.0
        if source == "assumed":
            return f"assumed {model.ASSUMED_BANDWIDTH_NAME}: nothing measured or set"
        return f"{gbps:.3g} Gbit/s, {source}"


# --------------------------------------------------------------------------- rules


def _rule_data_bound(r: _Run) -> list[dict]:
    if not r.data_bound or r.step is None or r.data_wait is None:
        return []
    current = _num(_get(r.run, "num_workers"))
    workers = _num(_get(r.rec, "num_workers"))
    needed = _num(_get(r.rec, "num_workers_needed"))
    cpus = _num(_get(r.run, "cpus_per_rank"))
    evidence = {"data_wait_ms": r.data_wait, "step_ms": r.step,
                "data_fraction": r.data_fraction, "num_workers": current,
                "num_workers_needed": needed, "cpus_per_rank": cpus,
                "threshold": DATA_BOUND_FRACTION,
                "data_wait_source": _get(r.summary, "data_wait_source")}
    gain = None
    gpu = r.device == "cuda"
    transfer = r.data_transfer or 0.0
    if transfer > 0:
        evidence["data_transfer_ms"] = transfer
    if transfer >= TRANSFER_BOUND_SHARE * r.data_wait:
        # Loader workers do not run the transfer hooks: more of them would not help.
        hooks = ("on_before_batch_transfer / transfer_batch_to_device / on_after_batch_transfer"
                 if r.lightning else "the batch's transfer to the device")
        action = (f"the wait is in {hooks} ({transfer:.1f} ms per step), not in the loader: move that "
                  "work into the Dataset or the DataLoader's collate_fn, where num_workers runs it in "
                  "parallel off the training loop"
                  + ("; pin_memory=True makes the copy itself asynchronous" if gpu else ""))
        if workers is not None and (current is None or workers > current):
            # The fetch's own part is data-bound too (recommend() sized the workers from it).
            action += (f"; for the fetch's own {r.data_wait - transfer:.1f} ms: DataLoader(num_workers="
                       f"{int(workers)}, persistent_workers=True)")
        gain = _gain(r.step, r.step - transfer) if r.step > transfer else None
    elif workers is not None and (current is None or workers > current):
        # Pinned host memory only speeds copies to a GPU.
        action = (f"DataLoader(num_workers={int(workers)}, {'pin_memory=True, ' if gpu else ''}"
                  "persistent_workers=True)")
        if needed is not None and needed > workers:
            action += (f"; {int(needed)} workers would hide it fully: give each rank more "
                       "CPU cores")
        # Supply with w workers: one batch per t_load / w; the step waits only for that.
        m = r.micro_batches
        busy = (r.step - r.data_wait) / m
        t_load = r.data_wait / m if not current else current * (busy + r.data_wait / m)
        gain = _gain(r.step, m * max(busy, t_load / workers))
    else:
        action = (f"the loader is at the CPU limit (num_workers={_count(current)}, cpus_per_rank="
                  f"{_count(cpus)}): give each rank more CPU cores, cache decoded samples or "
                  f"preprocess offline{', or move augmentation to the GPU' if gpu else ''}")
        gain = _gain(r.step, r.step - r.data_wait) if r.step > r.data_wait else None
    title = (f"Data-bound: waiting for data {r.data_wait:.1f} ms of a {r.step:.1f} ms step "
             f"({_pct(r.data_fraction)}, threshold {_pct(DATA_BOUND_FRACTION)})"
             + (f", {transfer:.1f} ms of it in the batch's transfer to the device" if transfer > 0 else ""))
    uneven = _uneven_data_wait(r)
    if uneven is not None:
        # A median over ranks is a wait no rank had when they differ this much: say whose.
        slow, slow_ms, others_ms = uneven
        evidence.update(slowest_rank=slow, slowest_rank_data_wait_ms=slow_ms, other_ranks_data_wait_ms=others_ms)
        title += f"; rank {slow} waits {slow_ms:.1f} ms, the other ranks {others_ms:.1f} ms (median)"
    if evidence["data_wait_source"] == "gap":
        # Without prof.loader the wait is the gap before forward: loading or any host work.
        title = (f"Data-bound or host-bound: {r.data_wait:.1f} ms of a {r.step:.1f} ms step pass "
                 f"between the optimizer step and the next forward ({_pct(r.data_fraction)}, "
                 f"threshold {_pct(DATA_BOUND_FRACTION)})")
        action = ("tell loading from other host work: iterate prof.loader(train_loader) (data wait "
                  f"= time blocked in next()); if it is the loader: {action}; if not: move host work "
                  "(logging, .item() calls, metrics) out of the step")
    return [_finding("data_bound", _band(r.data_fraction, DATA_BOUND_FRACTION), title,
                     evidence, action, gain)]


def _uneven_data_wait(r: _Run) -> tuple[int, float, float] | None:
    """(rank, its data wait, the other ranks' median) when one rank waits more than twice,
    and 1 ms more than, the others' median; else None."""
    ranks = [x for x in (_get(r.summary, "ranks") or []) if isinstance(x, Mapping)]
    waits = [_num(_get(x, "data_wait")) for x in ranks]
    if len(waits) < 2 or None in waits:
        return None
    slow = max(range(len(waits)), key=waits.__getitem__)
    others = statistics.median(w for i, w in enumerate(waits) if i != slow)
    if waits[slow] > 2 * others and waits[slow] - others > 1.0:
        return int(_num(_get(ranks[slow], "rank")) or 0), waits[slow], others
    return None


def _round_up(value: float, digits: int = 2) -> str:
    """``value`` rounded up to ``digits`` significant figures: a bound that still holds
    once rounded (0.1484 -> 0.15, 3.304 -> 3.4, 17.2 -> 18)."""
    if value <= 0 or not math.isfinite(value):
        return f"{value:g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(round(value / scale, 9)) * scale:.{max(0, -math.floor(math.log10(scale)))}f}"


def _count(value: float | None) -> str:
    """A count as a person writes it: 2, not 2.0 (1.5 stays 1.5)."""
    if value is None:
        return "unknown"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _rule_comm_bound(r: _Run) -> list[dict]:
    if not r.comm_bound or r.comm_exposed is None:
        return []
    overlap = _num(_get(r.ratios, "comm_overlap"))
    evidence = {"comm_exposed_ms": r.comm_exposed, "comm_total_ms": r.comm_total,
                "step_ms": r.step, "comm_fraction": r.comm_fraction, "comm_overlap": overlap,
                "grad_bytes": _num(_get(r.summary, "grad_bytes")),
                "busbw_GBps": _num(_get(r.summary, "busbw_GBps")),
                "world_size": r.world_size, "threshold": COMM_BOUND_FRACTION}
    gain = None
    if r.comm_total is not None and r.phases is not None and r.step is not None:
        # Compressing gradients to 16 bits halves the bytes and so the all-reduce time.
        halved = model.step_parts_ms(r.phases, 1.0, r.comm_total / 2.0)
        now = model.step_parts_ms(r.phases, 1.0, r.comm_total)
        gain = _measured_gain(r, now["step"], halved["step"])
    ddp = _get(r.run, "ddp")
    hook_name = str(_get(ddp, "comm_hook") or "")
    fewer_syncs = ("bigger per-rank batches or gradient accumulation under no_sync() send the "
                   "gradients less often per sample")
    if r.fsdp is not None:
        action = _fsdp_comm_action(r.fsdp, evidence)
    elif _get(r.summary, "backend") == "gloo":
        # Gloo sums 16-bit gradients on the CPU slowly (a bf16 hook measured 1.1-2.8x slower
        # here), and PowerSGD's collectives stall under it: compression does not pay.
        gain = None
        evidence["backend"] = "gloo"
        action = (f"{fewer_syncs}; with gloo, compressing hooks (bf16, PowerSGD) cost more than they "
                  "save: on GPUs use the NCCL backend, where they do")
    elif "powersgd" in hook_name.lower():
        gain = None  # compressed already, harder than 16 bits do
        evidence["comm_hook"] = hook_name
        action = (f"gradients are already compressed ({hook_name}): a lower matrix_approximation_rank "
                  f"compresses further, at some cost in accuracy; {fewer_syncs}")
    elif _get(ddp, "compressed_16bit"):
        gain = None  # the gradients already cross in 16 bits
        evidence["comm_hook"] = _get(ddp, "comm_hook")
        action = (f"gradients already cross in 16 bits ({_get(ddp, 'comm_hook')}); PowerSGD compresses "
                  "further, at some cost in accuracy: dtprofile.timed_hook(powerSGD_hook) with "
                  "PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1000) "
                  "(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)")
    elif r.lightning:
        action = ("DDPStrategy(ddp_comm_hook=dtprofile.timed_hook(torch.distributed.algorithms."
                  "ddp_comm_hooks.default_hooks.bf16_compress_hook)) (halves grad_bytes on the wire, "
                  "still timed by dtprofile; Lightning registers it on CUDA)")
    else:
        action = ("model.register_comm_hook(None, dtprofile.timed_hook(torch.distributed.algorithms."
                  "ddp_comm_hooks.default_hooks.bf16_compress_hook)) (halves grad_bytes on the wire, "
                  "still timed by dtprofile)")
    if _get(ddp, "compiled_inside") and not r.lightning:
        # Compiled inside DDP, backward is one graph: every bucket is ready at its end and
        # no all-reduce overlaps it. Compiled outside, Dynamo's DDPOptimizer splits the
        # graph at the buckets (a CPU run: exposed 3.9-6 ms inside, 1.1 ms outside).
        evidence["compiled_inside_ddp"] = True
        action = ("torch.compile(DDP(model)) rather than DDP(torch.compile(model)): compiled inside DDP, "
                  "backward is one graph and every gradient bucket is ready only at its end, so no "
                  "all-reduce overlaps it; compiled outside, the graph is split at the buckets; then "
                  + action)
    if _get(ddp, "gradient_as_bucket_view") is False:
        # Without it DDP copies every gradient into its buckets during backward and back
        # afterwards: work that only synchronisation costs.
        view = ("DDPStrategy(gradient_as_bucket_view=True)" if r.lightning
                else "DistributedDataParallel(model, gradient_as_bucket_view=True)")
        action += f"; {view} (no gradient copies into the buckets)"
        evidence["gradient_as_bucket_view"] = False
    action += "; see also batch_headroom and network_bandwidth"
    waits_for = r.comm_name
    buffers = r.comm_buffers or 0.0
    if r.fsdp is None and buffers >= BUFFER_BROADCAST_SHARE * r.comm_exposed:
        # DDP's buffer broadcast before forward: nothing hides it, and no gradient change
        # shortens it; the step need not make it.
        waits_for = f"communication, {buffers:.1f} ms of it DDP's buffer broadcast before forward"
        evidence["comm_buffers_ms"] = buffers
        evidence["buffer_broadcast_bytes"] = _num(_get(ddp, "buffer_broadcast_bytes"))
        skip = ("DDPStrategy(broadcast_buffers=False)" if r.lightning
                else "DistributedDataParallel(model, broadcast_buffers=False) (torch >= 2.13: "
                     "forward_sync_buffers=False)")
        action = (f"{skip} skips the broadcast of the module's buffers (BatchNorm's running statistics) "
                  "from rank 0 before every forward: each rank then keeps its own statistics (they are "
                  "used in eval mode: evaluate and checkpoint on rank 0, or broadcast them once before); "
                  f"for the gradients: {action}")
        if r.comm_total is not None and r.phases is not None and r.step is not None:
            without = model.step_parts_ms(r.phases, 1.0, max(0.0, r.comm_total - buffers))
            now = model.step_parts_ms(r.phases, 1.0, r.comm_total)
            gain = _measured_gain(r, now["step"], without["step"])
    title = (f"Communication-bound: {r.comm_exposed:.1f} ms of the step waits for "
             f"{waits_for} ({_pct(r.comm_fraction)}, threshold "
             f"{_pct(COMM_BOUND_FRACTION)})")
    severity = "high" if r.comm_fraction >= CRITICAL_FRACTION else "medium"
    return [_finding("comm_bound", severity, title, evidence, action, gain)]


_FSDP_COLLECTIVES = (("all_gathers", "all-gathers"), ("reduce_scatters", "reduce-scatters"),
                     ("replica_all_reduces", "all-reduces across replicas"))


def fsdp_collectives(fsdp: Mapping[str, Any] | None) -> str:
    """The collectives a sharded step issued, in words (``run.fsdp`` counts them).

    >>> fsdp_collectives({"all_gathers": 9, "reduce_scatters": 5, "replica_all_reduces": 0})
    "FSDP's all-gathers and reduce-scatters"
    >>> fsdp_collectives({"all_gathers": 0, "reduce_scatters": 0, "replica_all_reduces": 5})
    "FSDP's all-reduces across replicas"
    """
    names = [name for key, name in _FSDP_COLLECTIVES if (_num(_get(fsdp, key)) or 0) > 0]
    names = names or [name for _, name in _FSDP_COLLECTIVES[:2]]  # counts unknown: the usual pair
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return "FSDP's " + listed


def _fsdp_comm_action(fsdp: Mapping[str, Any], evidence: dict) -> str:
    """What shrinks a sharded step's communication: 16-bit collectives, fewer gathers."""
    fsdp1 = _get(fsdp, "api") == "FSDP1"
    if fsdp1:
        action = ("FullyShardedDataParallel(module, mixed_precision=MixedPrecision(param_dtype="
                  "torch.bfloat16, reduce_dtype=torch.bfloat16)) (halves the bytes of every collective "
                  "FSDP issues)")
    else:
        action = ("fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                  "reduce_dtype=torch.bfloat16)) (halves the bytes of every collective FSDP issues)")
    units, gathers = _num(_get(fsdp, "units")), _num(_get(fsdp, "all_gathers"))
    evidence.update({"fsdp_units": units, "all_gathers_per_step": gathers,
                     "reduce_scatters_per_step": _num(_get(fsdp, "reduce_scatters")),
                     "replica_all_reduces_per_step": _num(_get(fsdp, "replica_all_reduces"))})
    if units is not None and gathers is not None and gathers > units:
        # Units resharded after forward gather their parameters again for backward.
        regathered = int(gathers - units)
        keep = ("FullyShardedDataParallel(..., sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)" if fsdp1
                else "fully_shard(..., reshard_after_forward=False)")
        action += (f"; {keep} on the units that gather "
                   f"again in backward ({regathered} all-gathers per step) if their unsharded "
                   "parameters fit in memory between forward and backward")
    return action


def _projection_at(r: _Run, g: Any, key: str) -> float | None:
    gpus = _get(r.projection, "gpus") or []
    values = _get(r.projection, key)
    if g not in gpus or not isinstance(values, list):
        return None
    i = gpus.index(g)
    return _num(values[i]) if i < len(values) else None


def _largest_projected(r: _Run) -> Any:
    gpus = _get(r.projection, "gpus") or []
    known = [g for g in gpus if _projection_at(r, g, "efficiency") is not None]
    return max(known) if known else None


def _rule_network_bandwidth(r: _Run) -> list[dict]:
    at = _get(r.rec, "bandwidth_needed_at_gpus")
    if at is None:
        return []
    eff = _projection_at(r, at, "efficiency")
    step = _projection_at(r, at, "step_ms")
    exposed = _projection_at(r, at, "comm_exposed_ms")
    if eff is None or step is None or exposed is None or step <= 0:
        return []
    forecast = eff < r.target and exposed / step >= COMM_BOUND_FRACTION
    if not (r.comm_bound or forecast) or eff >= r.target:
        return []
    current_gbps = (_num(_get(r.projection, "bandwidth_GBps")) or 0.0) * 8.0
    needed = _num(_get(r.rec, "bandwidth_needed_Gbps"))
    evidence = {"bandwidth_Gbps": current_gbps,
                "bandwidth_source": _get(r.projection, "bandwidth_source"),
                "bandwidth_needed_Gbps": needed, "at_gpus": at, "efficiency_now": eff,
                "target_efficiency": r.target, "comm_ms": _projection_at(r, at, "comm_ms"),
                "comm_exposed_ms": exposed, "step_ms": step,
                "grad_bytes": _get(r.projection, "grad_bytes"),
                "model": _get(r.projection, "model")}
    severity = "medium" if r.comm_bound else "info"
    if needed is None:
        title = (f"No link bandwidth reaches efficiency {r.target:.2f} at {at} GPUs "
                 f"(now {eff:.2f} with {r.bandwidth_note()}): latency or serial work "
                 "dominates")
        action = ("batch_size larger per device (see batch_headroom) or fewer GPUs (see "
                  "gpu_count); bandwidth alone cannot fix it")
        return [_finding("network_bandwidth", severity, title, evidence, action, None)]
    title = (f"Link bandwidth limits scaling: efficiency {eff:.2f} at {at} GPUs with "
             f"{r.bandwidth_note()}; {_round_up(needed)} Gbit/s reaches {r.target:.2f}")
    action = f"link bandwidth >= {_round_up(needed)} Gbit/s (e.g. {_standard_link(needed)})"
    gain = (f"efficiency at {at} GPUs {eff:.2f} -> {r.target:.2f} "
            f"(speedup {eff * at:.1f}x -> {r.target * at:.1f}x)")
    return [_finding("network_bandwidth", severity, title, evidence, action, gain)]


def _rule_gpu_count(r: _Run) -> list[dict]:
    best = _num(_get(r.rec, "gpus"))
    largest = _largest_projected(r)
    if best is None or largest is None:
        return []
    best = _get(r.rec, "gpus")
    if best >= largest and best >= r.world_size:
        return []
    eff_largest = _projection_at(r, largest, "efficiency")
    eff_best = _projection_at(r, best, "efficiency")
    evidence = {"recommended_gpus": best, "efficiency_at_recommended": eff_best,
                "largest_projected_gpus": largest, "efficiency_at_largest": eff_largest,
                "target_efficiency": r.target, "world_size": r.world_size,
                "scaling": _get(r.projection, "scaling"),
                "bandwidth_source": _get(r.projection, "bandwidth_source"),
                "bandwidth_GBps": _get(r.projection, "bandwidth_GBps"),
                "gpus": _get(r.projection, "gpus"),
                "efficiency": _get(r.projection, "efficiency")}
    title = (f"Scaling knee: efficiency stays >= {r.target:.2f} up to {_gpus(best)} and falls "
             f"to {eff_largest:.2f} at {largest} ({_get(r.projection, 'scaling')} scaling, "
             f"{r.bandwidth_note()})")
    severity = "medium" if best < r.world_size else "info"
    launch = ("Trainer(devices=..., num_nodes=...) with devices x num_nodes" if r.lightning
              else "world_size (torchrun --nnodes/--nproc_per_node)")
    action = f"{launch} <= {best} at this bandwidth"
    gain = None
    if eff_best is not None:
        gain = (f"efficiency {eff_best:.2f} at {_gpus(best)} vs {eff_largest:.2f} at "
                f"{largest}")
        now, fewer = _projection_at(r, r.world_size, "speedup"), _projection_at(r, best, "speedup")
        if best < r.world_size and now is not None and fewer is not None:
            # Fewer GPUs than now: each works more efficiently, the run as a whole goes slower.
            gain += (f"; speedup {fewer:.2f} at {_gpus(best)} vs {now:.2f} at the {r.world_size} used "
                     "now: less throughput, each GPU better used")
    return [_finding("gpu_count", severity, title, evidence, action, gain)]


def _rule_parameter_servers(r: _Run) -> list[dict]:
    n_ps = _get(r.rec, "num_parameter_servers")
    g = _get(r.rec, "num_parameter_servers_at_gpus") or _get(r.rec, "gpus")
    if n_ps is None or g is None:
        return []
    gbps = _num(_get(r.rec, "num_parameter_servers_bandwidth_Gbps"))
    if gbps is None:  # a summary from before 0.5
        gbps = (_num(_get(r.projection, "bandwidth_GBps")) or 0.0) * 8.0
    imbalance = _num(_get(r.rec, "num_parameter_servers_imbalance")) or 1.0
    share = _num(_get(r.rec, "num_parameter_servers_largest_tensor_share"))
    evidence = {"num_parameter_servers": n_ps, "gpus": g,
                "param_bytes": _get(r.run, "param_bytes") or _get(r.projection, "grad_bytes"),
                "bytes_per_step": _get(r.rec, "num_parameter_servers_bytes")
                or _get(r.projection, "grad_bytes"),
                "largest_tensor_bytes": _get(r.run, "largest_trainable_param_bytes"),
                "server_bandwidth_Gbps": gbps, "compute_ms": _projection_at(r, g, "compute_ms"),
                "imbalance": imbalance, "largest_tensor_share": share,
                "bandwidth_source": _get(r.rec, "num_parameter_servers_bandwidth_source")
                or _get(r.projection, "bandwidth_source")}
    title = (f"A parameter-server deployment of this model at {_gpus(g)} needs >= {n_ps} "
             f"servers at {gbps:.3g} Gbit/s each (lemma N_ps >= 2*S*G/(B_ps*T_C))")
    if share is not None and share > 1.0:
        action = (f"num_parameter_servers >= {n_ps}, and split the largest parameter tensor "
                  f"across servers: on one server it alone needs {share:.3g}x the time the "
                  "compute hides, however many servers there are")
    elif share is not None:
        # Every tensor fits one server's budget: whole tensors pack into about N servers.
        action = (f"num_parameter_servers >= {n_ps}; shard by tensor, no tensor is too large "
                  "for one server")
    else:  # the tensors' sizes are not in the summary (before 0.5)
        action = (f"num_parameter_servers >= {n_ps}, more if the parameters split unevenly over "
                  "the servers (x largest/mean shard)")
    return [_finding("parameter_servers", "info", title, evidence, action, None)]


def _rule_batch_headroom(r: _Run) -> list[dict]:
    if r.batch_size is None or r.batch_size <= 0 or r.step is None:
        return []
    batch = int(r.batch_size)
    cap = r.critical_per_device()
    critical = _get(r.rec, "critical_batch_size")
    max_batch = _num(_get(r.rec, "max_batch_size"))
    evidence = {"batch_size": batch, "max_batch_size": max_batch,
                "critical_batch_size": critical, "critical_batch_per_device": cap,
                "R_O": r.r_o, "comm_fraction": r.comm_fraction, "device": r.device}
    if r.device == "cuda" and max_batch is not None and max_batch >= \
            BATCH_HEADROOM_MIN_RATIO * batch:
        suggested = int(max_batch)
        reason = "device memory"
    elif r.comm_bound:
        suggested, reason = None, "communication"
        for factor in BATCH_GROWTH_FACTORS:
            parts = r.batch_step_ms(factor)
            if parts is None:
                return []
            suggested = batch * factor
            if parts["step"] > 0 and parts["comm_exposed"] / parts["step"] \
                    < COMM_BOUND_FRACTION:
                break
        if r.device == "cuda" and max_batch is not None:
            suggested = min(suggested, int(max_batch))
    else:
        return []
    if cap is not None and suggested > cap:
        if cap <= batch:
            title = (f"The batch ({batch} per device) is at or past the critical batch size "
                     f"({critical:.0f} global): a bigger batch would hide {reason} "
                     "overhead but cost more samples to reach the same loss")
            return [_finding("batch_headroom", "info", title, evidence,
                             f"batch_size={batch} (keep)", None)]
        suggested = cap
    if suggested <= batch:
        return []
    factor = suggested / batch
    gain = None
    parts, now = r.batch_step_ms(factor), r.batch_step_ms(1.0)
    if parts is not None and now is not None:
        gain = _measured_gain(r, now["step"], parts["step"], samples_factor=factor)
    overhead = r.r_o if r.r_o is not None else 0.0
    severity = "low" if (r.comm_bound or overhead >= WARNING_FRACTION) else "info"
    why = ("memory allows it" if reason == "device memory"
           else f"it hides {r.hide_name} under more compute")
    capped = " (capped by the critical batch size)" if cap is not None and suggested == cap \
        else ""
    title = (f"Bigger per-device batch: {batch} -> {suggested}{capped}; {why}")
    action = (f"batch_size={suggested} per device (DataLoader(batch_size={suggested})); scale "
              "the learning rate with it")
    if gain:
        # The model scales forward and backward with the batch, as on a fully used GPU.
        gain += ("; compute taken to grow in proportion to the batch (a device with spare "
                 "capacity grows it less: the gain is then larger, the communication hides less)")
    evidence["suggested_batch_size"] = suggested
    return [_finding("batch_headroom", severity, title, evidence, action, gain)]


def _busy_ms(rank: Mapping[str, Any]) -> float | None:
    """Time a rank is not waiting for its peers: step - comm_exposed, else the phases."""
    step, exposed = _num(_get(rank, "step")), _num(_get(rank, "comm_exposed"))
    if step is not None and exposed is not None:
        return step - exposed
    compute, data = _num(_get(rank, "compute")), _num(_get(rank, "data_wait"))
    if compute is not None:
        return compute + (data or 0.0)
    phases = [_num(_get(rank, p)) for p in _PHASES]
    return sum(p for p in phases if p is not None) if any(p is not None for p in phases) \
        else None


def _rule_straggler(r: _Run) -> list[dict]:
    ranks = [x for x in (_get(r.summary, "ranks") or []) if isinstance(x, Mapping)]
    found = _compute_straggler(r, ranks) if len(ranks) >= 2 else []
    return found or _telemetry_straggler(r)


def _compute_straggler(r: _Run, ranks: list[Mapping[str, Any]]) -> list[dict]:
    exposed = [_num(_get(x, "comm_exposed")) for x in ranks]
    busy = [_busy_ms(x) for x in ranks]
    if all(e is not None for e in exposed):
        # The all-reduce equalises the steps: the rank the others wait for waits least.
        slow = min(range(len(ranks)), key=lambda i: exposed[i])
    elif all(b is not None for b in busy):
        slow = max(range(len(ranks)), key=lambda i: busy[i])
    else:
        return []
    others = [i for i in range(len(ranks)) if i != slow]
    typical = _median(busy[i] for i in others)
    if busy[slow] is None or typical is None:
        return []
    excess = busy[slow] - typical
    step_ms = _num(_get(ranks[slow], "step"))
    if (excess <= STRAGGLER_MIN_EXCESS_MS or excess <= STRAGGLER_MIN_EXCESS_FRACTION * typical
            or (step_ms is not None and excess <= STRAGGLER_MIN_EXCESS_STEP_FRACTION * step_ms)):
        return []
    diffs = {}
    for phase in _PHASES:
        mine = _num(_get(ranks[slow], phase))
        theirs = _median(_num(_get(ranks[i], phase)) for i in others)
        if mine is not None and theirs is not None:
            diffs[phase] = mine - theirs
    phase = max(diffs, key=diffs.get) if diffs else "unattributed"
    if phase != "unattributed" and diffs[phase] < STRAGGLER_PHASE_SHARE * excess:
        phase = "unattributed"
    rank_id = _get(ranks[slow], "rank")
    rank_id = slow if rank_id is None else rank_id
    step = r.step or _median(_num(_get(x, "step")) for x in ranks)
    evidence = {"rank": rank_id, "slow_phase": phase, "excess_ms": excess,
                "busy_ms": busy[slow], "others_median_busy_ms": typical,
                "phase_excess_ms": diffs,
                "comm_exposed_ms": {str(_get(x, "rank") if _get(x, "rank") is not None
                                        else i): exposed[i] for i, x in enumerate(ranks)},
                "threshold_fraction": STRAGGLER_MIN_EXCESS_FRACTION,
                "threshold_ms": STRAGGLER_MIN_EXCESS_MS}
    fraction = excess / step if step else 0.0
    severity = _band(fraction, 0.0)
    severity = "low" if severity == "info" else severity
    where = "between its phases" if phase == "unattributed" else f"in {phase}"
    title = (f"Straggler: rank {rank_id} is {excess:.1f} ms slower {where} than the other "
             f"ranks' median, and every rank waits for it in {r.sync_name}")
    actions = {
        "data_wait": f"rank {rank_id}: DataLoader(num_workers=...) higher, check its storage "
                     "and CPU affinity",
        "forward": f"balance the work: same batch_size and sequence lengths on every rank "
                   f"(DistributedSampler(drop_last=True), length bucketing); check rank "
                   f"{rank_id}'s device for throttling or other processes",
        "backward": f"balance the work: same batch_size and sequence lengths on every rank "
                    f"(DistributedSampler(drop_last=True), length bucketing); check rank "
                    f"{rank_id}'s device for throttling or other processes",
        "optimizer": f"rank {rank_id}: same optimizer and parameter groups on every rank; "
                     "move rank-0-only work (logging, checkpoints) out of the step",
        "unattributed": f"rank {rank_id}: move host work (logging, checkpoints, metrics) "
                        "out of the step",
    }
    gain = _gain(step, step - excess) if step and step > excess else None
    return [_finding("straggler", severity, title, evidence, actions[phase], gain)]


def _throttled(entry: Mapping[str, Any]) -> bool:
    if entry.get("throttled") is True:
        return True
    reasons = entry.get("throttle_reasons")
    if isinstance(reasons, str):
        reasons = [reasons]
    if isinstance(reasons, (list, tuple)):
        return any(str(x).lower() not in ("", "none", "idle", "gpu_idle",
                                          "applications_clocks_setting") for x in reasons)
    return False


def _telemetry_straggler(r: _Run) -> list[dict]:
    telemetry = _get(r.run, "telemetry")
    per_rank = _get(telemetry, "ranks")
    if not isinstance(per_rank, list):
        return []
    entries = [x for x in per_rank if isinstance(x, Mapping)]
    slow = [x.get("rank", i) for i, x in enumerate(entries) if _throttled(x)]
    if not slow:
        return []
    evidence = {"throttled_ranks": slow,
                "throttle_reasons": {str(x.get("rank", i)): x.get("throttle_reasons")
                                     for i, x in enumerate(entries) if _throttled(x)}}
    title = f"Straggler: GPU of rank(s) {', '.join(map(str, slow))} throttled its clocks (telemetry)"
    if r.world_size > 1:
        title += f"; every rank waits for it in {r.sync_name}"
    action = ("check cooling, power limits (nvidia-smi -q -d PERFORMANCE) and other "
              "processes on the throttled GPU(s)")
    return [_finding("straggler", "medium", title, evidence, action, None)]


def _telemetry_util(telemetry: Any) -> float | None:
    keys = ("gpu_util_percent", "util_percent", "utilization_percent", "sm_util_percent",
            "gpu_utilization")
    for key in keys:
        value = _num(_get(telemetry, key))
        if value is not None:
            return value
    per_rank = _get(telemetry, "ranks")
    if isinstance(per_rank, list):
        return _median(next((_num(_get(x, k)) for k in keys if _num(_get(x, k)) is not None),
                            None) for x in per_rank)
    return None


def _rule_launch_bound(r: _Run) -> list[dict]:
    if r.device != "cuda":
        return []
    util = _telemetry_util(_get(r.run, "telemetry"))
    if util is None or util >= LAUNCH_BOUND_UTIL_PERCENT or r.data_bound or r.comm_bound:
        return []
    evidence = {"gpu_util_percent": util, "threshold_percent": LAUNCH_BOUND_UTIL_PERCENT,
                "data_fraction": r.data_fraction, "comm_fraction": r.comm_fraction,
                "step_ms": r.step}
    bigger = f"batch_size={int(r.batch_size) * 2}" if r.batch_size else "a bigger batch_size"
    title = (f"Launch-bound: GPU busy {util:.0f}% of the time (< "
             f"{LAUNCH_BOUND_UTIL_PERCENT:.0f}%) with no data or communication wait to blame")
    action = (f"torch.compile(model, mode=\"reduce-overhead\") (CUDA graphs), or {bigger} to "
              "give each kernel launch more work")
    return [_finding("launch_bound", "medium", title, evidence, action, None)]


def _rule_optimizer_serial(r: _Run) -> list[dict]:
    if r.optimizer is None or r.compute is None or r.compute <= 0:
        return []
    share = r.optimizer / r.compute
    if share <= OPTIMIZER_SERIAL_FRACTION:
        return []
    evidence = {"optimizer_ms": r.optimizer, "compute_ms": r.compute, "share": share,
                "threshold": OPTIMIZER_SERIAL_FRACTION, "world_size": r.world_size}
    severity = "medium" if share > OPTIMIZER_SERIAL_HIGH_FRACTION else "low"
    opt = _get(r.run, "optimizer")
    cls = _get(opt, "class")
    if cls and _get(opt, "fused_on"):  # already fused: only sharding is left
        fused = f"{cls} is fused already"
    elif cls and _get(opt, "fused"):
        fused = f"{cls}(..., fused=True)" + ("" if _get(opt, "foreach_on") else " (or foreach=True)")
    elif cls and _get(opt, "foreach"):
        fused = f"{cls}(..., foreach=True)"
    else:  # the user's own optimizer: say what the fast ones are
        fused = ("a fused optimizer step (torch.optim's Adam, AdamW, SGD and Adagrad take fused=True)"
                 + (f" instead of {cls}" if cls else ""))
    sharded = r.fsdp is not None and ((_num(_get(r.fsdp, "all_gathers")) or 0) > 0
                                      or (_num(_get(r.fsdp, "reduce_scatters")) or 0) > 0)
    if sharded or _get(opt, "zero"):
        # FSDP or ZeRO already steps each rank's shard only: nothing left to shard.
        title = (f"Optimizer step is {_pct(share)} of compute ({r.optimizer:.1f} ms), on this "
                 f"rank's shard of the parameters ({'FSDP' if sharded else 'ZeroRedundancyOptimizer'})")
        if _get(opt, "fused_on"):
            fused += ("; it steps this rank's shard only: a bigger per-device batch spreads it over "
                      "more samples (see batch_headroom)")
        return [_finding("optimizer_serial", severity, title, evidence, fused, None)]
    if cls == "LBFGS":
        # Its step runs a line search over the closure: ZeRO would search each rank's shard
        # apart, and the ranks' closures (each an all-reduce) would fall out of step.
        title = (f"Optimizer step is {_pct(share)} of compute ({r.optimizer:.1f} ms, LBFGS's own work "
                 "between its closure calls)")
        action = ("LBFGS(..., max_iter=..., history_size=...) smaller: fewer iterations and a shorter "
                  "history per step; it cannot be sharded (ZeroRedundancyOptimizer would run each rank's "
                  "line search on its own shard)")
        return [_finding("optimizer_serial", severity, title, evidence, action, None)]
    if r.fsdp is not None:
        title = (f"Optimizer step is {_pct(share)} of compute ({r.optimizer:.1f} ms): every "
                 "replica repeats it on the whole model, so it does not shrink with more GPUs")
        action = (f"{fused}; with several GPUs shard it: fully_shard with the ranks on the "
                  "mesh's shard dimension (HSDP: a shard dimension > 1) steps each rank's shard only")
    else:
        # One process measured: nothing repeats it yet; say what more GPUs would do.
        repeats = (f"every one of the {r.world_size} ranks repeats it, so it does not shrink"
                   if r.world_size >= 2 else
                   "under DDP every rank would repeat it, so it would not shrink")
        title = (f"Optimizer step is {_pct(share)} of compute ({r.optimizer:.1f} ms): "
                 f"{repeats} with more GPUs")
        action = (f"{fused}; with several GPUs shard it: from torch.distributed.optim import "
                  "ZeroRedundancyOptimizer; ZeroRedundancyOptimizer(model.parameters(), "
                  f"optimizer_class={cls or 'torch.optim.AdamW'})")
    gain = None
    if r.world_size >= 2 and r.step:
        saved = r.optimizer * (1.0 - 1.0 / r.world_size)
        gain = (f"ZeRO at {r.world_size} ranks: " + (_gain(r.step, r.step - saved) or "")
                + ", less the parameter broadcast it adds after each step")
    return [_finding("optimizer_serial", severity, title, evidence, action, gain)]


def _rule_skipped_updates(r: _Run) -> list[dict]:
    skipped = _num(_get(r.summary, "steps_skipped_update"))
    total, warmup = _num(_get(r.summary, "steps_total")), _num(_get(r.summary, "warmup_steps")) or 0.0
    if skipped is None or total is None or skipped < SKIPPED_UPDATE_MIN_STEPS:
        return []
    steady = max(total - warmup, skipped)
    share = skipped / steady
    if share < SKIPPED_UPDATE_FRACTION:
        return []
    severity = "high" if share >= CRITICAL_FRACTION else "medium" if share >= SKIPPED_UPDATE_PERSISTENT_FRACTION else "low"
    evidence = {"steps_skipped_update": int(skipped), "steps_after_warmup": int(steady),
                "share": share, "threshold": SKIPPED_UPDATE_FRACTION}
    sync = "" if r.world_size < 2 else f" and {'gradient all-reduce' if r.fsdp is None else r.sync_name}"
    title = (f"{int(skipped)} of {int(steady)} steps ({_pct(share)}) updated nothing: inf/NaN "
             "gradients, so the loss scaler skipped optimizer.step(); each still cost a full "
             f"forward{',' if sync else ' and'} backward{sync}")
    # The scaler settles within its first few back-offs and then skips ~1 step in 2000:
    # at 5% the gradients themselves overflow, and bf16 (no scaler to skip such a step)
    # would write the inf/NaN into the weights.
    causes = ("check the inputs for inf/NaN (torch.isfinite(x).all()), lower the learning rate, clip "
              "gradients (scaler.unscale_(optimizer), then torch.nn.utils.clip_grad_norm_)")
    if share >= SKIPPED_UPDATE_PERSISTENT_FRACTION:
        action = (f"the skips persist, so the gradients themselves overflow: {causes}; switching to bf16 "
                  "before that would write the inf/NaN into the weights")
    else:
        action = ("with fp16 keep torch.amp.GradScaler's defaults (growth_interval=2000 skips ~0.05% of "
                  "steps once the scale settles); skips that persist come from the gradients themselves: "
                  f"{causes}; bf16 where the GPU supports it (torch.autocast(dtype=torch.bfloat16), "
                  "Lightning precision='bf16-mixed') needs no loss scaling")
    gain = f"{1.0 / (1.0 - share):.2f}x useful updates per second" if share < 1.0 else None
    return [_finding("skipped_updates", severity, title, evidence, action, gain)]


def _rule_identical_data(r: _Run) -> list[dict]:
    gns = _get(r.run, "gradient_noise")
    b_simple, samples = _num(_get(gns, "B_simple")), _num(_get(gns, "samples"))
    if r.world_size < 2 or b_simple is None or not samples or abs(b_simple) >= IDENTICAL_DATA_MAX_B:
        return []
    g = int(r.world_size)
    evidence = {"B_simple": b_simple, "samples": int(samples), "world_size": g,
                "batch_size": r.batch_size, "threshold": IDENTICAL_DATA_MAX_B}
    title = (f"Every rank computed the same gradient: the {g} ranks train on the same batches, "
             f"so {g} devices do the work of one")
    action = ("give each rank its own share of the data: DataLoader(dataset, sampler="
              "torch.utils.data.distributed.DistributedSampler(dataset)) and "
              "sampler.set_epoch(epoch) every epoch (Lightning adds it unless "
              "use_distributed_sampler=False); an IterableDataset must split its stream by rank")
    return [_finding("identical_data", "high", title, evidence, action,
                     f"{g}x distinct samples per step")]


def _rule_accumulation_sync(r: _Run) -> list[dict]:
    passes = _num(_get(r.run, "sync_passes"))
    if passes is None or passes < 2 or r.micro_batches < 2 or not r.comm_total or not r.step:
        return []
    if passes > r.micro_batches:  # several backward passes per batch (a GAN's losses): not accumulation
        return []
    wasted = (passes - 1) / passes
    saved_ms = r.comm_total * wasted  # at most: the communication of every pass but the last
    grad_mb = (_num(_get(r.summary, "grad_bytes")) or 0.0) / 1e6
    evidence = {"micro_batches": int(r.micro_batches), "sync_passes": int(passes),
                "comm_total_ms": r.comm_total, "grad_MB_per_step": grad_mb, "step_ms": r.step}
    severity = _band(saved_ms / r.step, 0.0)
    severity = "low" if severity == "info" else severity
    scatters = r.fsdp is not None and (_num(_get(r.fsdp, "reduce_scatters")) or 0) > 0
    verb = "reduce-scatters" if scatters else "all-reduces"
    title = (f"Gradient accumulation {verb} on {int(passes)} of {int(r.micro_batches)} "
             f"micro-batches; only the last one's result is used")
    if r.fsdp is not None and _get(r.fsdp, "api") == "FSDP1":
        action = ("run the first micro-batches' backward under model.no_sync() (FSDP1's, on the root "
                  f"FullyShardedDataParallel), so only the last backward {verb}; unsharded gradients "
                  "are kept in between")
    elif r.fsdp is not None and r.lightning:
        # The Trainer's ModelParallelStrategy does not hold FSDP2's reduction back itself.
        action = ("in training_step, before backward, on the module you gave fully_shard last (self, "
                  "or e.g. self.model): .set_requires_gradient_sync((batch_idx + 1) % "
                  "self.trainer.accumulate_grad_batches == 0 or self.trainer.is_last_batch), so only "
                  f"the last micro-batch {verb} (FSDP2 under ModelParallelStrategy)")
    elif r.fsdp is not None:
        action = ("model.set_requires_gradient_sync(False) before the first micro-batches and "
                  f"True before the last backward, so only it {verb} (FSDP2)")
        if scatters and (_num(_get(r.fsdp, "replica_all_reduces")) or 0) > 0:
            # HSDP: the middle way keeps gradients sharded (memory) and skips only the
            # all-reduce across replicas, which usually crosses the slower link.
            action += ("; or, to keep the gradients sharded between micro-batches, only "
                       "model.set_requires_all_reduce(False) (True before the last backward): each "
                       "micro-batch still reduce-scatters, only the last all-reduces across replicas")
    else:
        # DDP decides during the forward whether the backward synchronises: the forward
        # must run under no_sync() too (a backward alone under it still all-reduced).
        action = ("run the first micro-batches' forward and backward under model.no_sync() (with "
                  "ddp.no_sync(): loss = loss_fn(ddp(x), y); loss.backward()) and the last one outside "
                  "it, so only its backward synchronises; Lightning's accumulate_grad_batches does "
                  "this itself")
    gain = (f"{wasted:.0%} less gradient traffic ({grad_mb * wasted:.3g} MB per step), up to "
            + (_gain(r.step, r.step - saved_ms) or f"{saved_ms:.1f} ms per step"))
    return [_finding("accumulation_sync", severity, title, evidence, action, gain)]


def _rule_cpu_threads(r: _Run) -> list[dict]:
    threads, cpus = _num(_get(r.run, "torch_threads")), _num(_get(r.run, "cpus_per_rank"))
    if r.device != "cpu" or threads is None or cpus is None or cpus < 1:
        return []
    per_rank = max(1, int(cpus))
    evidence = {"torch_threads": int(threads), "cpus_per_rank": cpus, "world_size": r.world_size,
                "device": r.device}
    action = (f"torch.set_num_threads({per_rank}) in each rank (or OMP_NUM_THREADS={per_rank} "
              "before torchrun)")
    if threads > cpus:
        who = ("the ranks oversubscribe the cores and slow each other down" if r.world_size > 1
               else "the threads oversubscribe the cores and wait for each other")
        title = f"{int(threads)} compute threads per rank on {cpus:g} CPUs per rank: {who}"
        return [_finding("cpu_threads", "medium", title, evidence, action, None)]
    if cpus >= 4 and threads < CPU_THREADS_UNDERUSED_FRACTION * cpus:
        title = (f"{int(threads)} compute thread(s) per rank on {cpus:g} CPUs per rank: "
                 f"{cpus - threads:g} cores per rank sit idle during compute")
        return [_finding("cpu_threads", "low", title, evidence, action, None)]
    return []


def _rule_cudnn_benchmark(r: _Run) -> list[dict]:
    if r.device != "cuda" or _get(r.run, "has_conv") is not True \
            or _get(r.run, "cudnn_benchmark") is not False:
        return []
    evidence = {"has_conv": True, "cudnn_benchmark": False, "device": r.device}
    title = ("Convolutional model with cuDNN autotuning off: the fastest convolution "
             "algorithms are not being chosen")
    action = ("torch.backends.cudnn.benchmark = True (input shapes fixed; with varying "
              "shapes it re-tunes per shape)")
    return [_finding("cudnn_benchmark", "low", title, evidence, action, None)]


def _rule_host_work(r: _Run) -> list[dict]:
    if None in (r.step, r.compute, r.forward, r.backward, r.optimizer) or not 0 < r.compute <= r.step:
        return []
    other = r.compute - (r.forward + r.backward + r.optimizer)
    share = other / r.step
    if share < HOST_WORK_FRACTION:
        return []
    evidence = {"other_ms": other, "step_ms": r.step, "compute_ms": r.compute, "forward_ms": r.forward,
                "backward_ms": r.backward, "optimizer_ms": r.optimizer, "share": share,
                "threshold": HOST_WORK_FRACTION}
    title = (f"Work between the phases: {other:.1f} ms of a {r.step:.1f} ms step ({_pct(share)}) "
             "is outside forward, backward and the optimizer step")
    if r.lightning:
        action = ("it runs in Lightning's loop around your training_step: logging (self.log(..., "
                  "on_step=False), or a larger Trainer(log_every_n_steps=...)), on_before_optimizer_step "
                  "hooks (gradient norms: every N steps instead) and gradient clipping (gradient_clip_val), "
                  "checkpoints saved every few steps (ModelCheckpoint(every_n_train_steps=...)), your "
                  "on_train_batch_* hooks and callbacks, .item() calls, a loss computed outside forward")
    else:
        action = ("find it in the loop between the phases: .item() calls and logging every step (every N "
                  "steps instead), metrics (keep them on the device), the batch's move to the device "
                  "(x.to(device, non_blocking=True) from a DataLoader with pin_memory=True), a loss, "
                  "gradient penalty or clipping computed outside the model, another model's forward (a "
                  "teacher), another optimizer's step (pass every optimizer: dtprofile.profile(model, "
                  "[opt_a, opt_b])), checkpoints, zero_grad()")
    gain = _gain(r.step, r.step - other)
    gain = gain and gain + " if all of it moved out of the step"
    return [_finding("host_work", _band(share, HOST_WORK_FRACTION), title, evidence, action, gain)]


def _rare_long_steps(r: _Run, summary: Mapping[str, Any]) -> list[dict]:
    """The steps the averages leave out (the slowest by step time) held a share of the
    run's time: a phase every N updates (an RL rollout, a periodic evaluation outside
    Lightning, a checkpoint) is in no figure. Info: a loaded machine's hiccups look alike."""
    all_ms = _num(_get(summary, "step_ms_all_steps"))
    steps = _num(_get(summary, "steps_profiled")) or 0
    if all_ms is None or r.step is None or all_ms <= 0 or steps < FEW_STEPS:
        return []
    share = (all_ms - r.step) / all_ms
    if share < RARE_LONG_STEPS_FRACTION:
        return []
    trimmed = _pct(recorder.TRIM_FRACTION)
    return [_finding(
        "rare_long_steps", "info",
        f"Rare long steps: the run spent {all_ms:.1f} ms a step in all, the averages {r.step:.1f} ms; "
        f"{_pct(share)} of its time is in the {trimmed} slowest steps, which every figure leaves out",
        {"step_ms": r.step, "step_ms_all_steps": all_ms, "share": share,
         "trim_fraction": recorder.TRIM_FRACTION, "threshold": RARE_LONG_STEPS_FRACTION},
        "find what those steps do: work every N updates (an RL rollout or environment phase, an "
        "evaluation of another model such as an EMA copy, a checkpoint), a memory or garbage-collection "
        "pause, or a busy machine; time that work on its own, or profile a run whose steps all do the "
        "same work", None)]


def _eval_forwards_in_steps(r: _Run, summary: Mapping[str, Any]) -> list[dict]:
    """The profiled model ran in eval mode under no_grad in most steps: dtprofile leaves
    such passes out as evaluation, which a per-step teacher pass (self-distillation, a
    target network) is not."""
    count = _num(_get(summary, "steps_with_eval_forwards")) or 0
    steady = (_num(_get(summary, "steps_total")) or 0) - (_num(_get(r.options, "warmup_steps")) or 0)
    if steady < FEW_STEPS or count < EVAL_FORWARDS_STEP_FRACTION * steady:
        return []
    return [_finding(
        "eval_forwards_in_steps", "info",
        f"The profiled model ran in eval mode under no_grad in {int(count)} of {int(steady)} steps: "
        "dtprofile leaves such passes out of the step as evaluation, so their time is in no figure",
        {"steps_with_eval_forwards": int(count), "steps_after_warmup": int(steady),
         "threshold": EVAL_FORWARDS_STEP_FRACTION},
        "if that pass is part of training (a self-distillation teacher, a target network), run it in train "
        "mode under no_grad (it then counts as compute of the step), or through a module of its own; "
        "evaluation every step is better done every N steps", None)]


_RULES: tuple[Callable[[_Run], list[dict]], ...] = (
    _rule_identical_data, _rule_data_bound, _rule_comm_bound, _rule_straggler, _rule_network_bandwidth,
    _rule_gpu_count, _rule_batch_headroom, _rule_launch_bound, _rule_optimizer_serial, _rule_host_work,
    _rule_accumulation_sync, _rule_cpu_threads, _rule_cudnn_benchmark, _rule_skipped_updates, _rule_parameter_servers,
)


def _healthy(r: _Run) -> dict:
    largest = _largest_projected(r)
    eff = _projection_at(r, largest, "efficiency") if largest is not None else None
    evidence = {"step_ms": r.step, "data_fraction": r.data_fraction,
                "comm_fraction": r.comm_fraction, "R_O": r.r_o,
                "data_threshold": DATA_BOUND_FRACTION, "comm_threshold": COMM_BOUND_FRACTION,
                "largest_projected_gpus": largest, "efficiency_at_largest": eff,
                "recommended_gpus": _get(r.rec, "gpus"),
                "bandwidth_source": _get(r.projection, "bandwidth_source")}
    parts = [f"step {r.step:.1f} ms"]
    if r.data_fraction is not None and r.data_fraction >= DATA_BOUND_FRACTION and r.data_wait is not None \
            and not r.data_bound:  # under the gap floor
        parts.append(f"gap before forward {r.data_wait * 1e3:.0f} us (< {GAP_DATA_WAIT_FLOOR_MS * 1e3:.0f} us)")
    elif r.data_fraction is not None:
        parts.append(f"data wait {_pct(r.data_fraction)} (< {_pct(DATA_BOUND_FRACTION)})")
    if r.comm_fraction is not None:
        parts.append(f"exposed communication {_pct(r.comm_fraction)} "
                     f"(< {_pct(COMM_BOUND_FRACTION)})")
    if r.r_o is not None:
        parts.append(f"R_O {r.r_o:.3f}")
    if eff is not None:
        parts.append(f"projected efficiency {eff:.2f} at {largest} GPUs "
                     f"({r.bandwidth_note()})")
    unmeasured = _get(r.summary, "comm_unmeasured")
    if r.world_size > 1 and r.comm_total is None and unmeasured:
        # Nothing flagged in what was measured, but communication was not: not a verdict.
        evidence["comm_unmeasured"] = unmeasured
        title = "No overhead found in what was measured; gradient communication was not measured: " + ", ".join(parts)
        return _finding("healthy", "info", title, evidence,
                        f"measure communication to judge it: {unmeasured}", None)
    title = "Healthy: " + ", ".join(parts)
    return _finding("healthy", "info", title, evidence, "no change needed", None)


def json_safe(value: Any) -> Any:
    """Non-finite floats (degenerate measurements, a summary edited by hand) -> None,
    recursively: JSON has neither NaN nor infinities."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _severity_rank(finding: Mapping[str, Any]) -> int:
    severity = finding.get("severity")
    return SEVERITY_ORDER.index(severity) if severity in SEVERITY_ORDER \
        else len(SEVERITY_ORDER)


def advise(summary: Mapping[str, Any]) -> list[dict]:
    """Findings for a run summary, most severe first (ties in rule order).

    Reads ``per_step_ms``, ``ratios``, ``ranks``, ``run``, ``options`` and the summary's
    ``projection`` and ``recommendations`` (computed here when absent). When no finding
    is ``low`` or worse, a ``healthy`` finding says why with the numbers; with no step
    measured at all, a single ``insufficient_data`` finding.
    """
    r = _Run(summary)
    if r.step is None:
        return [_finding("insufficient_data", "info",
                         "No steady-state step was measured: nothing to advise",
                         {"steps_profiled": _get(summary, "steps_profiled"),
                          "steps_total": _get(summary, "steps_total")},
                         "run more steps than warmup_steps (options.warmup_steps)", None)]
    findings: list[dict] = []
    for rule in _RULES:
        findings.extend(rule(r))
    if not any(_severity_rank(f) < SEVERITY_ORDER.index("info") for f in findings):
        findings.insert(0, _healthy(r))
    seen = _get(r.run, "micro_batches_seen")
    if isinstance(seen, list) and len(seen) > 1:
        counts = ", ".join(str(int(c)) for c in seen[:-1]) + f" and {int(seen[-1])}"
        schedule = ("GradientAccumulationScheduler, or epochs that accumulate_grad_batches does not divide"
                    if r.lightning else "a changing accumulation, or a partial one at each epoch's end")
        findings.append(_finding(
            "varying_steps", "info",
            f"Steps of several sizes: {counts} micro-batches per optimizer step ({schedule}); the averages "
            f"mix them, and throughput counts the most common ({int(r.micro_batches)})",
            {"micro_batches_seen": seen, "micro_batches": r.micro_batches},
            "read the figures as a blend, or profile each setting in a run of its own", None))
    findings.extend(_rare_long_steps(r, summary))
    findings.extend(_eval_forwards_in_steps(r, summary))
    steps = _num(_get(summary, "steps_profiled"))
    # An interval's window is short by design: only a run with few steps in all is noted.
    steady = (_num(_get(summary, "steps_total")) or 0) - (_num(_get(r.options, "warmup_steps")) or 0)
    if steps is not None and 0 < steps < FEW_STEPS and steady < FEW_STEPS:
        findings.append(_finding(
            "few_steps", "info",
            f"Only {int(steps)} steady-state step{'s' if steps != 1 else ''} measured: the findings rest on little data",
            {"steps_profiled": int(steps), "steps_total": _get(summary, "steps_total"),
             "warmup_steps": _get(r.options, "warmup_steps"), "threshold": FEW_STEPS},
            f"profile at least {FEW_STEPS} steps after the warm-up", None))
    return [json_safe(f) for f in sorted(findings, key=_severity_rank)]


def analyze(summary: Mapping[str, Any]) -> dict:
    """A copy of ``summary`` with ``projection``, ``recommendations`` and ``advice`` filled.

    Calls :func:`dtprofile.model.project_summary`, :func:`dtprofile.model.recommend` and
    :func:`advise` with the summary's own options.
    """
    out = copy.deepcopy(dict(summary))
    out["projection"] = model.project_summary(out)
    out["recommendations"] = model.recommend(out, out["projection"])
    out["advice"] = advise(out)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def format_findings(findings: Sequence[Mapping[str, Any]]) -> str:
    """Plain-text lines for a terminal, most severe first.

    >>> print(format_findings([{"id": "healthy", "severity": "info", "title": "Healthy",
    ...                         "evidence": {"step_ms": 95.0}, "action": "no change needed",
    ...                         "expected_gain": None}]))
    [INFO]   healthy: Healthy
             action: no change needed
             evidence: step_ms=95
    """
    if not findings:
        return "No findings."
    lines = []
    for f in sorted(findings, key=_severity_rank):
        label = f"[{str(f.get('severity', '?')).upper()}]"
        lines.append(f"{label:<8} {f.get('id')}: {f.get('title')}")
        indent = " " * 9
        if f.get("action"):
            lines.append(f"{indent}action: {f['action']}")
        if f.get("expected_gain") is not None:
            lines.append(f"{indent}expected gain: {_fmt(f['expected_gain'])}")
        evidence = f.get("evidence") or {}
        if evidence:
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in evidence.items() if v is not None)
            if shown:
                lines.append(f"{indent}evidence: {shown}")
    return "\n".join(lines)
