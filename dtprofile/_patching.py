"""One object's method replaced by an instance attribute, and put back.

Integrations time a framework's calls by patching the one object that makes them (a
Lightning strategy, loop or plugin), never its class: other instances are untouched,
and :meth:`InstancePatch.restore` puts back what was there. Patches stack: one restored
while another sits on top of it stays as a pass-through, and the one on top skips it
when it goes in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["InstancePatch", "MISSING"]

#: No instance attribute of that name was there (the class's method showed through).
MISSING = object()


class InstancePatch:
    """Replaces the method ``name`` of ``obj`` by ``replacement`` (an instance attribute);
    :meth:`restore` puts back what was there (a method of its class, or an instance
    attribute). The original is ``self._inner``; after :meth:`restore`, ``self.retired``
    is true and the replacement should pass straight through to it.

    Args:
        obj: the object whose method is replaced.
        name: the method's name.
        replacement: a bound method of the patch (so that stacked patches find each other).
    """

    def __init__(self, obj: Any, name: str, replacement: Callable[..., Any]) -> None:
        self.obj, self.name, self.replacement = obj, name, replacement
        self.retired = False
        self._saved = obj.__dict__.get(name, MISSING)
        self._inner = getattr(obj, name)
        setattr(obj, name, replacement)

    def restore(self) -> None:
        self.retired = True
        if self.obj.__dict__.get(self.name) != self.replacement:
            return  # another patch went on top: it skips this one when it goes
        saved = self._saved
        while getattr(getattr(saved, "__self__", None), "retired", False):  # patches gone before
            saved = saved.__self__._saved
        if saved is MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, saved)
