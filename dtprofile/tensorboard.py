"""Deprecated compatibility path (warns when imported): re-exports dtprofile.sinks.tensorboard
and .tags (and the texts of dtprofile.render)."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.tensorboard", "dtprofile.sinks.tensorboard, dtprofile.sinks.tags and dtprofile.render")

from .render import (  # noqa: F401
    advice_markdown,
    breakdown_rows,
    finding_parts,
    fmt,
    fmt_compact,
    fmt_pct,
    format_evidence,
    measurement_notes,
    projection_caption,
    projection_rows,
    recommendation_items,
    run_caption,
    sorted_findings,
)
from .sinks.tags import BREAKDOWN_IMAGE_TAG, PROJECTION_KEYS, RANK_KEYS, SPEEDUP_IMAGE_TAG  # noqa: F401
from .sinks.tensorboard import (  # noqa: F401
    ADVICE_TAG,
    RATIO_KEYS,
    TAG_PREFIX,
    TIME_KEYS,
    TensorBoardSink,
    custom_scalars_layout,
    scalars_from_summary,
)

__all__ = [
    "TensorBoardSink",
    "advice_markdown",
    "scalars_from_summary",
    "custom_scalars_layout",
    "sorted_findings",
    "TIME_KEYS",
    "RATIO_KEYS",
    "TAG_PREFIX",
    "ADVICE_TAG",
]
