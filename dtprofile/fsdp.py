"""Deprecated compatibility path (warns when imported): re-exports dtprofile.capture.fsdp."""

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.fsdp", "dtprofile.capture.fsdp")

from .capture import fsdp as _moved
from .capture.fsdp import *  # noqa: F401,F403

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
