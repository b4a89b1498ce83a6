"""The timed DDP communication hook.

DDP calls a communication hook once per gradient bucket, as soon as the bucket's
gradients are ready during backward; the hook starts the reduction and returns a
future. :class:`TimedHook` wraps any such hook (by default PyTorch's
``allreduce_hook``, which divides the bucket by the world size and all-reduces it, the
same arithmetic as DDP without a hook) and, while a profiler is attached, marks:

- *start*: the moment the bucket is handed to the hook (bucket ready);
- *end*: inside the future's ``then`` callback. For gloo that callback runs on gloo's
  worker thread once the reduction is done; for NCCL it runs with the current stream
  synchronised to the collective, so a CUDA event recorded there completes exactly when
  the reduction does.

Bytes on the wire per bucket are ``buffer.numel() * element_size()``, or two bytes an
element when the wrapped hook is one of PyTorch's 16-bit compression hooks
(``fp16_compress_hook``, ``bf16_compress_hook``, and hooks wrapped in
``fp16_compress_wrapper`` or ``bf16_compress_wrapper``).

*Batched steps*: a callback per bucket costs a hand-over of the GIL to the
communication thread and back; with many small buckets that is a large share of a short
step. So only some steps time each bucket (:func:`~dtprofile.capture.steps.times_buckets`:
the first steps after warm-up, then every ``bucket_timing_every``-th). On the others the
hook launches the reduction, returns a future of its own, and queues one autograd
callback for the whole backward pass: when the graph is done (before DDP's own
finalisation, which is queued after the last bucket) it waits for every reduction in
bucket order and completes the futures, as DDP's finalisation would have waited for
them. The wait after backward is then measured exactly (the pass hooks' marks around
it); what each bucket took is not, and those steps carry no communication total.

*Probe steps* (``probe_every``) measure compute alone and communication alone. Where
DDP reduces every pass the plain way (:class:`NoSyncProbe`), a probe step's passes run
as under ``no_sync()`` and their gradients are all-reduced by hand when backward ends:
compute as on one device, without DDP's bucket copies beside it. Elsewhere the hook
holds every bucket's reduction and launches them all, in bucket order, when the last
bucket is ready: the same reductions on the same buffers in the same order, so
gradients are bit-identical, but DDP's own work still runs beside backward.

DDP has no way to unregister a hook. When the profiler detaches, the hook passes
straight through to the wrapped hook, and a later profiler re-uses it.

>>> import dtprofile
>>> hook = dtprofile.timed_hook()          # wraps allreduce_hook
>>> # ddp_model.register_comm_hook(None, hook)
"""

from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import console
from .._torch_internals import (current_graph_task, ddp_comm_hooks, ddp_logged_comm_hook,
                                ddp_prepare_for_backward, in_backward, module_hook, queue_autograd_callback)
from .records import PROBE_HOST
from .steps import probes

__all__ = ["TimedHook", "NoSyncProbe", "timed_hook", "find_timed_hook", "timed_buffer_sync"]

# PyTorch's hooks that cast each bucket to 16 bits before the all-reduce.
_HALF_PRECISION_HOOKS = frozenset({"fp16_compress_hook", "bf16_compress_hook",
                                   "fp16_compress_wrapper_hook", "bf16_compress_wrapper_hook"})

