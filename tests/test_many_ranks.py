"""The cross-rank gather through the job's store (dtprofile/gather.py) and its many-rank
benchmark (benchmarks/many_ranks.py): no connection a rank beyond the one it has to the
store, whatever the world size; a rank that ends first; a store that fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from dtprofile import gather as gather_module
from dtprofile.gather import StoreExchange, _decode, _encode

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


# ---------------------------------------------------------------- the protocol, in one process
def _exchanges(store: dist.Store, world: int, share_rows: bool = False) -> list[StoreExchange]:
    return [StoreExchange(store, "t/start/0/gather", r, world, share_rows) for r in range(world)]


def _post_all(ranks: list[StoreExchange], seq: int, final: set[int] = frozenset()) -> None:
    for x in reversed(ranks):  # (rank 0 last: it reads the others once all are in)
        x.post(seq, _encode([float(x.rank), 10.0 * seq + x.rank, float(x.rank in final)]))


def test_a_gather_reaches_rank_0_and_leaves_no_key_behind():
    """Rank 0 reads every vector in one go; the others read one small key (not the rows,
    which nobody else uses); once every rank counted itself out the store is as before."""
    store = dist.HashStore()
    ranks = _exchanges(store, 4)
    base = store.num_keys()
    for seq in range(3):
        assert ranks[0].collect(seq, want_rows=False) is None  # (nobody in yet)
        _post_all(ranks, seq)
        got = ranks[0].collect(seq, want_rows=False)
        assert [v[:2] for v in got.vectors] == [[float(r), 10.0 * seq + r] for r in range(4)]
        assert got.finals == []
        assert not store.check([ranks[0].key(seq, "all")])  # rows kept for rank 0 alone
        for x in ranks[1:]:
            seen = x.collect(seq, want_rows=True)
            assert seen.vectors is None and seen.finals == []
        assert store.num_keys() == base, f"gather {seq} left keys"


def test_shared_rows_final_flags_and_the_size_bound(monkeypatch):
    """Rows go to the other ranks where they use them (share_rows), and wherever a rank
    sent its final vector; beyond SHARED_ROWS_MAX_RANKS they do not (N^2 bytes)."""
    store = dist.HashStore()
    ranks = _exchanges(store, 3, share_rows=True)
    _post_all(ranks, 0)
    assert ranks[0].collect(0, want_rows=True).finals == []
    assert [v[1] for v in ranks[2].collect(0, want_rows=True).vectors] == [0.0, 1.0, 2.0]
    assert [v[1] for v in ranks[1].collect(0, want_rows=True).vectors] == [0.0, 1.0, 2.0]

    ranks = _exchanges(store, 3)  # (rows for rank 0 only, but a rank ended: everyone reads them)
    for x in ranks:
        x.prefix = "t/start/1/gather"
    _post_all(ranks, 0, final={2})
    assert ranks[0].collect(0, want_rows=False).finals == [2]
    assert ranks[1].collect(0, want_rows=False).vectors[2][-1] == 1.0

    monkeypatch.setattr(gather_module, "SHARED_ROWS_MAX_RANKS", 2)
    ranks = _exchanges(store, 3, share_rows=True)
    for x in ranks:
        x.prefix = "t/start/2/gather"
    _post_all(ranks, 0, final={0, 1, 2})
    assert len(ranks[0].collect(0, want_rows=True).vectors) == 3
    beyond = ranks[1].collect(0, want_rows=True)
    assert beyond.vectors is None and beyond.finals == [0, 1, 2]


def test_rank_0_knows_when_every_rank_has_read_the_final_rows():
    """Where rank 0's process holds the store's server, it waits at stop (bounded) until the
    others have read the final rows it published: they are gone with it otherwise."""
    store = dist.HashStore()
    ranks = _exchanges(store, 3)
    for x in ranks:
        x.prefix = "t/start/readers/gather"
    _post_all(ranks, 0, final={0, 1, 2})
    ranks[0].collect(0, want_rows=True)
    assert ranks[0].published_final == 0 and not ranks[0].read_by_all(0)
    ranks[1].collect(0, want_rows=True)
    assert not ranks[0].read_by_all(0)  # (rank 2 has yet to read them)
    assert len(ranks[2].collect(0, want_rows=True).vectors) == 3
    assert ranks[0].read_by_all(0)


def test_giving_up_keeps_a_vector_others_may_still_read():
    """A rank that gives up on a gather the others may still complete (DDP's join(): they
    come once it lets them go on) leaves its vector for rank 0, and counts itself out: the
    keys still go once the others read them. One nobody will complete: its keys go."""
    store = dist.HashStore()
    ranks = _exchanges(store, 2)
    base = store.num_keys()
    ranks[1].post(0, _encode([1.0, 1.0, 1.0]))
    ranks[1].give_up(0, completable=True)
    ranks[0].post(0, _encode([0.0, 0.0, 0.0]))
    got = ranks[0].collect(0, want_rows=False)
    assert got.finals == [1] and got.vectors[1][:2] == [1.0, 1.0]
    assert store.num_keys() == base
    ranks[1].post(1, _encode([1.0, 2.0, 0.0]))
    ranks[1].give_up(1, completable=False)
    ranks[0].give_up(1, completable=False)
    assert store.num_keys() == base
    with pytest.raises(ValueError, match="do not split"):
        _decode(_encode([1.0, 2.0, 3.0]), 2)


def test_a_vector_goes_sparse_and_the_published_rows_split_without_lengths():
    """NaN entries cost a bit each, not 8 bytes; blobs one after another split again."""
    from dtprofile.gather import VECTOR_KEYS

    dense = [float("nan")] * (len(VECTOR_KEYS) + 1)
    dense[:3] = [1.0, 0.0, -2.5]
    blob = _encode(dense)
    assert len(blob) == 4 + (len(dense) + 7) // 8 + 3 * 8  # (length, bitmask, three float64)
    got = _decode(blob + _encode([float(v) for v in range(len(dense))]), 2)
    assert got[0][:3] == [1.0, 0.0, -2.5] and all(v != v for v in got[0][3:]) and got[1][-1] == len(dense) - 1
    with pytest.raises(ValueError, match="do not split"):
        _decode(blob[:-1], 1)


def test_notes_are_read_in_one_go_missing_ones_absent_keys_deleted():
    """Rank 0 reads the notes there (a rank that posted none is absent, never waited for),
    the newest value of each, and deletes them; the keys are under the start's prefix."""
    store = dist.HashStore()
    ranks = _exchanges(store, 6)
    base = store.num_keys()
    for x in ranks[1:]:
        if x.rank not in (3, 5):
            x.post_note("host", f'"h{x.rank}"'.encode())
    ranks[2].post_note("host", b'"again"')
    assert ranks[1].note_key("host", 1).startswith("t/start/0/")
    assert ranks[0].read_notes("host", range(1, 6)) == {1: b'"h1"', 2: b'"again"', 4: b'"h4"'}
    ranks[0].delete_notes("host", [1, 2, 4])
    assert store.num_keys() == base and ranks[0].read_notes("host", [1, 2]) == {}


