"""What a report shows, shared by its terminal and Markdown forms.

Each function takes a summary (or part of one) as a plain dict and returns rows, lines or
captions; :mod:`.terminal` and :mod:`.markdown` lay them out. A figure that is null (not
measured) is left out, never shown as zero.

>>> rows = breakdown_rows({"per_step_ms": {"step": 10.0, "compute": 6.0, "overhead": 4.0}})
>>> [(label, ms, share) for label, ms, share in rows]
[('step', 10.0, 1.0), ('compute (T_C)', 6.0, 0.6), ('overhead (T_O)', 4.0, 0.4)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from .._values import get, parse_finite
from ..analysis.advice import SEVERITY_ORDER, fsdp_collectives
from .layout import mesh_caption
from .numbers import fmt, fmt_compact, fmt_pct, g_label

__all__ = [
    "OTHER_COMPUTE_MIN_SHARE",
    "breakdown_ranges",
    "breakdown_rows",
    "gpus_range_text",
    "finding_parts",
    "format_evidence",
    "measurement_notes",
    "projection_caption",
    "projection_rows",
    "range_label",
    "parameter_server_rows",
    "parameter_server_text",
    "recommendation_items",
    "run_caption",
    "scaling_question",
    "sorted_findings",
    "uncertainty_note",
]

#: Severities outside advice's own :data:`~dtprofile.analysis.advice.SEVERITY_ORDER` (a summary
#: edited by hand, or written by another tool), placed on its scale.
_SEVERITY_SYNONYMS: dict[str, str] = {"warning": "medium", "warn": "medium", "moderate": "medium"}
_ABOVE_EVERY_SEVERITY: tuple[str, ...] = ("critical", "error")
_BELOW_EVERY_SEVERITY: tuple[str, ...] = ("ok", "none")


def _severity_rank(severity: str) -> int:
    """A lower-case severity's place: 0 for advice's most severe, -1 above it, and an
    unknown severity with ``low`` (neither hidden at the bottom nor raised to the top)."""
    if severity in _ABOVE_EVERY_SEVERITY:
        return -1
    if severity in _BELOW_EVERY_SEVERITY:
        return len(SEVERITY_ORDER)
    severity = _SEVERITY_SYNONYMS.get(severity, severity)
    return SEVERITY_ORDER.index(severity if severity in SEVERITY_ORDER else "low")


def sorted_findings(advice: Any) -> list[Mapping[str, Any]]:
    """The advice records, most severe first (stable within a severity).

    Args:
        advice: A summary's ``advice`` list; entries that are not mappings are left out.

    Returns:
        The findings in :data:`dtprofile.analysis.advice.SEVERITY_ORDER`, case-insensitively;
        ``critical``/``error`` before ``high``, ``warning`` with ``medium``, ``ok`` after
        ``info``, and a severity it does not know with ``low``.

    Example:
        >>> [f["id"] for f in sorted_findings([{"id": "a", "severity": "info"},
        ...                                    {"id": "b", "severity": "HIGH"}, "junk"])]
        ['b', 'a']
    """
    if not isinstance(advice, Sequence) or isinstance(advice, (str, bytes)):
        return []
    items = [a for a in advice if isinstance(a, Mapping)]

    def key(item: tuple[int, Mapping[str, Any]]) -> tuple[float, int]:
        i, a = item
        sev = str(a.get("severity") or "").lower()
        return (_severity_rank(sev), i)

    return [a for _, a in sorted(enumerate(items), key=key)]


def finding_parts(finding: Mapping[str, Any]) -> tuple[str, str, str, list[tuple[str, str]]]:
    """The parts of one finding that every format shows.

    Args:
        finding: One advice record (docs/advice.md).

    Returns:
        ``(SEVERITY, title, id, details)``: the severity upper-cased (``INFO`` when
        missing), the title (the id when it has none), the id (``""`` when none) and
        ``(label, text)`` detail lines: evidence, action and expected gain, each only
        when present.

    Example:
        >>> finding_parts({"id": "data_bound", "severity": "high", "title": "Data-bound",
        ...                "evidence": {"data_wait_ms": 19.43}, "action": "num_workers=4"})
        ('HIGH', 'Data-bound', 'data_bound', [('evidence', 'data_wait_ms = 19.43'), ('action', 'num_workers=4')])
    """
    sev = str(finding.get("severity") or "info").upper()
    ident = str(finding.get("id") or "")
    title = str(finding.get("title") or ident or "finding")
    details = [
        ("evidence", format_evidence(finding.get("evidence"))),
        ("action", str(finding.get("action") or "")),
        ("expected gain", str(finding.get("expected_gain") or "")),
    ]
    return sev, title, ident, [(label, text) for label, text in details if text]


def format_evidence(evidence: Any) -> str:
    """A finding's evidence on one line.

    Args:
        evidence: A mapping (``k = v, k = v``, nested mappings in braces, lists in
            brackets), a list of records (joined with ``;``), anything else, or None.

    Returns:
        The text, numbers as :func:`~dtprofile.render.numbers.fmt_compact` shows them;
        ``""`` for None.

    Example:
        >>> format_evidence({"step_ms": 30.034, "gpus": [1, 2.0], "link": {"Gbps": 10.0}})
        'step_ms = 30.03, gpus = [1, 2], link = {Gbps = 10}'
    """
    if evidence is None:
        return ""
    if isinstance(evidence, Mapping):
        parts = []
        for k, v in evidence.items():
            if isinstance(v, Mapping):
                v = "{" + format_evidence(v) + "}"
            elif isinstance(v, (list, tuple)):
                v = "[" + ", ".join(fmt_compact(x) for x in v) + "]"
            else:
                v = fmt_compact(v)
            parts.append(f"{k} = {v}")
        return ", ".join(parts)
    if isinstance(evidence, (list, tuple)):
        return "; ".join(format_evidence(e) if isinstance(e, Mapping) else str(e) for e in evidence)
    return str(evidence)


def measurement_notes(summary: Mapping[str, Any]) -> list[str]:
    """What the breakdown's figures are, in words: how data wait was measured, and what
    communication's figures mean for the way it was timed.

    Args:
        summary: A summary dict.

    Returns:
        One note per line (none for a summary rebuilt from event files: the scalars do
        not say how they were measured).

    Example:
        >>> measurement_notes({"data_wait_source": "loader", "world_size": 1})
        ['data wait = time blocked in next(loader)']
    """
    if summary.get("source") == "tensorboard_events":  # the scalars do not say how they were measured
        return []
    loader = summary.get("data_wait_source") == "loader"
    if summary.get("timing") == "cuda_event":
        notes = [
            "data wait = GPU idle between a step's end and the next forward"
            + (", up to the time blocked in next(loader)" if loader else "")
        ]
    else:
        notes = [
            "data wait = time blocked in next(loader)"
            if loader
            else "data wait = gap from a step's end to the next forward"
        ]
    if (parse_finite(get(get(summary, "per_step_ms"), "data_transfer")) or 0.0) > 0.0:
        notes[0] += ", and the batch's transfer to the device (the framework's transfer hooks)"
    world = parse_finite(summary.get("world_size")) or 1
    if world > 1 and summary.get("comm_source") is None:
        notes.append("communication unmeasured: " + str(summary.get("comm_unmeasured") or "no reason recorded"))
    elif summary.get("comm_source") == "fsdp":
        collectives = fsdp_collectives((summary.get("run") or {}).get("fsdp"))
        notes.append(
            f"communication = {collectives} and the waits for them; "
            "exposed = what the step waited for (blocking calls, all-gather waits, the tail after backward)"
        )
    elif summary.get("comm_source") == "ddp_probe" and summary.get("probes_stopped"):
        notes.append(
            f"probe steps stopped: {summary['probes_stopped']}; communication: DDP's own all-reduce, "
            "exposed = the wait after backward; T_C = the step less its measured overhead"
        )
    elif summary.get("comm_source") == "ddp_probe":
        notes.append(
            "communication: DDP's own all-reduce; exposed = the wait after backward, every step; "
            "total = the probe steps' all-reduce, timed alone; T_C from the probe steps"
        )
    elif summary.get("comm_source") == "ddp_exposed":
        user_hook = ((summary.get("run") or {}).get("ddp") or {}).get("comm_hook")
        why = (
            f"DDP reduces through your hook {user_hook}, which dtprofile does not time: wrap it in dtprofile.timed_hook"
            if user_hook
            else "bucket_timing_every=0: no hook"
        )
        notes.append(f"communication = the wait after backward only ({why}; so no total, overlap or bandwidth)")
    elif summary.get("comm_source") == "dtensor":
        notes.append(
            "communication = DTensor's collectives on the mesh (tensor parallel), launch to the end of "
            "their wait; exposed = the waits, taken out of forward, backward and the update"
        )
    elif summary.get("comm_source") == "manual":
        notes.append("communication = the loop's prof.communication() blocks; exposed = their part after backward")
    elif summary.get("probe"):
        notes.append("T_C from probe steps (compute measured with no gradient reduction beside it)")
    elif world > 1:
        notes.append(
            "exposed communication = the wait after backward: a lower bound on its cost "
            "(probe_every=N measures the slowdown overlap causes)"
        )
    return notes


#: Below this share of the step, compute's remainder after its phases is not a row.
OTHER_COMPUTE_MIN_SHARE = 0.005


def _other_compute(per: Mapping[str, Any]) -> float | None:
    """T_C less forward, backward and optimizer: host work between them (the loss, zero_grad,
    logging), launches, and the GPU idle for it; None when it is negligible or unknown."""
    values = [parse_finite(per.get(k)) for k in ("step", "compute", "forward", "backward", "optimizer")]
    if any(v is None for v in values):
        return None
    step, compute, *phases = cast(list[float], values)  # none is None: checked above
    other = compute - sum(phases)
    return other if step > 0 and other >= OTHER_COMPUTE_MIN_SHARE * step else None


def breakdown_rows(summary: Mapping[str, Any], with_keys: bool = False) -> Any:
    """The rows of the measured breakdown.

    Args:
        summary: A summary dict (its ``per_step_ms`` and ``ratios``).
        with_keys: Also return each row's ``per_step_ms`` key, as ``(rows, keys)``.

    Returns:
        ``(label, ms, share of step)`` rows, the step first; a label that starts with two
        spaces is a part of the row above it (four: a part of that part). Rows whose
        value is null are left out, and so are the parts that exist only when nonzero
        (waiting for a slower rank, the batch's transfer, DDP's buffer broadcast). The
        total communication has no share: it overlaps compute.

    Example:
        See the module's example.
    """
    per = get(summary, "per_step_ms") or {}
    step = parse_finite(per.get("step"))

    def share(v: Any) -> float | None:
        v = parse_finite(v)
        return v / step if v is not None and step else None

    rows: list[tuple[str, Any, Any]] = []
    keys: list[str] = []
    spec = [
        ("step", "step", True),
        ("compute", "compute (T_C)", True),
        ("forward", "  forward", True),
        ("backward", "  backward", True),
        ("optimizer", "  optimizer", True),
        ("other_compute", "  other (outside these phases)", True),
        ("overhead", "overhead (T_O)", True),
        ("data_wait", "  data wait", True),
        ("data_transfer", "    of it, the batch's transfer to the device", True),
        ("comm_exposed", "  exposed communication", True),
        ("comm_buffers", "    of it, DDP's buffer broadcast before forward", True),
        ("comm_peer_wait", "  waiting for a slower rank", True),
        ("comm_interference", "  communication slowing compute (probe)", True),
        ("comm_total", "communication, total", False),
    ]
    for key, label, with_share in spec:
        v = _other_compute(per) if key == "other_compute" else per.get(key)
        if parse_finite(v) is None or (
            key in ("comm_peer_wait", "data_transfer", "comm_buffers") and parse_finite(v) == 0
        ):  # none: no row
            continue
        if key == "comm_total":
            ov = parse_finite(get(get(summary, "ratios"), "comm_overlap"))
            if ov is not None:  # total and exposed timed on the same steps
                label = f"communication, total ({100 * ov:.0f}% hidden)"
            elif summary.get("comm_source") == "ddp_probe":
                label = "communication, total (alone, probe steps)"
        rows.append((label, v, share(v) if with_share else None))
        keys.append(key)
    return (rows, keys) if with_keys else rows


def breakdown_ranges(summary: Mapping[str, Any]) -> list[str] | None:
    """Beside each of :func:`breakdown_rows`' rows, its interval (``"24.9-26.3"``; ``""``
    where there is none); None when the summary has no intervals (a short run).

    Example:
        >>> breakdown_ranges({"per_step_ms": {"step": 10.0},
        ...                   "uncertainty": {"per_step_ms": {"step": [9.5, 10.6]}}})
        ['9.50-10.6']
    """
    ranges = get(get(summary, "uncertainty"), "per_step_ms")
    if not isinstance(ranges, Mapping):
        return None
    _, keys = breakdown_rows(summary, with_keys=True)
    return [range_label(ranges.get(key)) for key in keys]


def range_label(span: Any, f: Any = fmt) -> str:
    """``[low, high]`` as ``"low-high"`` in ``f``'s format; ``""`` when not a pair of numbers.

    >>> range_label([0.71, 0.745], fmt_pct), range_label(None)
    ('71.0%-74.5%', '')
    """
    if not isinstance(span, Sequence) or isinstance(span, (str, bytes)) or len(span) != 2:
        return ""
    low, high = parse_finite(span[0]), parse_finite(span[1])
    if low is None or high is None:
        return ""
    return f"{f(low)}-{f(high)}"


def uncertainty_note(summary: Mapping[str, Any]) -> str | None:
    """What the intervals are, in a line (None: the summary has none)."""
    unc = get(summary, "uncertainty")
    level = parse_finite(get(unc, "level"))
    if level is None:
        return None
    blocks = parse_finite(get(unc, "blocks_per_rank"))
    pooled = parse_finite(get(unc, "pooled_runs")) or 0
    between = (
        f", moved by the spread between it and {g_label(pooled)} earlier "
        f"run{'s' if pooled != 1 else ''} of this job in its logdir"
        if pooled
        else ""
    )
    return (
        f"ranges: {level:.0%} of this run's replicates (its steps drawn again in "
        f"{g_label(blocks) if blocks is not None else 'their'} blocks a rank, and its probe steps{between}); "
        + (
            "more steps narrow them"
            if pooled
            else "more steps narrow them; runs of the same job in one logdir pool their spread"
        )
    )


def scaling_question(summary: Mapping[str, Any]) -> str | None:
    """Weak and strong scaling's GPU counts side by side, where the run did not say which
    the job follows and the two differ (``scaling_modes``); None otherwise.

    Example:
        >>> text = scaling_question({"recommendations": {"target_efficiency": 0.8},
        ...     "scaling_modes": {"assumed": "weak", "differ": True, "settled_by": "scaling=...",
        ...                       "weak": {"gpus": 64}, "strong": {"gpus": 4}}})
        >>> for part in text.split(": ", 1)[1].split("; "):
        ...     print(part)
        if each device keeps its batch (weak), 64 GPUs keep efficiency 80.0%
        if the global batch stays fixed (strong), 4. Shown: weak. Settle it with scaling=...
    """
    modes = get(summary, "scaling_modes")
    if not isinstance(modes, Mapping) or not modes.get("differ"):
        return None
    weak, strong = parse_finite(get(modes.get("weak"), "gpus")), parse_finite(get(modes.get("strong"), "gpus"))
    if weak is None or strong is None:
        return None
    target = parse_finite(get(get(summary, "recommendations"), "target_efficiency"))
    keep = f"keep efficiency {fmt_pct(target)}" if target is not None else "keep the target efficiency"
    return (
        f"Scaling not set (a run cannot tell what the job keeps fixed): if each device keeps its batch "
        f"(weak), {g_label(weak)} GPUs {keep}; if the global batch stays fixed (strong), {g_label(strong)}. "
        f"Shown: {modes.get('assumed')}. Settle it with {modes.get('settled_by')}"
    )


def gpus_range_text(summary: Mapping[str, Any]) -> str | None:
    """The recommended device count with its range within the run's noise, in words
    (None: no recommendation).

    Example:
        >>> print(gpus_range_text({"recommendations": {"gpus": 8, "gpus_range": [4, 16],
        ...                                            "target_efficiency": 0.8}}))
        8 GPUs keep efficiency 80.0% (4-16 within this run's noise; a longer run narrows it)
    """
    rec = get(summary, "recommendations")
    gpus = parse_finite(get(rec, "gpus"))
    if gpus is None:
        return None
    target = parse_finite(get(rec, "target_efficiency"))
    text = (
        f"{g_label(gpus)} GPU{'' if gpus == 1 else 's'} keep{'s' if gpus == 1 else ''} efficiency "
        f"{fmt_pct(target) if target is not None else 'on target'}"
    )
    span = get(rec, "gpus_range")
    if isinstance(span, Sequence) and len(span) == 2 and parse_finite(span[0]) != parse_finite(span[1]):
        low, high = parse_finite(span[0]), parse_finite(span[1])
        if low is not None and high is not None:
            text += f" ({g_label(low)}-{g_label(high)} within this run's noise; a longer run narrows it)"
    return text


def parameter_server_text(summary: Mapping[str, Any]) -> str | None:
    """The paper's parameter-server lemma for this model, as a projection's line (None:
    not computed).

    A what-if for a job that all-reduces: what a server deployment would need, never a
    finding of its own there (``dtprofile project --model ps`` gives each G).

    Example:
        >>> text = parameter_server_text({"recommendations": {
        ...     "num_parameter_servers": 3, "num_parameter_servers_at_gpus": 8,
        ...     "num_parameter_servers_bandwidth_Gbps": 10.0}})
        >>> text[text.index(">="):text.index(" (")]
        '>= 3 at 10 Gbit/s each for 8 GPUs'
    """
    rec = get(summary, "recommendations")
    n_ps, gpus = (
        parse_finite(get(rec, "num_parameter_servers")),
        parse_finite(get(rec, "num_parameter_servers_at_gpus")),
    )
    if n_ps is None or gpus is None:
        return None
    gbps = parse_finite(get(rec, "num_parameter_servers_bandwidth_Gbps"))
    link = f" at {fmt_compact(gbps)} Gbit/s each" if gbps is not None else ""
    return (
        f"Parameter servers, were this job to push its gradients to servers rather than all-reduce them: "
        f">= {g_label(n_ps)}{link} for {g_label(gpus)} GPU{'' if gpus == 1 else 's'} "
        "(the paper's lemma N_ps >= 2*S*G/(B_ps*T_C); dtprofile project --model ps gives each G)"
    )


def parameter_server_rows(plan: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """``dtprofile project --model ps``'s table: the lemma's servers at each G.

    Args:
        plan: :func:`~dtprofile.analysis.recommendations.parameter_server_plan`'s rows.

    Returns:
        ``(header, rows)``; ``([], [])`` for an empty plan.

    Example:
        >>> header, rows = parameter_server_rows([{
        ...     "gpus": 8, "num_parameter_servers": 13, "bandwidth_Gbps": 10.0, "compute_ms": 100.0,
        ...     "imbalance": 1.0, "largest_tensor_share": 0.2}])
        >>> dict(zip(header, rows[0]))["servers"], rows
        ('13', [['8', '13', '10', '100', '1.00', '0.200']])
    """
    if not plan:
        return [], []
    header = ["GPUs", "servers", "Gbit/s each", "T_C ms", "largest/mean shard", "largest tensor / server budget"]
    rows = [
        [
            g_label(p.get("gpus")),
            g_label(p.get("num_parameter_servers")),
            fmt_compact(p.get("bandwidth_Gbps")),
            fmt_compact(p.get("compute_ms")),
            fmt(p.get("imbalance")),
            fmt(p.get("largest_tensor_share")),
        ]
        for p in plan
    ]
    return header, rows


def projection_rows(proj: Any, ranges: Any = None) -> tuple[list[str], list[list[str]]]:
    """The projection table, formatted.

    Args:
        proj: A summary's ``projection`` (or ``dtprofile project``'s object).
        ranges: The summary's ``uncertainty.projection`` (its intervals, by the same GPU
            counts): an efficiency range column beside the efficiency.

    Returns:
        ``(header, rows)`` with a column for each projected figure present (and the
        nodes × GPUs split of the two-level model); ``([], [])`` without GPU counts.

    Example:
        >>> projection_rows({"gpus": [1, 8], "speedup": [1.0, 6.2], "efficiency": [1.0, 0.775]})
        (['GPUs', 'speedup', 'efficiency'], [['1', '1.00', '100.0%'], ['8', '6.20', '77.5%']])
    """
    if not isinstance(proj, Mapping):
        return [], []
    gpus = proj.get("gpus")
    if not isinstance(gpus, Sequence) or isinstance(gpus, (str, bytes)) or not gpus:
        return [], []
    cols = [
        ("step_ms", "step ms", fmt),
        ("speedup", "speedup", fmt),
        ("efficiency", "efficiency", fmt_pct),
        ("alpha_paper", "paper α", fmt),
        ("speedup_paper", "paper speedup", fmt),
    ]
    cols = [c for c in cols if isinstance(proj.get(c[0]), Sequence)]
    split: list[Any] = [proj.get(k) for k in ("nodes_used", "gpus_per_node")]
    two_level = all(isinstance(s, Sequence) and not isinstance(s, (str, bytes)) for s in split)
    spans = None
    if (
        isinstance(ranges, Mapping)
        and isinstance(ranges.get("efficiency"), Sequence)
        and list(ranges.get("gpus") or []) == list(gpus)
        and any(c[0] == "efficiency" for c in cols)
    ):
        spans = dict(zip(gpus, ranges["efficiency"], strict=False))
    mesh = proj.get("mesh") if isinstance(proj.get("mesh"), Mapping) else None
    totals = mesh.get("gpus_total") if mesh is not None else None
    # A mesh's G counts data-parallel replicas; the GPUs they take beside them.
    header = (["replicas", "GPUs"] if isinstance(totals, Sequence) else ["GPUs"]) + (
        ["nodes × GPUs"] if two_level else []
    )
    for key, name, _ in cols:
        header.append(name)
        if key == "efficiency" and spans is not None:
            header.append("efficiency range")
    rows = []
    for i, g in enumerate(gpus):
        row = [g_label(g)]
        if isinstance(totals, Sequence):
            row.append(g_label(totals[i]) if i < len(totals) else "-")
        if two_level:  # how the two-level model placed G: it may use fewer nodes than given
            row.append(_node_split_label(split[0], split[1], i))
        for key, _, f in cols:
            vals = proj[key]
            row.append(f(vals[i]) if i < len(vals) else "-")
            if key == "efficiency" and spans is not None:
                row.append(range_label(spans.get(g), fmt_pct) or "-")
        rows.append(row)
    return header, rows


#: Recommendation fields that only qualify others: shown beside one of those, never alone.
_REC_QUALIFIES: dict[str, tuple[str, ...]] = {
    "target_efficiency": ("gpus", "bandwidth_needed_Gbps", "bandwidth_needed_reachable"),
    "bandwidth_needed_at_gpus": ("bandwidth_needed_Gbps", "bandwidth_needed_reachable"),
    "num_parameter_servers_at_gpus": ("num_parameter_servers",),
    "gpus_range": ("gpus",),
}


#: Recommendation fields a line of their own shows (:func:`gpus_range_text`,
#: :func:`parameter_server_text`).
_REC_SHOWN_APART = frozenset(
    {
        "gpus_range",
        "num_parameter_servers",
        "num_parameter_servers_at_gpus",
        "num_parameter_servers_bytes",
        "num_parameter_servers_bandwidth_Gbps",
        "num_parameter_servers_bandwidth_source",
        "num_parameter_servers_imbalance",
        "num_parameter_servers_largest_tensor_share",
    }
)


def recommendation_items(rec: Any) -> list[str]:
    """The recommendations that have a value, as ``key = value``.

    A qualifier (``target_efficiency``, ``*_at_gpus``) is shown only beside a value it
    qualifies: alone it would make a line that recommends nothing.

    Args:
        rec: A summary's ``recommendations``.

    Returns:
        The items, in the summary's order.

    Example:
        >>> recommendation_items({"gpus": None, "target_efficiency": 0.8, "num_workers": 4})
        ['num_workers = 4']
    """
    if not isinstance(rec, Mapping):
        return []
    return [
        f"{k} = {fmt_compact(v)}"
        for k, v in rec.items()
        if v is not None
        and k not in _REC_SHOWN_APART
        and any(rec.get(q) is not None for q in _REC_QUALIFIES.get(k, (k,)))
    ]


def _node_split_label(nodes_used: Sequence[Any], gpus_per_node: Sequence[Any], i: int) -> str:
    """``"2 × 4"`` for the i-th G of a two-level projection; ``-`` when not known."""
    n = parse_finite(nodes_used[i]) if i < len(nodes_used) else None
    g = parse_finite(gpus_per_node[i]) if i < len(gpus_per_node) else None
    return "-" if n is None or g is None else f"{g_label(n)} × {g_label(g)}"


def projection_caption(proj: Any) -> str:
    """The scaling mode and the links a projection assumed.

    With ``nodes`` (the two-level model) both links are named: the intra-node one is
    often assumed, not measured.

    Args:
        proj: A summary's ``projection``.

    Returns:
        The caption; ``""`` when ``proj`` is not a mapping.

    Example:
        >>> projection_caption({"scaling": "weak", "bandwidth_GBps": 0.243,
        ...                     "bandwidth_source": "measured"})
        'weak scaling, bandwidth 0.243 GB/s, source: measured'
    """
    if not isinstance(proj, Mapping):
        return ""
    parts = []
    mesh = proj.get("mesh")
    if isinstance(mesh, Mapping) and parse_finite(mesh.get("tp")) is not None:
        parts.append(mesh_caption(mesh))
    if proj.get("scaling"):
        parts.append(f"{proj['scaling']} scaling")
    two_level = proj.get("model") == "two_level"
    if two_level:
        nodes = parse_finite(proj.get("nodes"))
        measured = proj.get("measured_nodes")
        if (
            nodes is None
            and isinstance(measured, Mapping)
            and proj.get("nodes_source") in ("hosts", "local_world_size")
        ):
            # (the run's own nodes: say how many ranks a node and how that was known)
            how = "its hosts" if proj["nodes_source"] == "hosts" else "LOCAL_WORLD_SIZE"
            parts.append(
                f"two-level all-reduce over nodes of {g_label(measured.get('ranks_per_node'))}, as this run's ({how})"
            )
        else:
            parts.append(
                "two-level all-reduce" + (f" over at most {g_label(nodes)} nodes" if nodes is not None else "")
            )
    link = "inter-node bandwidth" if two_level else "bandwidth"
    if two_level:  # whose link it is decides whether more GPUs per node help
        link += " per GPU (a NIC each)" if proj.get("link_per") == "gpu" else " per node (its GPUs share it)"
    bw = parse_finite(proj.get("bandwidth_GBps"))
    src = proj.get("bandwidth_source")
    if bw is not None:
        fitted = " (fitted to this run's all-reduce at its nodes)" if proj.get("bandwidth_fitted_to_nodes") else ""
        parts.append(f"{link} {fmt(bw)} GB/s" + (f", source: {src}{fitted}" if src else ""))
    elif src:
        parts.append(f"{link}: {src}")
    intra = parse_finite(proj.get("intra_bandwidth_GBps"))
    if two_level and intra is not None:
        intra_src = proj.get("intra_bandwidth_source")
        parts.append(f"intra-node bandwidth {fmt(intra)} GB/s" + (f", source: {intra_src}" if intra_src else ""))
    shared = proj.get("shared_host")
    slowdown = parse_finite(shared.get("sharing_slowdown")) if isinstance(shared, Mapping) else None
    if isinstance(shared, Mapping) and slowdown is not None:
        # Measured: the probe steps whose passes ran one rank at a time.
        alone = parse_finite(shared.get("compute_alone_ms"))
        note = f"forward and backward {slowdown:.0%} slower beside the other ranks than alone"
        if alone is not None:
            note += f"; 1 device computes alone ({fmt(alone)} ms), more keep the compute as measured"
        parts.append(note)
    elif isinstance(shared, Mapping) and shared.get("ranks_per_host"):
        # The compute kept at every G was measured beside the other ranks of this host.
        note = f"compute as measured with {shared['ranks_per_host']} ranks sharing a host"
        share = parse_finite(shared.get("compute_cpu_share"))
        if share is not None:
            note += f" (each ran {share:.0%} of its compute time on a core)"
        parts.append(note + ": one device alone may be faster")
    return ", ".join(parts)


def run_caption(summary: Mapping[str, Any], step: int | None = None) -> str:
    """What was profiled, on one line: ranks and device, backend, steps, completeness.

    Args:
        summary: A summary dict.
        step: The global step of a log interval, shown first; None for none.

    Returns:
        The caption's parts joined with `` · ``; ``""`` when the summary says none.

    Example:
        >>> run_caption({"world_size": 2, "device": "cpu", "backend": "gloo",
        ...              "steps_profiled": 115, "warmup_steps": 5, "steps_total": 120})
        '2 × cpu · gloo · 115 steps profiled, 5 warm-up skipped'
    """
    bits = []
    if step is not None:
        bits.append(f"step {step}")
    ws = summary.get("world_size")
    dev = summary.get("device")
    if dev:
        name = summary.get("device_name")
        bits.append(f"{ws if ws is not None else '?'} × {dev}" + (f" ({name})" if name else ""))
    elif ws is not None:
        bits.append(f"{ws} rank{'s' if ws != 1 else ''}")
    if summary.get("backend"):
        bits.append(str(summary["backend"]))
    sp = summary.get("steps_profiled")
    if sp is not None:
        wu, total = summary.get("warmup_steps"), summary.get("steps_total")
        if isinstance(wu, int) and isinstance(total, int):
            wu = min(wu, total)  # a run shorter than its warm-up skipped only the steps it had
        bits.append(f"{sp} steps profiled" + (f", {wu} warm-up skipped" if wu is not None else ""))
    skipped = summary.get("steps_skipped_update")
    if isinstance(skipped, int) and skipped > 0:
        bits.append(f"{skipped} without an update")
    if summary.get("complete") is False:
        bits.append("run incomplete")
    return " · ".join(bits)
