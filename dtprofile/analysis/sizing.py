"""Sizing the training loop: the batch that fits, the loader workers, the critical batch.

Pure functions of measured numbers (no summary, except :func:`critical_batch_size`,
which reads the summary's ``run`` object): :func:`max_batch_size` from device memory,
:func:`dataloader_workers_needed` from the data wait, and the critical batch size from
:class:`GradientNoiseScale`, the estimator the engine feeds during the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._values import finite, get
from .checks import REL_EPS, ceil_ignoring_noise, check_number

__all__ = [
    "GNS_MIN_SAMPLES",
    "MEMORY_USABLE_FRACTION",
    "LOADER_IO_MAX_CPU_SHARE",
    "NUM_WORKERS_IO_MAX",
    "NUM_WORKERS_MARGIN",
    "WORKER_HANDOFF_MS",
    "WORKER_SEND_MS",
    "SHM_COPY_BYTES_PER_S",
    "SHM_RELEASE_BYTES_PER_S",
    "LOADER_MIN_GAIN",
    "GradientNoiseScale",
    "LoaderPlan",
    "critical_batch_size",
    "dataloader_workers_needed",
    "loader_plan",
    "max_batch_size",
]

#: Share of device memory a batch may plan to fill (fragmentation, allocator slack,
#: cuDNN workspaces): the recommended max batch keeps 10% free.
MEMORY_USABLE_FRACTION = 0.9
#: Extra dataloader worker on top of the throughput minimum, absorbing jitter in load time.
NUM_WORKERS_MARGIN = 1
#: A batch whose CPU time is below this share of its load time waits (storage, network,
#: a remote service) more than it computes: more workers than cores hide it.
LOADER_IO_MAX_CPU_SHARE = 0.5
#: The most workers recommended for a waiting loader; past it, the storage is the question.
NUM_WORKERS_IO_MAX = 32
#: The training process's time to take a batch from a worker process (the queue, unpickling,
#: mapping its tensors' shared memory); with workers it is in the measured data wait, so
#: it is added to the training's own work in any plan: 0.8 ms of CPU and 1.5 ms in all per
#: small batch on a 2-core CPU host.
WORKER_HANDOFF_MS = 1.0
#: A worker's own time to hand each batch on, when the run has no workers to measure it
#: on, counted as the worker's CPU work too: its feeder thread pickles the batch (beside
#: the copy into shared memory), and takes the GIL from the loading code to do so. Per
#: small batch on a 2-core CPU host: 1.1-1.4 ms beside loading code that releases the GIL
#: (torch, numpy), 2.0-3.7 ms beside pure Python.
WORKER_SEND_MS = 2.0
#: Bytes a second a worker copies a batch's tensors into shared memory at, to hand it over,
#: where the run did not measure it (``run.shm_copy_ms``): a 19.3 MB batch took 6.6 ms
#: longer a batch through one worker than in the main process, and a 3.1 MB one 0.7 ms, on
#: a 2-core CPU host (the run's own probe measured 8.3 ms for that batch on another).
SHM_COPY_BYTES_PER_S = 2.9e9
#: Bytes a second the training process frees a worker's batch at, once done with it (the
#: shared memory unmapped and its pages freed), where the run did not measure it
#: (``run.shm_release_ms``): 3.4 ms for a 19.3 MB batch on a 2-core CPU host.
SHM_RELEASE_BYTES_PER_S = 5.7e9
#: The least gain in step a change of workers must promise to be advised: the computing
#: loaders' predictions erred up to 9% low on a 2-core host, so a smaller gain may not
#: hold when followed.
LOADER_MIN_GAIN = 0.10
#: Sampled steps the gradient noise scale must rest on before it caps a batch: the
#: estimate of a few steps is noise (3 samples once put the critical batch at 677 after 60).
GNS_MIN_SAMPLES = 10


# --------------------------------------------------------------------------- memory and loading


def max_batch_size(
    peak_bytes: float,
    static_bytes: float,
    total_bytes: float,
    batch_size: float,
    usable_fraction: float = MEMORY_USABLE_FRACTION,
) -> int | None:
    """Largest per-device batch that fits, from ``peak = static + per_sample * batch``.

    ``per_sample = (peak - static) / batch``; ``max = floor((total * usable - static) /
    per_sample)``.

    Args:
        peak_bytes: Peak device memory of a step at ``batch_size``.
        static_bytes: Memory that does not grow with the batch (parameters, gradients,
            optimizer state).
        total_bytes: The device's memory.
        batch_size: The per-device batch measured, in samples.
        usable_fraction: Share of the device's memory a batch may plan to fill.

    Returns:
        Samples per device; None when the per-sample cost is not positive.

    Example:
        >>> max_batch_size(10e9, 2e9, 80e9, 32)
        280
    """
    peak = check_number(peak_bytes, "peak_bytes")
    static = check_number(static_bytes, "static_bytes")
    total = check_number(total_bytes, "total_bytes", strict=True)
    batch = check_number(batch_size, "batch_size", strict=True)
    per_sample = (peak - static) / batch
    if per_sample <= 0:
        return None
    return max(0, math.floor((total * usable_fraction - static) / per_sample + REL_EPS))


def dataloader_workers_needed(
    data_wait_ms: float,
    step_ms: float,
    num_workers: int | None = 0,
    micro_batches: int = 1,
    margin: int = NUM_WORKERS_MARGIN,
) -> int:
    """DataLoader workers that keep up with the step, before any CPU cap.

    Per batch: ``wait = data_wait / m`` and ``busy = (step - data_wait) / m`` (m
    micro-batches per step). With w workers loading in parallel, each taking ``t_load``
    per batch, supply is ``w / t_load`` batches/s and must reach demand ``1 / busy``, so
    ``w = ceil(t_load / busy) + margin``. ``t_load`` is inferred from the wait:

    - ``num_workers == 0`` (or unknown): the main process loads, so ``t_load = wait``;
    - ``num_workers = w0 > 0`` and waiting: the workers are the bottleneck, so in steady
      state one batch arrives every ``busy + wait`` = ``t_load / w0``, hence
      ``t_load = w0 (busy + wait)``.

    Args:
        data_wait_ms: Time per step waiting for data (ms).
        step_ms: The step (ms, > 0).
        num_workers: The DataLoader's workers now (0 or None: the main process loads).
        micro_batches: Batches fetched per optimizer step.
        margin: Workers beyond the throughput minimum.

    Returns:
        Workers, at least 1.

    Example:
        >>> dataloader_workers_needed(30.0, 50.0)  # 30 ms loading per 20 ms step
        3
        >>> dataloader_workers_needed(10.0, 30.0, num_workers=2)  # t_load = 60 ms
        4
    """
    m, busy, t_load = _per_batch(data_wait_ms, step_ms, num_workers, micro_batches)
    if busy <= 0.0:  # the step is all waiting: no compute to set the pace against
        busy = step_ms * 1e-3 / m
    return max(1, ceil_ignoring_noise(t_load / busy) + margin)


def _per_batch(
    data_wait_ms: float, step_ms: float, num_workers: int | None, micro_batches: int
) -> tuple[float, float, float]:
    """``(m, busy, t_load)`` of :func:`dataloader_workers_needed`, checked: micro-batches a
    step, the step's time a batch that is not data wait, and a batch's load time."""
    data_wait_ms = check_number(data_wait_ms, "data_wait_ms")
    step_ms = check_number(step_ms, "step_ms", strict=True)
    m = max(1.0, float(micro_batches or 1))
    w0 = int(num_workers or 0)
    wait = data_wait_ms / m
    busy = max(step_ms - data_wait_ms, 0.0) / m
    return m, busy, (wait if w0 == 0 else w0 * (busy + wait))


@dataclass
class LoaderPlan:
    """What the loader needs to keep up with the step (see :func:`loader_plan`).

    All times per batch (micro-batch) in milliseconds.
    """

    load_ms: float  # one worker's (or the main process's) time to load a batch
    busy_ms: float  # the step's time per batch that is not data wait
    cpu_ms: float | None  # the CPU time a batch costs to load (None: not measured)
    cpu_share: float | None  # cpu_ms / load_ms, at most 1
    kind: str | None  # "io" (waits more than it computes), "cpu", or None (CPU not measured)
    workers_needed: int  # workers that hide the wait, before any cap
    workers: int  # recommended (see loader_plan)
    loader_cores: float | None  # cores the training leaves to the loader while it computes
    cores_needed: float | None  # a computing loader: cores that would keep up with the step
    predicted_step_ms: float  # the step with ``workers`` workers


def _stretch(workers: int, busy_share: float, cpus: float) -> float:
    """How much longer a CPU-bound thread takes beside ``workers`` loader workers, each
    wanting a core a ``busy_share`` of the time, on ``cpus`` cores: the mean of
    ``max(1, (1 + n) / cpus)`` over the number ``n`` of workers that want a core at once
    (binomial: the workers load independently), the cores shared evenly by the threads
    that want one.

    >>> _stretch(1, 0.9, 2.0), round(_stretch(5, 0.2, 2.0), 3), _stretch(2, 0.5, 1.0)
    (1.0, 1.164, 2.0)
    """
    p = min(1.0, max(0.0, busy_share))
    return sum(
        math.comb(workers, n) * p**n * (1.0 - p) ** (workers - n) * max(1.0, (1 + n) / cpus) for n in range(workers + 1)
    )


def _handoff_costs(
    w0: int,
    handoff_ms: float | None,
    batch_bytes: float | None,
    shm_copy_ms: float | None,
    shm_release_ms: float | None,
) -> tuple[float, float, float]:
    """``(handoff, send, release)`` ms a batch for :func:`loader_plan`.

    Taking a batch over is in the measured wait, not in busy: it stays in any plan. A
    worker's sending, its copy and the batch's release are in the times measured with
    the workers a run has (``w0`` > 0: all 0).
    """
    handoff = WORKER_HANDOFF_MS if handoff_ms is None else handoff_ms
    nbytes = max(0.0, finite(batch_bytes) or 0.0)
    copy_ms = 0.0 if w0 else _measured_or(shm_copy_ms, nbytes / SHM_COPY_BYTES_PER_S * 1e3)
    release_ms = 0.0 if w0 else _measured_or(shm_release_ms, nbytes / SHM_RELEASE_BYTES_PER_S * 1e3)
    return handoff, 0.0 if w0 else WORKER_SEND_MS + copy_ms, release_ms


def _at_least(value: Any, floor: float, strict: bool = False) -> float | None:
    """``value`` as a finite number of at least (``strict``: above) ``floor``, else None."""
    number = finite(value)
    if number is None or number < floor or (strict and number == floor):
        return None
    return number


def _fewest_workers(
    step_with: Callable[[int], float], w0: int, cap: int, workers_set_pace: Callable[[int], bool], step_ms: float
) -> tuple[int, float]:
    """:func:`loader_plan`'s choice: the fewest workers within 2% of the best step, one more
    for jitter where the workers (not the CPUs) set the pace, never fewer than the ``w0``
    the run has; ``(workers, predicted step)``, the run's own where no change is worth it."""
    # Fewer workers than now would only give back what the measured step already has.
    candidates = range(max(1, w0), max(cap, w0) + 1)
    best = min(step_with(w) for w in candidates)
    workers = next(w for w in candidates if step_with(w) <= best * 1.02)
    if workers_set_pace(workers):
        workers = min(max(cap, w0), workers + NUM_WORKERS_MARGIN)
    predicted = step_ms if workers == w0 else step_with(workers)  # (the workers it has: its step)
    if predicted > (1.0 - LOADER_MIN_GAIN) * step_ms:
        return w0, step_ms  # no change worth making: the step it has
    return workers, predicted


