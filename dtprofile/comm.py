"""Deprecated compatibility path (warns when imported): re-exports dtprofile.capture.ddp."""

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.comm", "dtprofile.capture.ddp")

from .capture import ddp as _moved
from .capture.ddp import *  # noqa: F401,F403

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
