"""Compatibility path: re-exports dtprofile.capture.ddp."""

from .capture.ddp import *  # noqa: F401,F403
from .capture import ddp as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
