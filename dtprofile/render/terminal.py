"""The report, projection and comparison as terminal text (``str(Report)`` and the
``dtprofile`` command's output).

>>> print(format_projection({"gpus": [1, 8], "speedup": [1.0, 6.2], "scaling": "weak"}))
Projection (weak scaling):
  GPUs  speedup
  ----  -------
  1        1.00
  8        6.20
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._values import get
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
    measurement_notes,
    parameter_server_rows,
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

__all__ = ["format_comparison", "format_parameter_servers", "format_projection", "format_report", "text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """A plain-text table: the first column left-aligned, the others right-aligned.

    Args:
        header: The column names.
        rows: The rows, one cell per column.
        indent: Put before every line.

    Returns:
        The table's lines: the header, a line of dashes, the rows.

    Example:
        >>> print("\\n".join(text_table(["", "ms"], [("step", "30.0"), ("data wait", "19.4")])))
                       ms
          ---------  ----
          step       30.0
          data wait  19.4
    """
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    out = []
    for i, r in enumerate([header, *rows]):
        cells = [
            str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        out.append(indent + "  ".join(cells).rstrip())
        if i == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return out


def format_projection(proj: Mapping[str, Any], ranges: Any = None) -> str:
    """A projection as a terminal table under its caption.

    Args:
        proj: A summary's ``projection``, or ``dtprofile project``'s object.
        ranges: The summary's ``uncertainty.projection``: an efficiency range column.

    Returns:
        The text; ``Projection: none`` without GPU counts.

    Example:
        See the module's example.
    """
    header, rows = projection_rows(proj, ranges)
    if not header:
        return "Projection: none"
    cap = projection_caption(proj)
    lines = ["Projection" + (f" ({cap})" if cap else "") + ":"]
    lines += text_table(header, rows)
    return "\n".join(lines)


def format_parameter_servers(plan: Sequence[Mapping[str, Any]]) -> str:
    """``dtprofile project --model ps``'s table under its caption.

    Args:
        plan: :func:`~dtprofile.analysis.recommendations.parameter_server_plan`'s rows.

    Returns:
        The text; ``Parameter servers: none`` where no G has a compute time and bytes.

    Example:
        >>> print(format_parameter_servers([]))
        Parameter servers: none
    """
    header, rows = parameter_server_rows(plan)
    if not header:
        return "Parameter servers: none"
    lines = [
        "Parameter servers, were the job to push its gradients to servers "
        "(the paper's lemma N_ps >= 2*S*G/(B_ps*T_C), a network link each):"
    ]
    return "\n".join(lines + text_table(header, rows))


def format_report(summary: Mapping[str, Any]) -> str:
    """The terminal report: breakdown, ratios, advice (most severe first), projection.

    What ``str(Report)``, ``dtprofile report`` and the demo print.

    Args:
        summary: A summary dict.

    Returns:
        The text, without a final newline.

    Example:
        >>> print(format_report({"world_size": 1, "per_step_ms": {"step": 10.0},
        ...                      "ratios": {"R_O": 0.25}}))
        dtprofile report: 1 rank
        <BLANKLINE>
        Per optimizer step (average over steps, median over ranks):
                  ms  % of step
          ----  ----  ---------
          step  10.0     100.0%
          (data wait = gap from a step's end to the next forward)
        <BLANKLINE>
        R_O = T_O / T_C = 0.250
    """
    lines = []
    cap = run_caption(summary)
    lines.append("dtprofile report" + (f": {cap}" if cap else ""))
    if summary.get("source") == "tensorboard_events":
        lines.append("(rebuilt from TensorBoard event files: the latest logged interval; no summary file was written)")
    lines.append("")
    rows = breakdown_rows(summary)
    if rows:
        lines.append("Per optimizer step (average over steps, median over ranks):")
        ranges = breakdown_ranges(summary)
        if ranges is None:
            lines += text_table(
                ["", "ms", "% of step"], [(lbl, fmt(v), fmt_pct(s) if s is not None else "") for lbl, v, s in rows]
            )
        else:
            lines += text_table(
                ["", "ms", "range", "% of step"],
                [
                    (lbl, fmt(v), span, fmt_pct(s) if s is not None else "")
                    for (lbl, v, s), span in zip(rows, ranges, strict=False)
                ],
            )
        notes = measurement_notes(summary)
        note = uncertainty_note(summary)
        lines += [f"  ({n})" for n in notes + ([note] if note else [])]
    else:
        lines.append("No steady-state steps measured.")
    ratios = found if isinstance(found := summary.get("ratios"), Mapping) else {}
    bits = [] if ratios.get("R_O") is not None else ["R_O = T_O / T_C = -"]
    for key, label in (
        ("R_O", "R_O = T_O / T_C"),
        ("data_fraction", "data"),
        ("comm_fraction", "exposed comm"),
        ("comm_overlap", "comm hidden"),
    ):
        v = ratios.get(key)
        if v is None:
            continue
        span = range_label(get(get(get(summary, "uncertainty"), "ratios"), key), fmt if key == "R_O" else fmt_pct)
        bits.append(
            (f"{label} = {fmt(v)}" if key == "R_O" else f"{label} {fmt_pct(v)}") + (f" ({span})" if span else "")
        )
    if bits:
        lines.append("")
        lines.append("   ".join(bits))
    gb = summary.get("grad_bytes")
    if isinstance(gb, (int, float)) and gb:
        bw = [
            f"{n} {fmt(summary[k])} GB/s"
            for k, n in (("algbw_GBps", "algbw"), ("busbw_GBps", "busbw"))
            if summary.get(k) is not None
        ]
        what = "FSDP collectives (all-reduce equivalent)" if summary.get("comm_source") == "fsdp" else "gradients"
        lines.append(f"{what} {fmt(gb / 1e6)} MB per step" + (", " + ", ".join(bw) if bw else ""))
    mesh, per_dim = mesh_text(summary), comm_by_dim_lines(summary)
    if mesh or per_dim:  # (a DeviceMesh's collectives per dimension, per step)
        lines += ["", f"Communication per mesh dimension ({mesh or 'mesh'}):"] + [f"  {x}" for x in per_dim]
    pipe = pipeline_lines(summary)
    if pipe:  # (a pipeline stage: its schedule, bubble and stages)
        lines += ["", "Pipeline: " + pipe[0]] + [f"  {x}" for x in pipe[1:]]
        timeline = pipeline_timeline_lines(summary)
        if timeline:  # (one step as the stages ran it)
            lines += ["  " + timeline[0]] + timeline[1:]
    spread = rank_spread_lines(summary)
    if spread and len(get(summary, "ranks") or []) > RANKS_LISTED:  # (many ranks: their distribution)
        lines += ["", "Ranks: " + spread[0]] + [f"  {x}" for x in spread[1:]]

    findings = sorted_findings(summary.get("advice"))
    if findings:
        lines += ["", "Advice (most severe first):"]
        for i, a in enumerate(findings, 1):
            sev, title, ident, details = finding_parts(a)
            lines.append(f"  {i}. {sev}: {title}" + (f" [{ident}]" if ident else ""))
            lines += [f"     {label}: {text}" for label, text in details]
    proj = summary.get("projection")
    if isinstance(proj, Mapping) and proj.get("gpus"):
        lines += ["", format_projection(proj, get(get(summary, "uncertainty"), "projection"))]
    gpus = gpus_range_text(summary)
    if gpus:
        lines += ["", f"GPU count: {gpus}"]
    question = scaling_question(summary)
    if question:
        lines += ["", question]
    servers = parameter_server_text(summary)
    if servers:
        lines += ["", servers]
    items = recommendation_items(summary.get("recommendations"))
    if items:
        lines += ["", "Recommendations: " + ", ".join(items)]
    return "\n".join(lines)


def _change_text(change: Mapping[str, Any], key: str, pct: bool) -> str:
    """One figure's change, signed: ``+12.0 (+14.3%)`` for ms, ``+3.1%`` for a share."""
    delta = change.get(key)
    if delta is None:
        return ""
    frac = change.get("delta_fraction")
    text = f"{'+' if delta >= 0 else ''}{fmt_pct(delta)}" if pct else f"{'+' if delta >= 0 else ''}{fmt(delta)}"
    if not pct and frac is not None:
        text += f" ({'+' if frac >= 0 else ''}{fmt_pct(frac)})"
    return text


def format_comparison(cmp: Mapping[str, Any], baseline: str, candidate: str) -> str:
    """The terminal text of ``dtprofile compare``.

    Args:
        cmp: :func:`dtprofile.compare_summaries`'s result.
        baseline: The baseline's name as the user gave it (a path).
        candidate: The candidate's, the same way.

    Returns:
        The text, without a final newline.

    Example:
        >>> print(format_comparison({"per_step_ms": {"step": {"baseline": 95.0, "candidate": 80.0,
        ...                          "delta_ms": -15.0, "delta_fraction": -0.158}}},
        ...                         "a", "b"))
        dtprofile compare: a -> b
        <BLANKLINE>
                            baseline  candidate
          ----------------  --------  ---------
          ranks                    -          -
          batch per device         -          -
        <BLANKLINE>
        Per optimizer step (ms, average over steps, median over ranks):
                baseline  candidate          change
          ----  --------  ---------  --------------
          step      95.0       80.0  -15.0 (-15.8%)
        <BLANKLINE>
        Advice not compared: a run rebuilt from TensorBoard events has no advice record
    """
    lines = [f"dtprofile compare: {baseline} -> {candidate}", ""]
    if cmp.get("different_jobs"):
        lines[1:1] = [
            f"Warning: these look like different jobs, not one job before and after a change: "
            f"{'; '.join(cmp['different_jobs'])}"
        ]
    ws, bs = cmp.get("world_size") or {}, cmp.get("batch_size") or {}
    lines += text_table(
        ["", "baseline", "candidate"],
        [
            ("ranks", fmt(ws.get("baseline")), fmt(ws.get("candidate"))),
            ("batch per device", fmt(bs.get("baseline")), fmt(bs.get("candidate"))),
        ],
    )
    note = (cmp.get("dtprofile_version") or {}).get("note")
    if note:
        lines += ["", f"Note: {note}"]
    lines += ["", "Per optimizer step (ms, average over steps, median over ranks):"]
    rows = [
        (k, fmt(c.get("baseline")), fmt(c.get("candidate")), _change_text(c, "delta_ms", False))
        for k, c in (cmp.get("per_step_ms") or {}).items()
        if c.get("baseline") is not None or c.get("candidate") is not None
    ]
    lines += text_table(["", "baseline", "candidate", "change"], rows)
    rows = [
        (
            k,
            fmt(c.get("baseline")) if k == "R_O" else fmt_pct(c.get("baseline")),
            fmt(c.get("candidate")) if k == "R_O" else fmt_pct(c.get("candidate")),
            _change_text(c, "delta", k != "R_O"),
        )
        for k, c in (cmp.get("ratios") or {}).items()
        if c.get("baseline") is not None or c.get("candidate") is not None
    ]
    if rows:
        lines += ["", "Ratios:"] + text_table(["", "baseline", "candidate", "change"], rows)
    thr = cmp.get("throughput") or {}
    if thr.get("speedup") is not None:
        if thr.get("basis") == "step_time":  # not samples/s: a run's batch size is unknown
            rate = " (step-time ratio: batch size unknown, the same samples per step assumed)"
        elif None in (thr.get("baseline_samples_per_s"), thr.get("candidate_samples_per_s")):
            rate = ""
        else:
            rate = f" ({fmt(thr['baseline_samples_per_s'])} -> {fmt(thr['candidate_samples_per_s'])} samples/s)"
        lines += ["", f"Throughput: {fmt(thr['speedup'])}x{rate}"]
    check = cmp.get("projection_check")
    if isinstance(check, Mapping):
        head = f"Projection check ({check.get('baseline_gpus')} -> {check.get('candidate_gpus')} ranks)"
        if check.get("skipped"):
            lines += ["", f"{head}: not made: {check['skipped']}"]
        else:
            err = check.get("error")
            lines += [
                "",
                f"{head}, {check.get('scaling')} scaling, bandwidth {check.get('bandwidth_source')}:",
                f"  predicted step {fmt(check.get('predicted_step_ms'))} ms, speedup "
                f"{fmt(check.get('predicted_speedup'))}x; measured step "
                f"{fmt(check.get('measured_step_ms'))} ms, speedup "
                f"{fmt(check.get('measured_speedup'))}x"
                + (f" (prediction {'+' if err >= 0 else ''}{fmt_pct(err)})" if err is not None else ""),
            ]
    adv = cmp.get("advice")
    advice = [
        f"{label}: {', '.join(adv[key])}"
        for key, label in (("resolved", "Advice resolved"), ("new", "New advice"), ("remaining", "Advice remaining"))
        if adv and adv.get(key)
    ]
    if adv is None:
        advice = ["Advice not compared: a run rebuilt from TensorBoard events has no advice record"]
    if advice:
        lines += [""] + advice
    return "\n".join(lines)