class _Recording:
    """A HashStore that records the keys set, in order (or fails, or hangs, where told)."""

    def __init__(self, fail: str | None = None, hang_s: float = 0.0) -> None:
        self.store, self.sets, self.fail, self.hang_s = dist.HashStore(), [], fail, hang_s

    def __getattr__(self, name):
        return getattr(self.store, name)

    def set(self, key, value):
        self.sets.append(key)
        return self.store.set(key, value)

    def check(self, keys):
        if self.fail:
            raise RuntimeError(self.fail)
        time.sleep(self.hang_s)
        return self.store.check(keys)


def _gather(store, rank: int, world: int) -> gather_module.RankGather:
    """A RankGather as rank ``rank`` of ``world`` would hold one, on ``store`` (no process group)."""
    g = gather_module.RankGather(timeout_s=5.0)
    g.enabled, g.rank, g.world_size = True, rank, world
    g._exchange = StoreExchange(store, "t/start/9/gather", rank, world)
    return g


def test_a_rank_posts_its_notes_before_its_final_vector_and_rank_0_reads_them():
    """post_note never touches the store on the training thread; the gather's thread sets
    the newest value before the final vector; a note too big is dropped; rank 0 keeps its
    own; read_notes never raises nor hangs on a store that fails or does not answer."""
    recording = _Recording()
    one = _gather(recording, 1, 2)
    one.post_note("host", "first")
    one.post_note("host", "node-1")
    one.post_note("huge", "x" * gather_module.NOTE_MAX_BYTES)  # (dropped: over the bound once quoted)
    assert recording.sets == []  # (no thread yet: held until the first vector)
    assert one.launch([1.0, 2.0], final=True)
    zero = _gather(recording.store, 0, 2)
    zero.post_note("host", "node-0")
    assert zero.finish([0.0, 2.0]) == [[0.0, 2.0], [1.0, 2.0]]
    note, vector = one._exchange.note_key("host", 1), one._exchange.key(0, "1")
    assert recording.sets.index(note) < recording.sets.index(vector) and "huge" not in str(recording.sets)
    assert zero.read_notes("host", [0, 1, 2]) == {0: "node-0", 1: "node-1"}
    assert one.read_notes("host", [0, 1]) == {}  # (rank 0 only)
    one.close()
    for store in (_Recording(fail="injected"), _Recording(hang_s=3.0)):
        late = _gather(store, 0, 2)
        late.post_note("host", "node-0")
        t0 = time.monotonic()
        assert late.read_notes("host", [0, 1], timeout_s=0.5) == {0: "node-0"}
        assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------- real ranks
def many_ranks_snapshots(rank: int, world: int, cfg: dict) -> dict:
    """benchmarks/many_ranks.py's rank: descriptors and threads around a profiled run."""
    import many_ranks

    return many_ranks._rank(rank, world, cfg)


