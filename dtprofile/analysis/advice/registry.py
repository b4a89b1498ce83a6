"""The rule registry: every finding of the advice comes from a rule registered here.

A rule is a function of the summary's :class:`~dtprofile.analysis.advice.readings.Readings`
that returns one :class:`Finding` (with the rule's id) or None, registered with the
decorator :func:`rule`. Three kinds run at three moments of
:func:`~dtprofile.analysis.advice.findings.advise`:

- ``gate``: first; the first gate that finds something is the whole advice (nothing
  else can be judged, e.g. ``insufficient_data`` when no step was measured);
- ``check``: the rules proper, each on its own;
- ``verdict``: last, given the checks' findings, and placed before them (``healthy``
  says why nothing was found).

Findings are sorted most severe first (:data:`SEVERITY_ORDER`); within a severity, by
kind (verdict, then checks) and by each rule's ``order``.

Example:
    >>> [r.id for r in rules("gate")], [r.id for r in rules("verdict")]
    (['insufficient_data'], ['healthy'])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .thresholds import CRITICAL_FRACTION, WARNING_FRACTION

__all__ = ["RULE_KINDS", "SEVERITY_ORDER", "Finding", "Rule", "rule", "rules", "severity_band", "severity_rank"]

#: Most severe first; findings are sorted by it.
SEVERITY_ORDER: tuple[str, ...] = ("high", "medium", "low", "info")
#: When a kind of rule runs, in that order (see the module's docstring).
RULE_KINDS: tuple[str, ...] = ("gate", "check", "verdict")

RuleKind = Literal["gate", "check", "verdict"]
RuleFunction = TypeVar("RuleFunction", bound=Callable[..., Any])


@dataclass
class Finding:
    """One finding: what was found, how bad, the numbers behind it and what to change.

    Attributes:
        id: The rule's stable id (``docs/advice.md`` lists them).
        severity: One of :data:`SEVERITY_ORDER`.
        title: One line saying what was found, with its numbers.
        evidence: The measured numbers that triggered it, by name.
        action: Which argument to change, to what.
        expected_gain: The performance model's estimate of the change's effect, or None.
    """

    id: str
    severity: str
    title: str
    evidence: dict[str, Any]
    action: str
    expected_gain: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The finding as the summary's ``advice`` holds it (keys in this order)."""
        return {
            "id": self.id,
            "severity": self.severity,
            "title": self.title,
            "evidence": self.evidence,
            "action": self.action,
            "expected_gain": self.expected_gain,
        }


@dataclass(frozen=True)
class Rule:
    """A registered rule.

    Attributes:
        id: The id of the findings it returns.
        kind: One of :data:`RULE_KINDS`.
        order: Its place among the rules of its kind (and so among findings of the same
            severity), smallest first.
        function: ``function(readings)`` (a verdict: ``function(readings, findings)``)
            -> :class:`Finding` or None.
    """

    id: str
    kind: str
    order: int
    function: Callable[..., Finding | None] = field(compare=False)


_REGISTRY: dict[str, Rule] = {}


def rule(finding_id: str, *, order: int, kind: RuleKind = "check") -> Callable[[RuleFunction], RuleFunction]:
    """Register the decorated function as the rule that emits findings with ``finding_id``.

    Args:
        finding_id: The finding id (lowercase words joined by ``_``), unique among the rules.
        order: Its place among the rules of its kind, unique within the kind; the
            registered rules use multiples of 100, so a new one fits between two.
        kind: ``"check"`` (the default), ``"gate"`` or ``"verdict"``.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: an unknown kind, or an id or (kind, order) already registered.
    """
    if kind not in RULE_KINDS:
        raise ValueError(f"kind must be one of {RULE_KINDS}, got {kind!r}")

    def register(function: RuleFunction) -> RuleFunction:
        if finding_id in _REGISTRY:
            raise ValueError(f"advice rule {finding_id!r} is registered twice")
        taken = [r.id for r in _REGISTRY.values() if r.kind == kind and r.order == order]
        if taken:
            raise ValueError(f"advice rule {finding_id!r}: order {order} of kind {kind!r} is {taken[0]!r}'s")
        _REGISTRY[finding_id] = Rule(id=finding_id, kind=kind, order=order, function=function)
        return function

    return register


def rules(kind: str | None = None) -> list[Rule]:
    """The registered rules in the order they run: by kind, then by ``order``.

    Args:
        kind: Only the rules of this kind; None: all of them.

    Returns:
        The rules.
    """
    ordered = sorted(_REGISTRY.values(), key=lambda r: (RULE_KINDS.index(r.kind), r.order))
    return [r for r in ordered if kind is None or r.kind == kind]


def severity_rank(severity: Any) -> int:
    """Position of ``severity`` in :data:`SEVERITY_ORDER`; an unknown one sorts last.

    Example:
        >>> severity_rank("high"), severity_rank("info"), severity_rank("?")
        (0, 3, 4)
    """
    return SEVERITY_ORDER.index(severity) if severity in SEVERITY_ORDER else len(SEVERITY_ORDER)


def severity_band(fraction: float, low: float) -> str:
    """Severity of a share of the step: high >= 20%, medium >= 10%, low >= ``low``.

    Args:
        fraction: The share of the step.
        low: The share from which it is ``low`` rather than ``info``.

    Returns:
        One of :data:`SEVERITY_ORDER`.

    Example:
        >>> severity_band(0.25, 0.05), severity_band(0.12, 0.05), severity_band(0.01, 0.05)
        ('high', 'medium', 'info')
    """
    if fraction >= CRITICAL_FRACTION:
        return "high"
    if fraction >= WARNING_FRACTION:
        return "medium"
    return "low" if fraction >= low else "info"