# DDP checks a hook's annotations at registration, so they are real objects here
# (no ``from __future__ import annotations`` in this module).
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class TimedHook:
    """A DDP communication hook that times the hook it wraps.

    ``recorder`` (a :class:`~dtprofile.capture.comm.CommRecorder`) is set by a running
    profiler and cleared when it stops; with none the call is exactly ``hook(state, bucket)`` (for the default hook, the same
    reduction as ``allreduce_hook``).
    """

    def __init__(self, hook: Optional[CommHook] = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"timed_hook(hook): hook must be a DDP comm hook callable (state, bucket) -> Future, got {type(hook).__name__}")
        self.hook: CommHook = hook if hook is not None else default_hooks.allreduce_hook
        self.recorder: Any = None
        self.user_supplied = hook is not None
        # DDP logs a hook by its name.
        inner = getattr(self.hook, "__qualname__", type(self.hook).__name__)
        self.__name__ = self.__qualname__ = f"dtprofile.timed_hook({inner})"
        self.hook_name = getattr(self.hook, "__name__", inner)
        # Bytes an element takes on the wire when the hook compresses (None: the bucket's).
        self.wire_itemsize = 2 if self.hook_name in _HALF_PRECISION_HOOKS else None
        self._held: list[tuple[Any, Any, torch.futures.Future]] = []
        # Batched steps: (reduction, its tensor or None, the future DDP waits on, interval),
        # completed together when the backward pass in ``_batch_task`` is done.
        self._batch: list[tuple[Any, Any, torch.futures.Future, Any]] = []
        self._batch_task = -1
        self._batch_recorder: Any = None  # the batch's CommRecorder (None: not recording)
        self._batch_interval: Any = None  # the interval the batch's buckets count in
        self._future_devices: Optional[list[torch.device]] = None  # the buckets' CUDA device, if any
        # DDP reduces inside its own finalisation (a static graph's first step, delayed
        # all-reduce): a batch queued from there would complete after DDP waits for it.
        self.reduces_in_finalize = True  # until a profiler attaches and reads the model
        # The default path does allreduce_hook's work itself, so that each bucket costs
        # one Python callback on the communication thread instead of two (on CPU every
        # callback is a GIL hand-over, which shows in short steps).
        self._default = hook is None

    @property
    def engine(self) -> Any:
        """Alias of :attr:`recorder` (None: not timing now)."""
        return self.recorder

    def __repr__(self) -> str:
        return f"TimedHook({getattr(self.hook, '__name__', self.hook)!r})"

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._batch and self._batch_task == current_graph_task():
            return self._hold(state, bucket, self._next_in_batch(bucket))  # the rest of a batched pass
        recorder = self.recorder
        if recorder is not None and recorder.batches_buckets():
            interval = recorder.bucket_untimed(bucket, self.wire_itemsize)
            if interval is not None:
                return self._start_batch(recorder, state, bucket, interval)
        interval = recorder.bucket_ready(bucket, self.wire_itemsize) if recorder is not None else None
        if interval is None:  # not profiling, or timing disabled after an internal error
            if self._default:
                if not self.reduces_in_finalize and in_backward():
                    return self._start_batch(None, state, bucket, None)  # no callback per bucket
                return _allreduce_mean(state, bucket).then(_first_tensor)
            return self.hook(state, bucket)
        if recorder.probing:
            return self._probe(recorder, state, bucket, interval)
        return self._launch(recorder, state, bucket, interval)

    def release_held(self) -> None:
        """Forget buckets held for a probe step (the profiler stopped). A batch still open
        is completed by its own callback."""
        self._held.clear()

    def _launch(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future:
        unwrap = self._default
        future = _allreduce_mean(state, bucket) if unwrap else self.hook(state, bucket)

        def done(fut: torch.futures.Future) -> Any:
            recorder.bucket_done(interval, fut)
            return fut.value()[0] if unwrap else fut.value()

        return future.then(done)

    def _start_batch(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future:
        """The first bucket of a batched backward pass: queue the callback that completes
        the batch, then hold the bucket."""
        if self._batch:
            self._complete_batch()  # another backward's (one that raised, or a reentrant one)
        # Runs before DDP's finalisation (queued once the last bucket is ready), on every
        # path: it is the only thing that completes these futures, so it is never guarded.
        queue_autograd_callback(self._complete_batch)
        self._batch_task = current_graph_task()
        self._batch_recorder = recorder
        self._batch_interval = interval
        if self._future_devices is None:
            self._future_devices = _devices(bucket)
        return self._hold(state, bucket, interval)

    def _next_in_batch(self, bucket: Any) -> Any:
        """The interval a later bucket of the batched pass counts in (None: not recording)."""
        recorder = self._batch_recorder
        if recorder is None:
            return None
        return recorder.bucket_untimed(bucket, self.wire_itemsize, joined=self._batch_interval)

    def _hold(self, state: Any, bucket: Any, interval: Any) -> torch.futures.Future:
        """Launch the bucket's reduction now; its future completes with the batch."""
        if self._default:
            group, tensor = _divided_bucket(state, bucket)
            pending, value = group.allreduce([tensor]), tensor
        else:
            pending, value = self.hook(state, bucket), None
        held = torch.futures.Future(devices=self._future_devices)
        self._batch.append((pending, value, held, interval))
        return held

    def _complete_batch(self) -> None:
        """Wait for each held reduction in bucket order and complete its future (a failed
        reduction's future gets the error: DDP raises it in the loop, as without dtprofile)."""
        batch, self._batch = self._batch, []
        self._batch_recorder = self._batch_interval = None
        for pending, value, held, interval in batch:
            try:
                if value is None:
                    value = pending.wait()  # the wrapped hook's future: its value is the bucket
                else:
                    pending.wait()  # the collective (NCCL: the current stream waits for it)
            except BaseException as exc:
                held.set_exception(exc)
                continue
            recorder = self.recorder
            if recorder is not None and interval is not None and interval.local_sq is not None:
                recorder.bucket_reduced(interval, value)
            held.set_result(value)

    def _probe(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future:
        """Hold buckets until the last one is ready, then launch all in bucket order."""
        if not bucket.is_last():
            held = torch.futures.Future(devices=_devices(bucket))
            self._held.append((bucket, interval, held))
            return held
        pending, self._held = self._held, []
        for held_bucket, held_interval, held in pending:
            recorder.restart(held_interval)  # its reduction starts now, not when held
            self._launch(recorder, state, held_bucket, held_interval).then(_forward_into(held))
        return self._launch(recorder, state, bucket, interval)


def _allreduce_mean(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """What ``allreduce_hook`` puts on the wire, without its ``then``.

    Divides the bucket by the group size (before the sum, as DDP does, so fp16 does not
    overflow), then all-reduces it (sum) asynchronously. The future's value is
    ``[bucket tensor]``; the caller's single ``then`` unwraps it.
    """
    group, tensor = _divided_bucket(process_group, bucket)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def _divided_bucket(process_group: Any, bucket: dist.GradBucket) -> tuple[Any, torch.Tensor]:
    """The group (None: WORLD) and the bucket divided by its size in place, as
    ``allreduce_hook`` and DDP do before the sum (so fp16 does not overflow)."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return group, tensor


def _first_tensor(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


def _devices(bucket: Any) -> list[torch.device]:
    device = bucket.buffer().device
    return [device] if device.type == "cuda" else []


def _forward_into(target: torch.futures.Future) -> Callable[[torch.futures.Future], None]:
    def forward(fut: torch.futures.Future) -> None:
        try:
            target.set_result(fut.value())
        except Exception as exc:  # the reduction failed: DDP must see it
            target.set_exception(exc)

    return forward


def timed_hook(hook: Optional[CommHook] = None) -> TimedHook:
    """Wrap your own DDP communication hook so dtprofile can time it.

    Register the result where you registered your hook; dtprofile finds it when it
    attaches::

        model.register_comm_hook(state, dtprofile.timed_hook(my_hook))

    Without an argument it wraps PyTorch's ``allreduce_hook`` (what dtprofile registers
    itself when the model has no hook).
    """
    return TimedHook(hook)


def find_timed_hook(ddp_model: Any) -> "tuple[Optional[TimedHook], bool]":
    """The model's registered :class:`TimedHook`, and whether some other hook is present.

    DDP keeps the hooks given to ``register_comm_hook`` in ``_comm_hooks``; a builtin
    hook leaves its type in the DDP logging data instead.
    """
    hooks = ddp_comm_hooks(ddp_model)
    for hook, _state in hooks:
        if isinstance(hook, TimedHook):
            return hook, False
    return None, bool(hooks) or ddp_logged_comm_hook(ddp_model)


def timed_buffer_sync(ddp_model: Any, inner: Callable[[], Any], recorder: Any) -> Callable[[], None]:
    """DDP's buffer sync ``inner``, timed as blocking communication for ``recorder``.

    On the wire: with ``broadcast_buffers=True`` (the default) and a model that has
    buffers (BatchNorm's running statistics), DDP broadcasts every buffer from rank 0 at
    the start of each forward, coalesced. Gloo blocks the training thread for it; under
    NCCL the current stream waits for it. Either way nothing overlaps it, and a rank that
    is ahead waits there for the others (a straggler), not in its gradients' all-reduce.
    """
    nbytes = sum(b.numel() * b.element_size() for b in getattr(ddp_model, "modules_buffers", None) or [])

    def sync_buffers() -> Any:
        interval = recorder.blocking_start("buffer_broadcast", nbytes)
        try:
            return inner()
        finally:
            if interval is not None:
                recorder.end(interval)

    return sync_buffers


class NoSyncProbe:
    """Probe steps that measure compute exactly as a step without DDP: each pass that
    would reduce runs as under ``no_sync()``, and its gradients are all-reduced by hand
    at the end of its backward, before anything else sees them.

    Holding the reductions (:meth:`TimedHook._probe`) keeps communication from
    overlapping backward, but not DDP's own CPU work during it: copying each gradient
    into its bucket, dividing it, gloo's reductions on the same cores. On a CPU that
    work can double backward, and a one-device run does none of it. Here backward runs
    with DDP's reducer idle, as on one device; the reduction then happens whole, timed
    as exposed communication.

    The gradients are those DDP would produce: divided by the group's size and summed,
    in chunks of DDP's bucket size (bit-identical with two ranks; with more, equal up
    to the order of the floating-point sum). Used only where DDP reduces every pass the
    plain way (:func:`~dtprofile._torch_internals.ddp_reduces_plainly`), with DDP's own
    all-reduce or dtprofile's default hook (no user hook to reproduce). The flag DDP
    reads is restored after every forward, also one that raises.

    A probe adds collectives, so which passes are probes must be the same on every rank
    whatever happens to one rank's profiler: they are counted here, among the training
    forwards that synchronise (DDP needs the same sequence of them on every rank), from
    a start every rank made (:meth:`start`), on :func:`~dtprofile.capture.steps.probes`'
    schedule.

    Args:
        ddp: the DistributedDataParallel model.
        recorder: the :class:`~dtprofile.capture.comm.CommRecorder` (its ``end`` and
            ``blocking_start`` time the reduction).
        options: the run's options (``warmup_steps``, ``probe_every``).
    """

    def __init__(self, ddp: Any, recorder: Any, options: Any, scale_by_reciprocal: bool = False) -> None:
        self.ddp = ddp
        self.recorder = recorder
        self.options = options
        # How the ordinary steps scale each gradient before the sum: DDP's own reducer
        # multiplies a gradient it copies by 1 / size (and divides one that is a view of
        # its bucket); allreduce_hook (dtprofile's default hook) divides.
        self.scale_by_reciprocal = scale_by_reciprocal
        self._suppressed = False  # this forward runs as under no_sync()
        self._due = 0  # passes whose reduction is due at their backward's end
        self._started = False  # every rank started profiling (probes may run)
        self._passes = 0  # synchronising training forwards since the start
        self._params = _reduced_params(ddp)
        # A backward inside DDP's forward (a training step run as the module's call) would
        # skip a probe's reduction altogether: one parameter's gradient accumulation is
        # watched during each synchronising forward.
        self._in_forward = False
        self._backward_seen = False
        self.disabled = False
        self.compiled = False  # its hooks were traced into a compiled forward
        # Probes whose passes run one rank at a time (see _take_turn): the same probes, and
        # the same number of one-element collectives in each, on every rank.
        self._probes_made = 0
        self._turn_ranks, self._rank = _turn_group(ddp) if self._params else (0, 0)
        self._turns_due = 0  # this pass's meetings still to make at its backward's end
        self._waits_turn = False  # this pass waits for the ranks before it (a CPU's passes)
        self._handles = [ddp.register_forward_pre_hook(self._forward_pre),
                         ddp.register_forward_hook(self._forward_post, always_call=True)]
        inner = getattr(ddp, "module", None)
        if self._turn_ranks and isinstance(inner, torch.nn.Module):
            # On the wrapped module: it runs after DDP's own collectives before forward
            # (the buffers' broadcast), which every rank makes first. A copy of the module
            # (an EMA model) gets an inert hook.
            self._handles.append(inner.register_forward_pre_hook(module_hook(self._take_turn)))
        watched = self._params[0] if self._params else None
        if watched is not None and hasattr(watched, "register_post_accumulate_grad_hook"):
            self._handles.append(watched.register_post_accumulate_grad_hook(self._grad_accumulated))

    def start(self, every_rank: bool) -> None:
        """The profiler started; ``every_rank``: on every rank of the group (one verdict
        for all), so that probes may run."""
        self._started = every_rank
        self._passes = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._restore()

    def _forward_pre(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Traced into a compiled DDP forward: DDP's flag would be a guard, and a probe a
            # recompilation. Probe steps of a compiled model hold the reductions instead.
            self.compiled = True
            return
        ddp = self.ddp
        try:
            if self.disabled or not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
                return
            self._in_forward, self._backward_seen = True, False
            index = self._passes
            self._passes += 1
            if not (self._started and probes(index, self.options.warmup_steps, self.options.probe_every)):
                return
            if getattr(getattr(ddp, "_join_config", None), "enable", True):
                # A join() (uneven inputs) shadows DDP's own reductions for the ranks that
                # ran out, not one made by hand: from now on probes hold the reductions.
                self.recorder.lost_probes_by_hand()
                return
            ddp.require_backward_grad_sync = False
            self._suppressed = True
            alone = self._turn_ranks and solo_probe(self._probes_made)
            self._probes_made += 1
            if alone:
                self._turns_due = self._turn_ranks
                self._waits_turn = _on_cpu(self._params)
        except Exception:  # a probe never breaks training: this step is an ordinary one
            self._restore()

    def _take_turn(self, module: Any, args: Any) -> None:
        """A probe whose passes run alone: wait until every rank before this one has
        finished its backward (one meeting each), so that on a host the ranks share, each
        computes with the others idle; how much faster than beside them is what sharing
        the host costs. The wait is exposed time of the step, not its compute."""
        if not self._waits_turn:
            return
        self._waits_turn = False
        recorder = self.recorder
        wait = None
        try:
            if recorder is not None and recorder.active:
                recorder.steps.current.alone = True
                wait = _start(recorder, 0, PROBE_HOST)
        except Exception:
            wait = None
        self._meet(self._rank)
        if wait is not None:
            recorder.end(wait)

    def _meet(self, times: int) -> None:
        """``times`` of the probe's one-element meetings (the same count on every rank)."""
        times = min(times, self._turns_due)
        self._turns_due -= times
        group = getattr(self.ddp, "process_group", None) or dist.group.WORLD
        for _ in range(times):
            dist.all_reduce(torch.zeros(1, device=self._params[0].device), group=group)

    def _grad_accumulated(self, param: Any) -> None:
        if self._in_forward:
            self._backward_seen = True

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._in_forward:
            self._in_forward = False
            if self._backward_seen:
                self._backward_inside_forward()
        if not self._suppressed:
            return
        self._restore()
        ddp = self.ddp
        ddp.require_forward_param_sync = True  # as after a pass that reduces (buffers next forward)
        from .passes import _watched_outputs  # (one definition of "the outputs backward starts from")

        tensors = _watched_outputs(output) if output is not None else []
        if not tensors:  # no backward will start from here: let DDP reduce this pass after all
            self._waits_turn = False
            self._meet(self._turns_due)
            ddp_prepare_for_backward(ddp)
            return
        self._due += 1
        if len(tensors) == 1:
            tensors[0].register_hook(self._backward_started)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_started, mode="any")

    def _backward_inside_forward(self) -> None:
        self.disabled = True
        try:
            self.recorder.lost_probes_by_hand()
        except Exception as exc:
            self.recorder.parts["comm"].fail(exc)
        if self._suppressed:
            # This probe's backward ran unsynchronised inside the forward and its update
            # is done: nothing can reduce it now. (The first synchronising forward, never
            # a probe, normally reveals the pattern first.)
            console.warn("dtprofile: a probe step's backward ran inside DDP's forward, so its gradients were not "
                         "all-reduced; further probe steps hold DDP's reductions instead", stacklevel=2)

    def _restore(self) -> None:
        if self._suppressed:
            self._suppressed = False
            self.ddp.require_backward_grad_sync = True

    def _backward_started(self, grad: Any) -> None:
        # Never guarded: the pass's gradients must be reduced whatever happens to the profiler.
        queue_autograd_callback(self._reduce)

    def _reduce(self) -> None:
        """Backward is done: mark its compute's end (the pass hooks keep the first mark),
        then all-reduce the gradients as DDP would have.

        Each chunk's collective is timed from its launch to its end, so that the step's
        communication (their union) leaves out the copies into and out of the chunks,
        which DDP makes during backward and in its finalisation, not on the wire.
        """
        if self._due <= 0:
            return
        self._due -= 1
        recorder = self.recorder
        params = self._params
        if not params:
            return
        group = getattr(self.ddp, "process_group", None)
        if group is None:
            group = dist.group.WORLD
        timed = recorder is not None and recorder.active
        try:
            recorder.steps.current.reduced_by_hand = True  # the step is a probe
            if timed:
                recorder.backward_compute_done()
        except Exception:
            timed = False
        # What the step waits for besides the wire: the slowest rank (below), the copies
        # and the norms. Exposed, so none of it is counted as the probe's compute.
        host = _start(recorder, 0, PROBE_HOST) if timed else None
        self._waits_turn = False
        self._meet(self._turns_due)  # a probe whose passes ran alone: the ranks after this one
        # The ranks meet first (one element; every rank that skipped DDP's reduction, so
        # never unmatched), so that the intervals time the communication alone, not also
        # this rank's lead over the slowest.
        dist.all_reduce(torch.zeros(1, device=params[0].device), group=group)
        sampled = None
        if timed:
            try:
                sampled = ([], []) if recorder.noise.sampling_probe() else None
            except Exception:
                sampled = None
        # Small chunks several at a time, as DDP keeps several buckets in flight (each one
        # alone would wait out the link's latency); large ones one after another, which a
        # shaped or congested link carries at its rate (two large flows at once may not).
        in_flight: deque = deque()
        last = None
        for chunk in _chunks(params, int(getattr(self.ddp, "bucket_bytes_cap", 0) or 25 * 2**20)):
            chunk_bytes = sum(g.numel() * g.element_size() for g in chunk)
            while in_flight and (len(in_flight) >= PROBE_CHUNKS_IN_FLIGHT
                                 or chunk_bytes + sum(r.nbytes for r in in_flight) > PROBE_BYTES_IN_FLIGHT):
                sampled = in_flight.popleft().copy_back(recorder, sampled)
            grads, flat = _divided_copy(chunk, group, self.scale_by_reciprocal)
            sampled = _sample(sampled, 0, flat)  # |g|^2 of this rank's chunk (divided by the group's size)
            interval = _start(recorder, chunk_bytes) if timed else None
            last = _ChunkReduction(grads, flat, dist.all_reduce(flat, group=group, async_op=True), interval)
            in_flight.append(last)
        while in_flight:
            sampled = in_flight.popleft().copy_back(recorder, sampled)
        if sampled is not None and last is not None and last.interval is not None:
            recorder.probe_reduced(last.interval, *sampled, 1.0 / group.size())
        if host is not None:
            recorder.end(host)


class _ChunkReduction:
    """One chunk's all-reduce by hand: the gradients, their flat copy, the collective, and
    its interval (None: not timed)."""

    __slots__ = ("grads", "flat", "work", "interval", "nbytes")

    def __init__(self, grads: list[torch.Tensor], flat: torch.Tensor, work: Any, interval: Any) -> None:
        self.grads, self.flat, self.work, self.interval = grads, flat, work, interval
        self.nbytes = flat.numel() * flat.element_size()

    def copy_back(self, recorder: Any, sampled: tuple | None) -> tuple | None:
        """Wait for the sum, end the interval, copy the result into the gradients; the
        gradient-noise sample with the mean's chunk added (None: not sampled)."""
        from torch._utils import _unflatten_dense_tensors

        self.work.wait()
        if self.interval is not None:
            recorder.end(self.interval)
        sampled = _sample(sampled, 1, self.flat)
        for target, reduced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
            target.copy_(reduced)
        return sampled


#: Ranks at most for probes whose passes run one rank at a time (such a probe step takes
#: about that many times its passes' compute).
TURN_RANKS_MAX = 8
#: The 2nd and 4th probe, then every 8th, run their passes one rank at a time.
SOLO_PROBE_FIRST = (1, 3)
SOLO_PROBE_EVERY = 8


def solo_probe(probe_index: int) -> bool:
    """Whether the probe ``probe_index`` (0: the run's first) runs its passes one rank at
    a time; the others run them together, as every other step does.

    >>> [i for i in range(40) if solo_probe(i)]
    [1, 3, 11, 19, 27, 35]
    """
    return probe_index in SOLO_PROBE_FIRST or (probe_index > 3 and probe_index % SOLO_PROBE_EVERY == 3)


def _turn_group(ddp: Any) -> tuple[int, int]:
    """(ranks, this rank's place) for probes that take turns: the group's size where it is
    a gloo group of 2 to TURN_RANKS_MAX ranks, else 0 (every rank decides the same)."""
    try:
        group = getattr(ddp, "process_group", None) or dist.group.WORLD
        size = dist.get_world_size(group)
        if dist.get_backend(group) != "gloo" or not 2 <= size <= TURN_RANKS_MAX:
            return 0, 0
        return size, dist.get_rank(group)
    except Exception:
        return 0, 0


def _on_cpu(params: list) -> bool:
    # A GPU's passes queue work and return: a host-side turn would not keep them apart.
    return bool(params) and params[0].device.type == "cpu"


def _start(recorder: Any, nbytes: int, kind: str = "all_reduce") -> Any:
    try:
        return recorder.blocking_start(kind, nbytes)
    except Exception:
        return None


#: A probe step's all-reduce by hand keeps at most this many chunks (DDP's bucket size
#: each), and this many bytes, in flight (a chunk larger than that goes alone): the
#: copies' memory stays bounded on the host (on a GPU the host does not wait for the
#: device, so up to the gradients' size may be allocated).
PROBE_CHUNKS_IN_FLIGHT = 4
PROBE_BYTES_IN_FLIGHT = 4 * 2**20


def _chunks(params: list, chunk_bytes: int) -> list[list[torch.Tensor]]:
    """The parameters' gradients in groups of at most ``chunk_bytes`` (one dtype and device
    each); a missing gradient takes part as zeros and stays missing."""
    chunks: list[list[torch.Tensor]] = []
    fill = 0
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        size = grad.numel() * grad.element_size()
        last = chunks[-1] if chunks else None
        if last is None or grad.dtype != last[0].dtype or grad.device != last[0].device or fill + size > chunk_bytes:
            chunks.append([])
            fill = 0
        chunks[-1].append(grad)
        fill += size
    return chunks


def _divided_copy(grads: list[torch.Tensor], group: Any, by_reciprocal: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``grads`` and one flat copy of them divided by the group's size before the sum, as
    the ordinary steps do (``by_reciprocal``: multiplied by 1 / size, as DDP's reducer
    does; else divided, as ``allreduce_hook`` does; the two can differ in the last bit)."""
    from torch._utils import _flatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    if by_reciprocal:
        flat.mul_(1.0 / group.size())
    else:
        flat.div_(group.size())
    return grads, flat


def _sample(sampled: tuple | None, which: int, flat: torch.Tensor) -> tuple | None:
    """``sampled`` with |flat|^2 added to its list ``which`` (0: before the sum, 1: after);
    None when not sampling, or when the norm cannot be taken (the sample is dropped, the
    reduction goes on)."""
    if sampled is None:
        return None
    try:
        sampled[which].append(torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2)
    except Exception:
        return None
    return sampled


def _reduced_params(ddp: Any) -> list:
    """The parameters DDP reduces: those with gradients, less the ones it was told to
    ignore (``_set_params_and_buffers_to_ignore_for_model``)."""
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        params = list(ddp.parameters())
    return [p for p in params if p.requires_grad]
