"""The TensorBoard sink: dtprofile summaries -> scalars, Markdown advice, layout, images.

Everything goes under one ``dtprofile/`` namespace:

- scalars: ``dtprofile/time/<part>`` (ms per optimizer step: step, data_wait, forward,
  backward, optimizer, comm_total, comm_exposed, compute, overhead; comm_interference
  with probes, comm_peer_wait with several ranks),
  ``dtprofile/steps/{skipped_update,without_backward}`` (cumulative counts),
  ``dtprofile/ratio/<name>`` (R_O, data_fraction, comm_fraction, comm_overlap),
  ``dtprofile/projection/{speedup,efficiency,alpha_paper,speedup_paper,step_ms}_G<G>``,
  ``dtprofile/comm/{grad_MB,algbw_GBps,busbw_GBps}``,
  ``dtprofile/rank/{step_ms,compute_ms,data_wait_ms,comm_exposed_ms}/rank<r>`` (plus
  ``dtprofile/rank/step_ms/{min,max}`` across ranks) and ``dtprofile/gpu/<metric>[/rank<r>]``
  from the run's GPU telemetry. Null values are skipped, never written as zero.
- text: ``dtprofile/advice`` (stored as ``dtprofile/advice/text_summary``), a Markdown
  report rewritten at every log interval: the measured breakdown, the findings most severe
  first, the projection table.
- a custom-scalars layout (once per writer) grouping the charts.
- images (when matplotlib is installed): ``dtprofile/plot/speedup`` (projected speedup vs
  linear, paper vs refined model) and ``dtprofile/plot/breakdown`` (stacked per-step time
  over the log intervals seen). Rendering costs ~0.1 s per figure (plus ~0.6 s to import
  matplotlib once), so images are written at the first log, every ``image_every``-th log
  and at close, not at every interval.

The sink never prints; problems go to the ``dtprofile.tensorboard`` logger.
"""

from __future__ import annotations

import collections
import logging
import math
import numbers
import re
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, Sequence

from .advice import fsdp_collectives

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

log = logging.getLogger(__name__)

TAG_PREFIX = "dtprofile"
ADVICE_TAG = f"{TAG_PREFIX}/advice"
SPEEDUP_IMAGE_TAG = f"{TAG_PREFIX}/plot/speedup"
BREAKDOWN_IMAGE_TAG = f"{TAG_PREFIX}/plot/breakdown"

TIME_KEYS: tuple[str, ...] = (
    "step", "data_wait", "forward", "backward", "optimizer",
    "comm_total", "comm_exposed", "compute", "overhead",
    "comm_interference",  # probe runs only: part of overhead
    "comm_peer_wait",  # several ranks: part of overhead, not of comm_exposed
    "data_transfer",  # part of data_wait: the batch's transfer to the device (Lightning)
    "comm_buffers",  # part of comm_exposed: DDP's buffer broadcast before forward
)
RATIO_KEYS: tuple[str, ...] = ("R_O", "data_fraction", "comm_fraction", "comm_overlap")
# projection list key -> scalar name prefix (the tag is dtprofile/projection/<prefix>_G<G>)
PROJECTION_KEYS: tuple[str, ...] = (
    "speedup", "efficiency", "alpha_paper", "speedup_paper", "step_ms",
)
# per-rank record key -> tag component (dtprofile/rank/<component>/rank<r>)
RANK_KEYS: tuple[tuple[str, str], ...] = (
    ("step", "step_ms"), ("compute", "compute_ms"),
    ("data_wait", "data_wait_ms"), ("comm_exposed", "comm_exposed_ms"),
)

_SEVERITY_ORDER = {
    "critical": 0, "error": 0, "high": 1, "warning": 2, "warn": 2, "medium": 2,
    "moderate": 2, "low": 3, "info": 4, "ok": 5, "none": 5,
}

# Writers that already carry our custom-scalars layout (one layout per writer).
_layout_written: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()
_layout_lock = threading.Lock()


# --------------------------------------------------------------------------- helpers

def _num(x: Any) -> float | None:
    """A finite float, or None for null / non-numeric / bool / NaN / inf."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _get(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, Mapping) else None


def _tag_part(name: Any) -> str:
    """A safe tag component: letters, digits, ``_ . -``; anything else becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(name)).strip("_") or "x"


