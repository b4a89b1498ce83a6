"""Compatibility path: re-exports dtprofile.sinks.background."""

from __future__ import annotations

from .sinks.background import BackgroundSink

__all__ = ["BackgroundSink"]
