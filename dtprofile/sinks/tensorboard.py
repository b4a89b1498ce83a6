"""The TensorBoard sink: dtprofile summaries -> scalars, Markdown advice, layout, images.

It writes; the Markdown text is :func:`dtprofile.render.advice_markdown`'s and the images
are :mod:`dtprofile.sinks.plots`'.

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
- a custom-scalars layout (written again when new projected counts or GPU metrics
  appear), one labelled quantity per chart.
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
import re
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._values import get, parse_finite
from ..render import advice_markdown, g_label, tag_part

__all__ = [
    "TensorBoardSink",
    "sink_factory",
    "scalars_from_summary",
    "custom_scalars_layout",
    "TIME_KEYS",
    "RATIO_KEYS",
    "TAG_PREFIX",
    "ADVICE_TAG",
]

# Named for what it logs, not for where the module lives: the name users configure.
log = logging.getLogger("dtprofile.tensorboard")

TAG_PREFIX = "dtprofile"
#: The custom-scalar layout charts per-rank GPU metrics of ranks below this.
GPU_CHART_RANKS = 8
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

# Writers that already carry our custom-scalars layout (one layout per writer).
_layout_written: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()
_layout_lock = threading.Lock()


# --------------------------------------------------------------------------- scalars and layout

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
            for g, v in zip(gpus, vals):
                put(f"{TAG_PREFIX}/projection/{key}_G{g_label(g)}", v)

    gb = parse_finite(summary.get("grad_bytes"))
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
                put(f"{TAG_PREFIX}/rank/{comp}/rank{tag_part(rid)}", r.get(key))
            if parse_finite(r.get("step")) is not None:
                steps.append(parse_finite(r.get("step")))
        if len(steps) >= 2:
            put(f"{TAG_PREFIX}/rank/step_ms/min", min(steps))
            put(f"{TAG_PREFIX}/rank/step_ms/max", max(steps))

    out.update(_telemetry_scalars(get(get(summary, "run"), "telemetry")))
    return out


def custom_scalars_layout(gpu_metrics: Iterable[str] = (), gpus: Iterable[str] = ()) -> dict:
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

    def one(tag: str) -> list:
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
            "step: median rank, band from the fastest to the slowest": ["Margin", [
                f"{t}/step", f"{p}/rank/step_ms/min", f"{p}/rank/step_ms/max"]],
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
    metrics = sorted((m for m in set(gpu_metrics) if _rank_of(m) < GPU_CHART_RANKS),
                     key=lambda m: (m.split("/")[0], _rank_of(m)))
    if metrics:
        layout["dtprofile: GPU"] = {m: one(f"{p}/gpu/{m}") for m in metrics}
    return layout


def _rank_of(metric: str) -> int:
    """The rank a GPU metric's name ends with (``util/rank3``: 3); -1 for none."""
    m = re.search(r"/rank(\d+)$", metric)
    return int(m.group(1)) if m else -1


def _layout_keys(tags: Iterable[str]) -> frozenset[tuple[str, str]]:
    """What the layout has charts for, from the tags written: ``("gpu", metric)`` for the
    telemetry's metrics (per rank: ``util/rank0``), ``("G", count)`` for projected counts."""
    gpu, projected = f"{TAG_PREFIX}/gpu/", f"{TAG_PREFIX}/projection/speedup_G"
    return frozenset([("gpu", t[len(gpu):]) for t in tags if t.startswith(gpu)]
                     + [("G", t[len(projected):]) for t in tags if t.startswith(projected)])


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
    try:
        thread = writer._get_file_writer().event_writer._async_writer._worker
    except Exception:  # another writer or tensorboard version: its traceback stays
        return
    _install_excepthook()
    _QUIET_THREADS.add(thread)


def _install_excepthook() -> None:
    global _chained_excepthook
    if _chained_excepthook is None:
        _chained_excepthook = threading.excepthook
        threading.excepthook = _excepthook


# Threads alive before a sink began creating its SummaryWriter (None: not creating one).
# The writer's thread starts, and may die on a missing directory, inside the constructor,
# before _quiet_writer_thread can name it.
_threads_before_writer: "set[int] | None" = None


def _new_writer(logdir: str | None) -> Any:
    """A SummaryWriter for ``logdir``, its event-file thread quiet from its first write."""
    global _threads_before_writer
    from torch.utils.tensorboard import SummaryWriter

    _install_excepthook()
    _threads_before_writer = {t.ident for t in threading.enumerate()}
    try:
        writer = SummaryWriter(log_dir=logdir)
    finally:
        _threads_before_writer = None
    _quiet_writer_thread(writer)
    return writer


def _excepthook(args: Any) -> None:
    thread = args.thread
    creating = _threads_before_writer
    if thread is not None and (thread in _QUIET_THREADS or (
            creating is not None and thread.ident not in creating
            and type(thread).__module__.startswith("tensorboard."))):
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
            self._writer = _new_writer(self.logdir)
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
        candidates = [int(v) for v in (parse_finite(summary.get("steps_total")), self._last_step)
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
        self._ensure_layout(w, _layout_keys(scalars))
        if not repeat:
            for tag, value in scalars.items():
                w.add_scalar(tag, value, step)
            per = summary.get("per_step_ms")
            if isinstance(per, Mapping) and parse_finite(per.get("step")) is not None:
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

    def _ensure_layout(self, w: Any, keys: frozenset[tuple[str, str]]) -> None:
        """The layout for ``keys`` (:func:`_layout_keys`), rewritten when new ones appear."""
        with _layout_lock:
            try:
                seen = _layout_written.get(w)
            except TypeError:  # not weak-referenceable
                seen = getattr(self, "_layout_seen", None)
            if seen is not None and keys <= seen:
                return
            metrics = keys | (seen or frozenset())
            try:
                w.add_custom_scalars(custom_scalars_layout(
                    [name for kind, name in metrics if kind == "gpu"], [name for kind, name in metrics if kind == "G"]))
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


def sink_factory(writer: Any = None, logdir: str | None = None) -> Callable[[], TensorBoardSink] | None:
    """What an integration gives the engine to make its sink (``Engine(sink_factory=...)``):
    a TensorBoardSink into ``writer`` (a SummaryWriter, e.g. the Trainer's logger's), else
    into ``logdir``; None when there is neither. Images (matplotlib, ~0.2 s each) are drawn
    once, at the end of the run, so that drawing never competes with training."""
    if writer is None and logdir is None:
        return None
    return lambda: TensorBoardSink(writer=writer, logdir=logdir, image_every=None)
