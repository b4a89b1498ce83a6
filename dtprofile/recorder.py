"""Moved to :mod:`dtprofile.capture.records`; this path re-exports it for one release."""

from .capture.records import *  # noqa: F401,F403
from .capture import records as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