def _workers_cap(needed: int, kind: str | None, cores_left: float | None, share: float | None) -> int:
    """The most workers :func:`loader_plan` considers: those that hide the wait, at most
    :data:`NUM_WORKERS_IO_MAX`, and for a loader that computes, the cores the training
    leaves it.

    A computing worker past those cores competes with the training's own thread, and a
    CPU's time shared that way is not predictable. A worker that computes half the time
    it loads takes half a core.
    """
    cap = min(needed, NUM_WORKERS_IO_MAX)
    if kind != "io" and cores_left is not None:
        cap = min(cap, max(1, math.floor(cores_left / (share or 1.0) + REL_EPS)))
    return cap


def loader_plan(
    data_wait_ms: float,
    step_ms: float,
    num_workers: int | None = 0,
    micro_batches: int = 1,
    cpu_ms_per_batch: float | None = None,
    cpus_per_rank: float | None = None,
    training_cpu_cores: float | None = None,
    handoff_ms: float | None = None,
    batch_bytes: float | None = None,
    shm_copy_ms: float | None = None,
    shm_release_ms: float | None = None,
) -> LoaderPlan:
    """Workers for a data-bound loop, from what the loader spends its time on.

    Per batch (``m`` micro-batches a step), with ``w`` workers each taking ``load`` to
    load a batch (inferred as in :func:`dataloader_workers_needed`) of which ``cpu`` is
    CPU time, and the training process using ``train`` CPU time a batch, the step is the
    slowest of three paces:

    - the training process's: its own work, taking each batch over from a worker and
      freeing it (``own = busy + handoff + release``);
    - the workers': each hands its batch on after loading it (``send``), so a batch
      every ``(load + send) / w``;
    - the CPUs': ``(train + cpu + send + handoff + release) / cpus``, all of the rank's
      cores kept busy.

    The slowest of them is the pace; then the training's CPU work is stretched where the
    workers want more cores than are left: ``step = m * max(pace, own + stretch)``, with
    ``stretch = train * max(0, s(w) - s(w0))`` and ``s`` :func:`_stretch` of each worker
    wanting a core ``(cpu + send) / (w * pace)`` of the time (for ``w0``, at the measured
    step). ``handoff`` is :data:`WORKER_HANDOFF_MS`; ``copy`` and ``release`` as the run
    measured them for its batch (``shm_copy_ms``, ``shm_release_ms``), else
    ``batch_bytes`` at :data:`SHM_COPY_BYTES_PER_S` and :data:`SHM_RELEASE_BYTES_PER_S`;
    ``send`` :data:`WORKER_SEND_MS` + ``copy`` (all three 0 when the run has workers
    already: they are in its measured times). Each
    worker keeps ``cpu / load`` of a core busy while it loads: a loader that waits
    (``cpu`` under :data:`LOADER_IO_MAX_CPU_SHARE` of ``load``: storage, network) may
    have workers beyond the cores; one that computes (or whose CPU time is unknown,
    taken as all CPU) gets no more workers than fit the cores the training leaves it
    while it computes (``cpus - train / busy``), at least 1. The recommended ``w`` is
    the fewest workers within 2% of the best step (and :data:`NUM_WORKERS_MARGIN` more
    for jitter when the workers, not the CPUs, set the pace), up to the workers that
    hide the wait (:func:`dataloader_workers_needed`) and :data:`NUM_WORKERS_IO_MAX`;
    never fewer than the run has now (the measured step is what those give). A plan
    that does not shorten the step by :data:`LOADER_MIN_GAIN` keeps the workers the run
    has (``workers`` = ``num_workers``, the step as measured).

    Args:
        data_wait_ms: Time per step waiting for data (ms).
        step_ms: The step (ms, > 0).
        num_workers: The DataLoader's workers now (0 or None: the main process loads).
        micro_batches: Batches fetched per optimizer step.
        cpu_ms_per_batch: CPU time a batch costs to load (the main process's during
            ``next()``, or the workers' per batch).
        cpus_per_rank: CPUs this rank may use.
        training_cpu_cores: CPU the training process itself uses, in cores (its
            fetches left out).
        handoff_ms: The training process's time to take a batch from a worker (None:
            :data:`WORKER_HANDOFF_MS`).
        batch_bytes: The bytes of a batch (``run.batch_bytes``), which a worker copies
            into shared memory to hand it over.
        shm_copy_ms: A worker's CPU time to copy the batch into shared memory, as
            measured on this machine (``run.shm_copy_ms``; None: from ``batch_bytes``).
        shm_release_ms: The training process's CPU time to free it, as measured
            (``run.shm_release_ms``; None: from ``batch_bytes``).

    Returns:
        The :class:`LoaderPlan`.

    Example:
        >>> p = loader_plan(30.0, 40.0, cpu_ms_per_batch=1.0, cpus_per_rank=2, training_cpu_cores=0.25)
        >>> p.kind, p.workers, round(p.predicted_step_ms, 1)  # waits: 4 workers on 2 cores
        ('io', 4, 11.1)
        >>> p = loader_plan(30.0, 40.0, cpu_ms_per_batch=30.0, cpus_per_rank=2, training_cpu_cores=0.25)
        >>> p.kind, p.workers, round(p.predicted_step_ms, 1), p.cores_needed  # computes: 1 core left
        ('cpu', 1, 32.0, 4.0)
    """
    needed = dataloader_workers_needed(data_wait_ms, step_ms, num_workers, micro_batches)
    m, busy, load = _per_batch(data_wait_ms, step_ms, num_workers, micro_batches)
    w0 = int(num_workers or 0)
    cpu = _at_least(cpu_ms_per_batch, 0.0)
    share = min(1.0, cpu / load) if cpu is not None and load > 0 else None
    kind = None if share is None else ("io" if share < LOADER_IO_MAX_CPU_SHARE else "cpu")
    cpus = _at_least(cpus_per_rank, 0.0, strict=True)
    train = max(0.0, finite(training_cpu_cores) or 0.0) * step_ms / m  # CPU ms a batch
    handoff, send, release_ms = _handoff_costs(w0, handoff_ms, batch_bytes, shm_copy_ms, shm_release_ms)
    # CPU time unknown: the loader computes all the time it loads (the cautious side). A worker's
    # sending (its copy into shared memory), and taking a batch over and freeing it, are CPU work too.
    worker_cpu = (load if cpu is None else cpu) + send
    own = busy + handoff + release_ms
    cpu_pace = (train + worker_cpu + handoff + release_ms) / cpus if cpus is not None else 0.0

    def stretch(w: int, pace: float) -> float:
        # (each of w workers takes a batch every w paces, and wants a core worker_cpu of it;
        # with none, what under one core per rank costs the training alone)
        return 1.0 if cpus is None else _stretch(w, worker_cpu / (max(w, 1) * max(pace, 1e-9)), cpus)

    stretch_now = stretch(w0, step_ms / m)

    def step_with(w: int) -> float:
        pace = max(own, (load + send) / w, cpu_pace)
        return m * max(own + train * max(0.0, stretch(w, pace) - stretch_now), pace)

    cores_left = None if cpus is None else max(0.0, cpus - train / max(busy, 1e-9))
    cap = _workers_cap(needed, kind, cores_left, share)
    workers, predicted = _fewest_workers(step_with, w0, cap, lambda w: (load + send) / w > cpu_pace, step_ms)
    cores_needed = (train + cpu) / busy if kind == "cpu" and busy > 0 and cpu is not None else None
    return LoaderPlan(
        load_ms=load,
        busy_ms=busy,
        cpu_ms=cpu,
        cpu_share=share,
        kind=kind,
        workers_needed=needed,
        workers=workers,
        loader_cores=cores_left,
        cores_needed=cores_needed,
        predicted_step_ms=predicted,
    )


