"""Deprecated compatibility path (warns when imported): re-exports dtprofile.analysis
(perf_model, phases, projection, recommendations, sizing)."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.model", "dtprofile.analysis (perf_model, phases, projection, recommendations, sizing)")

# Beside __all__, the names callers imported from here: BANDWIDTH_UNIT_FORMS,
# GNS_MIN_SAMPLES, critical_batch_size and the private readers _get, _num, _is_number,
# _r_o, _world_size.
from ._values import finite as _num
from ._values import get as _get
from ._values import is_number as _is_number
from .analysis.perf_model import (
    BANDWIDTH_UNIT_FORMS,
    LINK_PER,
    alpha,
    bandwidth_needed,
    min_parameter_servers,
    paper_r_o,
    parameter_server_seconds,
    parse_bandwidth,
    projected_speedup,
    ring_allreduce_seconds,
    two_level_allreduce_seconds,
)
from .analysis.phases import (
    DEFAULT_SCALING,
    SCALING_MODES,
    StepPhases,
    phases_from_summary,
    project_phases,
    step_parts_ms,
)
from .analysis.projection import (
    ASSUMED_BANDWIDTH_NAME,
    BANDWIDTH_SOURCES,
    DEFAULT_LATENCY_S,
    DEFAULT_PROJECT_GPUS,
    ASSUMED_BANDWIDTH_Bps,
    DEFAULT_INTRA_NODE_BANDWIDTH_Bps,
    project_summary,
    resolve_bandwidth,
)
from .analysis.recommendations import DATA_WAIT_HIDDEN_FRACTION, DEFAULT_TARGET_EFFICIENCY, recommend
from .analysis.sizing import (
    GNS_MIN_SAMPLES,
    MEMORY_USABLE_FRACTION,
    NUM_WORKERS_MARGIN,
    GradientNoiseScale,
    critical_batch_size,
    dataloader_workers_needed,
    max_batch_size,
)
from .analysis.summary_readers import overhead_ratio as _r_o
from .analysis.summary_readers import world_size as _world_size

__all__ = [
    "ASSUMED_BANDWIDTH_Bps",
    "ASSUMED_BANDWIDTH_NAME",
    "BANDWIDTH_SOURCES",
    "DATA_WAIT_HIDDEN_FRACTION",
    "DEFAULT_INTRA_NODE_BANDWIDTH_Bps",
    "DEFAULT_LATENCY_S",
    "DEFAULT_PROJECT_GPUS",
    "DEFAULT_SCALING",
    "DEFAULT_TARGET_EFFICIENCY",
    "MEMORY_USABLE_FRACTION",
    "NUM_WORKERS_MARGIN",
    "SCALING_MODES",
    "GradientNoiseScale",
    "StepPhases",
    "alpha",
    "paper_r_o",
    "bandwidth_needed",
    "dataloader_workers_needed",
    "max_batch_size",
    "min_parameter_servers",
    "parameter_server_seconds",
    "parse_bandwidth",
    "phases_from_summary",
    "project_phases",
    "project_summary",
    "projected_speedup",
    "recommend",
    "resolve_bandwidth",
    "ring_allreduce_seconds",
    "step_parts_ms",
    "two_level_allreduce_seconds",
    "LINK_PER",
]
