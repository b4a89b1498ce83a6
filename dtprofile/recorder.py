"""Compatibility path: re-exports dtprofile.capture.records."""

from .capture.records import *  # noqa: F401,F403
from .capture import records as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
