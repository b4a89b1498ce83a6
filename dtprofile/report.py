"""The summary's former home: the names other code imports from here.

Everything is defined in :mod:`dtprofile.summary` (building, writing, reading a summary
and :class:`Report`); the texts are :mod:`dtprofile.render`'s.
"""

from __future__ import annotations

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
