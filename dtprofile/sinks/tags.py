"""What dtprofile writes to TensorBoard, by name: the tags, the scalars a summary gives,
and the custom-scalars layout that groups them (the sink, :mod:`.tensorboard`, writes them;
the command line reads runs back by the same names).

Everything goes under one ``dtprofile/`` namespace:

- scalars: ``dtprofile/time/<part>`` (ms per optimizer step: step, data_wait, forward,
  backward, optimizer, comm_total, comm_exposed, compute, overhead; comm_interference
  with probes, comm_peer_wait with several ranks),
  ``dtprofile/steps/{skipped_update,without_backward}`` (cumulative counts),
  ``dtprofile/ratio/<name>`` (R_O, data_fraction, comm_fraction, comm_overlap),
  ``dtprofile/projection/{speedup,efficiency,alpha_paper,speedup_paper,step_ms}_G<G>``,
  ``dtprofile/comm/{grad_MB,algbw_GBps,busbw_GBps}``,
  ``dtprofile/mesh/<dim>/{total_ms,waited_ms,MB}`` and ``dtprofile/mesh/<dim>/<kind>/waited_ms``
  (a DeviceMesh's collectives per step, per dimension and kind: ``comm_by_dim``),
  ``dtprofile/rank/{step_ms,compute_ms,data_wait_ms,comm_exposed_ms}/rank<r>`` (up to
  ``RANKS_LISTED`` ranks; plus ``dtprofile/rank/step_ms/{min,p10,median,p90,max}`` across
  ranks) and ``dtprofile/gpu/<metric>[/rank<r>]``
  from the run's GPU telemetry. Null values are skipped, never written as zero.
- text: ``dtprofile/advice`` (stored as ``dtprofile/advice/text_summary``), a Markdown
  report rewritten at every log interval: the measured breakdown, the findings most severe
  first, the projection table.
- a custom-scalars layout (written again when new projected counts or GPU metrics
  appear), one labelled quantity per chart.
- images (when matplotlib is installed): ``dtprofile/plot/speedup`` (projected speedup vs
  linear, paper vs refined model) and ``dtprofile/plot/breakdown`` (stacked per-step time
  over the log intervals seen). Rendering costs ~0.1 s per figure (plus ~0.6 s to import
  matplotlib once), so images are written at the first log, every ``image_every``-th log
  and at close, not at every interval.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._values import get, parse_finite
from ..analysis.rank_spread import RANKS_LISTED
from ..render import g_label, tag_part

__all__ = [
    "ADVICE_TAG",
    "BREAKDOWN_IMAGE_TAG",
    "GPU_CHART_RANKS",
    "PROJECTION_KEYS",
    "RANK_KEYS",
    "RATIO_KEYS",
    "SPEEDUP_IMAGE_TAG",
    "TAG_PREFIX",
    "TIME_KEYS",
    "custom_scalars_layout",
    "layout_keys",
    "scalars_from_summary",
]

TAG_PREFIX = "dtprofile"
#: The custom-scalar layout charts per-rank GPU metrics of ranks below this.
GPU_CHART_RANKS = 8
ADVICE_TAG = f"{TAG_PREFIX}/advice"
SPEEDUP_IMAGE_TAG = f"{TAG_PREFIX}/plot/speedup"
BREAKDOWN_IMAGE_TAG = f"{TAG_PREFIX}/plot/breakdown"

TIME_KEYS: tuple[str, ...] = (
    "step",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "comm_total",
    "comm_exposed",
    "compute",
    "overhead",
    "comm_interference",  # probe runs only: part of overhead
    "comm_peer_wait",  # several ranks: part of overhead, not of comm_exposed
    "data_transfer",  # part of data_wait: the batch's transfer to the device (Lightning)
    "comm_buffers",  # part of comm_exposed: DDP's buffer broadcast before forward
)
RATIO_KEYS: tuple[str, ...] = ("R_O", "data_fraction", "comm_fraction", "comm_overlap")
# projection list key -> scalar name prefix (the tag is dtprofile/projection/<prefix>_G<G>)
PROJECTION_KEYS: tuple[str, ...] = (
    "speedup",
    "efficiency",
    "alpha_paper",
    "speedup_paper",
    "step_ms",
)
# per-rank record key -> tag component (dtprofile/rank/<component>/rank<r>)
RANK_KEYS: tuple[tuple[str, str], ...] = (
    ("step", "step_ms"),
    ("compute", "compute_ms"),
    ("data_wait", "data_wait_ms"),
    ("comm_exposed", "comm_exposed_ms"),
)


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
        v = parse_finite(x)
        if v is not None:
            sink[prefix or "value"] = v
        elif isinstance(x, Mapping):
            for k, y in x.items():
                if k in ("rank", "available"):
                    continue
                flat(f"{prefix}_{tag_part(k)}" if prefix else tag_part(k), y, sink, depth + 1)
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                flat(f"{prefix}_{i}" if prefix else str(i), y, sink, depth + 1)

    def rank_id(key: Any) -> str | None:
        m = re.fullmatch(r"(?:rank)?(\d+)", str(key))
        return m.group(1) if m else None

    per_rank: list[tuple[str, Any]] = []
    rest: Any = telemetry
    if isinstance(telemetry, Mapping) and isinstance(telemetry.get("ranks"), (list, tuple)):
        per_rank = [
            (str(d.get("rank", i)) if isinstance(d, Mapping) else str(i), d) for i, d in enumerate(telemetry["ranks"])
        ]
        rest = {k: v for k, v in telemetry.items() if k != "ranks"}
    elif isinstance(telemetry, (list, tuple)) and telemetry and all(isinstance(d, Mapping) for d in telemetry):
        per_rank = [(str(d.get("rank", i)), d) for i, d in enumerate(telemetry)]
        rest = None
    elif (
        isinstance(telemetry, Mapping)
        and telemetry
        and all(rank_id(k) is not None and isinstance(v, Mapping) for k, v in telemetry.items())
    ):
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
    """Every scalar the sink writes for one summary.

    Args:
        summary: A summary dict.

    Returns:
        ``tag -> value`` (the tags of the module's docstring); a null or non-finite
        figure has no tag, never a zero.

    Example:
        >>> scalars_from_summary({"per_step_ms": {"step": 30.0, "data_wait": None},
        ...                       "ratios": {"R_O": 3.1}, "grad_bytes": 1600000})
        {'dtprofile/time/step': 30.0, 'dtprofile/ratio/R_O': 3.1, 'dtprofile/comm/grad_MB': 1.6}
    """
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        v = parse_finite(value)
        if v is not None:
            out[tag] = v

    per = get(summary, "per_step_ms") or {}
    for k in TIME_KEYS:
        put(f"{TAG_PREFIX}/time/{k}", get(per, k))
    ratios = get(summary, "ratios") or {}
    for k in RATIO_KEYS:
        put(f"{TAG_PREFIX}/ratio/{k}", get(ratios, k))

    proj = get(summary, "projection")
    gpus = get(proj, "gpus")
    if isinstance(gpus, Sequence) and not isinstance(gpus, (str, bytes)):
        for key in PROJECTION_KEYS:
            vals = proj.get(key)
            if not isinstance(vals, Sequence) or isinstance(vals, (str, bytes)):
                continue
            for g, v in zip(gpus, vals, strict=False):
                put(f"{TAG_PREFIX}/projection/{key}_G{g_label(g)}", v)

    gb = parse_finite(summary.get("grad_bytes"))
    if gb is not None:
        put(f"{TAG_PREFIX}/comm/grad_MB", gb / 1e6)
    put(f"{TAG_PREFIX}/comm/algbw_GBps", summary.get("algbw_GBps"))
    put(f"{TAG_PREFIX}/comm/busbw_GBps", summary.get("busbw_GBps"))
    _mesh_scalars(summary, put)
    # Cumulative: steps after warm-up that updated nothing (a loss scaler skipped them).
    put(f"{TAG_PREFIX}/steps/skipped_update", summary.get("steps_skipped_update"))
    put(f"{TAG_PREFIX}/steps/without_backward", summary.get("steps_without_backward"))

    ranks = summary.get("ranks")
    if isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)):
        steps = []
        for i, r in enumerate(ranks):
            if not isinstance(r, Mapping):
                continue
            if len(ranks) <= RANKS_LISTED:  # (more: their distribution, below, not a tag a rank)
                rid = r.get("rank", i)
                for key, comp in RANK_KEYS:
                    put(f"{TAG_PREFIX}/rank/{comp}/rank{tag_part(rid)}", r.get(key))
            if (step := parse_finite(r.get("step"))) is not None:
                steps.append(step)
        if len(steps) >= 2:
            put(f"{TAG_PREFIX}/rank/step_ms/min", min(steps))
            put(f"{TAG_PREFIX}/rank/step_ms/max", max(steps))
        step_spread = get(get(summary, "rank_spread"), "step") or {}
        for k in ("p10", "median", "p90"):
            put(f"{TAG_PREFIX}/rank/step_ms/{k}", get(step_spread, k))

    out.update(_telemetry_scalars(get(get(summary, "run"), "telemetry")))
    return out


def _mesh_scalars(summary: Mapping[str, Any], put: Any) -> None:
    """A mesh's collectives per step (``comm_by_dim``): per dimension its total, its wait and
    its megabytes, and per kind of collective its wait."""
    by_dim = summary.get("comm_by_dim")
    if not isinstance(by_dim, Mapping):
        return
    for dim, entry in by_dim.items():
        base = f"{TAG_PREFIX}/mesh/{tag_part(dim)}"
        total = get(entry, "total") or {}
        put(f"{base}/total_ms", get(total, "total_ms"))
        put(f"{base}/waited_ms", get(total, "waited_ms"))
        nbytes = parse_finite(get(total, "bytes"))
        put(f"{base}/MB", None if nbytes is None else nbytes / 1e6)
        kinds = get(entry, "kinds")
        for kind, figures in kinds.items() if isinstance(kinds, Mapping) else ():
            put(f"{base}/{tag_part(kind)}/waited_ms", get(figures, "waited_ms"))


def custom_scalars_layout(gpu_metrics: Iterable[str] = (), gpus: Iterable[str] = ()) -> dict[str, Any]:
    r"""The custom-scalars layout (``SummaryWriter.add_custom_scalars`` format): each chart
    one quantity, named in its title (lines of one run in one chart share a colour, so
    two quantities in a chart could not be told apart).

    Patterns are regular expressions matched against tags from their start (TensorBoard
    uses ``re.match``); each matches one tag.

    Args:
        gpu_metrics: The GPU telemetry's metric names (``dtprofile/gpu/<metric>``, per rank
            ``<metric>/rank<r>``); each gets a chart in a "dtprofile: GPU" category, per-rank
            ones for the first :data:`GPU_CHART_RANKS` ranks.
        gpus: The projected device counts, as their tags spell them (``8`` of
            ``speedup_G8``); each gets a category of its projected figures.

    Returns:
        ``{category: {chart title: [kind, [tag patterns]]}}``.

    Example:
        >>> layout = custom_scalars_layout(["util"], ["8"])
        >>> layout["dtprofile: GPU"]["util"]
        ['Multiline', ['dtprofile/gpu/util$']]
        >>> layout["dtprofile: projected at 8 GPUs"]["speedup (refined model)"]
        ['Multiline', ['dtprofile/projection/speedup_G8$']]
    """
    p = TAG_PREFIX
    t = f"{p}/time"

    def one(tag: str) -> list[Any]:
        return ["Multiline", [f"{re.escape(tag)}$"]]

    layout = {
        "dtprofile: time per step (ms)": {
            "step (= compute + overhead)": one(f"{t}/step"),
            "compute (T_C)": one(f"{t}/compute"),
            "overhead (T_O)": one(f"{t}/overhead"),
            "data wait": one(f"{t}/data_wait"),
            "exposed communication": one(f"{t}/comm_exposed"),
            "waiting for a slower rank": one(f"{t}/comm_peer_wait"),
            "communication slowing compute (probe)": one(f"{t}/comm_interference"),
            "forward": one(f"{t}/forward"),
            "backward": one(f"{t}/backward"),
            "optimizer": one(f"{t}/optimizer"),
            "communication, total (hidden or not)": one(f"{t}/comm_total"),
        },
        "dtprofile: ratios": {
            "overhead ratio R_O = T_O / T_C": one(f"{p}/ratio/R_O"),
            "data wait, share of the step": one(f"{p}/ratio/data_fraction"),
            "exposed communication, share of the step": one(f"{p}/ratio/comm_fraction"),
            "communication hidden under compute, share": one(f"{p}/ratio/comm_overlap"),
        },
        "dtprofile: communication": {
            "bus bandwidth (GB/s)": one(f"{p}/comm/busbw_GBps"),
            "algorithm bandwidth (GB/s)": one(f"{p}/comm/algbw_GBps"),
            "gradient bytes per step (MB)": one(f"{p}/comm/grad_MB"),
        },
        "dtprofile: per rank (ms)": {
            "step: median rank, band from the fastest to the slowest": [
                "Margin",
                [f"{t}/step", f"{p}/rank/step_ms/min", f"{p}/rank/step_ms/max"],
            ],
        },
    }
    for g in sorted(set(gpus), key=lambda x: float(x)):
        projected = f"{p}/projection"
        layout[f"dtprofile: projected at {g} GPUs"] = {
            "speedup (refined model)": one(f"{projected}/speedup_G{g}"),
            "efficiency (refined model)": one(f"{projected}/efficiency_G{g}"),
            "speedup (paper: G x alpha)": one(f"{projected}/speedup_paper_G{g}"),
            "step (ms)": one(f"{projected}/step_ms_G{g}"),
        }
    # Per-rank GPU metrics get charts for the first ranks only: at 64 ranks one chart
    # each would be hundreds (every rank's are in the Scalars tab).
    metrics = sorted(
        (m for m in set(gpu_metrics) if _rank_of(m) < GPU_CHART_RANKS), key=lambda m: (m.split("/")[0], _rank_of(m))
    )
    if metrics:
        layout["dtprofile: GPU"] = {m: one(f"{p}/gpu/{m}") for m in metrics}
    return layout


def _rank_of(metric: str) -> int:
    """The rank a GPU metric's name ends with (``util/rank3``: 3); -1 for none."""
    m = re.search(r"/rank(\d+)$", metric)
    return int(m.group(1)) if m else -1


def layout_keys(tags: Iterable[str]) -> frozenset[tuple[str, str]]:
    """What the layout has charts for, from the tags written: ``("gpu", metric)`` for the
    telemetry's metrics (per rank: ``util/rank0``), ``("G", count)`` for projected counts."""
    gpu, projected = f"{TAG_PREFIX}/gpu/", f"{TAG_PREFIX}/projection/speedup_G"
    return frozenset(
        [("gpu", t[len(gpu) :]) for t in tags if t.startswith(gpu)]
        + [("G", t[len(projected) :]) for t in tags if t.startswith(projected)]
    )
