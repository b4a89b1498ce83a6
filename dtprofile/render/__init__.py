"""Every text dtprofile shows a person: a summary (a plain dict) in, a string out.

- :mod:`.numbers`: numbers as the reports show them (:func:`fmt`, :func:`fmt_pct`, ...).
- :mod:`.views`: what a report shows, shared by both forms (the breakdown's rows, the
  findings most severe first, the projection table, the captions).
- :mod:`.terminal`: the terminal text: ``str(Report)``, ``dtprofile report``,
  ``project`` and ``compare``, the demo's report.
- :mod:`.markdown`: the Markdown text: TensorBoard's ``dtprofile/advice``,
  ``dtprofile report --markdown``, a notebook's display.

Pure functions: no I/O, no state, nothing imported beyond the advice's severity order.

>>> summary = {"world_size": 2, "per_step_ms": {"step": 95.0}, "ratios": {"R_O": 0.53}}
>>> format_report(summary).splitlines()[0]
'dtprofile report: 2 ranks'
>>> advice_markdown(summary).splitlines()[0]
'**dtprofile** · 2 ranks'
"""

from __future__ import annotations

from .markdown import advice_markdown, md_cell, md_table
from .numbers import fmt, fmt_compact, fmt_pct, g_label, tag_part
from .terminal import format_comparison, format_parameter_servers, format_projection, format_report, text_table
from .views import (
    OTHER_COMPUTE_MIN_SHARE,
    breakdown_ranges,
    breakdown_rows,
    finding_parts,
    format_evidence,
    measurement_notes,
    projection_caption,
    projection_rows,
    recommendation_items,
    run_caption,
    sorted_findings,
)

__all__ = [
    "OTHER_COMPUTE_MIN_SHARE",
    "advice_markdown",
    "breakdown_ranges",
    "breakdown_rows",
    "finding_parts",
    "fmt",
    "fmt_compact",
    "fmt_pct",
    "format_comparison",
    "format_evidence",
    "format_parameter_servers",
    "format_projection",
    "format_report",
    "g_label",
    "md_cell",
    "md_table",
    "measurement_notes",
    "projection_caption",
    "projection_rows",
    "recommendation_items",
    "run_caption",
    "sorted_findings",
    "tag_part",
    "text_table",
]
