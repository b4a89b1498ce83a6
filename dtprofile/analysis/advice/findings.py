"""A summary's findings: the registered rules run over it, and the findings written out."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..pipeline_plan import pipeline_projection, pipeline_view
from ..projection import project_summary
from ..recommendations import recommend, scaling_modes
from .readings import Readings
from .registry import Finding, Rule, rules, severity_rank

__all__ = ["advise", "analyze", "format_findings", "json_safe"]


def _found(rule: Rule, *args: Any) -> Finding | None:
    """The rule's finding, checked to carry the rule's id (the id the docs list)."""
    finding = rule.function(*args)
    if finding is not None and finding.id != rule.id:
        raise ValueError(f"advice rule {rule.id!r} returned a finding with id {finding.id!r}")
    return finding


def advise(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Findings for a run summary, most severe first (ties in rule order).

    Reads ``per_step_ms``, ``ratios``, ``ranks``, ``run``, ``options`` and the summary's
    ``projection`` and ``recommendations`` (computed here when absent). The gates run
    first: with no step measured at all, a single ``insufficient_data`` finding is the
    advice. Then every check; then the verdicts: when no finding is ``low`` or worse, a
    ``healthy`` finding says why with the numbers. Rules never raise on a well-formed
    summary with missing measurements.

    Args:
        summary: A run summary (``docs/summary.md``).

    Returns:
        The findings as dicts (``id``, ``severity``, ``title``, ``evidence``, ``action``,
        ``expected_gain``), non-finite numbers replaced by None.

    Example:
        >>> [f["id"] for f in advise({"per_step_ms": {"step": None}})]
        ['insufficient_data']
    """
    readings = Readings(summary)
    for gate in rules("gate"):
        finding = _found(gate, readings)
        if finding is not None:
            # The gate's evidence is the summary's own step counts, passed on as they are.
            return [finding.to_dict()]
    found = [f for check in rules("check") if (f := _found(check, readings)) is not None]
    verdicts = [f for verdict in rules("verdict") if (f := _found(verdict, readings, found)) is not None]
    ordered = sorted(verdicts + found, key=lambda f: severity_rank(f.severity))
    return [json_safe(f.to_dict()) for f in ordered]


def analyze(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``summary`` with ``projection``, ``recommendations`` and ``advice`` filled
    (and a pipeline's stages, bubble and projection in ``pipeline``).

    Args:
        summary: A run summary; its ``options`` set the projection.

    Returns:
        The copy, computed by :func:`~dtprofile.analysis.projection.project_summary`,
        :func:`~dtprofile.analysis.recommendations.recommend` and :func:`advise`.
    """
    out = copy.deepcopy(dict(summary))
    pipeline = pipeline_view(out)
    if pipeline is not None:  # (the stages, the bubble, and its what-ifs beside the schedule)
        out["pipeline"] = {**out["pipeline"], **pipeline, "projection": pipeline_projection(pipeline)}
    out["projection"] = project_summary(out)
    out["recommendations"] = recommend(out, out["projection"])
    out["scaling_modes"] = scaling_modes(out, out["projection"], out["recommendations"])
    out["advice"] = advise(out)
    return out


def json_safe(value: Any) -> Any:
    """Non-finite floats (degenerate measurements, a summary edited by hand) -> None,
    recursively: JSON has neither NaN nor infinities.

    Example:
        >>> json_safe({"a": [1.0, float("nan")], "b": (float("inf"),)})
        {'a': [1.0, None], 'b': [None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    """A value of a finding's evidence, short: floats to 4 significant figures."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def format_findings(findings: Sequence[Mapping[str, Any]]) -> str:
    """Plain-text lines for a terminal, most severe first.

    Args:
        findings: Findings as :func:`advise` returns them.

    Returns:
        The lines, joined; "No findings." for none.

    Example:
        >>> print(format_findings([{"id": "healthy", "severity": "info", "title": "Healthy",
        ...                         "evidence": {"step_ms": 95.0}, "action": "no change needed",
        ...                         "expected_gain": None}]))
        [INFO]   healthy: Healthy
                 action: no change needed
                 evidence: step_ms=95
    """
    if not findings:
        return "No findings."
    lines = []
    for f in sorted(findings, key=lambda f: severity_rank(f.get("severity"))):
        label = f"[{str(f.get('severity', '?')).upper()}]"
        lines.append(f"{label:<8} {f.get('id')}: {f.get('title')}")
        indent = " " * 9
        if f.get("action"):
            lines.append(f"{indent}action: {f['action']}")
        if f.get("expected_gain") is not None:
            lines.append(f"{indent}expected gain: {_fmt(f['expected_gain'])}")
        evidence = f.get("evidence") or {}
        if evidence:
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in evidence.items() if v is not None)
            if shown:
                lines.append(f"{indent}evidence: {shown}")
    return "\n".join(lines)