def _measured_or(value: float | None, fallback: float) -> float:
    """``value`` where measured (finite, >= 0), else ``fallback``."""
    v = finite(value)
    return fallback if v is None or v < 0 else v


# --------------------------------------------------------------------------- gradient noise scale


def critical_batch_size(run_info: Mapping[str, Any] | None) -> float | None:
    """The critical (global) batch size, from the gradient noise scale the run measured.

    Args:
        run_info: The summary's ``run`` object.

    Returns:
        ``run.gradient_noise.B_simple`` when positive and estimated from at least
        :data:`GNS_MIN_SAMPLES` sampled steps; else None.

    Example:
        >>> critical_batch_size({"gradient_noise": {"B_simple": 512.0, "samples": 20}})
        512.0
    """
    gns = get(run_info, "gradient_noise")
    b_simple, samples = finite(get(gns, "B_simple")), finite(get(gns, "samples"))
    if b_simple is None or b_simple <= 0 or samples is None or samples < GNS_MIN_SAMPLES:
        return None
    return b_simple


class GradientNoiseScale:
    """The simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (critical batch size).

    McCandlish et al. 2018, *An Empirical Model of Large-Batch Training*, appendix A.1:
    from the squared norm of one rank's gradient (batch b) and of the all-reduced mean
    gradient (batch B = G b), two unbiased estimates

    - ``|G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b)``
    - ``S = tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)``

    each smoothed by an exponential moving average with Adam's bias correction
    (``ema / (1 - beta^n)``) *before* dividing (the ratio of noisy estimates is biased).
    Updates with non-finite norms (e.g. AMP overflow steps) are skipped.

    Args:
        beta: The moving averages' decay, in [0, 1).

    Example:
        >>> gns = GradientNoiseScale()
        >>> gns.update(local_sq_norm=2.0, global_sq_norm=1.5, local_batch=32, global_batch=64)
        >>> gns.value  # |G|^2 = 1.0, S = 0.5 / (1/64) = 32
        32.0
    """

    def __init__(self, beta: float = 0.95) -> None:
        beta = check_number(beta, "beta")
        if beta >= 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self._ema_grad_sq = 0.0
        self._ema_trace = 0.0
        self._samples = 0

    def update(self, local_sq_norm: float, global_sq_norm: float, local_batch: int, global_batch: int) -> None:
        """Add one step's estimate.

        Args:
            local_sq_norm: Squared norm of this rank's gradient (batch b).
            global_sq_norm: Squared norm of the all-reduced mean gradient (batch B).
            local_batch: b, in samples.
            global_batch: B, in samples; larger than ``local_batch`` (needs >= 2 ranks).
        """
        b = check_number(local_batch, "local_batch", strict=True)
        big_b = check_number(global_batch, "global_batch", strict=True)
        if big_b <= b:
            raise ValueError(
                "global_batch must be larger than local_batch (needs >= 2 "
                f"ranks), got local_batch={local_batch!r}, "
                f"global_batch={global_batch!r}"
            )
        small_sq, big_sq = finite(local_sq_norm), finite(global_sq_norm)
        if small_sq is None or big_sq is None:
            return
        grad_sq = (big_b * big_sq - b * small_sq) / (big_b - b)
        trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big_b)
        self._ema_grad_sq = self.beta * self._ema_grad_sq + (1.0 - self.beta) * grad_sq
        self._ema_trace = self.beta * self._ema_trace + (1.0 - self.beta) * trace
        self._samples += 1

    def _corrected(self, ema: float) -> float | None:
        if self._samples == 0:
            return None
        return ema / (1.0 - self.beta**self._samples)

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed unbiased estimate of |G|^2 (squared norm of the true gradient)."""
        return self._corrected(self._ema_grad_sq)

    @property
    def trace_sigma(self) -> float | None:
        """Smoothed unbiased estimate of tr(Sigma) (per-sample gradient variance)."""
        return self._corrected(self._ema_trace)

    @property
    def samples(self) -> int:
        """Number of updates folded in."""
        return self._samples

    @property
    def value(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 in samples; None before an update or if |G|^2 <= 0."""
        grad_sq, trace = self.grad_sq_norm, self.trace_sigma
        if grad_sq is None or trace is None or grad_sq <= 0.0:
            return None
        return trace / grad_sq

    def to_dict(self) -> dict[str, Any]:
        """``{"B_simple", "grad_sq_norm", "trace_sigma", "samples"}`` for run.gradient_noise."""
        return {
            "B_simple": self.value,
            "grad_sq_norm": self.grad_sq_norm,
            "trace_sigma": self.trace_sigma,
            "samples": self._samples,
        }
