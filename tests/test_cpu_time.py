"""The loader's CPU time per batch, measured in the main process and in worker processes,
and the advice that follows from it: a loader that waits gets workers beyond the cores."""

from __future__ import annotations

import logging
import os
import statistics
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dtprofile
from dtprofile.capture.cpu_time import process_cpu_s
from dtprofile.capture.handoff import PROBE_MIN_BYTES, HandoffCost, HandoffProbe, measure_handoff

LOAD_MS = 12.0


class _Items(Dataset):
    """Each item takes LOAD_MS: spent computing (``spin``) or waiting (``sleep``)."""

    def __init__(self, kind: str, n: int = 64) -> None:
        self.kind, self.n = kind, n
        self.walls_ms: list[float] = []  # each item's own wall time (in the main process)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        if self.kind == "sleep":
            time.sleep(LOAD_MS / 1e3)
        else:
            end = time.thread_time() + LOAD_MS / 1e3
            while time.thread_time() < end:
                pass
        self.walls_ms.append((time.perf_counter() - t0) * 1e3)
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def _run(kind: str, workers: int, steps: int = 40, items: _Items | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(items or _Items(kind), batch_size=1, num_workers=workers, persistent_workers=workers > 0)
    with dtprofile.profile(model, opt, warmup_steps=4, every_n_steps=1000) as prof:
        done = 0
        while done < steps:
            for x, y in prof.loader(loader):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                done += 1
                if done == steps:
                    break
    return prof.report().to_dict()


def test_process_cpu_s_reads_this_process():
    before = process_cpu_s(os.getpid())
    if before is None:
        pytest.skip("no /proc here")
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.03


def _loader_kind_follows_its_cpu_share(s: dict, cpu_ms: float) -> None:
    """The loader's CPU share is ``cpu_ms`` a batch over the time a batch takes to load
    (the main process: its wait; one worker: a step), and its kind that share against the
    threshold. On an idle machine a loader that spins is "cpu", one that sleeps "io"; on a
    busy one the spinning loader waits for a core too, and its share drops (0.12 under a
    load average of 8 on 2 cores)."""
    from dtprofile.analysis.sizing import LOADER_IO_MAX_CPU_SHARE

    rec, per = s["recommendations"], s["per_step_ms"]
    load = per["data_wait"] if not s["run"]["num_workers"] else per["step"]
    share = rec["loader_cpu_share"]
    assert share == pytest.approx(min(1.0, cpu_ms / load), rel=0.05), (rec, cpu_ms, per)
    assert rec["loader_kind"] == ("io" if share < LOADER_IO_MAX_CPU_SHARE else "cpu"), rec


@pytest.mark.parametrize("kind", ["spin", "sleep"])
def test_the_main_process_loaders_cpu_time_per_batch(kind):
    items = _Items(kind)
    s = _run(kind, workers=0, items=items)
    loader = s["run"]["cpu_time"]
    assert loader["fetches"] >= 30 and loader["workers_alive"] == 0
    assert s["run"]["batch_bytes"] == 8 * 4 + 8  # x: 8 float32, y: one int64
    assert s["run"]["shm_copy_ms"] is None  # (a small batch: its hand-over is the fixed cost)
    # A fetch's wall time is its item's (batch 1), measured by the item itself on the
    # same fetches (the last ones: the counts start after warm-up), plus the loader's own
    # fraction of a ms. Never less than the item's LOAD_MS, of sleep or of CPU.
    own_ms = statistics.fmean(items.walls_ms[-loader["fetches"] :])
    assert own_ms >= LOAD_MS and 0.98 * own_ms <= loader["fetch_ms"] <= 1.1 * own_ms + 1.0, (loader, own_ms)
    rec = s["recommendations"]
    _loader_kind_follows_its_cpu_share(s, loader["fetch_cpu_ms"])
    if kind == "spin":
        # The item spins LOAD_MS of this thread's CPU time, however long that takes on a
        # busy machine: the CPU clock reads it whatever the load (the wall clock does not).
        assert loader["fetch_cpu_ms"] == pytest.approx(LOAD_MS, rel=0.3)
    else:
        assert loader["fetch_cpu_ms"] < 0.2 * LOAD_MS
        assert rec["loader_kind"] == "io"


@pytest.mark.parametrize("kind", ["spin", "sleep"])
def test_the_worker_processes_cpu_time_per_batch(kind):
    if process_cpu_s(os.getpid()) is None:
        pytest.skip("no /proc here: the live workers' CPU time cannot be read")
    s = _run(kind, workers=1)
    loader = s["run"]["cpu_time"]
    assert loader["workers_alive"] == 1
    rec = s["recommendations"]
    _loader_kind_follows_its_cpu_share(s, loader["worker_cpu_ms_per_batch"])
    if kind == "spin":
        # Each batch costs the worker LOAD_MS of CPU (plus its share of collation and IPC).
        assert loader["worker_cpu_ms_per_batch"] == pytest.approx(LOAD_MS, rel=0.35)
    else:
        assert loader["worker_cpu_ms_per_batch"] < 0.3 * LOAD_MS
        assert rec["loader_kind"] == "io" and rec["num_workers"] > 1
        f = next(f for f in s["advice"] if f["id"] == "data_bound")
        assert "beyond the CPU cores" in f["action"]


def test_ranks_sharing_a_host_label_the_projection(monkeypatch):
    from dtprofile.render.views import projection_caption

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = _run("sleep", workers=0, steps=30)
    assert s["run"]["ranks_per_host"] == 2
    shared = s["projection"]["shared_host"]
    # All of this compute is the training thread's own CPU work: on a core throughout
    # (1.0) on an idle machine; waiting for one a share of the time on a busy one (0.5 with
    # one other busy thread per core).
    assert shared["ranks_per_host"] == 2 and 0.25 <= shared["compute_cpu_share"] <= 1.0, shared
    assert "compute as measured with 2 ranks sharing a host" in projection_caption(s["projection"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _run("sleep", workers=0, steps=12)["projection"]["shared_host"] is None


def test_one_fetch_in_every_few_reads_the_cpu_clock_and_stands_for_all():
    """Every fetch is timed; the CPU clock (a system call) is read on the first fetch of
    each pass (which starts the loader: counted as itself) and on one other fetch in
    FETCH_CPU_EVERY, whose rate stands for the rest."""
    from dtprofile.capture.data_wait import FETCH_CPU_EVERY

    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(2 * FETCH_CPU_EVERY + 3)]
    with dtprofile.profile(model, opt, warmup_steps=2, every_n_steps=1000) as prof:
        for _ in range(2):  # two passes: each starts its count again
            for x, y in prof.loader(batches):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        data = prof._engine.data
        assert data.fetch_count == 2 * len(batches) and data.pass_starts == 2
        assert data.fetch_cpu_samples == 2 * 3  # fetches 1, 9 and 17 of each pass
    loader = prof.report().to_dict()["run"]["cpu_time"]
    assert loader["fetches"] == 2 * len(batches) - 2  # (counted after the warm-up's 2 steps)
    assert loader["fetch_cpu_ms"] is not None and 0.0 <= loader["fetch_cpu_ms"] < loader["fetch_ms"] + 0.05


class _SlowToStart:
    """A loader whose pass takes START_MS of CPU to start (its workers, its sampler), then
    yields cheap batches."""

    START_MS = 30.0

    def __init__(self, n: int) -> None:
        self.batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(n)]

    def __iter__(self):
        end = time.thread_time() + self.START_MS / 1e3
        while time.thread_time() < end:
            pass
        return iter(self.batches)


def test_a_passes_start_counts_once_not_for_every_fetch():
    """Starting a pass is the loader's CPU time, counted as it is: the sampled fetches'
    rate is not applied to it (one slow start would count eight times over)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = _SlowToStart(24)
    with dtprofile.profile(model, opt, warmup_steps=2, every_n_steps=1000) as prof:
        for _ in range(3):
            for x, y in prof.loader(loader):
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    cpu = prof.report().to_dict()["run"]["cpu_time"]
    assert cpu["fetches"] == 3 * 24 - 2
    # Two passes started after the warm-up: 2 x 30 ms over 70 fetches, plus the batches' own.
    expected_ms = 2 * _SlowToStart.START_MS / cpu["fetches"]
    assert cpu["fetch_cpu_ms"] == pytest.approx(expected_ms, rel=0.3, abs=0.1)
    assert cpu["training_thread_cpu_ms_per_step"] is not None and cpu["training_thread_cpu_ms_per_step"] > 0


def test_a_baseline_after_the_last_sampled_fetch_takes_the_runs_rate():
    """The counts start after warm-up: with no sampled fetch since, the run's rate stands
    in, so the training figures still leave the fetches out."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(6)]
    with dtprofile.profile(model, opt, warmup_steps=3, every_n_steps=1000) as prof:
        for x, y in prof.loader(batches):  # fetch 1 is the only sampled one: before the counts start
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert prof._engine.data.fetch_cpu_samples == 1
    cpu = prof.report().to_dict()["run"]["cpu_time"]
    assert cpu["fetches"] == 3
    assert cpu["fetch_cpu_ms"] is not None and cpu["training_thread_cpu_ms_per_step"] is not None


def test_a_large_batch_loaded_in_the_main_process_gets_its_hand_over_measured():
    # 2 MiB batches loaded in the main process: what a worker's copy of one into shared
    # memory and its release would cost this machine is measured once, for the advice.
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(64, 8192), torch.randint(0, 2, (64,))) for _ in range(2)]
    with dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=1000) as prof:
        for x, y in prof.loader(batches * 3):
            nn.functional.cross_entropy(model(x[:, :8]), y).backward()
            opt.step()
            opt.zero_grad()
    run = prof.report().to_dict()["run"]
    assert run["batch_bytes"] == 64 * 8192 * 4 + 64 * 8
    assert run["shm_copy_ms"] > 0.0 and run["shm_release_ms"] > 0.0


