"""Cross-rank aggregation that can never hang training.

Every log interval each rank all-gathers one small float vector (its window averages)
over a **separate gloo process group** created with a timeout. The gather is launched
asynchronously and only polled from the training thread, so a slow or dead rank never
blocks the others: they keep their local figures, and once the group's timeout expires
the failed gather disables further gathers with one warning. Only at the end of the run
does a rank wait for the final gather, and never longer than the timeout.

Ranks may run different numbers of steps (uneven inputs under DDP's ``join()``): a rank
that ends sends its final vector, flagged as final, into whatever gather the others are
at. Whoever receives a final vector stops gathering (the ended rank takes part in no
more) and reports that rank's final figures beside the others' latest; nobody waits
for a gather that cannot complete.

On the wire: ``all_gather`` of ``world_size`` float64 vectors of a few dozen elements
(plus the final flag) per interval.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import console
from ._torch_internals import allgather_with_timeout, default_store
from .analysis.uncertainty import BLOCK_KEYS, PROBE_KEYS
from .capture.windows import FIELDS
from .mesh_keys import COLL_KEYS
from .noise import SHARD_SAMPLE_KEYS
from .nvml import RANK_KEYS

__all__ = ["RankGather", "STEP_KEYS", "VECTOR_KEYS", "pack", "unpack", "shard_samples_of"]

log = logging.getLogger(__name__)

# A rank that falls this many gathers behind is treated as gone. Under DDP's join() a
# rank that ran out of data joins no gather until the others end (each waits at most the
# group's timeout), so the others' gathers pile up meanwhile: room for a long skew.
_MAX_OUTSTANDING = 64
# The tag of this rank's final gather (a completed gather with another tag that carries
# another rank's final flag means that rank ended first).
_FINAL = object()


#: How long the ranks wait for each other when profiling starts (at most the gather timeout).
START_WAIT_S = 10.0
_next_start = 0  # this process's place in the sequence of profiles started on every rank


def _why_gather_failed(exc: BaseException, timeout_s: float) -> str:
    """What a failed gather says happened: a rank that did not come in time, or one whose
    process failed or exited (the connection to it closed), which is that rank's failure
    and not the gather's."""
    text = str(exc)
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"a rank did not arrive within {timeout_s:g} s"
    first = text.split(". This is typically", 1)[0]  # gloo: "[file:line] Connection closed by peer [addr]"
    first = first.rsplit("] ", 1)[-1] if first.startswith("[") else first
    return f"another rank's process failed or exited: {first[:120]}"


