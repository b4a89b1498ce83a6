"""Deprecated compatibility path (warns when imported): re-exports dtprofile.sinks.background."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.background", "dtprofile.sinks.background")

from .sinks.background import BackgroundSink

__all__ = ["BackgroundSink"]
