"""Deprecated compatibility path (warns when imported): re-exports dtprofile.capture.records."""

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.recorder", "dtprofile.capture.records")

from .capture import records as _moved
from .capture.records import *  # noqa: F401,F403

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