def _g_label(g: Any) -> str:
    v = _num(g)
    if v is None:
        return _tag_part(g)
    return str(int(v)) if v == int(v) else _tag_part(f"{v:g}")


def fmt(x: Any, digits: int = 3) -> str:
    """A number for humans: ``digits`` significant digits, no exponent for ordinary sizes;
    ``-`` for null."""
    v = _num(x)
    if v is None:
        return "-" if x is None or isinstance(x, (int, float)) else str(x)
    if v == 0:
        return "0"
    if isinstance(x, numbers.Integral):
        return str(int(v))
    if abs(v) >= 10 ** (digits - 1):
        return f"{v:.0f}"
    if abs(v) < 1e-3:
        return f"{v:.{digits}g}"
    mag = int(math.floor(math.log10(abs(v))))
    decimals = max(0, digits - 1 - mag)
    return f"{v:.{decimals}f}"


def fmt_pct(x: Any) -> str:
    v = _num(x)
    return "-" if v is None else f"{100.0 * v:.1f}%"


def sorted_findings(advice: Any) -> list[Mapping[str, Any]]:
    """The advice records, most severe first (stable within a severity)."""
    if not isinstance(advice, Sequence) or isinstance(advice, (str, bytes)):
        return []
    items = [a for a in advice if isinstance(a, Mapping)]

    def key(item: tuple[int, Mapping[str, Any]]) -> tuple[float, int]:
        i, a = item
        sev = str(a.get("severity") or "").lower()
        return (_SEVERITY_ORDER.get(sev, 3), i)

    return [a for _, a in sorted(enumerate(items), key=key)]


def fmt_compact(x: Any) -> str:
    """A number as in evidence: integers whole, others to 4 significant digits."""
    v = _num(x)
    if v is None:
        return str(x)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}"


def finding_parts(finding: Mapping[str, Any]) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(SEVERITY, title, id, [(label, text)...]) of one finding, for any renderer.

    The detail lines are evidence, action and expected gain, each only when present.
    """
    sev = str(finding.get("severity") or "info").upper()
    ident = str(finding.get("id") or "")
    title = str(finding.get("title") or ident or "finding")
    details = [("evidence", format_evidence(finding.get("evidence"))),
               ("action", str(finding.get("action") or "")),
               ("expected gain", str(finding.get("expected_gain") or ""))]
    return sev, title, ident, [(label, text) for label, text in details if text]


def format_evidence(evidence: Any) -> str:
    """Evidence record -> ``k = v, k = v`` (numbers to 3 significant digits)."""
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
        return "; ".join(format_evidence(e) if isinstance(e, Mapping) else str(e)
                         for e in evidence)
    return str(evidence)


def measurement_notes(summary: Mapping[str, Any]) -> list[str]:
    """What the breakdown's figures are, in words (data-wait source, what comm means)."""
    if summary.get("source") == "tensorboard_events":  # the scalars do not say how they were measured
        return []
    loader = summary.get("data_wait_source") == "loader"
    if summary.get("timing") == "cuda_event":
        notes = ["data wait = GPU idle between a step's end and the next forward"
                 + (", up to the time blocked in next(loader)" if loader else "")]
    else:
        notes = ["data wait = time blocked in next(loader)" if loader
                 else "data wait = gap from a step's end to the next forward"]
    if (_num(_get(_get(summary, "per_step_ms"), "data_transfer")) or 0.0) > 0.0:
        notes[0] += ", and the batch's transfer to the device (the framework's transfer hooks)"
    world = _num(summary.get("world_size")) or 1
    if world > 1 and summary.get("comm_source") is None:
        notes.append("communication unmeasured: " + str(
            summary.get("comm_unmeasured") or "the model has a comm hook dtprofile cannot time "
            "(register it wrapped: dtprofile.timed_hook(hook))"))
    elif summary.get("comm_source") == "fsdp":
        collectives = fsdp_collectives((summary.get("run") or {}).get("fsdp"))
        notes.append(f"communication = {collectives} and the waits for them; "
                     "exposed = what the step waited for (blocking calls, all-gather waits, the tail after backward)")
    elif summary.get("comm_source") == "manual":
        notes.append("communication = the loop's prof.communication() blocks; exposed = their part after backward")
    elif summary.get("probe"):
        notes.append("T_C from probe steps (backward measured without overlapping communication)")
    elif world > 1:
        notes.append("exposed communication = the wait after backward: a lower bound on its cost "
                     "(probe_every=N measures the slowdown overlap causes)")
    return notes


