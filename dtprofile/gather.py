"""Cross-rank aggregation that can never hang training, through the job's store.

Every log interval each rank hands one fixed-length float vector (its window averages,
:func:`pack`) to the gather, numbered in order (0, 1, 2, ... the same on every rank).
No process group is created and no collective runs: the vectors go through the c10d
store that ``init_process_group`` set up, over the one connection each rank already
holds to it, whatever the world size (a side gloo group was a full mesh: N-1 sockets in
every process, 4,095 at 4,096 ranks). The keys are named under the start's key
(``dtprofile/start/<n>``, agreed on the store by :meth:`RankGather._every_rank_arrives`),
so a later profile never meets an earlier one's:

- each rank other than 0 ``set``s its vector (sparse: :func:`_encode`; final flag last) under
  ``<start>/g<seq>/<rank>`` and counts itself in (``add`` on ``<start>/g<seq>/n``);
- rank 0, once the count is complete, reads them all with one ``multi_get`` and writes
  ``<start>/g<seq>/done``: which ranks sent their final vector, and whether the gathered
  vectors are published for the others (``<start>/g<seq>/all``, one key);
- the other ranks read ``done`` (and ``all`` where they use the rows: an integration
  that summarises every interval on every rank, their final report, another rank that
  ended) rather than N keys each; each deletes its own vector once ``done`` is out, and
  whoever counts last on ``<start>/g<seq>/seen`` deletes ``done``, ``all`` and the count:
  the store holds at most a couple of intervals' vectors, however long the run.

Each rank may also post small notes (:meth:`RankGather.post_note`: its host, for one),
set before its next vector under ``<start>/note/<name>/<rank>``; rank 0 reads them once,
after the final gather (:meth:`RankGather.read_notes`), and deletes them.

Beyond :data:`SHARED_ROWS_MAX_RANKS` ranks the gathered rows are not published (every
rank reading N vectors is N^2 bytes through one server): rank 0 reports the cluster, the
other ranks their own figures (docs/benchmarks.md, "Many ranks", has the figures).

All store traffic runs on one background thread per rank (``dtprofile-gather``); the
training thread only queues a vector and collects what came back, so a slow store or a
slow rank never blocks a step. Each gather has a deadline (the gather timeout): one not
complete by then disables further gathers with one warning, and the rank reports its own
figures, whatever the thread is doing. Only at the end of the run does a rank wait for
the final gather, and never longer than the timeout; rank 0 then waits, at most
:data:`FINAL_READ_WAIT_S`, until the others have read the final rows it published (where
its process holds the store's server, they would be gone with it).

Ranks may run different numbers of steps (uneven inputs under DDP's ``join()``): a rank
that ends sends its final vector, flagged as final, into whatever gather the others are
at. Whoever receives a final vector stops gathering (the ended rank takes part in no
more) and reports that rank's final figures beside the others' latest; nobody waits
for a gather that cannot complete.

On the wire, per interval: N-1 vectors into the store and out to rank 0, each sparse
(:func:`_encode`: a bitmask of :data:`VECTOR_KEYS` and the float64 of the entries
present; 285 bytes a plain DDP rank's, about 2.1 KB with a DeviceMesh's collectives,
3,080 dense), a few dozen bytes of counts and ``done`` per rank, and,
where the rows are shared, N vectors out to each rank that reads them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist

from . import console
from ._torch_internals import default_store

# What each rank sends and its wire format (importable from here too, as they always were).
from .rank_vector import STEP_KEYS, VECTOR_KEYS, _decode, _decode_one, _encode, pack, shard_samples_of, unpack

__all__ = [
    "NOTE_MAX_BYTES",
    "RankGather",
    "SHARED_ROWS_MAX_RANKS",
    "STEP_KEYS",
    "StoreExchange",
    "VECTOR_KEYS",
    "pack",
    "unpack",
    "shard_samples_of",
]

log = logging.getLogger(__name__)

# A rank that falls this many gathers behind is treated as gone. Under DDP's join() a
# rank that ran out of data joins no gather until the others end (each waits at most the
# gather timeout), so the others' gathers pile up meanwhile: room for a long skew.
_MAX_OUTSTANDING = 64
# The tag of this rank's final gather (a completed gather with another tag that carries
# another rank's final flag means that rank ended first).
_FINAL = object()

#: The most ranks whose gathered rows rank 0 publishes for the others: each rank that
#: reads them reads N vectors (3 KB each at most), N^2 through the one store in all (12 MB at 64
#: ranks, 50 GB at 4,096). Beyond it the other ranks report their own figures.
SHARED_ROWS_MAX_RANKS = 64

#: The most bytes a rank's note (:meth:`RankGather.post_note`) may take, JSON-encoded.
NOTE_MAX_BYTES = 64 * 1024
#: The longest :meth:`RankGather.read_notes` waits for the store (once a run: after a read
#: that timed out, the next ones do not wait).
NOTE_READ_TIMEOUT_S = 10.0

#: How long the ranks wait for each other when profiling starts (at most the gather timeout).
START_WAIT_S = 10.0
#: How long rank 0 waits at stop for the other ranks to read the final rows (at most the
#: gather timeout; a rank that never reads costs rank 0 this much at stop, once).
FINAL_READ_WAIT_S = 3.0
_next_start = 0  # this process's place in the sequence of profiles started on every rank

# The background thread polls the store for a gather's completion: at first soon (the
# ranks mostly arrive together), then less often. Rank 0 polls one counter; the others,
# all of them, one key each: their longest pause grows with the world size, so that the
# store answers a few thousand of these a second at most, however many ranks wait.
_FIRST_PAUSE_S = 0.002
_RANK0_MAX_PAUSE_S = 0.05
# How long close() waits for the thread to finish its last store operations.
_THREAD_STOP_S = 2.0


def _max_pause_s(rank: int, world_size: int) -> float:
    return _RANK0_MAX_PAUSE_S if rank == 0 else max(0.05, world_size / 4000.0)


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    getter = getattr(store, "multi_get", None)
    if getter is None:  # (a store without it: one round trip a key)
        return [store.get(k) for k in keys]
    return list(getter(keys))


@dataclass
class _Result:
    """A completed gather as one rank sees it."""

    seq: int
    vectors: list[list[float]] | None  # every rank's vector, final flag last; None: not shared with this rank
    finals: list[int]  # the ranks whose vector was flagged final


class StoreExchange:
    """The gather's keys on the job's store: what each rank writes and reads.

    No threads and no waits: every call is a few store round trips that return at once
    (the gather's background thread calls it; tests call it directly).

    Args:
        store: the job's c10d store (``torch.distributed``'s default store).
        prefix: the key every rank agreed on for this start (``dtprofile/start/<n>``).
        rank: this rank.
        world_size: the number of ranks.
        share_rows: rank 0 publishes every gather's rows for the others (they summarise
            every interval), not only where one is final.

    Example:
        >>> store = dist.HashStore()
        >>> ranks = [StoreExchange(store, "doc", r, 2) for r in range(2)]
        >>> ranks[1].post(0, _encode([1.0, 1.0])); ranks[0].post(0, _encode([0.0, 1.0]))
        >>> ranks[0].collect(0, want_rows=True).vectors
        [[0.0, 1.0], [1.0, 1.0]]
        >>> ranks[1].collect(0, want_rows=True).finals
        [0, 1]
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, share_rows: bool = False) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.share_rows = share_rows
        self.arrived = 0  # rank 0: how many other ranks the oldest gather had, when last asked
        self._own: dict[int, bytes] = {}  # rank 0: its own vectors, by number (never stored)
        self._collected_upto = -1  # gathers complete in order: every one up to this is done
        self.published_final: int | None = None  # rank 0: a gather whose final rows it published

    def key(self, seq: int, name: str) -> str:
        """The store key ``name`` of gather ``seq``."""
        return f"{self.prefix}/g{seq}/{name}"

    def post(self, seq: int, blob: bytes) -> None:
        """This rank's vector for gather ``seq`` (rank 0 keeps its own: it reads the rest)."""
        if self.rank == 0:
            self._own[seq] = blob
            return
        self.store.set(self.key(seq, str(self.rank)), blob)
        self.store.add(self.key(seq, "n"), 1)

    def collect(self, seq: int, want_rows: bool) -> _Result | None:
        """Gather ``seq`` if it is complete (else None). ``want_rows``: this rank uses the
        rows (read where rank 0 published them)."""
        result = self._collect_all(seq) if self.rank == 0 else self._collect_published(seq, want_rows)
        if result is not None:
            self._collected_upto = seq
        return result

    def _collect_all(self, seq: int) -> _Result | None:
        """Rank 0: every rank's vector once all are in; then ``done`` (and ``all``)."""
        store = self.store
        self.arrived = int(store.add(self.key(seq, "n"), 0))
        if self.arrived < self.world_size - 1:
            return None
        keys = [self.key(seq, str(r)) for r in range(1, self.world_size)]
        blobs = _multi_get(store, keys)
        own = self._own.pop(seq)
        vectors = [_decode_one(bytes(blob))[0] for blob in (own, *blobs)]
        if len({len(v) for v in vectors}) != 1:
            raise ValueError("the ranks' vectors differ in length (dtprofile versions differ?)")
        finals = [r for r, vector in enumerate(vectors) if vector[-1]]
        shared = self.world_size <= SHARED_ROWS_MAX_RANKS and (self.share_rows or bool(finals))
        if shared:  # (before done: whoever reads done may read all at once)
            store.set(self.key(seq, "all"), b"".join([own, *blobs]))
            if finals:
                self.published_final = seq
        store.set(self.key(seq, "done"), ("rows" if shared else "-") + ";" + ",".join(map(str, finals)))
        store.delete_key(self.key(seq, "n"))
        for r in finals:  # a rank that ended may have stopped looking: its vector goes here
            if r:
                store.delete_key(keys[r - 1])
        self._seen(seq)
        return _Result(seq, vectors, finals)

    def _collect_published(self, seq: int, want_rows: bool) -> _Result | None:
        """Another rank: ``done`` once rank 0 wrote it; the rows where they are used."""
        store = self.store
        done = self.key(seq, "done")
        if not store.check([done]):
            return None
        shared, _, ended = bytes(store.get(done)).decode().partition(";")
        finals = [int(r) for r in ended.split(",") if r]
        vectors = None
        if shared == "rows" and (want_rows or finals):
            vectors = _decode(store.get(self.key(seq, "all")), self.world_size)
        store.delete_key(self.key(seq, str(self.rank)))
        self._seen(seq)
        return _Result(seq, vectors, finals)

    def _seen(self, seq: int) -> None:
        """Count this rank out of gather ``seq``; the last one deletes its shared keys."""
        if self.store.add(self.key(seq, "seen"), 1) >= self.world_size:
            for name in ("done", "all", "seen"):
                self.store.delete_key(self.key(seq, name))

    def read_by_all(self, seq: int) -> bool:
        """Rank 0: whether every rank has read gather ``seq`` (the last one deletes ``done``)."""
        return not self.store.check([self.key(seq, "done")])

    def give_up(self, seq: int, completable: bool) -> None:
        """This rank no longer waits for gather ``seq``.

        ``completable``: the others may still complete it (a rank late, or one that needs
        this rank to let it go on: DDP's join()): this rank's vector stays for rank 0 to
        read, and it counts itself out now, so that the shared keys still go once the
        others read them. Otherwise (a rank ended before it) nobody will complete it:
        this rank's keys go.
        """
        if seq <= self._collected_upto:  # (collected meanwhile: counted out already)
            return
        if self.rank == 0:
            self._own.pop(seq, None)
            if not completable:
                self.store.delete_key(self.key(seq, "n"))
        elif completable:
            self._seen(seq)
        else:
            self.store.delete_key(self.key(seq, str(self.rank)))

    def note_key(self, name: str, rank: int) -> str:
        """The store key of rank ``rank``'s note ``name``."""
        return f"{self.prefix}/note/{name}/{rank}"

    def post_note(self, name: str, blob: bytes) -> None:
        """This rank's note ``name`` (JSON bytes), replacing any it posted before."""
        self.store.set(self.note_key(name, self.rank), blob)

    def read_notes(self, name: str, ranks: Sequence[int]) -> dict[int, bytes]:
        """The notes ``name`` of ``ranks`` that are in the store, read in one ``multi_get``
        and then deleted; a rank without one is absent. Raises what the store raises."""
        keys = {r: self.note_key(name, r) for r in ranks}
        # (a get of a key not there waits for it, up to the store's timeout: only those there)
        present = self._present(list(keys.values()))
        if not present:
            return {}
        there = set(present)
        wanted = [r for r, k in keys.items() if k in there]
        blobs = _multi_get(self.store, [keys[r] for r in wanted])
        return dict(zip(wanted, (bytes(b) for b in blobs), strict=True))

    def delete_notes(self, name: str, ranks: Sequence[int]) -> None:
        """Delete the notes ``name`` of ``ranks`` (those absent: nothing happens)."""
        for r in ranks:
            self.store.delete_key(self.note_key(name, r))

    def _present(self, keys: list[str]) -> list[str]:
        """The ``keys`` in the store. ``check`` answers for all of them at once, so the
        keys are halved where it says no: one round trip when every rank posted, about
        2 m log2(N) for m missing of N (a few hundred at 4,096 ranks with a few missing)."""
        if not keys or self.store.check(keys):
            return keys
        if len(keys) == 1:
            return []
        half = len(keys) // 2
        return self._present(keys[:half]) + self._present(keys[half:])


