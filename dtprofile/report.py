"""Deprecated compatibility path (warns when imported): re-exports dtprofile.summary."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.report", "dtprofile.summary (Report, build_summary)")

from .summary import (  # noqa: F401
    OVERHEAD_PARTS,
    PEER_WAIT_MIN_BUSY_FRACTION,
    PEER_WAIT_MIN_MS,
    PEER_WAIT_MIN_STEP_FRACTION,
    SCHEMA,
    SUMMARY_RESERVE_BYTES,
    Report,
    SummaryError,
    build_summary,
    load_summary,
    peer_waits,
    rank_row,
    reserve_summary_space,
    write_summary,
    write_summary_with_reserve,
)

__all__ = ["Report", "build_summary", "rank_row", "write_summary", "load_summary", "SCHEMA"]