#: Below this share of the step, compute's remainder after its phases is not a row.
OTHER_COMPUTE_MIN_SHARE = 0.005


def _other_compute(per: Mapping[str, Any]) -> float | None:
    """T_C less forward, backward and optimizer: host work between them (the loss, zero_grad,
    logging), launches, and the GPU idle for it; None when it is negligible or unknown."""
    values = [_num(per.get(k)) for k in ("step", "compute", "forward", "backward", "optimizer")]
    if any(v is None for v in values):
        return None
    step, compute, *phases = values
    other = compute - sum(phases)
    return other if step > 0 and other >= OTHER_COMPUTE_MIN_SHARE * step else None


def breakdown_rows(summary: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(label, ms, share of step) rows of the measured breakdown; rows whose value is
    null are left out. Labels starting with two spaces are sub-parts."""
    per = _get(summary, "per_step_ms") or {}
    step = _num(per.get("step"))

    def share(v: Any) -> float | None:
        v = _num(v)
        return v / step if v is not None and step else None

    rows: list[tuple[str, Any, Any]] = []
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
        if _num(v) is None or (key in ("comm_peer_wait", "data_transfer", "comm_buffers")
                               and _num(v) == 0):  # none: no row
            continue
        if key == "comm_total":
            ov = _num(_get(_get(summary, "ratios"), "comm_overlap"))
            if ov is not None:
                label = f"communication, total ({100 * ov:.0f}% hidden)"
        rows.append((label, v, share(v) if with_share else None))
    return rows


def projection_rows(proj: Any) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of a projection object (columns present in it only)."""
    if not isinstance(proj, Mapping):
        return [], []
    gpus = proj.get("gpus")
    if not isinstance(gpus, Sequence) or isinstance(gpus, (str, bytes)) or not gpus:
        return [], []
    cols = [
        ("step_ms", "step ms", fmt), ("speedup", "speedup", fmt),
        ("efficiency", "efficiency", fmt_pct), ("alpha_paper", "paper α", fmt),
        ("speedup_paper", "paper speedup", fmt),
    ]
    cols = [c for c in cols if isinstance(proj.get(c[0]), Sequence)]
    split = [proj.get(k) for k in ("nodes_used", "gpus_per_node")]
    two_level = all(isinstance(s, Sequence) and not isinstance(s, (str, bytes)) for s in split)
    header = ["GPUs"] + (["nodes × GPUs"] if two_level else []) + [c[1] for c in cols]
    rows = []
    for i, g in enumerate(gpus):
        row = [_g_label(g)]
        if two_level:  # how the two-level model placed G: it may use fewer nodes than given
            row.append(_node_split_label(split[0], split[1], i))
        for key, _, f in cols:
            vals = proj[key]
            row.append(f(vals[i]) if i < len(vals) else "-")
        rows.append(row)
    return header, rows


#: Recommendation fields that only qualify others: shown beside one of those, never alone.
_REC_QUALIFIES: dict[str, tuple[str, ...]] = {
    "target_efficiency": ("gpus", "bandwidth_needed_Gbps", "bandwidth_needed_reachable"),
    "bandwidth_needed_at_gpus": ("bandwidth_needed_Gbps", "bandwidth_needed_reachable"),
    "num_parameter_servers_at_gpus": ("num_parameter_servers",),
}


def recommendation_items(rec: Any) -> list[str]:
    """``key = value`` for each recommendation with a value. A qualifier
    (``target_efficiency``, ``*_at_gpus``) only beside a value it qualifies: alone it
    would make a line that recommends nothing."""
    if not isinstance(rec, Mapping):
        return []
    return [f"{k} = {fmt_compact(v)}" for k, v in rec.items()
            if v is not None and any(rec.get(q) is not None for q in _REC_QUALIFIES.get(k, (k,)))]


def _node_split_label(nodes_used: Sequence, gpus_per_node: Sequence, i: int) -> str:
    """``"2 × 4"`` for the i-th G of a two-level projection; ``-`` when not known."""
    n = _num(nodes_used[i]) if i < len(nodes_used) else None
    g = _num(gpus_per_node[i]) if i < len(gpus_per_node) else None
    return "-" if n is None or g is None else f"{_g_label(n)} × {_g_label(g)}"


def projection_caption(proj: Any) -> str:
    """Scaling mode and the links the projection assumed. With ``nodes`` (the two-level
    model) both links are named: the intra-node one is often assumed, not measured."""
    if not isinstance(proj, Mapping):
        return ""
    parts = []
    if proj.get("scaling"):
        parts.append(f"{proj['scaling']} scaling")
    two_level = proj.get("model") == "two_level"
    if two_level:
        nodes = _num(proj.get("nodes"))
        parts.append("two-level all-reduce"
                     + (f" over at most {_g_label(nodes)} nodes" if nodes is not None else ""))
    link = "inter-node bandwidth" if two_level else "bandwidth"
    if two_level:  # whose link it is decides whether more GPUs per node help
        link += (" per GPU (a NIC each)" if proj.get("link_per") == "gpu"
                 else " per node (its GPUs share it)")
    bw = _num(proj.get("bandwidth_GBps"))
    src = proj.get("bandwidth_source")
    if bw is not None:
        parts.append(f"{link} {fmt(bw)} GB/s" + (f", source: {src}" if src else ""))
    elif src:
        parts.append(f"{link}: {src}")
    intra = _num(proj.get("intra_bandwidth_GBps"))
    if two_level and intra is not None:
        intra_src = proj.get("intra_bandwidth_source")
        parts.append(f"intra-node bandwidth {fmt(intra)} GB/s"
                     + (f", source: {intra_src}" if intra_src else ""))
    return ", ".join(parts)


def run_caption(summary: Mapping[str, Any], step: int | None = None) -> str:
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


def _md_cell(x: Any) -> str:
    """Text as Markdown shows it literally on one line: ``|`` (tables) and ``*``
    (emphasis: the lemma's ``2*S*G/(B_ps*T_C)``) escaped. Underscores stay: inside
    words (``grad_bytes``) Markdown leaves them alone."""
    text = str(x).replace("\\", "\\\\")
    for char in "|*":
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ")


def _md_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
              align: Sequence[str] | None = None) -> list[str]:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(_md_cell(h) for h in header) + " |",
           "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return out


