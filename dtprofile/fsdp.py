"""Compatibility path: re-exports dtprofile.capture.fsdp."""

from .capture.fsdp import *  # noqa: F401,F403
from .capture import fsdp as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