@pytest.mark.slow
def test_descriptors_do_not_grow_with_the_world_size():
    """The side gloo group opened N-1 sockets a rank (+5 at 2 ranks, +7 at 4 here); the
    store's connection is the one each rank had: nothing opened, at 2 ranks as at 4, one
    thread a rank while profiling, all of it gone after stop."""
    for world in (2, 4):
        for r in run_ranks(many_ranks_snapshots, world, {"steps": 8}, timeout_s=120):
            assert r["ranks"] == world, r
            assert r["during"]["fds"] == r["before"]["fds"], (world, r)
            assert r["after"]["fds"] <= r["before"]["fds"], (world, r)
            assert r["during"]["tasks"] - r["before"]["tasks"] == 1, (world, r)  # the gather's thread
            assert r["after"]["tasks"] == r["before"]["tasks"], (world, r)


def ends_first_or_store_fails(rank: int, world: int, cfg: dict) -> dict:
    """Each rank profiles a plain model (only dtprofile's gather connects the ranks):
    ``ends``: that rank stops first; ``fails``: that rank's store refuses the gather's
    writes (``set`` raises) once profiling started."""
    import logging
    import warnings

    import dtprofile

    logged: list[str] = []  # (rank 0 warns; the other ranks log the same line at INFO)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("dtprofile").addHandler(handler)
    logging.getLogger("dtprofile").setLevel(logging.INFO)
    if rank == cfg.get("fails"):
        real = gather_module.default_store()

        class Refusing:
            def __getattr__(self, name):
                return getattr(real, name)

            def set(self, key, value):
                if "/gather/" in key:
                    raise RuntimeError("injected: the store refused the write")
                return real.set(key, value)

        gather_module.default_store = lambda: Refusing()
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=3, gather_timeout_s=cfg["timeout_s"])
    steps = 8 if rank == cfg.get("ends") else 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof.start()
        for _ in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
        t0 = time.monotonic()
        report = prof.stop().to_dict()
    return {
        "hosts": [r.get("host") for r in report["ranks"]],
        "stop_s": time.monotonic() - t0,
        "rank_steps": sorted([int(r["rank"]), r["steps"]] for r in report["ranks"]),  # (JSON: no int keys)
        "warnings": [str(w.message) for w in caught if "dtprofile" in str(w.message)] + logged,
        "threads": [t.name for t in __import__("threading").enumerate()],
    }


@pytest.mark.slow
def test_a_rank_that_ends_first_reaches_every_other_rank():
    """With 3 ranks, rank 1 ends first: rank 0 reads its final vector, and rank 2 learns
    it from rank 0's one key (not by reading every rank's); both report its figures at
    its end beside the others', and nobody waits out the timeout."""
    res = run_ranks(ends_first_or_store_fails, 3, {"ends": 1, "timeout_s": 20.0}, timeout_s=120)
    for r in res:
        r["rank_steps"] = dict(r["rank_steps"])
        assert r["stop_s"] < 5.0, r
        assert sorted(r["rank_steps"]) == [0, 1, 2], r
        assert r["rank_steps"][1] == 8 - 1, r
        assert not any("did not arrive" in w or "timed out" in w for w in r["warnings"]), r
        assert "dtprofile-gather" not in r["threads"], r
    assert res[0]["hosts"] == [__import__("socket").gethostname()] * 3, res[0]  # (each rank's note)
    for late in (res[0], res[2]):  # (rank 0's a warning, rank 2's a line logged)
        assert sum("rank(s) [1] ended before this rank" in w for w in late["warnings"]) == 1, late


@pytest.mark.slow
def test_a_store_that_fails_degrades_to_own_figures_with_one_warning():
    """Rank 1's store refuses the gather's writes: it says so once and reports its own
    figures (a line logged: a warning is rank 0's); rank 0, whose gathers then never
    complete, warns once within the timeout (how many ranks came) and reports its own.
    Neither raises nor hangs."""
    res = run_ranks(ends_first_or_store_fails, 2, {"fails": 1, "timeout_s": 2.0}, timeout_s=120)
    for r in res:
        r["rank_steps"] = dict(r["rank_steps"])
    failed, waiting = res[1], res[0]
    assert list(failed["rank_steps"]) == [1] and list(waiting["rank_steps"]) == [0], res
    gathers = [w for w in failed["warnings"] if "gather" in w]
    assert len(gathers) == 1 and "the store failed" in gathers[0] and "injected" in gathers[0], failed
    gathers = [w for w in waiting["warnings"] if "gather" in w]
    assert len(gathers) == 1 and "1 of 2 ranks arrived within 2 s" in gathers[0], waiting
    assert waiting["stop_s"] < 2.0 + 3.0, waiting
    for r in res:
        assert "dtprofile-gather" not in r["threads"], r


# ---------------------------------------------------------------- the benchmark
@pytest.mark.slow
def test_many_ranks_quick_prints_its_tables():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "many_ranks.py"), "--quick", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout
    for world in (2, 4):
        assert f"| this    | {world} |" in out, out
    assert "+0 (max +0)" in out and "| NO" not in out, out
    assert "Rank 0's read, alone" in out and "| 512 " in out, out