# --------------------------------------------------------------------------- pure views

def advice_markdown(summary: Mapping[str, Any], step: int | None = None) -> str:
    """The Markdown report written to the ``dtprofile/advice`` text tag."""
    lines: list[str] = []
    cap = run_caption(summary, step)
    lines.append(f"**dtprofile** · {cap}" if cap else "**dtprofile**")
    lines.append("")

    rows = breakdown_rows(summary)
    lines.append("#### Measured breakdown (ms per optimizer step: average over steps, median over ranks)")
    if rows:
        lines += _md_table(
            ["part", "ms", "share of step"],
            [(lbl.replace("  ", "↳ ", 1) if lbl.startswith("  ") else lbl, fmt(v),
              fmt_pct(s) if s is not None else "") for lbl, v, s in rows])
    else:
        lines.append("_No steady-state steps measured yet._")
    ratios = _get(summary, "ratios") or {}
    r_o = _num(ratios.get("R_O"))
    extra = []
    if r_o is not None:
        ceiling = f"; the paper's ceiling on speedup (1 + R_O) / R_O = {fmt((1 + r_o) / r_o)}×" \
            if r_o > 0 else ""
        extra.append(f"R_O = T_O / T_C = **{fmt(r_o)}**{ceiling}.")
    gb = _num(summary.get("grad_bytes"))
    if gb is not None:
        bw = []
        for k, lbl in (("algbw_GBps", "algbw"), ("busbw_GBps", "busbw")):
            if _num(summary.get(k)) is not None:
                bw.append(f"{lbl} {fmt(summary[k])} GB/s")
        what = ("FSDP collectives (all-reduce equivalent)" if summary.get("comm_source") == "fsdp"
                else "Gradients all-reduced")
        extra.append(f"{what}: {fmt(gb / 1e6)} MB per step"
                     + (f" ({', '.join(bw)})" if bw else "") + ".")
    probe = summary.get("probe")
    if isinstance(probe, Mapping) and _num(probe.get("overlap_slowdown_ms")) is not None:
        extra.append(f"Probe: overlapped communication slows compute by "
                     f"{fmt(probe['overlap_slowdown_ms'])} ms per step.")
    if extra:
        lines.append("")
        lines.append(" ".join(extra))

    lines.append("")
    lines.append("#### Findings (most severe first)")
    findings = sorted_findings(summary.get("advice"))
    if not findings:
        lines.append("_No findings yet._")
    for i, a in enumerate(findings, 1):
        sev, title, ident, details = finding_parts(a)
        lines.append(f"{i}. **{sev} · {_md_cell(title)}**" + (f" (`{ident}`)" if ident else ""))
        lines += [f"    - {label}: {_md_cell(text)}" for label, text in details]

    proj = summary.get("projection")
    header, prow = projection_rows(proj)
    if header:
        lines.append("")
        pc = projection_caption(proj)
        lines.append("#### Projection" + (f": {pc}" if pc else ""))
        lines += _md_table(header, prow)
    items = recommendation_items(summary.get("recommendations"))
    if items:
        lines.append("")
        lines.append("Recommendations: " + ", ".join(items) + ".")
    return "\n".join(lines) + "\n"


