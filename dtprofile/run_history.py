"""Earlier runs of the same job under a log directory, for intervals that hold what
changes from one run to the next.

One run's intervals (:mod:`dtprofile.analysis.uncertainty`) hold its own variation over
steps, blocks and ranks. What moves a whole run (where the ranks' threads landed, another
job on the node, the network's load that hour) shows only across runs. So rank 0 appends
each finished run's figures, one JSON line, to ``<logdir>/dtprofile_runs.jsonl``, and a
later run of the same job, in that log directory or one beside it (``runs/a``,
``runs/b``: a directory per run, as TensorBoard reads them), pools them into its
intervals (``pool_runs`` of them; 0 pools nothing).

*The same job* is the same :func:`job_key`: world size, device, backend, framework,
model class and parameter count, gradient bytes, optimizer, batch size, micro-batches,
loader workers, and the parallel layout (a mesh's dimensions, a pipeline's schedule,
stages and microbatches). A run that changed any of them (following the advice, say) starts
a history of its own; a change the key cannot see (the model's code) is the user's to
mark, by deleting the file or passing ``pool_runs=0``.

The file keeps the latest :data:`MAX_ENTRIES` runs; it is rewritten whole, atomically,
and a file that cannot be read is left out with a debug line, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ._values import parse_finite
from .analysis.uncertainty import BLOCK_FIELDS

__all__ = ["HISTORY_NAME", "MAX_ENTRIES", "POOLED_FIGURES", "append_run", "earlier_runs", "job_key"]

log = logging.getLogger(__name__)

HISTORY_NAME = "dtprofile_runs.jsonl"
#: Runs the file keeps (all jobs together); older lines are dropped when it is rewritten.
MAX_ENTRIES = 64
#: The ``per_step_ms`` figures kept per run: the blocks' (the ones the replicates move) but the
#: data's transfer and DDP's buffer broadcast, parts of the data wait and the exposed communication.
POOLED_FIGURES: tuple[str, ...] = tuple(f for f in BLOCK_FIELDS if f not in ("data_transfer", "comm_buffers"))
#: Log directories beside the run's whose history files are read (the latest written).
MAX_SIBLINGS = 64
#: Entries of the parent directory looked at for them.
MAX_SCANNED = 1024
#: A line longer than this is not one of ours (the file was replaced): left out.
_MAX_LINE_CHARS = 4096


def job_key(summary: Mapping[str, Any]) -> str:
    """What makes two runs the same job, as a short hash of the summary's fields.

    Args:
        summary: A summary, or the part of one with ``world_size``, ``device``,
            ``device_name``, ``backend``, ``grad_bytes`` and ``run``.

    Returns:
        12 hex digits.

    Example:
        >>> a = job_key({"world_size": 2, "run": {"batch_size": 32}})
        >>> a == job_key({"world_size": 2, "run": {"batch_size": 32}}), a == job_key({"world_size": 4})
        (True, False)
    """
    run = summary.get("run") or {}
    optimizer = run.get("optimizer") or {}
    mesh, pipe = summary.get("mesh") or {}, summary.get("pipeline") or {}
    fields = [
        summary.get("world_size"),
        summary.get("device"),
        summary.get("device_name"),
        summary.get("backend"),
        summary.get("grad_bytes"),
        run.get("framework"),
        run.get("model_class"),
        run.get("param_count"),
        optimizer.get("class") if isinstance(optimizer, Mapping) else None,
        run.get("batch_size"),
        run.get("micro_batches"),
        run.get("num_workers"),
        # The parallel layout: a mesh's dimensions, a pipeline's schedule, stages and microbatches.
        [(d.get("label"), d.get("size"), d.get("role")) for d in mesh.get("dims") or [] if isinstance(d, dict)],
        [pipe.get(k) for k in ("schedule", "stages", "group_size", "microbatches")] if pipe else None,
    ]
    return hashlib.sha1(json.dumps(fields, default=str).encode()).hexdigest()[:12]


def _entry(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The line a finished run leaves: its job, its time, and its figures; None when it
    has none worth pooling (no step figure)."""
    per_step = summary.get("per_step_ms") or {}
    figures = {k: parse_finite(per_step.get(k)) for k in POOLED_FIGURES}
    if not figures["step"]:
        return None
    return {
        "job": job_key(summary),
        "time": round(time.time(), 3),
        "steps": summary.get("steps_profiled"),
        "per_step_ms": {k: v for k, v in figures.items() if v is not None},
    }


def _read(path: str) -> list[dict[str, Any]]:
    """The file's entries, oldest first; lines that are not an entry are left out."""
    entries = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(line) > _MAX_LINE_CHARS:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and isinstance(entry.get("per_step_ms"), dict) and "job" in entry:
                    entries.append(entry)
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        log.debug("dtprofile: earlier runs not read from %s: %r", path, exc)
        return []
    return entries


def _history_files(logdir: str) -> list[str]:
    """``logdir``'s history file and its siblings' (a log directory per run, as TensorBoard
    reads them), the :data:`MAX_SIBLINGS` latest written; at most :data:`MAX_SCANNED`
    entries of the parent looked at, so that a crowded parent costs little."""
    own = os.path.join(logdir, HISTORY_NAME)
    parent = os.path.dirname(os.path.abspath(logdir))
    found: list[tuple[float, str]] = []
    try:
        with os.scandir(parent) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SCANNED:
                    break
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                path = os.path.join(entry.path, HISTORY_NAME)
                try:
                    found.append((os.stat(path).st_mtime, path))
                except OSError:
                    continue
    except OSError as exc:
        log.debug("dtprofile: sibling runs not read from %s: %r", parent, exc)
    files = [p for _, p in sorted(found)[-MAX_SIBLINGS:]]
    own_real = os.path.realpath(own)
    return [p for p in files if os.path.realpath(p) != own_real] + [own]


def earlier_runs(logdir: str | None, job: str, limit: int) -> list[dict[str, float]]:
    """The ``per_step_ms`` figures of the latest ``limit`` earlier runs of ``job`` in
    ``logdir`` and the log directories beside it, oldest first; ``[]`` without a log
    directory, a run of that job or a ``limit``.

    Example:
        >>> earlier_runs(None, "0123456789ab", 8)
        []
    """
    if logdir is None or limit <= 0:
        return []
    entries = [e for path in _history_files(logdir) for e in _read(path) if e.get("job") == job]
    entries.sort(key=lambda e: parse_finite(e.get("time")) or 0.0)
    return [
        {k: float(v) for k, v in e["per_step_ms"].items() if k in POOLED_FIGURES and parse_finite(v) is not None}
        for e in entries[-limit:]
    ]


def append_run(logdir: str, summary: Mapping[str, Any]) -> bool:
    """Add a finished run's line to ``<logdir>/dtprofile_runs.jsonl`` (rewritten whole and
    atomically, the latest :data:`MAX_ENTRIES` kept).

    Args:
        logdir: The run's log directory.
        summary: Its final summary.

    Returns:
        Whether a line was written (not for a run without a step figure).

    Raises:
        OSError: The file could not be written (the caller warns).
    """
    entry = _entry(summary)
    if entry is None:
        return False
    path = os.path.join(logdir, HISTORY_NAME)
    entries = (_read(path) + [entry])[-MAX_ENTRIES:]
    fd, tmp = tempfile.mkstemp(prefix=".dtprofile_runs.", dir=logdir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps(e, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True
