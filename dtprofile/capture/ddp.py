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

*Probe steps* (``probe_every``): the hook holds every bucket's reduction and launches
them all, in bucket order, when the last bucket is ready. Backward then runs with no
communication overlapping it, so the step measures compute alone and communication
alone. The reductions are the same ones on the same buffers in the same order, so
gradients are bit-identical.

DDP has no way to unregister a hook. When the profiler detaches, the hook passes
straight through to the wrapped hook, and a later profiler re-uses it.

>>> import dtprofile
>>> hook = dtprofile.timed_hook()          # wraps allreduce_hook
>>> # ddp_model.register_comm_hook(None, hook)
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .._torch_internals import ddp_comm_hooks, ddp_logged_comm_hook

__all__ = ["TimedHook", "timed_hook", "find_timed_hook", "timed_buffer_sync"]

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
        recorder = self.recorder
        interval = recorder.bucket_ready(bucket, self.wire_itemsize) if recorder is not None else None
        if interval is None:  # not profiling, or timing disabled after an internal error
            if self._default:
                return _allreduce_mean(state, bucket).then(_first_tensor)
            return self.hook(state, bucket)
        if recorder.probing:
            return self._probe(recorder, state, bucket, interval)
        return self._launch(recorder, state, bucket, interval)

    def release_held(self) -> None:
        """Forget buckets held for a probe step (the profiler stopped)."""
        self._held.clear()

    def _launch(self, recorder: Any, state: Any, bucket: Any, interval: Any) -> torch.futures.Future:
        unwrap = self._default
        future = _allreduce_mean(state, bucket) if unwrap else self.hook(state, bucket)

        def done(fut: torch.futures.Future) -> Any:
            recorder.bucket_done(interval, fut)
            return fut.value()[0] if unwrap else fut.value()

        return future.then(done)

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
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


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