def _telemetry_scalars(telemetry: Any) -> dict[str, float]:
    """Flatten GPU telemetry into ``dtprofile/gpu/<metric>[/rank<r>]`` -> value."""
    out: dict[str, float] = {}
    if telemetry is None or isinstance(telemetry, (str, bytes, bool)):
        return out
    if isinstance(telemetry, Mapping) and telemetry.get("available") is False:
        return out

    def flat(prefix: str, x: Any, sink: dict[str, float], depth: int = 0) -> None:
        if depth > 4:
            return
        v = _num(x)
        if v is not None:
            sink[prefix or "value"] = v
        elif isinstance(x, Mapping):
            for k, y in x.items():
                if k in ("rank", "available"):
                    continue
                flat(f"{prefix}_{_tag_part(k)}" if prefix else _tag_part(k), y, sink, depth + 1)
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                flat(f"{prefix}_{i}" if prefix else str(i), y, sink, depth + 1)

    def rank_id(key: Any) -> str | None:
        m = re.fullmatch(r"(?:rank)?(\d+)", str(key))
        return m.group(1) if m else None

    per_rank: list[tuple[str, Any]] = []
    rest: Any = telemetry
    if isinstance(telemetry, Mapping) and isinstance(telemetry.get("ranks"), (list, tuple)):
        per_rank = [(str(d.get("rank", i)) if isinstance(d, Mapping) else str(i), d)
                    for i, d in enumerate(telemetry["ranks"])]
        rest = {k: v for k, v in telemetry.items() if k != "ranks"}
    elif isinstance(telemetry, (list, tuple)) and telemetry and all(
            isinstance(d, Mapping) for d in telemetry):
        per_rank = [(str(d.get("rank", i)), d) for i, d in enumerate(telemetry)]
        rest = None
    elif isinstance(telemetry, Mapping) and telemetry and all(
            rank_id(k) is not None and isinstance(v, Mapping) for k, v in telemetry.items()):
        per_rank = [(rank_id(k), v) for k, v in telemetry.items()]  # type: ignore[misc]
        rest = None
    for r, d in per_rank:
        vals: dict[str, float] = {}
        flat("", d, vals)
        for metric, v in vals.items():
            out[f"{TAG_PREFIX}/gpu/{metric}/rank{r}"] = v
    if rest is not None:
        vals = {}
        flat("", rest, vals)
        for metric, v in vals.items():
            out[f"{TAG_PREFIX}/gpu/{metric}"] = v
    return out


