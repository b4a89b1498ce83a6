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
from collections.abc import Callable
from typing import Any, Protocol

from .._torch_internals import grad_scaler_class

log = logging.getLogger(__name__)

__all__ = ["ScalerListener", "watch_scalers"]


class ScalerListener(Protocol):
    """What :func:`watch_scalers` reports to (the :class:`~dtprofile.capture.updates.UpdateTracker`)."""

    def optimizer_updates(self, optimizer: Any) -> int | None:
        """Completed ``step()`` calls of ``optimizer`` so far; None: not watched."""

    def scaler_stepped(self, optimizer: Any, updated: bool) -> None:
        """An enabled scaler's ``step(optimizer)`` returned; ``updated``: the optimizer stepped."""


_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
# The wrapper on the class now, or None. It keeps the method it wraps: if something else
# wraps GradScaler.step over it, it stays (passing straight through) and is used again.
_wrapper: Callable[..., Any] | None = None
# A subclass whose step() calls super().step() nests the wrapper: only the outer call reports.
_depth = threading.local()


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GradScaler.step`` reporting to the listeners, around ``original``."""

    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not getattr(_depth, "n", 0)
        watching = []
        if outer and _listeners:
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
        for listener, before in watching:
            try:
                listener.scaler_stepped(optimizer, updated=listener.optimizer_updates(optimizer) != before)
            except Exception as exc:
                log.debug("dtprofile: loss scaler step not reported: %r", exc)
        return result

    step.__wrapped__ = original  # type: ignore[attr-defined]
    step.__doc__ = original.__doc__
    return step


def watch_scalers(listener: ScalerListener) -> Callable[[], None]:
    """Report every enabled ``GradScaler.step`` to ``listener`` until the returned
    function is called.

    Returns:
        A function that stops the reports (and puts ``GradScaler.step`` back when no
        listener is left and nothing else has wrapped it since). It never raises.
    """
    global _wrapper
    cls = grad_scaler_class()
    if cls is None:
        return lambda: None
    with _lock:
        if _wrapper is None:
            _wrapper = _wrap(cls.step)
            cls.step = _wrapper  # type: ignore[method-assign]  # (the patch this module makes)
        _listeners.add(listener)

    def unwatch() -> None:
        global _wrapper
        with _lock:
            _listeners.discard(listener)
            if not _listeners and _wrapper is not None and cls.__dict__.get("step") is _wrapper:
                # (mypy does not narrow a global: _wrapper is not None, checked above)
                cls.step = _wrapper.__wrapped__  # type: ignore[method-assign, union-attr]
                _wrapper = None

    return unwatch
