"""Deprecated compatibility path (warns when imported): re-exports dtprofile.sinks.plots."""

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.plots", "dtprofile.sinks.plots")

from .sinks.plots import *  # noqa: F401,F403
from .sinks.plots import __all__  # noqa: F401
