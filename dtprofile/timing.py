"""Deprecated compatibility path (warns when imported): re-exports dtprofile.capture.clocks."""

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.timing", "dtprofile.capture.clocks")

from .capture import clocks as _moved
from .capture.clocks import *  # noqa: F401,F403

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
