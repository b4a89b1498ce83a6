"""The TensorBoard sink: dtprofile summaries -> scalars, Markdown advice, layout, images.

It writes; the Markdown text is :func:`dtprofile.render.advice_markdown`'s and the images
are :mod:`dtprofile.sinks.plots`'.

The tags, their scalars and the custom-scalars layout are :mod:`.tags`'; the images
(when matplotlib is installed) are written at the first log, every ``image_every``-th log
and at close, not at every interval (~0.1 s per figure, plus ~0.6 s to import matplotlib
once).

The sink never prints; problems go to the ``dtprofile.tensorboard`` logger.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .._values import parse_finite
from ..render import advice_markdown
from .tags import (  # noqa: F401 (the tags' names, here too: their older home)
    ADVICE_TAG,
    BREAKDOWN_IMAGE_TAG,
    PROJECTION_KEYS,
    RANK_KEYS,
    RATIO_KEYS,
    SPEEDUP_IMAGE_TAG,
    TAG_PREFIX,
    TIME_KEYS,
    custom_scalars_layout,
    layout_keys,
    scalars_from_summary,
)

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

# Writers that already carry our custom-scalars layout (one layout per writer).
_layout_written: weakref.WeakKeyDictionary[Any, frozenset[tuple[str, str]]] = weakref.WeakKeyDictionary()
_layout_lock = threading.Lock()


# --------------------------------------------------------------------------- the sink

# The background threads of the SummaryWriters the sinks own; see _quiet_writer_thread.
_QUIET_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
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
_threads_before_writer: set[int | None] | None = None


def _new_writer(logdir: str | os.PathLike[str] | None) -> Any:
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
    if thread is not None and (
        thread in _QUIET_THREADS
        or (
            creating is not None and thread.ident not in creating and type(thread).__module__.startswith("tensorboard.")
        )
    ):
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

    def __init__(
        self,
        writer: Any = None,
        logdir: str | os.PathLike[str] | None = None,
        *,
        image_every: int | None = 10,
        history: int = 200,
        flush: bool = True,
    ):
        if writer is None and logdir is None:
            raise ValueError("TensorBoardSink needs a SummaryWriter or a logdir")
        self._writer = writer
        self._own = writer is None
        self.logdir = logdir
        self.image_every = None if image_every is None else max(0, int(image_every))
        self.history: collections.deque[Any] = collections.deque(maxlen=max(1, int(history)))
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
    def log(self, summary: dict[str, Any], step: int) -> None:
        """Write one log interval's (analysed) summary at global optimizer step ``step``."""
        self._log(summary, step, final=False)

    def close(self, summary: dict[str, Any] | None = None, step: int | None = None) -> None:
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
        candidates = [int(v) for v in (parse_finite(summary.get("steps_total")), self._last_step) if v is not None]
        return max(candidates) if candidates else 0

    def _log(self, summary: Mapping[str, Any], step: int, final: bool) -> None:
        if self._closed:
            log.debug("dtprofile: TensorBoardSink.log after close ignored")
            return
        if not isinstance(summary, Mapping):
            log.warning("dtprofile: TensorBoardSink got a %s, not a summary dict", type(summary).__name__)
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
        self._ensure_layout(w, layout_keys(scalars))
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
            draw = bool(self.image_every) and (final or self._logs == 1 or (self._logs - 1) % self.image_every == 0)
        if draw:
            self._write_images(w, summary, step)
        if self._flush or final:
            w.flush()

    def _ensure_layout(self, w: Any, keys: frozenset[tuple[str, str]]) -> None:
        """The layout for ``keys`` (:func:`.tags.layout_keys`), rewritten when new ones appear."""
        with _layout_lock:
            try:
                seen = _layout_written.get(w)
            except TypeError:  # not weak-referenceable
                seen = getattr(self, "_layout_seen", None)
            if seen is not None and keys <= seen:
                return
            metrics = keys | (seen or frozenset())
            try:
                w.add_custom_scalars(
                    custom_scalars_layout(
                        [name for kind, name in metrics if kind == "gpu"],
                        [name for kind, name in metrics if kind == "G"],
                    )
                )
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
                log.info(
                    "dtprofile: matplotlib is not installed; TensorBoard images (%s, %s) are skipped",
                    SPEEDUP_IMAGE_TAG,
                    BREAKDOWN_IMAGE_TAG,
                )
                return
        t0 = time.perf_counter()
        try:
            if isinstance(summary.get("projection"), Mapping):
                w.add_image(SPEEDUP_IMAGE_TAG, plots.render_speedup(summary), step, dataformats="HWC")
            if self.history:
                w.add_image(BREAKDOWN_IMAGE_TAG, plots.render_breakdown(self.history), step, dataformats="HWC")
        except Exception as e:  # noqa: BLE001
            log.warning("dtprofile: rendering the TensorBoard images failed: %s", e)
        self.render_seconds = time.perf_counter() - t0
        log.debug("dtprofile: TensorBoard images rendered in %.3f s", self.render_seconds)


def sink_factory(
    writer: Any = None, logdir: str | os.PathLike[str] | None = None
) -> Callable[[], TensorBoardSink] | None:
    """What an integration gives the engine to make its sink (``Engine(sink_factory=...)``):
    a TensorBoardSink into ``writer`` (a SummaryWriter, e.g. the Trainer's logger's), else
    into ``logdir``; None when there is neither. Images (matplotlib, ~0.2 s each) are drawn
    once, at the end of the run, so that drawing never competes with training.

    Example:
        >>> sink_factory() is None  # nowhere to write: no sink
        True
    """
    if writer is None and logdir is None:
        return None
    return lambda: TensorBoardSink(writer=writer, logdir=logdir, image_every=None)
