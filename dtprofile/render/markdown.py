"""The report as Markdown: the text TensorBoard's Text tab shows (``dtprofile/advice``),
``dtprofile report --markdown`` prints and a notebook displays.

>>> print(advice_markdown({"per_step_ms": {"step": 10.0}}), end="")
**dtprofile**
<BLANKLINE>
#### Measured breakdown (ms per optimizer step: average over steps, median over ranks)
| part | ms | share of step |
|---|---:|---:|
| step | 10.0 | 100.0% |
<BLANKLINE>
#### Findings (most severe first)
_No findings yet._
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._values import get, parse_finite
from .layout import (
    RANKS_LISTED,
    comm_by_dim_lines,
    mesh_text,
    pipeline_lines,
    pipeline_timeline_lines,
    rank_spread_lines,
)
from .numbers import fmt, fmt_pct
from .views import (
    breakdown_ranges,
    breakdown_rows,
    finding_parts,
    gpus_range_text,
    parameter_server_text,
    projection_caption,
    projection_rows,
    range_label,
    recommendation_items,
    run_caption,
    scaling_question,
    sorted_findings,
    uncertainty_note,
)

__all__ = ["advice_markdown", "md_cell", "md_table"]


def md_cell(x: Any) -> str:
    """Text as Markdown shows it literally, on one line.

    ``|`` (tables) and ``*`` (emphasis: the lemma's ``2*S*G/(B_ps*T_C)``) are escaped.
    Underscores stay: inside words (``grad_bytes``) Markdown leaves them alone.

    Args:
        x: Anything; its ``str()`` is used.

    Returns:
        The escaped text, newlines as spaces.

    Example:
        >>> md_cell("2*S*G | x")
        '2\\\\*S\\\\*G \\\\| x'
    """
    text = str(x).replace("\\", "\\\\")
    for char in "|*":
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    """A Markdown table.

    Args:
        header: The column names.
        rows: The rows, one cell per column (escaped with :func:`md_cell`).
        align: The separator row's cells; by default the first column left-aligned and
            the others right-aligned.

    Returns:
        The table's lines.

    Example:
        >>> md_table(["part", "ms"], [["step", "10.0"]])
        ['| part | ms |', '|---|---:|', '| step | 10.0 |']
    """
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]
    return out


def advice_markdown(summary: Mapping[str, Any], step: int | None = None) -> str:
    """The report as Markdown: breakdown, ratios, findings, projection, recommendations.

    Args:
        summary: A summary dict.
        step: The global step of a log interval, shown in the caption; None for none.

    Returns:
        The Markdown text, ending in a newline.

    Example:
        See the module's example.
    """
    lines: list[str] = []
    cap = run_caption(summary, step)
    lines.append(f"**dtprofile** · {cap}" if cap else "**dtprofile**")
    lines.append("")

    rows = breakdown_rows(summary)
    lines.append("#### Measured breakdown (ms per optimizer step: average over steps, median over ranks)")
    if rows:
        ranges: Sequence[str | None] = breakdown_ranges(summary) or [None] * len(rows)
        header = ["part", "ms"] + (["range"] if ranges[0] is not None else []) + ["share of step"]
        lines += md_table(
            header,
            [
                (
                    lbl.replace("  ", "↳ ", 1) if lbl.startswith("  ") else lbl,
                    fmt(v),
                    *([span] if span is not None else []),
                    fmt_pct(s) if s is not None else "",
                )
                for (lbl, v, s), span in zip(rows, ranges, strict=False)
            ],
        )
        note = uncertainty_note(summary)
        if note:
            lines.append(f"_({note})_")
    else:
        lines.append("_No steady-state steps measured yet._")
    ratios = get(summary, "ratios") or {}
    r_o = parse_finite(ratios.get("R_O"))
    extra = []
    if r_o is not None:
        ceiling = f"; the paper's ceiling on speedup (1 + R_O) / R_O = {fmt((1 + r_o) / r_o)}×" if r_o > 0 else ""
        span = range_label(get(get(get(summary, "uncertainty"), "ratios"), "R_O"))
        extra.append(f"R_O = T_O / T_C = **{fmt(r_o)}**" + (f" ({span})" if span else "") + f"{ceiling}.")
    gb = parse_finite(summary.get("grad_bytes"))
    if gb is not None:
        bw = []
        for k, lbl in (("algbw_GBps", "algbw"), ("busbw_GBps", "busbw")):
            if parse_finite(summary.get(k)) is not None:
                bw.append(f"{lbl} {fmt(summary[k])} GB/s")
        what = (
            "FSDP collectives (all-reduce equivalent)"
            if summary.get("comm_source") == "fsdp"
            else "Gradients all-reduced"
        )
        extra.append(f"{what}: {fmt(gb / 1e6)} MB per step" + (f" ({', '.join(bw)})" if bw else "") + ".")
    probe = summary.get("probe")
    if isinstance(probe, Mapping) and parse_finite(probe.get("overlap_slowdown_ms")) is not None:
        extra.append(
            f"Probe: overlapped communication slows compute by {fmt(probe['overlap_slowdown_ms'])} ms per step."
        )
    if extra:
        lines.append("")
        lines.append(" ".join(extra))
    mesh, per_dim = mesh_text(summary), comm_by_dim_lines(summary)
    if mesh or per_dim:  # (a DeviceMesh's collectives per dimension, per step)
        lines += ["", f"Communication per mesh dimension ({mesh or 'mesh'}):", ""] + [
            f"- {md_cell(x)}" for x in per_dim
        ]
    pipe = pipeline_lines(summary)
    if pipe:  # (a pipeline stage: its schedule, bubble and stages)
        lines += ["", f"Pipeline: {md_cell(pipe[0])}", ""] + [f"- {md_cell(x)}" for x in pipe[1:]]
        timeline = pipeline_timeline_lines(summary)
        if timeline:  # (one step as the stages ran it: a fixed-width block)
            lines += ["", md_cell(timeline[0]), "", "```"] + timeline[1:] + ["```"]
    spread = rank_spread_lines(summary)
    if spread and len(get(summary, "ranks") or []) > RANKS_LISTED:  # (many ranks: their distribution)
        lines += ["", f"Ranks: {md_cell(spread[0])}", ""] + [f"- {md_cell(x)}" for x in spread[1:]]

    lines.append("")
    lines.append("#### Findings (most severe first)")
    findings = sorted_findings(summary.get("advice"))
    if not findings:
        lines.append("_No findings yet._")
    for i, a in enumerate(findings, 1):
        sev, title, ident, details = finding_parts(a)
        lines.append(f"{i}. **{sev} · {md_cell(title)}**" + (f" (`{ident}`)" if ident else ""))
        lines += [f"    - {label}: {md_cell(text)}" for label, text in details]

    proj = summary.get("projection")
    header, prow = projection_rows(proj, get(get(summary, "uncertainty"), "projection"))
    if header:
        lines.append("")
        pc = projection_caption(proj)
        lines.append("#### Projection" + (f": {pc}" if pc else ""))
        lines += md_table(header, prow)
    gpus = gpus_range_text(summary)
    if gpus:
        lines.append("")
        lines.append(f"GPU count: {gpus}.")
    question = scaling_question(summary)
    if question:
        lines.append("")
        lines.append(question + ".")
    servers = parameter_server_text(summary)
    if servers:
        lines.append("")
        lines.append(servers + ".")
    items = recommendation_items(summary.get("recommendations"))
    if items:
        lines.append("")
        lines.append("Recommendations: " + ", ".join(items) + ".")
    return "\n".join(lines) + "\n"