def scalars_from_summary(summary: Mapping[str, Any]) -> dict[str, float]:
    """Every scalar the sink writes for one summary: ``tag -> value`` (nulls left out)."""
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        v = _num(value)
        if v is not None:
            out[tag] = v

    per = _get(summary, "per_step_ms") or {}
    for k in TIME_KEYS:
        put(f"{TAG_PREFIX}/time/{k}", _get(per, k))
    ratios = _get(summary, "ratios") or {}
    for k in RATIO_KEYS:
        put(f"{TAG_PREFIX}/ratio/{k}", _get(ratios, k))

    proj = _get(summary, "projection")
    gpus = _get(proj, "gpus")
    if isinstance(gpus, Sequence) and not isinstance(gpus, (str, bytes)):
        for key in PROJECTION_KEYS:
            vals = proj.get(key)
            if not isinstance(vals, Sequence) or isinstance(vals, (str, bytes)):
                continue
            for g, v in zip(gpus, vals):
                put(f"{TAG_PREFIX}/projection/{key}_G{_g_label(g)}", v)

    gb = _num(summary.get("grad_bytes"))
    if gb is not None:
        put(f"{TAG_PREFIX}/comm/grad_MB", gb / 1e6)
    put(f"{TAG_PREFIX}/comm/algbw_GBps", summary.get("algbw_GBps"))
    put(f"{TAG_PREFIX}/comm/busbw_GBps", summary.get("busbw_GBps"))
    # Cumulative: steps after warm-up that updated nothing (a loss scaler skipped them).
    put(f"{TAG_PREFIX}/steps/skipped_update", summary.get("steps_skipped_update"))
    put(f"{TAG_PREFIX}/steps/without_backward", summary.get("steps_without_backward"))

    ranks = summary.get("ranks")
    if isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)):
        steps = []
        for i, r in enumerate(ranks):
            if not isinstance(r, Mapping):
                continue
            rid = r.get("rank", i)
            for key, comp in RANK_KEYS:
                put(f"{TAG_PREFIX}/rank/{comp}/rank{_tag_part(rid)}", r.get(key))
            if _num(r.get("step")) is not None:
                steps.append(_num(r.get("step")))
        if len(steps) >= 2:
            put(f"{TAG_PREFIX}/rank/step_ms/min", min(steps))
            put(f"{TAG_PREFIX}/rank/step_ms/max", max(steps))

    out.update(_telemetry_scalars(_get(_get(summary, "run"), "telemetry")))
    return out


def custom_scalars_layout(gpu_metrics: Iterable[str] = ()) -> dict:
    """The custom-scalars layout (``SummaryWriter.add_custom_scalars`` format).

    Multiline entries are regular expressions matched against tags from their start
    (TensorBoard uses ``re.match``), so one chart picks up every rank or every G.
    """
    p = TAG_PREFIX
    t = f"{p}/time"
    layout = {
        "dtprofile: time per step (ms)": {
            "step = compute + overhead": ["Multiline", [
                f"{t}/step$", f"{t}/compute$", f"{t}/overhead$"]],
            "overhead: data wait + exposed communication (+ waiting for a slower rank, interference)": ["Multiline", [
                f"{t}/overhead$", f"{t}/data_wait$", f"{t}/comm_exposed$", f"{t}/comm_interference$",
                f"{t}/comm_peer_wait$"]],
            "compute phases": ["Multiline", [
                f"{t}/forward$", f"{t}/backward$", f"{t}/optimizer$"]],
            "communication: total vs exposed": ["Multiline", [
                f"{t}/comm_total$", f"{t}/comm_exposed$"]],
        },
        "dtprofile: ratios": {
            "overhead ratio R_O = T_O / T_C": ["Multiline", [f"{p}/ratio/R_O$"]],
            "fractions": ["Multiline", [
                f"{p}/ratio/data_fraction$", f"{p}/ratio/comm_fraction$",
                f"{p}/ratio/comm_overlap$"]],
        },
        "dtprofile: projection": {
            "speedup (refined model)": ["Multiline", [rf"{p}/projection/speedup_G\d"]],
            "speedup (paper: G * alpha)": ["Multiline", [rf"{p}/projection/speedup_paper_G"]],
            "efficiency (refined model)": ["Multiline", [rf"{p}/projection/efficiency_G"]],
            "alpha (paper)": ["Multiline", [rf"{p}/projection/alpha_paper_G"]],
            "projected step (ms)": ["Multiline", [rf"{p}/projection/step_ms_G"]],
        },
        "dtprofile: communication": {
            "bandwidth (GB/s)": ["Multiline", [
                f"{p}/comm/algbw_GBps$", f"{p}/comm/busbw_GBps$"]],
            "gradient bytes per step (MB)": ["Multiline", [f"{p}/comm/grad_MB$"]],
        },
        "dtprofile: per rank (ms)": {
            "step, median with the slowest and fastest rank": ["Margin", [
                f"{t}/step", f"{p}/rank/step_ms/min", f"{p}/rank/step_ms/max"]],
            "step": ["Multiline", [rf"{p}/rank/step_ms/rank\d"]],
            "compute": ["Multiline", [rf"{p}/rank/compute_ms/rank\d"]],
            "data wait": ["Multiline", [rf"{p}/rank/data_wait_ms/rank\d"]],
            "exposed communication": ["Multiline", [rf"{p}/rank/comm_exposed_ms/rank\d"]],
        },
    }
    metrics = sorted(set(gpu_metrics))
    if metrics:
        layout["dtprofile: GPU"] = {
            m: ["Multiline", [rf"{p}/gpu/{re.escape(m)}(/rank\d+)?$"]] for m in metrics
        }
    return layout