class _GatherThread:
    """The one thread that talks to the store for a rank's gather: it posts the vectors
    the training thread queued, polls the oldest gather not yet complete (pausing longer
    each time nothing changed) and hands back what completed, in order."""

    def __init__(self, exchange: StoreExchange) -> None:
        self.exchange = exchange
        self.results: deque[_Result] = deque()  # the thread appends; the training thread takes
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._posts: deque[tuple[int, bytes]] = deque()
        self._notes: dict[str, bytes] = {}  # (name -> JSON): set before any vector queued after them
        self._pending: deque[tuple[int, bool]] = deque()  # (seq, want_rows) to collect, in order
        self._give_ups: deque[tuple[int, bool]] = deque()
        self._stopping = False
        self._linger_until: float | None = None  # stopping, but collecting until then
        self._max_pause_s = _max_pause_s(exchange.rank, exchange.world_size)
        self._thread = threading.Thread(target=self._run, name="dtprofile-gather", daemon=True)
        self._thread.start()

    def post(self, seq: int, blob: bytes, want_rows: bool) -> None:
        """Queue this rank's vector for gather ``seq``, and its collection."""
        with self._lock:
            self._posts.append((seq, blob))
            self._pending.append((seq, want_rows))
        self._wake.set()

    def post_note(self, name: str, blob: bytes) -> None:
        """Queue this rank's note ``name``: set before any vector queued after it."""
        with self._lock:
            self._notes[name] = blob  # (a newer value replaces one not yet set)
        self._wake.set()

    def give_up(self, seqs: list[int], completable: bool) -> None:
        """Stop collecting gathers ``seqs`` (see :meth:`StoreExchange.give_up`)."""
        if not seqs:
            return
        with self._lock:
            self._pending = deque(p for p in self._pending if p[0] not in seqs)
            self._give_ups.extend((seq, completable) for seq in seqs)
        self._wake.set()

    def stop(self, timeout_s: float, linger_until: float | None = None) -> bool:
        """End the thread once what is queued has gone to the store; whether it ended
        within ``timeout_s`` (a store that does not answer keeps it, a daemon, past that).

        ``linger_until`` (a ``time.monotonic()``): go on collecting the gathers still
        pending until then, not waiting for it here (rank 0 is the one that completes
        them for the others)."""
        with self._lock:
            self._linger_until = linger_until
        self.request_stop()
        if linger_until is not None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def request_stop(self) -> None:
        """End the thread, not waiting for it (also when its gather is garbage-collected)."""
        with self._lock:
            self._stopping = True
        self._wake.set()

    def _run(self) -> None:
        pause_s = _FIRST_PAUSE_S
        while True:
            self._wake.clear()  # (before the queues are read: a post after this wakes the wait)
            with self._lock:
                notes, self._notes = self._notes, {}
                posts, self._posts = list(self._posts), deque()
                give_ups, self._give_ups = list(self._give_ups), deque()
                head = self._pending[0] if self._pending else None
                stopping = self._stopping
                linger_until = self._linger_until
            try:
                # The notes first: once rank 0 has this rank's final vector, they are in the store.
                for name, note in notes.items():
                    self.exchange.post_note(name, note)
                for seq, blob in posts:
                    self.exchange.post(seq, blob)
                for seq, completable in give_ups:
                    self.exchange.give_up(seq, completable)
                # (after the posts: a final vector left for the others is out)
                if stopping and (head is None or linger_until is None or time.monotonic() > linger_until):
                    return
                result = self.exchange.collect(*head) if head is not None else None
            except Exception as exc:  # the training thread reports it, once
                self.error = exc
                return
            if result is not None:
                with self._lock:
                    if self._pending and self._pending[0] == head:
                        self._pending.popleft()
                self.results.append(result)
            if result is not None or posts or notes:
                pause_s = _FIRST_PAUSE_S  # (the next gather may be complete already)
                continue
            self._wake.wait(pause_s if head is not None else None)  # (idle: until woken)
            pause_s = min(pause_s * 2, self._max_pause_s)


