"""Compatibility path: re-exports dtprofile.sinks.plots."""

from .sinks.plots import *  # noqa: F401,F403
from .sinks.plots import __all__  # noqa: F401