def _gpu_metrics(tags: Iterable[str]) -> frozenset[str]:
    pre = f"{TAG_PREFIX}/gpu/"
    return frozenset(t[len(pre):].split("/")[0] for t in tags if t.startswith(pre))


# --------------------------------------------------------------------------- the sink

# The background threads of the SummaryWriters the sinks own; see _quiet_writer_thread.
_QUIET_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_chained_excepthook: Any = None


def _quiet_writer_thread(writer: Any) -> None:
    """Keep the traceback of ``writer``'s event-file thread off stderr.

    That thread dies on a failed write (the logdir deleted, the disk full) and Python
    prints its traceback; the next write raises the same error in the sink, which warns
    once and disables itself. Other threads' errors go to the hook that was there before.
    """
    global _chained_excepthook
    try:
        thread = writer._get_file_writer().event_writer._async_writer._worker
    except Exception:  # another writer or tensorboard version: its traceback stays
        return
    if _chained_excepthook is None:
        _chained_excepthook = threading.excepthook
        threading.excepthook = _excepthook
    _QUIET_THREADS.add(thread)


def _excepthook(args: Any) -> None:
    if args.thread is not None and args.thread in _QUIET_THREADS:
        log.debug("dtprofile: the TensorBoard writer's thread failed: %r", args.exc_value)
        return
    _chained_excepthook(args)


