"""Updates a loss scaler skipped, told by the scaler itself.

``torch.amp.GradScaler.step(optimizer)`` calls ``optimizer.step()`` only when the
unscaled gradients are finite; otherwise the iteration did all of a step's work and
updated nothing. The gradients' state cannot tell that apart in every loop (a skip before
the first real update, ``zero_grad(set_to_none=False)``), so while a profiler runs,
``GradScaler.step`` is wrapped: an enabled scaler's step after which the optimizer's own
step hooks did not fire is a skipped update. The wrapper is on the class, so scalers made
before or after ``profile()`` (and its subclasses: ``torch.cuda.amp.GradScaler``, FSDP's
``ShardedGradScaler``, those of Lightning and Accelerate) are all seen; it is removed when
the last profiler stops.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Protocol

from .._torch_internals import grad_scaler_class

log = logging.getLogger(__name__)

__all__ = ["ScalerListener", "watch_scalers"]


class ScalerListener(Protocol):
    """What :func:`watch_scalers` reports to (the engine)."""

    def optimizer_updates(self, optimizer: Any) -> int | None:
        """Completed ``step()`` calls of ``optimizer`` so far; None: not watched."""

    def scaler_stepped(self, optimizer: Any, updated: bool) -> None:
        """An enabled scaler's ``step(optimizer)`` returned; ``updated``: the optimizer stepped."""


_listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()
_original_step: Callable | None = None
_lock = threading.Lock()
# A subclass whose step() calls super().step() nests the wrapper: only the outer call reports.
_depth = threading.local()


def _timed_step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    original = _original_step or grad_scaler_class().step  # (removed while this call was on its way)
    outer = not getattr(_depth, "n", 0)
    watching = []
    if outer:
        try:
            if scaler.is_enabled():
                watching = [(e, e.optimizer_updates(optimizer)) for e in list(_listeners)]
                watching = [(e, n) for e, n in watching if n is not None]
        except Exception as exc:  # never the training's problem
            log.debug("dtprofile: loss scaler not watched: %r", exc)
            watching = []
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        result = original(scaler, optimizer, *args, **kwargs)
    finally:
        _depth.n -= 1
    for engine, before in watching:
        try:
            engine.scaler_stepped(optimizer, updated=engine.optimizer_updates(optimizer) != before)
        except Exception as exc:
            log.debug("dtprofile: loss scaler step not reported: %r", exc)
    return result


def watch_scalers(listener: ScalerListener) -> Callable[[], None]:
    """Report every enabled ``GradScaler.step`` to ``listener`` until the returned
    function is called.

    Returns:
        A function that stops the reports (and unwraps ``GradScaler.step`` when no
        listener is left). It never raises.
    """
    global _original_step
    cls = grad_scaler_class()
    if cls is None:
        return lambda: None
    with _lock:
        if _original_step is None:
            _original_step = cls.step
            cls.step = _timed_step
        _listeners.add(listener)

    def unwatch() -> None:
        global _original_step
        with _lock:
            _listeners.discard(listener)
            if not _listeners and _original_step is not None:
                if cls.__dict__.get("step") is _timed_step:
                    cls.step = _original_step
                _original_step = None

    return unwatch
