"""Every threshold of the advice, each defined once, with where it comes from.

A rule reads its thresholds from here; ``evidence["threshold"]`` in a finding quotes
the one that triggered it. The performance model's own constants (the target
efficiency, the data wait that counts as hidden, the assumed link) live beside the
model in :mod:`dtprofile.analysis.recommendations` and
:mod:`dtprofile.analysis.projection`.
"""

from __future__ import annotations

from ..recommendations import DATA_WAIT_HIDDEN_FRACTION

__all__ = [
    "BATCH_GROWTH_FACTORS",
    "BATCH_HEADROOM_MIN_RATIO",
    "BUFFER_BROADCAST_SHARE",
    "COMM_BOUND_FRACTION",
    "MICROBATCH_MIN_GAIN",
    "CPU_THREADS_UNDERUSED_FRACTION",
    "CPU_THREADS_UNDERUSED_MIN_CPUS",
    "CRITICAL_FRACTION",
    "DATA_BOUND_FRACTION",
    "EVAL_FORWARDS_STEP_FRACTION",
    "FEW_STEPS",
    "GAP_DATA_WAIT_FLOOR_MS",
    "HOST_WORK_FRACTION",
    "IDENTICAL_DATA_MAX_B",
    "LAUNCH_BOUND_UTIL_PERCENT",
    "OPTIMIZER_SERIAL_FRACTION",
    "OPTIMIZER_SERIAL_HIGH_FRACTION",
    "RARE_LONG_STEPS_FRACTION",
    "SKIPPED_UPDATE_FRACTION",
    "SKIPPED_UPDATE_MIN_STEPS",
    "SKIPPED_UPDATE_PERSISTENT_FRACTION",
    "STANDARD_LINK_Gbps",
    "STRAGGLER_MIN_EXCESS_FRACTION",
    "STRAGGLER_MIN_EXCESS_MS",
    "STRAGGLER_MIN_EXCESS_STEP_FRACTION",
    "STRAGGLER_PHASE_SHARE",
    "TRANSFER_BOUND_SHARE",
    "UNEVEN_DATA_WAIT_MIN_MS",
    "UNEVEN_DATA_WAIT_RATIO",
    "WARNING_FRACTION",
]

# --------------------------------------------------------------------------- severity bands

#: Severity bands for a share of the step (TraceML: 10% warning, 20% critical). A share
#: at or above CRITICAL_FRACTION is ``high``, at or above WARNING_FRACTION ``medium``.
WARNING_FRACTION = 0.10
CRITICAL_FRACTION = 0.20

# --------------------------------------------------------------------------- data

#: Data wait above this share of the step is data-bound: the PyTorch profiler's
#: TensorBoard plugin flagged data loading above 5% of the step. The same figure as the
#: data wait the recommendations count as hidden.
DATA_BOUND_FRACTION = DATA_WAIT_HIDDEN_FRACTION
#: When the batch's transfer to the device is at least this share of the data wait, the
#: data advice is about the transfer hooks, not the loader's workers.
TRANSFER_BOUND_SHARE = 0.5
#: Without ``prof.loader`` the data wait is the gap between steps, and that holds some
#: tens of microseconds of framework dispatch (the optimizer's and the module's hooks,
#: zero_grad) however fast the data comes: below this it is not called data-bound.
GAP_DATA_WAIT_FLOOR_MS = 0.1
#: One rank's data wait is named beside the median over ranks when it is more than this
#: many times the other ranks' median ...
UNEVEN_DATA_WAIT_RATIO = 2.0
#: ... and more than this much above it (ms): a median of two ranks that differ this much
#: is a wait neither had, while sub-millisecond differences are timer noise.
UNEVEN_DATA_WAIT_MIN_MS = 1.0
#: Identical data on every rank: the gradient noise scale measured between the local and
#: the all-reduced buckets, B_simple = tr(Sigma) / |G|^2, is in samples and is at least of
#: order one for different batches; below a thousandth of a sample the ranks computed the
#: same gradient (no DistributedSampler, or every rank reads the same shard).
IDENTICAL_DATA_MAX_B = 1e-3

# --------------------------------------------------------------------------- communication

