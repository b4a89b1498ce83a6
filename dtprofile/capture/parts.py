"""The parts of the profiler an internal error can switch off, one at a time.

Every hook body runs under :func:`guarded`: while its part is enabled and the profiler
is measuring, it runs; an exception warns once, disables that part, and never reaches
the training loop.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from .. import console

__all__ = ["Part", "Parts", "Unhookable", "guarded"]

log = logging.getLogger(__name__)


class Unhookable(RuntimeError):
    """Something the user passed cannot be hooked: the part that needs it goes unmeasured."""


class Part:
    """A piece of the profiler that an internal error can switch off on its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.enabled = True
        self.error: str | None = None

    def fail(self, exc: BaseException) -> None:
        """Switch this part off, with one warning that says why (never raises)."""
        if self.enabled:
            self.enabled = False
            self.error = f"{type(exc).__name__}: {exc}"
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if missing:
                why = f": it needs {missing!r}, which is not installed: pip install {missing.split('.')[0]}"
            elif isinstance(exc, OSError) and exc.errno is not None:  # a full disk, a deleted logdir
                why = f": {self.error}"
            elif isinstance(exc, Unhookable):
                why = f": {exc}"
            else:
                why = f" after an internal error ({self.error})"
            console.warn(f"dtprofile: {self.name} disabled{why}; training continues", stacklevel=2)
            log.debug("dtprofile %s failure", self.name, exc_info=exc)


class Parts(dict[str, Part]):
    """The profiler's parts by name, and whether it is measuring now.

    ``active``: between start() and stop(); ``suspended``: training that is not the run's
    (Lightning's tuner) runs, and every hook does nothing.
    """

    NAMES = ("timing", "comm", "data", "gather", "sink", "summary")

    active: bool
    suspended: bool
    measuring: bool

    def __init__(self) -> None:
        super().__init__((name, Part(name)) for name in self.NAMES)
        self.active = False
        self.suspended = False

    def __setattr__(self, name: str, value: Any) -> None:
        # Plain attributes, read by every hook call (no property in between);
        # ``measuring`` is kept up to date here.
        if name not in ("active", "suspended"):
            object.__setattr__(self, name, value)
            return
        object.__setattr__(self, name, bool(value))
        state = self.__dict__
        object.__setattr__(self, "measuring", state.get("active", False) and not state.get("suspended", False))


_GUARD_SOURCE = """
def guard(self{params}):
    parts = self.parts
    part = parts[part_name]
    if not part.enabled or not parts.measuring:
        return None
    try:
        return fn(self{params})
    except Exception as exc:
        part.fail(exc)
        return None
"""
_GUARD_NAMES = {"self", "parts", "part", "part_name", "fn", "exc"}  # the source's own


def guarded(part_name: str) -> Callable[..., Any]:
    """Run the method only while its part is enabled and the profiler measures; turn its
    errors into ``Part.fail``. The method's object holds the :class:`Parts` as ``parts``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        # Hooks run on every step: a guard with the method's own positional parameters
        # passes them on without packing them (half the cost of ``*args, **kwargs``).
        params = list(inspect.signature(fn).parameters.values())[1:]
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in _GUARD_NAMES for p in params)
        names = "".join(f", {p.name}" for p in params) if plain else ", *args, **kwargs"
        scope: dict[str, Any] = {"fn": fn, "part_name": part_name}
        code = compile(_GUARD_SOURCE.format(params=names), f"<dtprofile guard of {fn.__qualname__}>", "exec")
        exec(code, scope)  # noqa: S102 (our own fixed source)
        guard: Callable[..., Any] = scope["guard"]  # (a function: exec defined it)
        if plain:
            guard.__defaults__ = fn.__defaults__
        guard.__name__ = fn.__name__
        guard.__qualname__ = fn.__qualname__
        guard.__doc__ = fn.__doc__
        guard.__wrapped__ = fn  # type: ignore[attr-defined]  # (a function attribute, as functools.wraps sets)
        return guard

    return wrap
