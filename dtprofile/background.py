"""The background writer's former home: the name other code imports from here.

It is :mod:`dtprofile.sinks.background`'s.
"""

from __future__ import annotations

from .sinks.background import BackgroundSink

__all__ = ["BackgroundSink"]