class TensorBoardSink:
    """Writes dtprofile summaries to TensorBoard.

    ``writer``: a ``torch.utils.tensorboard.SummaryWriter`` (e.g. Lightning's
    ``trainer.logger.experiment``); it is flushed but never closed by the sink.
    Otherwise ``logdir``: a SummaryWriter is created there on the first log and closed by
    :meth:`close`.

    ``image_every``: write the images at the first log, every ``image_every``-th log after
    it and at close (0 disables images; None: at close only, which the engine uses so
    that drawing never competes with training). ``history``: how many log intervals the breakdown
    plot keeps.
    """

    def __init__(self, writer: Any = None, logdir: str | None = None, *,
                 image_every: int | None = 10, history: int = 200, flush: bool = True):
        if writer is None and logdir is None:
            raise ValueError("TensorBoardSink needs a SummaryWriter or a logdir")
        self._writer = writer
        self._own = writer is None
        self.logdir = logdir
        self.image_every = None if image_every is None else max(0, int(image_every))
        self.history: collections.deque = collections.deque(maxlen=max(1, int(history)))
        self._flush = flush
        self._logs = 0
        self._closed = False
        self._images_ok: bool | None = None  # None: not tried; False: matplotlib missing
        self._last_step: int | None = None
        self._last_scalar_step: int | None = None
        self.render_seconds: float | None = None  # last image rendering cost

    # -- writer -------------------------------------------------------------------
    @property
    def writer(self) -> Any:
        """The SummaryWriter, created on first use when the sink owns it."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.logdir)
            _quiet_writer_thread(self._writer)
        elif not hasattr(self._writer, "add_scalar") and hasattr(self._writer, "experiment"):
            # a Lightning TensorBoardLogger given instead of its SummaryWriter
            self._writer = self._writer.experiment
        return self._writer

    def prepare(self) -> None:
        """Import the writer's modules now (about 0.2 s), on the caller's thread before
        training: the first interval, written from a background thread, would otherwise
        hold the interpreter lock through that import in the middle of a step. No file is
        created until the first log."""
        if self._writer is None:
            import torch.utils.tensorboard  # noqa: F401

    # -- public API ---------------------------------------------------------------
    def log(self, summary: dict, step: int) -> None:
        """Write one log interval's (analysed) summary at global optimizer step ``step``."""
        self._log(summary, step, final=False)

    def close(self, summary: dict | None = None, step: int | None = None) -> None:
        """Final log (when ``summary`` is given), flush, and close the writer if ours.

        ``step`` defaults to the latest step seen (or the summary's ``steps_total``).
        When it equals the last logged interval's step, the scalars are not written again
        (one point per step); the advice text and the images show the final summary.
        """
        if self._closed:
            return
        try:
            if summary is not None:
                if step is None:
                    step = self._default_step(summary)
                self._log(summary, step, final=True)
        finally:
            self._closed = True
            w = self._writer
            if w is not None:
                try:
                    w.flush()
                    if self._own:
                        w.close()
                except Exception as e:  # noqa: BLE001 - never raise into training
                    log.warning("dtprofile: closing the TensorBoard writer failed: %s", e)

    # -- internals ----------------------------------------------------------------
    def _default_step(self, summary: Mapping[str, Any]) -> int:
        candidates = [int(v) for v in (_num(summary.get("steps_total")), self._last_step)
                      if v is not None]
        return max(candidates) if candidates else 0

    def _log(self, summary: Mapping[str, Any], step: int, final: bool) -> None:
        if self._closed:
            log.debug("dtprofile: TensorBoardSink.log after close ignored")
            return
        if not isinstance(summary, Mapping):
            log.warning("dtprofile: TensorBoardSink got a %s, not a summary dict",
                        type(summary).__name__)
            return
        step = int(step)
        w = self.writer
        self._logs += 1
        self._last_step = step
        # The final call usually comes at the step of the last interval: its scalars are
        # already there (one point per step keeps the curves clean); the text and images
        # still show the final summary.
        repeat = final and self._last_scalar_step == step
        if not repeat:
            self._last_scalar_step = step

        scalars = scalars_from_summary(summary)
        self._ensure_layout(w, _gpu_metrics(scalars))
        if not repeat:
            for tag, value in scalars.items():
                w.add_scalar(tag, value, step)
            per = summary.get("per_step_ms")
            if isinstance(per, Mapping) and _num(per.get("step")) is not None:
                if self.history and self.history[-1][0] == step:
                    self.history.pop()
                self.history.append((step, dict(per)))
        try:
            w.add_text(ADVICE_TAG, advice_markdown(summary, step), step)
        except Exception as e:  # noqa: BLE001
            log.warning("dtprofile: writing the advice text failed: %s", e)

        if self.image_every is None:
            draw = final
        else:
            draw = bool(self.image_every) and (final or self._logs == 1
                                               or (self._logs - 1) % self.image_every == 0)
        if draw:
            self._write_images(w, summary, step)
        if self._flush or final:
            w.flush()

    def _ensure_layout(self, w: Any, gpu_metrics: frozenset[str]) -> None:
        with _layout_lock:
            try:
                seen = _layout_written.get(w)
            except TypeError:  # not weak-referenceable
                seen = getattr(self, "_layout_seen", None)
            if seen is not None and gpu_metrics <= seen:
                return
            metrics = gpu_metrics | (seen or frozenset())
            try:
                w.add_custom_scalars(custom_scalars_layout(metrics))
            except Exception as e:  # noqa: BLE001
                log.warning("dtprofile: writing the custom-scalars layout failed: %s", e)
            try:
                _layout_written[w] = metrics
            except TypeError:
                self._layout_seen = metrics

    def _write_images(self, w: Any, summary: Mapping[str, Any], step: int) -> None:
        if self._images_ok is False:
            return
        from . import plots

        if self._images_ok is None:
            self._images_ok = plots.available()
            if not self._images_ok:
                log.info("dtprofile: matplotlib is not installed; TensorBoard images "
                         "(%s, %s) are skipped", SPEEDUP_IMAGE_TAG, BREAKDOWN_IMAGE_TAG)
                return
        t0 = time.perf_counter()
        try:
            if isinstance(summary.get("projection"), Mapping):
                w.add_image(SPEEDUP_IMAGE_TAG, plots.render_speedup(summary), step,
                            dataformats="HWC")
            if self.history:
                w.add_image(BREAKDOWN_IMAGE_TAG, plots.render_breakdown(self.history), step,
                            dataformats="HWC")
        except Exception as e:  # noqa: BLE001
            log.warning("dtprofile: rendering the TensorBoard images failed: %s", e)
        self.render_seconds = time.perf_counter() - t0
        log.debug("dtprofile: TensorBoard images rendered in %.3f s", self.render_seconds)