class RankGather:
    """All-gather fixed-length vectors across ranks without ever blocking a step."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.rank = dist.get_rank() if self.enabled else 0
        self.group = None
        self._outstanding: list[tuple[Any, list[torch.Tensor], object]] = []  # (work, out, tag)
        self._completed: list[tuple[object, list[list[float]]]] = []  # (tag, vectors), not yet taken
        self.latest: list[list[float]] | None = None
        self.completed = 0
        self.ended_early: list[int] = []  # ranks whose final vector came before this rank's end
        # Every rank started this profiler: one verdict for all of them, which nothing later
        # changes on one rank only (what makes extra collectives, the probe steps, safe).
        self.started_together = self.enabled
        # The store key of this start, the same on every rank that made it (None: one rank,
        # or no store): what the ranks' meetings during this run are named under.
        self.start_key: str | None = None
        if self.enabled and not self._every_rank_arrives(min(timeout_s, START_WAIT_S)):
            self.started_together = False
            return
        if self.enabled:
            try:
                self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            except Exception as exc:
                self._fail(f"could not create the side gloo group: {exc!r}")

    def _every_rank_arrives(self, wait_s: float) -> bool:
        """Whether every rank starts profiling within ``wait_s``; else warn and disable.

        Creating the side group is collective: a profile started on some ranks only (a
        common mistake: ``profile()`` under ``if rank == 0``) would hold them in it for the
        whole gather timeout. So the ranks first count themselves in on the default
        store, and one verdict, written once (``compare_set``), decides for all of them:
        "go" by the rank that completes the count, "stop" by a rank that stopped waiting,
        whichever comes first. Every rank follows it, so either all create the group or
        none does. A rank that finds a verdict already written when it arrives missed
        that start (it did not profile then): it moves on to the next one.
        """
        global _next_start
        store = default_store()
        if store is None:  # another torch: the group's own creation waits (the timeout)
            return True
        try:
            while True:
                key = f"dtprofile/start/{_next_start}"
                _next_start += 1
                if not store.check([key + "/verdict"]):
                    break
            arrived = store.add(key, 1)
            first = arrived == 1
            verdict = store.compare_set(key + "/verdict", "", "go") if arrived >= self.world_size else None
            deadline, pause_s = time.monotonic() + wait_s, 0.005
            while verdict is None and time.monotonic() < deadline:
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.2)  # a light load on the store, however many ranks
                if store.check([key + "/verdict"]):
                    verdict = store.get(key + "/verdict")
            if verdict is None:
                verdict = store.compare_set(key + "/verdict", "", "stop")
            if verdict in (b"go", "go"):
                self.start_key = key
                return True
            arrived = min(store.add(key, 0), self.world_size)
        except Exception as exc:
            self._fail(f"the ranks could not meet on the store: {exc!r}")
            return False
        self.enabled = False
        # The first rank that came says so (rank 0 may be one that never called profile()).
        console.warn(
            f"dtprofile: profile() must be called on every rank of the process group: only "
            f"{arrived} of {self.world_size} ranks started it within {wait_s:g} s; reporting this "
            "rank's figures only",
            stacklevel=4,
            here=first,
        )
        return False

    def abandon(self) -> None:
        """Gather no more: the other ranks may never reach another gather (gone, or stuck in
        a collective this rank will not join); what was gathered so far stands."""
        self.enabled = False

    def _fail(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            console.warn(
                f"dtprofile: cross-rank gather disabled ({why}); reporting this rank's figures only", stacklevel=3
            )

    def launch(
        self, vector: Sequence[float], tag: object = None, final: bool = False, timeout_s: float | None = None
    ) -> bool:
        """Start gathering ``vector`` from every rank; returns at once, True if launched.

        A gather with a ``tag`` is handed back by :meth:`take_completed` once complete.
        ``timeout_s``: how long this gather may wait for the others in the background
        (default: the group's); a gather left waiting keeps the process from exiting.
        """
        if self.enabled:
            self.poll()
        if not self.enabled:
            return False
        if len(self._outstanding) >= _MAX_OUTSTANDING:
            # Skipping one would pair the ranks' later gathers out of order: stop instead.
            self._fail(f"{len(self._outstanding)} gathers still waiting for another rank")
            return False
        tensor = torch.tensor([*vector, float(final)], dtype=torch.float64)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = self._all_gather(out, tensor, self.timeout_s if timeout_s is None else timeout_s)
        except Exception as exc:
            self._fail(f"all_gather failed: {exc!r}")
            return False
        self._outstanding.append((work, out, tag))
        return True

    def _all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor, timeout_s: float) -> object:
        """``all_gather(out, tensor)`` on the side group, asynchronous, failing after ``timeout_s``.

        On the wire: each rank's ``tensor`` to every rank (gloo). The group's own
        ``all_gather`` cannot take a timeout of its own; the process group's method can.
        """
        try:
            return allgather_with_timeout(self.group, out, tensor, timedelta(seconds=timeout_s))
        except (ImportError, AttributeError, TypeError):  # another torch: the group's timeout
            return dist.all_gather(out, tensor, group=self.group, async_op=True)

    def poll(self) -> list[list[float]] | None:
        """Collect finished gathers; the newest complete result (or None)."""
        while self._outstanding and self._outstanding[0][0].is_completed():
            work, out, tag = self._outstanding.pop(0)
            try:
                work.wait()
            except Exception as exc:
                self._outstanding.clear()
                self._fail(_why_gather_failed(exc, self.timeout_s))
                return self.latest
            vectors = [t.tolist() for t in out]
            ended = [i for i, v in enumerate(vectors) if v.pop() and i != self.rank]
            self.latest = vectors
            self.completed += 1
            if tag is not None and tag is not _FINAL:
                self._completed.append((tag, vectors))
            if ended and tag is not _FINAL:  # their final vector met one of our interval gathers
                self._stop_for(ended)
                break
        return self.latest

    def take_completed(self) -> list[tuple[object, list[list[float]]]]:
        """The tagged gathers completed since the last call, oldest first: ``(tag, vectors)``."""
        done, self._completed = self._completed, []
        return done

    def current(self, vector: Sequence[float]) -> list[list[float]] | None:
        """After other ranks ended: their final vectors and the others' latest, with this
        rank's ``vector``; otherwise None (nothing gathered stands for now)."""
        if not self.ended_early or self.latest is None:
            return None
        self.latest[self.rank] = list(vector)
        return [list(v) for v in self.latest]

    def _stop_for(self, ended: list[int]) -> None:
        """Ranks ``ended`` sent their final figures: they join no more gathers."""
        self.ended_early = ended
        self.enabled = False
        self._outstanding.clear()  # gathers the ended ranks will never join
        console.warn(
            f"dtprofile: rank(s) {ended} ended before this rank (uneven step counts, e.g. DDP's "
            "join()); the report has their figures at their end and the other ranks' at the "
            "last common gather",
            stacklevel=4,
        )

    def finish(
        self, vector: Sequence[float], timeout_s: float | None = None, linger: bool = False
    ) -> list[list[float]] | None:
        """The final gather: wait for it, at most ``timeout_s`` (default: the gather's);
        None if it failed.

        A shorter ``timeout_s`` (a run that raised: the others may never come) bounds the
        gather itself too, so that it does not hold this process's exit; with ``linger``
        (under DDP's join(): the others come once this rank lets them go on) it stays open
        for the group's timeout, for another rank's interval gather to take.
        If other ranks ended first (seen before or while waiting), their final vectors and
        the others' latest, with this rank's ``vector``.
        """
        wait_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        if not self.launch(vector, tag=_FINAL, final=True, timeout_s=None if linger else wait_s):
            return self.current(vector)  # None unless other ranks ended first
        final = self.completed + len(self._outstanding)
        deadline = time.monotonic() + wait_s
        # Interval gathers still outstanding complete first; one of them may carry the final
        # vector of a rank that ended first (under DDP's join() it ends after this one).
        while self.enabled and self.completed < final and time.monotonic() < deadline:
            self.poll()
            if self.completed < final:
                time.sleep(0.002)
        if self.ended_early:
            return self.current(vector)
        if self.completed >= final:
            self.close()
            return self.latest
        if self.enabled:
            self._outstanding.clear()
            if linger:  # the others have yet to reach a gather: not a failure
                self.enabled = False
                log.info(
                    "dtprofile: the other ranks are still training (DDP join()); this rank reports "
                    "its own figures, they report its final ones"
                )
            else:
                self._fail(f"the final gather timed out after {wait_s:g} s")
        return None

    def close(self) -> None:
        """Destroy the side group once no gather is in flight (its threads and sockets would
        otherwise stay for the life of the process, one set per profiled run)."""
        group, self.group = self.group, None
        if group is None or self._outstanding:
            self.group = group
            return
        try:
            dist.destroy_process_group(group)
        except Exception as exc:
            log.debug("dtprofile: side group not destroyed: %r", exc)


# ---------------------------------------------------------------- what each rank sends
#: A rank's step figures, in the order its gathered vector carries them.
STEP_KEYS: tuple[str, ...] = (
    "rank",
    "steps",
    *FIELDS,
    "probe_steps",
    "probe_step",
    "probe_compute",
    "probe_comm",
    "step_all",
    "comm_timed_steps",
    "probe_passes",
    "probe_forward",
    "probe_backward",
    "probe_optimizer",
    "alone_steps",
    "alone_passes",
    "backward_timed_steps",
    *BLOCK_KEYS,
    *PROBE_KEYS,
    *COLL_KEYS,
)
#: The whole vector: the step figures, the rank's NVML figures
#: (:data:`dtprofile.nvml.RANK_KEYS`), and a sharded model's last gradient-noise samples.
VECTOR_KEYS: tuple[str, ...] = STEP_KEYS + tuple("telemetry_" + k for k in RANK_KEYS) + SHARD_SAMPLE_KEYS
_SHARD_OFFSET = len(VECTOR_KEYS) - len(SHARD_SAMPLE_KEYS)


def pack(row: dict[str, Any], telemetry: list[float], shard_samples: list[float]) -> list[float]:
    """One rank's vector: its row of step figures (None as NaN), telemetry and samples."""
    return (
        [float("nan") if row[k] is None else float(row[k]) for k in STEP_KEYS] + list(telemetry) + list(shard_samples)
    )


def unpack(vectors: list[list[float]]) -> list[dict[str, Any]]:
    """Each rank's row (NaN back to None) from the gathered vectors."""
    rows = []
    for vec in vectors:
        row: dict[str, Any] = {k: (None if math.isnan(v) else v) for k, v in zip(VECTOR_KEYS, vec, strict=False)}
        row["rank"] = int(row["rank"])
        row["steps"] = int(row["steps"] or 0)
        rows.append(row)
    return rows


def shard_samples_of(vectors: list[list[float]] | None) -> list[list[float]] | None:
    """Each rank's gradient-noise samples from the gathered vectors."""
    return None if vectors is None else [vec[_SHARD_OFFSET:] for vec in vectors]