def test_the_hand_over_probe_measures_once_and_only_where_it_matters(caplog, monkeypatch):
    calls = []

    def fake(nbytes):
        calls.append(nbytes)
        return HandoffCost(nbytes, 4.0, 1.0)

    probe = HandoffProbe(fake)
    assert probe.cost(None, 0) is None and probe.cost(PROBE_MIN_BYTES - 1, 0) is None
    assert probe.cost(8 << 20, 2) is None  # with workers it is in the measured times
    assert probe.cost(8 << 20, None) == HandoffCost(8 << 20, 4.0, 1.0)
    assert probe.cost(16 << 20, 0) == HandoffCost(16 << 20, 8.0, 2.0)  # the same costs a byte
    assert calls == [8 << 20]

    # Under the file_system strategy the probe would start torch's shared-memory manager.
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    assert HandoffProbe(fake).cost(8 << 20, 0) is None and calls == [8 << 20]
    monkeypatch.undo()

    def broken(nbytes):
        raise OSError("no shared memory")

    probe = HandoffProbe(broken)
    with caplog.at_level(logging.WARNING, logger="dtprofile.capture.handoff"):
        assert probe.cost(8 << 20, 0) is None and probe.cost(8 << 20, 0) is None
    assert len([r for r in caplog.records if "hand-over" in r.getMessage()]) == 1


def test_measure_handoff_scales_a_batch_past_the_probes_size():
    cost = measure_handoff(4 << 20, max_bytes=1 << 20, repeats=1)
    assert cost.batch_bytes == 4 << 20 and cost.copy_ms >= 0.0 and cost.release_ms > 0.0
    with pytest.raises(ValueError, match="batch_bytes must be > 0"):
        measure_handoff(0)