@dataclass
class _Outstanding:
    """A gather this rank launched, not yet complete."""

    seq: int
    tag: object
    deadline: float  # time.monotonic() after which it counts as failed
    timeout_s: float


class RankGather:
    """Gather fixed-length vectors from every rank through the job's store, never
    blocking a step (see the module's docstring).

    Args:
        timeout_s: how long a gather may wait for the others before it counts as failed.
        share_rows: every rank uses every interval's rows (an integration that summarises
            each interval on every rank); otherwise only rank 0 reads them, and the other
            ranks read the rows of the final gather and of one that a rank ended in.
    """

    def __init__(self, timeout_s: float, share_rows: bool = False) -> None:
        self.timeout_s = timeout_s
        self.share_rows = share_rows
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.rank = dist.get_rank() if self.enabled else 0
        self._exchange: StoreExchange | None = None
        self._thread: _GatherThread | None = None  # started at the first gather
        self._linger_until: float | None = None  # a final gather left to complete after stop
        self._final_rows: list[list[float]] | None = None  # the final gather's, where this rank got them
        self._next_seq = 0
        self._outstanding: list[_Outstanding] = []
        self._completed: list[tuple[object, list[list[float]]]] = []  # (tag, vectors), not yet taken
        self.latest: list[list[float]] | None = None
        self.completed = 0
        self.ended_early: list[int] = []  # ranks whose final vector came before this rank's end
        self._own_notes: dict[str, Any] = {}  # rank 0: its own notes (never stored)
        self._early_notes: dict[str, bytes] = {}  # notes posted before the thread started
        self._notes_unanswered = False  # a read of notes timed out: no more (one wait at most)
        # Every rank started this profiler: one verdict for all of them, which nothing later
        # changes on one rank only (what makes extra collectives, the probe steps, safe).
        self.started_together = self.enabled
        # The store key of this start, the same on every rank that made it (None: one rank,
        # or no store): what the ranks' meetings during this run are named under.
        self.start_key: str | None = None
        if not self.enabled:
            return
        store = default_store()
        if store is None:
            self._fail("this torch has no default store to gather through")
            self.started_together = False
            return
        if not self._every_rank_arrives(store, min(timeout_s, START_WAIT_S)):
            self.started_together = False
            return
        self._exchange = StoreExchange(store, f"{self.start_key}/gather", self.rank, self.world_size, share_rows)
        if self.rank != 0 and self.world_size > SHARED_ROWS_MAX_RANKS:
            log.info(
                "dtprofile: %d ranks: rank 0 gathers and reports every rank's figures; this rank reports its own",
                self.world_size,
            )

    def _every_rank_arrives(self, store: Any, wait_s: float) -> bool:
        """Whether every rank starts profiling within ``wait_s``; else warn and disable.

        The gather needs every rank: a profile started on some ranks only (a common
        mistake: ``profile()`` under ``if rank == 0``) would have them wait for the others
        at every gather. So the ranks first count themselves in on the default store, and
        one verdict, written once (``compare_set``), decides for all of them: "go" by the
        rank that completes the count, "stop" by a rank that stopped waiting, whichever
        comes first. Every rank follows it, so either all gather or none does. A rank
        that finds a verdict already written when it arrives missed that start (it did
        not profile then): it moves on to the next one.
        """
        global _next_start
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
        ``timeout_s``: how long this gather may wait for the others (default: the
        gather's); past it the gather fails and gathering stops.
        """
        if self.enabled:
            self.poll()
        if not self.enabled or self._exchange is None:
            return False
        if len(self._outstanding) >= _MAX_OUTSTANDING:
            # Skipping one would pair the ranks' later gathers out of order: stop instead.
            self._fail(f"{len(self._outstanding)} gathers still waiting for another rank")
            return False
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            blob = _encode([*vector, float(final)])
            if self._thread is None:
                self._thread = _GatherThread(self._exchange)
                for name, note in self._early_notes.items():  # (before the first vector)
                    self._thread.post_note(name, note)
                self._early_notes.clear()
                # A gather dropped without stop() (its engine abandoned) ends its thread too.
                weakref.finalize(self, self._thread.request_stop)
            self._thread.post(seq, blob, want_rows=self.share_rows or final)
        except Exception as exc:
            self._fail(f"the gather could not start: {exc!r}")
            return False
        self._outstanding.append(_Outstanding(seq, tag, time.monotonic() + wait_s, wait_s))
        return True

    def post_note(self, name: str, value: Any) -> None:
        """Post a small JSON-able ``value`` from this rank under ``name``, for rank 0 to
        read at the end (:meth:`read_notes`); calling it again replaces the value.

        Never blocks: the gather's thread sets it in the store, before any vector this
        rank gathers after this call, so once rank 0 holds every rank's final vector, the
        notes posted before are in the store. Rank 0 keeps its own in memory. A value
        that is not JSON-able, or over :data:`NOTE_MAX_BYTES` encoded, is dropped (one
        debug line).

        Args:
            name: The note's name (the same on every rank).
            value: What JSON can encode: a string, a number, a small list or dict.
        """
        try:
            blob = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()  # (JSON the file takes)
        except (TypeError, ValueError) as exc:
            log.debug("dtprofile: note %r not posted: %s", name, exc)
            return
        if len(blob) > NOTE_MAX_BYTES:
            log.debug("dtprofile: note %r not posted: %d bytes, over %d", name, len(blob), NOTE_MAX_BYTES)
            return
        if self.rank == 0:
            self._own_notes[name] = json.loads(blob)  # (a copy, as the others' are)
            return
        if self._exchange is None or not self.enabled:  # (no gather, or gathers given up: nobody reads it)
            return
        try:
            thread = self._thread
            if thread is None:
                self._early_notes[name] = blob  # (the thread, once it starts, sets these first)
            else:
                thread.post_note(name, blob)
        except Exception as exc:  # never into the training loop
            log.debug("dtprofile: note %r not posted: %r", name, exc)

    def read_notes(self, name: str, ranks: Sequence[int], timeout_s: float | None = None) -> dict[int, Any]:
        """Rank 0, after :meth:`finish` returned the final vectors: the notes ``name`` of
        ``ranks`` (:meth:`post_note`), by rank; a rank without one is absent. Other ranks
        get ``{}``.

        One ``multi_get`` of the notes in the store (those there, found first: a read of
        one not there would wait for it), then their keys are deleted. It waits at most
        ``timeout_s`` (default: the gather's timeout, at most
        :data:`NOTE_READ_TIMEOUT_S`); a store that fails or does not answer in time gives
        only rank 0's own note (one debug line). Never raises.

        Args:
            name: The note's name.
            ranks: The ranks whose notes are wanted.
            timeout_s: The longest wait for the store.

        Returns:
            ``{rank: value}``.
        """
        if self.rank != 0:
            return {}
        out: dict[int, Any] = {0: self._own_notes[name]} if 0 in ranks and name in self._own_notes else {}
        others = [r for r in ranks if r != 0]
        exchange = self._exchange
        if exchange is None or not others:
            return out
        if self._notes_unanswered:  # (an earlier read timed out: its thread may still hold the store)
            return out
        wait_s = min(self.timeout_s, NOTE_READ_TIMEOUT_S) if timeout_s is None else timeout_s
        read = _read_notes_bounded(exchange, name, others, wait_s)
        if read is None:
            self._notes_unanswered = True
            return out
        for rank, blob in read.items():
            try:
                out[rank] = json.loads(blob)
            except ValueError as exc:
                log.debug("dtprofile: rank %d's note %r unreadable: %s", rank, name, exc)
        return out

    def poll(self) -> list[list[float]] | None:
        """Collect finished gathers; the newest complete result (or None)."""
        thread = self._thread
        if thread is None:
            return self.latest
        while self._outstanding:
            head = self._outstanding[0]
            while thread.results and thread.results[0].seq < head.seq:
                thread.results.popleft()  # (completed after this rank gave up on it)
            if not thread.results:
                if thread.error is not None:
                    self._give_up(completable=True)
                    self._fail(f"the store failed: {thread.error!r}")
                elif time.monotonic() > head.deadline:
                    self._give_up(completable=True)
                    self._fail(self._why_late(head.timeout_s))
                break
            result = thread.results.popleft()
            self._outstanding.pop(0)
            self.completed += 1
            ended = [r for r in result.finals if r != self.rank]
            if result.vectors is not None:
                for vector in result.vectors:
                    vector.pop()  # (the final flag)
                self.latest = result.vectors
                if head.tag is _FINAL:
                    self._final_rows = result.vectors
                elif head.tag is not None:
                    self._completed.append((head.tag, result.vectors))
            if ended and head.tag is not _FINAL:  # their final vector met one of our interval gathers
                self._stop_for(ended)
                break
        return self.latest

    def _why_late(self, timeout_s: float) -> str:
        """What a gather past its deadline says happened (rank 0 knows how many came)."""
        if self.rank == 0 and self._exchange is not None:
            return f"{self._exchange.arrived + 1} of {self.world_size} ranks arrived within {timeout_s:g} s"
        return f"a rank did not arrive within {timeout_s:g} s"

    def _give_up(self, completable: bool) -> None:
        """Wait for no outstanding gather any more (see :meth:`StoreExchange.give_up`)."""
        seqs = [o.seq for o in self._outstanding]
        self._outstanding.clear()
        if self._thread is not None:
            self._thread.give_up(seqs, completable)

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
        self._give_up(completable=False)  # gathers the ended ranks will never join
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
        None if it failed. The gather's thread ends here, whatever the outcome.

        A shorter ``timeout_s`` (a run that raised: the others may never come) bounds the
        wait. With ``linger`` (under DDP's join(): the others come once this rank lets them
        go on) this rank's final vector stays in the store after the wait, for another
        rank's interval gather to take.
        If other ranks ended first (seen before or while waiting), their final vectors and
        the others' latest, with this rank's ``vector``.
        """
        try:
            return self._finish(vector, timeout_s, linger)
        finally:
            self.close()

    def _finish(self, vector: Sequence[float], timeout_s: float | None, linger: bool) -> list[list[float]] | None:
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
            return self._final_rows  # (None: beyond SHARED_ROWS_MAX_RANKS, rank 0's alone)
        if self.enabled:
            if linger:  # the others have yet to reach a gather: not a failure
                self.enabled = False
                self._linger_until = self._outstanding[-1].deadline
                log.info(
                    "dtprofile: the other ranks are still training (DDP join()); this rank reports "
                    "its own figures, they report its final ones"
                )
            else:
                # (through the store a dead peer closes no connection here: its absence is all
                # that shows, the same as a rank still training)
                self._fail(
                    f"the final gather timed out after {wait_s:g} s: another rank's process failed or exited, "
                    "or has not reached the end of its run"
                )
        return None

    def close(self) -> None:
        """End the gather's thread once what it was handed has gone to the store (after a
        lingering final gather: once that completes, or at its deadline); gathers still
        outstanding are given up, their vectors left for the others to read."""
        self.enabled = False  # (no thread from here on: a later launch would wait for nothing)
        linger_until, self._linger_until = self._linger_until, None
        if linger_until is None:
            self._give_up(completable=True)
        thread, self._thread = self._thread, None
        if thread is not None and not thread.stop(_THREAD_STOP_S, linger_until):
            log.debug("dtprofile: the gather's thread is still in a store operation; left to end by itself")
            return
        self._wait_for_readers()

    def _wait_for_readers(self) -> None:
        """Rank 0, once its thread has ended: until the other ranks have read the final rows
        it published, at most :data:`FINAL_READ_WAIT_S` (where rank 0's process holds the
        store's server, as ``mp.spawn`` and ``init_method="tcp://"`` have it, a rank 0 that
        exits right after stop would take the rows with it)."""
        exchange = self._exchange
        seq = exchange.published_final if exchange is not None else None
        if exchange is None or seq is None:
            return
        exchange.published_final = None
        deadline = time.monotonic() + min(self.timeout_s, FINAL_READ_WAIT_S)
        pause_s = _FIRST_PAUSE_S
        try:
            while not exchange.read_by_all(seq) and time.monotonic() < deadline:
                time.sleep(pause_s)
                pause_s = min(2 * pause_s, _RANK0_MAX_PAUSE_S)
        except Exception as exc:  # (the store gone: nobody left to read)
            log.debug("dtprofile: the final rows' readers not awaited: %r", exc)


def _read_notes_bounded(
    exchange: StoreExchange, name: str, ranks: list[int], timeout_s: float
) -> dict[int, bytes] | None:
    """:meth:`StoreExchange.read_notes` on a thread of its own, then the keys read deleted,
    waited for at most ``timeout_s`` in all (a store call may block up to the store's own
    timeout, minutes), the thread joined once done (nothing of it outlives the call where
    the store answers). ``{}`` on a failure, None when the store did not answer in time."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def read() -> None:
        try:
            box["notes"] = exchange.read_notes(name, ranks)
        except Exception as exc:
            box["error"] = exc
        try:
            if box.get("notes"):
                exchange.delete_notes(name, list(box["notes"]))
        except Exception as exc:
            log.debug("dtprofile: the notes %r stay in the store: %r", name, exc)
        finally:
            done.set()

    try:
        thread = threading.Thread(target=read, name="dtprofile-notes", daemon=True)
        thread.start()
    except Exception as exc:
        log.debug("dtprofile: notes %r not read: %r", name, exc)
        return {}
    if not done.wait(timeout_s):
        if "notes" in box:  # (read, still deleting: the notes stand; their keys may stay)
            return cast("dict[int, bytes]", box["notes"])
        log.debug("dtprofile: notes %r not read: the store did not answer within %g s", name, timeout_s)
        return None
    thread.join(_THREAD_STOP_S)
    if "error" in box:
        log.debug("dtprofile: notes %r not read: %r", name, box["error"])
        return {}
    notes: dict[int, bytes] = box["notes"]
    return notes