#: Exposed communication above this share of the step is communication-bound: the same
#: plugin flagged exposed communication above 10%.
COMM_BOUND_FRACTION = 0.10
#: pipeline_bubble suggests a microbatch count only where the projected step is at least
#: this much shorter: each microbatch brings host work (the schedule's, the transfers'),
#: measured at 0.7-2.3 ms a microbatch and stage on CPU (benchmarks/pipeline.py), which
#: can outweigh the bubble it saves; below 3% the projection's own error decides.
MICROBATCH_MIN_GAIN = 0.03
#: DDP's buffer broadcast holding this share of the exposed communication leads the
#: ``comm_bound`` advice (``broadcast_buffers=False``).
BUFFER_BROADCAST_SHARE = 0.25
#: Common link speeds (Ethernet / InfiniBand), to name one that meets a need.
STANDARD_LINK_Gbps: tuple[float, ...] = (1, 10, 25, 40, 50, 100, 200, 400, 800)

# --------------------------------------------------------------------------- stragglers

#: Straggler: the slow rank's busy time (step minus exposed communication: data wait +
#: compute) must exceed the median of the other ranks' by more than 10% AND by more than
#: 1 ms. Per-rank averages of a healthy run differ by a few percent (timer jitter, core
#: placement on a shared CPU); 10% is TraceML's warning band, and the 1 ms floor keeps
#: sub-millisecond steps from flagging on scheduler noise.
STRAGGLER_MIN_EXCESS_FRACTION = 0.10
STRAGGLER_MIN_EXCESS_MS = 1.0
#: ... and by at least this share of the step: on machines shared with other work, a few
#: percent of imbalance comes and goes (seen on the two-namespace bench).
STRAGGLER_MIN_EXCESS_STEP_FRACTION = 0.05
#: A phase is named as where the straggler loses its time only if it holds at least this
#: share of the excess; otherwise the time lies between the phases (host work).
STRAGGLER_PHASE_SHARE = 0.5

# --------------------------------------------------------------------------- compute

#: Launch-bound: device utilisation below 50% (the profiler plugin's GPU-utilisation
#: rule) while neither data wait nor communication explains the idle time.
LAUNCH_BOUND_UTIL_PERCENT = 50.0
#: Optimizer step above 20% of compute is worth fusing or sharding (DDP replicates it on
#: every rank, so it does not shrink with more devices); above 40% it is ``medium``.
OPTIMIZER_SERIAL_FRACTION = 0.20
OPTIMIZER_SERIAL_HIGH_FRACTION = 0.40
#: Compute outside forward, backward and the optimizer step (host work in the loop: logging,
#: .item(), metrics, moving batches) above this share of the step is named (the warning band).
HOST_WORK_FRACTION = 0.10
#: CPU training: intra-op threads per rank below half the CPUs a rank has leave cores
#: idle; torchrun sets OMP_NUM_THREADS=1 for several ranks per node.
CPU_THREADS_UNDERUSED_FRACTION = 0.5
#: ... counted only from this many CPUs per rank: below it the cores a rank leaves idle
#: are one or two, too few to be worth a finding.
CPU_THREADS_UNDERUSED_MIN_CPUS = 4

# --------------------------------------------------------------------------- memory and batch

#: Memory headroom worth reporting: the batch could at least double.
BATCH_HEADROOM_MIN_RATIO = 2.0
#: Per-device batch multipliers tried when a bigger batch should hide communication.
BATCH_GROWTH_FACTORS: tuple[int, ...] = (2, 4, 8, 16)

# --------------------------------------------------------------------------- the run's steps

#: Fewer steady-state steps than this: a ``few_steps`` note says the findings rest on little data.
FEW_STEPS = 10
#: The slowest steps the averages leave out holding this share of the run's time or more:
#: ``rare_long_steps`` names the gap (5%: what the trim alone removes from even steps is
#: well under it).
RARE_LONG_STEPS_FRACTION = 0.05
#: The profiled model in eval mode under no_grad in at least this share of the steps: not
#: an occasional evaluation (``eval_forwards_in_steps``).
EVAL_FORWARDS_STEP_FRACTION = 0.5
#: Updates skipped by a loss scaler (inf/NaN gradients): torch.amp.GradScaler's dynamic
#: scale grows every ``growth_interval=2000`` steps and backs off once, so by design it
#: skips about 1 step in 2000 (0.05%); 20x that is a problem worth naming. At 5% and 20%
#: of the steps the wasted work takes the usual severity bands.
SKIPPED_UPDATE_FRACTION = 0.01
#: A couple of back-offs right after warm-up are the scale settling, not a finding.
SKIPPED_UPDATE_MIN_STEPS = 3
#: Above this share the skips are not the scale settling (a few back-offs) but overflowing gradients.
SKIPPED_UPDATE_PERSISTENT_FRACTION = 0.05
