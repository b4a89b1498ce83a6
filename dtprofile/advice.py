"""Deprecated compatibility path (warns when imported): re-exports dtprofile.analysis.advice."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.advice", "dtprofile.analysis.advice")

# Beside __all__, the names callers read from here: the thresholds outside __all__ and
# the private helpers _get, _num, _median and _round_up.
from ._values import finite as _num
from ._values import get as _get
from ._values import median as _median
from .analysis.advice import SEVERITY_ORDER, advise, analyze, format_findings, fsdp_collectives, json_safe
from .analysis.advice.thresholds import (
    BATCH_GROWTH_FACTORS,
    BATCH_HEADROOM_MIN_RATIO,
    BUFFER_BROADCAST_SHARE,
    COMM_BOUND_FRACTION,
    CPU_THREADS_UNDERUSED_FRACTION,
    CRITICAL_FRACTION,
    DATA_BOUND_FRACTION,
    EVAL_FORWARDS_STEP_FRACTION,
    FEW_STEPS,
    GAP_DATA_WAIT_FLOOR_MS,
    HOST_WORK_FRACTION,
    IDENTICAL_DATA_MAX_B,
    LAUNCH_BOUND_UTIL_PERCENT,
    OPTIMIZER_SERIAL_FRACTION,
    OPTIMIZER_SERIAL_HIGH_FRACTION,
    RARE_LONG_STEPS_FRACTION,
    SKIPPED_UPDATE_FRACTION,
    SKIPPED_UPDATE_MIN_STEPS,
    SKIPPED_UPDATE_PERSISTENT_FRACTION,
    STRAGGLER_MIN_EXCESS_FRACTION,
    STRAGGLER_MIN_EXCESS_MS,
    STRAGGLER_MIN_EXCESS_STEP_FRACTION,
    STRAGGLER_PHASE_SHARE,
    TRANSFER_BOUND_SHARE,
    WARNING_FRACTION,
    STANDARD_LINK_Gbps,
)
from .analysis.advice.wording import round_up as _round_up

__all__ = [
    "BATCH_GROWTH_FACTORS",
    "BATCH_HEADROOM_MIN_RATIO",
    "BUFFER_BROADCAST_SHARE",
    "COMM_BOUND_FRACTION",
    "CRITICAL_FRACTION",
    "CPU_THREADS_UNDERUSED_FRACTION",
    "DATA_BOUND_FRACTION",
    "EVAL_FORWARDS_STEP_FRACTION",
    "IDENTICAL_DATA_MAX_B",
    "LAUNCH_BOUND_UTIL_PERCENT",
    "OPTIMIZER_SERIAL_FRACTION",
    "OPTIMIZER_SERIAL_HIGH_FRACTION",
    "RARE_LONG_STEPS_FRACTION",
    "SEVERITY_ORDER",
    "SKIPPED_UPDATE_FRACTION",
    "SKIPPED_UPDATE_MIN_STEPS",
    "STANDARD_LINK_Gbps",
    "STRAGGLER_MIN_EXCESS_FRACTION",
    "STRAGGLER_MIN_EXCESS_MS",
    "STRAGGLER_MIN_EXCESS_STEP_FRACTION",
    "WARNING_FRACTION",
    "advise",
    "analyze",
    "json_safe",
    "format_findings",
    "fsdp_collectives",
]
