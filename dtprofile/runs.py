"""The profiled runs under a log directory: their summaries, or what their TensorBoard
event files hold when a run left no summary (still running, or killed).

The command line (``dtprofile report``, ``project``, ``compare``) and the TensorBoard tab
both read runs through :func:`find_runs`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .sinks.tags import RATIO_KEYS, TIME_KEYS
from .summary_file import SCHEMA, SUMMARY_NAME, SummaryError, load_summary

__all__ = ["Run", "RunError", "find_runs", "is_event_file", "walk_logdir"]


class RunError(Exception):
    """A log directory or file that holds no readable run: one line for the user."""


@dataclass
class Run:
    """One profiled run found under a log directory."""

    path: str  # the summary file, or the directory holding the event files
    summary: dict[str, Any]
    source: str = "summary"  # "summary" | "tensorboard_events"
    advice_markdown: str | None = None  # last advice text (event-file runs only)
    extra: dict[str, Any] = field(default_factory=dict)

    def label(self, root: str) -> str:
        """The run's directory relative to ``root`` (the path the user gave), as shown."""
        p = os.path.dirname(self.path) if self.source == "summary" else self.path
        rel = os.path.relpath(p, root) if os.path.isdir(root) else p
        return rel


def _load(path: str) -> dict[str, Any]:
    """:func:`dtprofile.summary_file.load_summary`, its errors as one-line RunErrors."""
    try:
        return load_summary(path)
    except SummaryError as e:
        raise RunError(str(e)) from None
    except OSError as e:
        raise RunError(f"{path}: cannot read ({e.strerror or e})") from None


def is_event_file(name: str) -> bool:
    """A TensorBoard event file's name."""
    return "tfevents" in name


def walk_logdir(root: str) -> Iterator[tuple[str, list[str]]]:
    """``(directory, its file names)`` under ``root``, in order, hidden folders left out."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        yield dirpath, sorted(filenames)


def find_runs(logdir: str) -> tuple[list[Run], list[str]]:
    """Every run under ``logdir``.

    Summaries first; event files only for directories not already covered by a summary
    (equal to, inside, or containing a summary's directory).

    Args:
        logdir: A directory (searched recursively), a summary file, or an event file (its
            directory's summary when there is one).

    Returns:
        ``(runs, errors)``: the runs found, and one line for each file that could not be
        read as one.

    Raises:
        RunError: ``logdir`` does not exist, or is an event file without dtprofile
            scalars.
    """
    if not os.path.exists(logdir):
        raise RunError(f"{logdir}: no such file or directory")
    if os.path.isfile(logdir):
        if is_event_file(os.path.basename(logdir)):
            beside = os.path.join(os.path.dirname(logdir), SUMMARY_NAME)
            if os.path.isfile(beside):  # the run finished: its summary wins, as for a directory
                return [Run(path=beside, summary=_load(beside))], []
            run = _run_from_events(os.path.dirname(logdir) or ".")
            if run is None:
                raise RunError(f"{logdir}: no dtprofile/ scalars in this event file")
            return [run], []
        return [Run(path=logdir, summary=_load(logdir))], []

    runs: list[Run] = []
    errors: list[str] = []
    summary_dirs: list[str] = []
    event_dirs: list[str] = []
    for dirpath, files in walk_logdir(logdir):
        if SUMMARY_NAME in files:
            path = os.path.join(dirpath, SUMMARY_NAME)
            summary_dirs.append(os.path.abspath(dirpath))
            try:
                runs.append(Run(path=path, summary=_load(path)))
            except RunError as e:
                errors.append(str(e))
        if any(is_event_file(f) for f in files):
            event_dirs.append(dirpath)

    def covered(d: str) -> bool:
        a = os.path.abspath(d)
        return any(a == s or a.startswith(s + os.sep) or s.startswith(a + os.sep) for s in summary_dirs)

    for d in event_dirs:
        if covered(d):
            continue
        try:
            run = _run_from_events(d)
        except Exception as e:  # noqa: BLE001 - a corrupt event file is one error line
            errors.append(f"{d}: cannot read the TensorBoard event files ({e})")
            continue
        if run is not None:
            runs.append(run)
    return runs, errors


def _run_from_events(directory: str) -> Run | None:
    """Rebuild a partial summary from the latest dtprofile/ scalars in ``directory``."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    # Size 1 per tag: TensorBoard's reservoir always keeps the most recent value.
    guidance = {k: 1 for k in ea.DEFAULT_SIZE_GUIDANCE}
    acc = ea.EventAccumulator(directory, size_guidance=guidance)
    acc.Reload()
    tags = acc.Tags()
    scalars = [t for t in tags.get("scalars", []) if t.startswith("dtprofile/")]
    if not any(t.startswith(("dtprofile/time/", "dtprofile/ratio/")) for t in scalars):
        return None

    latest: dict[str, tuple[int, float]] = {}
    for t in scalars:
        events = acc.Scalars(t)
        if events:
            latest[t] = (events[-1].step, float(events[-1].value))

    def val(tag: str) -> float | None:
        return latest[tag][1] if tag in latest else None

    steps = [s for t, (s, _) in latest.items() if t.startswith("dtprofile/time/")]
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "complete": False,
        "source": "tensorboard_events",
        "steps_total": max(steps) if steps else None,
        "per_step_ms": {k: val(f"dtprofile/time/{k}") for k in TIME_KEYS},
        "ratios": {k: val(f"dtprofile/ratio/{k}") for k in RATIO_KEYS},
    }
    ranks: dict[int, dict[str, Any]] = {}
    rank_keys = {
        "step_ms": "step",
        "compute_ms": "compute",
        "data_wait_ms": "data_wait",
        "comm_exposed_ms": "comm_exposed",
    }
    for t, (_, v) in latest.items():
        m = re.fullmatch(r"dtprofile/rank/(\w+)/rank(\d+)", t)
        if m and m.group(1) in rank_keys:
            r = int(m.group(2))
            ranks.setdefault(r, {"rank": r})[rank_keys[m.group(1)]] = v
    if ranks:
        summary["ranks"] = [ranks[r] for r in sorted(ranks)]
        summary["world_size"] = len(ranks)
    if "dtprofile/comm/grad_MB" in latest:
        summary["grad_bytes"] = int(round(latest["dtprofile/comm/grad_MB"][1] * 1e6))
    for k in ("algbw_GBps", "busbw_GBps"):
        if f"dtprofile/comm/{k}" in latest:
            summary[k] = val(f"dtprofile/comm/{k}")

    proj: dict[str, dict[float, float]] = {}
    for t, (_, v) in latest.items():
        m = re.fullmatch(r"dtprofile/projection/(\w+?)_G([0-9.]+)", t)
        if m:
            proj.setdefault(m.group(1), {})[float(m.group(2))] = v
    if proj:
        gpus = sorted({g for d in proj.values() for g in d})
        summary["projection"] = {"gpus": [int(g) if g == int(g) else g for g in gpus]}
        for key, d in proj.items():
            summary["projection"][key] = [d.get(g) for g in gpus]

    advice_md = None
    if "dtprofile/advice/text_summary" in tags.get("tensors", []):
        events = acc.Tensors("dtprofile/advice/text_summary")
        if events and events[-1].tensor_proto.string_val:
            advice_md = events[-1].tensor_proto.string_val[0].decode("utf-8", "replace")
    return Run(path=directory, summary=summary, source="tensorboard_events", advice_markdown=advice_md)
