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
step. So only some steps time each bucket (:func:`~dtprofile.capture.schedule.times_buckets`:
the first steps after warm-up, then every ``bucket_timing_every``-th). On the others the
hook launches the reduction, returns a future of its own, and queues one autograd
callback for the whole backward pass: when the graph is done (before DDP's own
finalisation, which is queued after the last bucket) it waits for every reduction in
bucket order and completes the futures, as DDP's finalisation would have waited for
them. The wait after backward is then measured exactly (the pass hooks' marks around
it); what each bucket took is not, and those steps carry no communication total.

*Probe steps* (``probe_every``) measure compute alone and communication alone. Where
DDP reduces every pass the plain way (:class:`NoSyncProbe`, with DDP's own all-reduce
also where it searches for unused parameters), a probe step's passes run as under
``no_sync()`` and their gradients are all-reduced when backward ends: compute as on
one device, without DDP's bucket copies beside it. Elsewhere the hook
holds every bucket's reduction and launches them all, in bucket order, when the last
bucket is ready: the same reductions on the same buffers in the same order, so
gradients are bit-identical, but DDP's own work still runs beside backward.

DDP has no way to unregister a hook. When the profiler detaches, the hook passes
straight through to the wrapped hook, and a later profiler re-uses it.

>>> import dtprofile
>>> hook = dtprofile.timed_hook()          # wraps allreduce_hook
>>> # ddp_model.register_comm_hook(None, hook)
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .._torch_internals import (
    current_graph_task,
    ddp_comm_hooks,
    ddp_logged_comm_hook,
    in_backward,
    queue_autograd_callback,
)
from .probe import NoSyncProbe  # probe steps that reduce by hand (its own module)

__all__ = ["TimedHook", "NoSyncProbe", "timed_hook", "find_timed_hook", "other_hook", "timed_buffer_sync", "wire_bytes"]

# PyTorch's hooks that cast each bucket to 16 bits before the all-reduce.
_HALF_PRECISION_HOOKS = frozenset(
    {"fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper_hook", "bf16_compress_wrapper_hook"}
)

# DDP checks a hook's annotations at registration, so they are real objects here
# (no ``from __future__ import annotations`` in this module).
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[Any]]


class TimedHook:
    """A DDP communication hook that times the hook it wraps.

    ``recorder`` (a :class:`~dtprofile.capture.comm.CommRecorder`) is set by a running
    profiler and cleared when it stops; with none the call is exactly ``hook(state, bucket)``
    (for the default hook, the same reduction as ``allreduce_hook``).
    """

    def __init__(self, hook: CommHook | None = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(
                "timed_hook(hook): hook must be a DDP comm hook callable (state, bucket) -> Future, "
                f"got {type(hook).__name__}"
            )
        self.hook: CommHook = hook if hook is not None else default_hooks.allreduce_hook
        self.recorder: Any = None
        self.user_supplied = hook is not None
        # DDP logs a hook by its name.
        inner = getattr(self.hook, "__qualname__", type(self.hook).__name__)
        self.__name__ = self.__qualname__ = f"dtprofile.timed_hook({inner})"
        self.hook_name = getattr(self.hook, "__name__", inner)
        # Bytes an element takes on the wire when the hook compresses (None: the bucket's).
        self.wire_itemsize = 2 if self.hook_name in _HALF_PRECISION_HOOKS else None
        self._held: list[tuple[Any, Any, torch.futures.Future[Any]]] = []
        # Batched steps: (reduction, its tensor or None, the future DDP waits on, interval),
        # completed together when the backward pass in ``_batch_task`` is done.
        self._batch: list[tuple[Any, Any, torch.futures.Future[Any], Any]] = []
        self._batch_task = -1
        self._batch_recorder: Any = None  # the batch's CommRecorder (None: not recording)
        self._batch_interval: Any = None  # the interval the batch's buckets count in
        self._future_devices: list[int | str | torch.device] | None = None  # the buckets' CUDA device, if any
        # DDP reduces inside its own finalisation (a static graph's first step, delayed
        # all-reduce): a batch queued from there would complete after DDP waits for it.
        self.reduces_in_finalize = True  # until a profiler attaches and reads the model
        # The default path does allreduce_hook's work itself, so that each bucket costs
        # one Python callback on the communication thread instead of two (on CPU every
        # callback is a GIL hand-over, which shows in short steps).
        self._default = hook is None
        # How the default path scales a bucket before the sum: divided, as allreduce_hook
        # does (a hook the user registered); multiplied by 1 / size where dtprofile stands
        # in for DDP's own all-reduce, as DDP's reducer scales the gradients it copies in
        # (the two differ in the last bit for sizes that are not powers of two).
        self.by_reciprocal = False

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
                return _allreduce_mean(state, bucket, self.by_reciprocal).then(_first_tensor)
            return self.hook(state, bucket)
        if recorder.probing:
            return self._probe(recorder, state, bucket, interval)
        return self._launch(recorder, state, bucket, interval)

    def release_held(self) -> None:
        """Forget buckets held for a probe step (the profiler stopped). A batch still open
        is completed by its own callback."""
        self._held.clear()

    def _launch(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future[Any]:
        unwrap = self._default
        future = _allreduce_mean(state, bucket, self.by_reciprocal) if unwrap else self.hook(state, bucket)

        def done(fut: "torch.futures.Future[Any]") -> Any:  # (quoted: not built on every bucket)
            recorder.bucket_done(interval, fut)
            return fut.value()[0] if unwrap else fut.value()

        return future.then(done)

    def _start_batch(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future[Any]:
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

    def _hold(self, state: Any, bucket: Any, interval: Any) -> torch.futures.Future[Any]:
        """Launch the bucket's reduction now; its future completes with the batch."""
        if self._default:
            group, tensor = _divided_bucket(state, bucket, self.by_reciprocal)
            pending, value = group.allreduce([tensor]), tensor
        else:
            pending, value = self.hook(state, bucket), None
        held: torch.futures.Future[Any] = torch.futures.Future(devices=self._future_devices)
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

    def _probe(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future[Any]:
        """Hold buckets until the last one is ready, then launch all in bucket order."""
        if not bucket.is_last():
            held: torch.futures.Future[Any] = torch.futures.Future(devices=_devices(bucket))
            self._held.append((bucket, interval, held))
            return held
        pending, self._held = self._held, []
        for held_bucket, held_interval, held in pending:
            recorder.restart(held_interval)  # its reduction starts now, not when held
            self._launch(recorder, state, held_bucket, held_interval).then(_forward_into(held))
        return self._launch(recorder, state, bucket, interval)


def _allreduce_mean(
    process_group: Any, bucket: dist.GradBucket, by_reciprocal: bool = False
) -> torch.futures.Future[Any]:
    """What ``allreduce_hook`` puts on the wire, without its ``then``.

    Divides the bucket by the group size (before the sum, as DDP does, so fp16 does not
    overflow; ``by_reciprocal``: multiplies by 1 / size, as DDP's own reducer), then
    all-reduces it (sum) asynchronously. The future's value is ``[bucket tensor]``; the
    caller's single ``then`` unwraps it.
    """
    group, tensor = _divided_bucket(process_group, bucket, by_reciprocal)
    future: torch.futures.Future[Any] = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return future


def _divided_bucket(
    process_group: Any, bucket: dist.GradBucket, by_reciprocal: bool = False
) -> tuple[Any, torch.Tensor]:
    """The group (None: WORLD) and the bucket divided by its size in place, as
    ``allreduce_hook`` and DDP do before the sum (so fp16 does not overflow);
    ``by_reciprocal``: multiplied by 1 / size, DDP's own reducer's arithmetic."""
    group: Any = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    if by_reciprocal:
        tensor.mul_(1.0 / group.size())
    else:
        tensor.div_(group.size())
    return group, tensor


def _first_tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


def _devices(bucket: Any) -> list[int | str | torch.device]:
    device = bucket.buffer().device
    return [device] if device.type == "cuda" else []


def _forward_into(target: torch.futures.Future[Any]) -> Callable[[torch.futures.Future[Any]], None]:
    def forward(fut: "torch.futures.Future[Any]") -> None:  # (quoted: not built on every call)
        try:
            target.set_result(fut.value())
        except Exception as exc:  # the reduction failed: DDP must see it
            target.set_exception(exc)

    return forward


def timed_hook(hook: CommHook | None = None) -> TimedHook:
    """Wrap your own DDP communication hook so dtprofile can time it.

    Register the result where you registered your hook; dtprofile finds it when it
    attaches::

        model.register_comm_hook(state, dtprofile.timed_hook(my_hook))

    Without an argument it wraps PyTorch's ``allreduce_hook`` (what dtprofile registers
    itself when the model has no hook).
    """
    return TimedHook(hook)


def find_timed_hook(ddp_model: Any) -> "tuple[TimedHook | None, bool]":
    """The model's registered :class:`TimedHook`, and whether some other hook is present.

    DDP keeps the hooks given to ``register_comm_hook`` in ``_comm_hooks``; a builtin
    hook leaves its type in the DDP logging data instead.
    """
    hooks = ddp_comm_hooks(ddp_model)
    for hook, _state in hooks:
        if isinstance(hook, TimedHook):
            return hook, False
    return None, bool(hooks) or ddp_logged_comm_hook(ddp_model)


def wire_bytes(tensor: torch.Tensor, wire_itemsize: int | None = None) -> int:
    """A bucket's or gradient's bytes on the wire (``wire_itemsize``: a compressing hook's
    element size; None: the tensor's own)."""
    return tensor.numel() * min(wire_itemsize or tensor.element_size(), tensor.element_size())


#: How DDP's logging data names its builtin 16-bit hook (``_register_builtin_comm_hook``).
_BUILTIN_HALF_PRECISION = "BuiltinCommHookType.FP16_COMPRESS"


def other_hook(ddp_model: Any) -> "tuple[str | None, int | None]":
    """The name of the model's communication hook that is not a :class:`TimedHook`
    (None: none found), and the bytes an element takes on the wire where it is one of
    PyTorch's 16-bit compression hooks (None: the gradient's own)."""
    hooks = ddp_comm_hooks(ddp_model)
    if hooks:
        hook = hooks[0][0]
        name = getattr(hook, "__name__", None) or type(hook).__name__
    else:
        try:
            name = ddp_model._get_ddp_logging_data().get("comm_hook") or None
        except Exception:
            name = None
    half = name in _HALF_PRECISION_HOOKS or name == _BUILTIN_HALF_PRECISION
    return name, (2 if half else None)


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
