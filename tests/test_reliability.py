"""dtprofile never breaks, slows down or hangs the training it watches.

One test per protection; each fails if the protection is removed."""

from __future__ import annotations

import gc
import json
import os
import threading
import tracemalloc
import warnings

import pytest
import torch
from distributed import run_ranks
from torch import nn
from workers import ddp_odd, environment_of, gather_missing_rank

import dtprofile
from dtprofile.capture.data_wait import DataWait
from dtprofile.capture.parts import guarded as _guard
from dtprofile.capture.steps import StepTracker
from dtprofile.engine import Engine
from dtprofile.intervals import Intervals
from dtprofile.options import Options
from dtprofile.summary import write_summary


def _train(model, opt, prof=None, steps=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]
    batches = prof.loader(data) if prof is not None else data
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _fresh(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- 1. fault isolation
@pytest.mark.parametrize("target", ["clock", "data", "sink", "summary"])
def test_internal_error_warns_once_disables_that_part_and_training_is_unchanged(target, tmp_path, monkeypatch):
    ref_model, ref_opt = _fresh()
    _train(ref_model, ref_opt)
    model, opt = _fresh()
    prof = dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=1, every_n_steps=3)

    def boom(*a, **k):
        raise RuntimeError(f"injected {target} fault")

    if target == "clock":
        monkeypatch.setattr("dtprofile.capture.clocks.HostClock.mark", boom)
    elif target == "data":
        monkeypatch.setattr(DataWait, "add", _guard("data")(boom))  # guarded like the real one
    elif target == "sink":
        monkeypatch.setattr("dtprofile.sinks.tensorboard.TensorBoardSink.log", boom)
    elif target == "summary":
        monkeypatch.setattr("dtprofile.intervals.build_summary", boom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with prof:
            _train(model, opt, prof)
    ours = [str(w.message) for w in caught if "dtprofile" in str(w.message)]
    assert len(ours) == 1, ours  # warned once with the cause
    assert "disabled" in ours[0] and "injected" in ours[0]
    for a, b in zip(_weights(ref_model), _weights(model), strict=False):
        assert torch.equal(a, b)  # training results unchanged
    summary = prof.report().to_dict()
    if target == "summary":  # no summary could be built: the report says so
        assert (
            summary["error"].startswith("summary unavailable after an internal error")
            and "injected" in summary["error"]
        )
        assert summary["steps_total"] > 0
    else:
        assert summary["parts_disabled"], "the failed part is named in the summary"


def test_comm_fault_is_isolated():
    engine = Engine(Options())
    engine.active = True

    class BadBucket:
        def buffer(self):
            raise RuntimeError("injected comm fault")

    with pytest.warns(RuntimeWarning, match="comm disabled"):
        assert engine.comm.bucket_ready(BadBucket()) is None
    assert not engine.parts["comm"].enabled
    assert engine.comm.bucket_ready(BadBucket()) is None  # no second warning, no exception


# ---------------------------------------------------------------- 2. no hangs
@pytest.mark.slow
def test_launched_ranks_run_in_the_launchers_environment_of_the_moment(monkeypatch):
    """The multi-process tests' ranks come from a fork server started at the first
    launch: each still gets the environment as the launch finds it (a variable set or
    removed since), as a freshly spawned process would."""
    names = ["DTPROFILE_TEST_LAUNCH", "DTPROFILE_TEST_GONE"]
    monkeypatch.setenv("DTPROFILE_TEST_GONE", "1")
    run_ranks(environment_of, 1, {"names": names})  # (the server may start here, with both)
    monkeypatch.setenv("DTPROFILE_TEST_LAUNCH", "set since")
    monkeypatch.delenv("DTPROFILE_TEST_GONE")
    seen = run_ranks(environment_of, 2, {"names": names})
    assert seen == [{"DTPROFILE_TEST_LAUNCH": "set since", "DTPROFILE_TEST_GONE": None}] * 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stuck", "killed"])
def test_a_rank_that_never_arrives_makes_the_others_warn_and_go_on(mode):
    cfg = dict(mode=mode, timeout_s=3.0, stuck_s=12.0, steps_rank0=12, steps_rank1=12)
    res = run_ranks(gather_missing_rank, 2, cfg, timeout_s=60, allow_missing=True)
    r0 = res[0]
    assert (res[1] is None) == (mode == "killed")
    assert r0["stop_s"] < 3.0 + 5.0  # waited at most about the timeout
    assert any("gather" in w for w in r0["warnings"])
    assert r0["ranks"] == [0]  # went on with local figures


@pytest.mark.slow
def test_a_rank_whose_loop_raised_does_not_wait_out_the_gather_timeout():
    """An exception leaves the `with` block on one rank while its peer is stuck in the
    collective it left: the exception surfaced only after gather_timeout_s (60 s by
    default). Its final gather now waits FAILED_RUN_GATHER_TIMEOUT_S."""
    from dtprofile.intervals import FAILED_RUN_GATHER_TIMEOUT_S

    cfg = dict(mode="raises", timeout_s=30.0, stuck_s=6.0, steps_rank0=8, steps_rank1=8)
    res = run_ranks(gather_missing_rank, 2, cfg, timeout_s=90, allow_missing=True)
    raised = res[1]
    assert raised["stop_s"] < FAILED_RUN_GATHER_TIMEOUT_S + 2.0, raised
    assert raised["complete"] is False and raised["ranks"] == [1]


@pytest.mark.slow
def test_a_rank_whose_loop_raised_lets_its_peer_fail_at_once():
    """The final gather a failed run gave up on stayed in flight for the group's timeout,
    and gloo waits for it as the process exits: its peer, blocked in DDP's next all-reduce
    until then, stayed blocked 30.6 s here (62 s at the default timeout after a Ctrl-C,
    against 1.4 s without dtprofile). The gather now gives up with the wait."""
    from workers import one_rank_raises

    res = run_ranks(one_rank_raises, 2, dict(timeout_s=30.0), timeout_s=120)
    assert res[1]["error"] == "the loop failed"
    assert res[0]["error"] and res[0]["blocked_s"] < 12.0, res[0]


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1])
def test_a_rank_that_ends_first_is_reported_and_nobody_waits(first):
    """Uneven step counts (DDP's join()): the rank that ends first sends its final figures
    into the others' interval gather; they stop gathering instead of pairing the wrong
    rounds or waiting out the timeout, and every report has both ranks."""
    steps = {first: 12, 1 - first: 25}
    cfg = dict(mode="ended", timeout_s=20.0, steps_rank0=steps[0], steps_rank1=steps[1], step_s=0.01)
    res = run_ranks(gather_missing_rank, 2, cfg, timeout_s=90)
    early, late = res[first], res[1 - first]
    for r in res:
        assert r["stop_s"] < 5.0  # nobody waits for a gather that cannot complete
        assert r["ranks"] == [0, 1]
    assert early["steps_total"] == 12 and late["steps_total"] == 25
    # The rank that went on reports the other's final figures: all its profiled steps.
    assert late["rank_steps"][first] == early["rank_steps"][first] == 12 - 1
    assert late["rank_steps"][1 - first] == 25 - 1
    if first == 1:  # warnings come from rank 0 only
        assert any("rank(s) [1] ended before this rank" in w for w in late["warnings"])
    assert not any("did not arrive" in w or "timed out" in w for r in res for w in r["warnings"])


@pytest.mark.slow
def test_uneven_inputs_under_ddp_join_end_without_waiting_out_the_timeout():
    """Under join() the rank with fewer batches shadows the other's all-reduces and reaches
    its final gather last: the other rank, already waiting for its own final gather, takes
    the final vector from its interval gather and stops at once, with both ranks."""
    from workers import ddp_join_uneven

    res = run_ranks(ddp_join_uneven, 2, dict(steps=[25, 12], timeout_s=20.0), timeout_s=90)
    for r in res:
        assert r["stop_s"] < 5.0, r  # not the 20 s timeout
        assert r["ranks"] == [0, 1], r
    assert res[0]["steps_total"] == 25 and res[1]["steps_total"] == 12
    assert any("rank(s) [1] ended before this rank" in w for w in res[0]["warnings"])
    # Under join() a probe cannot reduce by hand (the ranks that ran out shadow DDP's own
    # reductions only): the first probe step finds the join, and from the next step on
    # dtprofile's hook times the buckets and probe steps hold the reductions in it.
    for r in res:
        assert r["comm_source"] == "dtprofile" and r["comm_hooks"] == 1, r
        assert r["probe_steps"] >= 1 and r["comm_total"] > 0, r
    assert not any("did not arrive" in w or "timed out" in w for r in res for w in r["warnings"])


@pytest.mark.slow
def test_profile_inside_join_and_a_long_skew_keep_both_ranks():
    """stop() inside join() ran before join's shadowing, so the other rank, blocked in DDP,
    never reached a gather: rank 0's loop stalled for the gather timeout (60 s by default).
    Profiled outside join(), a skew of more than 4 intervals disabled the gather (the
    ended rank joins none while it shadows): rank 0 reported itself only."""
    from workers import ddp_join_uneven

    inner = run_ranks(ddp_join_uneven, 2, dict(steps=[25, 12], timeout_s=20.0, inner=True), timeout_s=120)
    assert inner[0]["loop_s"] < 12.0, inner  # held at most UNEVEN_GATHER_WAIT_S, not 20 s
    assert inner[0]["ranks"] == [0, 1] and inner[0]["steps_total"] == 25, inner
    skew = run_ranks(ddp_join_uneven, 2, dict(steps=[70, 12], timeout_s=20.0), timeout_s=120)  # 11 intervals
    assert skew[0]["ranks"] == [0, 1], skew
    assert not any("still waiting" in w or "timed out" in w for r in skew for w in r["warnings"])


@pytest.mark.slow
def test_a_join_that_has_ended_is_not_uneven_inputs():
    """join() leaves the model's join config enabled after its block: a rank 5 s late to
    stop() was left out of rank 0's report after 3 s, as if the inputs were uneven."""
    from workers import join_then_late_stop

    res = run_ranks(join_then_late_stop, 2, {}, timeout_s=120)
    assert res[0]["ranks"] == [0, 1] and res[0]["stop_s"] > 4.0, res


@pytest.mark.slow
def test_repeated_profiles_leave_no_threads_or_sockets_behind():
    """Each start() created a side gloo group, none destroyed: 3 threads and 5 file
    descriptors more after every profiled run. The gather's thread (through the store
    now) ends at each stop."""
    from workers import repeated_profiles

    for r in run_ranks(repeated_profiles, 2, dict(runs=4), timeout_s=120):
        assert r["ranks"] == [0, 1], r
        assert r["threads"][-1] <= r["threads"][0] and r["fds"][-1] <= r["fds"][0], r


@pytest.mark.parametrize("target", ["drain", "rows"])
def test_an_internal_error_in_stop_neither_escapes_nor_replaces_the_loops(target, monkeypatch):
    """stop()'s own work (draining the last steps, the final rows) ran unguarded: an error
    there came out of the `with` block after training, or replaced the loop's exception."""

    def boom(*a, **k):
        raise ArithmeticError(f"injected {target} fault")

    model, opt = _fresh()
    prof = dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with prof:
            _train(model, opt, prof)
            if target == "drain":
                monkeypatch.setattr(StepTracker, "drain", boom)
            else:
                monkeypatch.setattr(Intervals, "_rows", boom)
        with pytest.raises(KeyError) as raised:  # the loop's own exception, unchanged
            with dtprofile.profile(*_fresh(), warmup_steps=1):
                raise KeyError("the loop's")
    assert raised.value.__context__ is None
    assert prof.report().to_dict()["steps_total"] > 0
    assert sum(f"injected {target} fault" in str(w.message) for w in caught) <= 2  # one per profile


def test_a_loader_whose_properties_raise_is_still_iterated():
    class Odd:
        def __iter__(self):
            return iter([(torch.randn(4, 6), torch.randn(4, 3))] * 4)

        @property
        def batch_size(self):
            raise NotImplementedError("no batch size here")

    model, opt = _fresh()
    with dtprofile.profile(model, opt, warmup_steps=1) as prof:
        seen = 0
        for x, y in prof.loader(Odd()):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen += 1
    assert seen == 4


def test_a_logdir_deleted_mid_run_warns_once_without_a_traceback(tmp_path):
    """The SummaryWriter's own thread died on the missing file and Python printed its
    traceback beside dtprofile's one warning (in a process of its own: pytest catches
    thread exceptions itself)."""
    import subprocess
    import sys

    code = (
        "import shutil, sys, torch, dtprofile\n"
        "torch.set_num_threads(1)\n"
        "m = torch.nn.Linear(6, 3); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "with dtprofile.profile(m, o, logdir=sys.argv[1], warmup_steps=1, every_n_steps=5) as prof:\n"
        "    for i, x in enumerate(prof.loader([torch.randn(8, 6)] * 60)):\n"
        "        if i == 20:  # moved away at once (the writer may be adding a file), then deleted\n"
        "            prof._engine.intervals._worker.flush(60)  # once its writer exists (written off-thread)\n"
        "            shutil.move(sys.argv[1], sys.argv[1] + '.gone'); shutil.rmtree(sys.argv[1] + '.gone', True)\n"
        "        m(x).sum().backward(); o.step(); o.zero_grad()\n"
        "print(prof.report().to_dict()['steps_total'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == ["60"], out.stderr[-2000:]
    assert out.stderr.count("dtprofile: sink disabled") == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_the_summary_file_is_readable_by_others(tmp_path):
    model, opt = _fresh()
    with dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=1) as prof:
        _train(model, opt, prof)
    mode = os.stat(tmp_path / "dtprofile_summary.json").st_mode & 0o777
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert mode == os.stat(plain).st_mode & 0o777  # as any new file (under umask 022: 0644, was 0600)


# ---------------------------------------------------------------- 3. bad endings leave data
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_exception_in_the_loop_still_writes_an_incomplete_summary(exc, tmp_path):
    model, opt = _fresh()
    with pytest.raises(exc):
        with dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=1, every_n_steps=2) as prof:
            for i, (x, y) in enumerate(prof.loader([(torch.randn(4, 6), torch.randn(4, 3))] * 10)):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i == 6:
                    raise exc()
    summary = json.loads((tmp_path / "dtprofile_summary.json").read_text())
    assert summary["complete"] is False and summary["steps_total"] == 7
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))


def test_summary_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "dtprofile_summary.json"
    write_summary({"schema": "dtprofile.summary/1", "n": 1}, str(path))

    def crash(obj, fh, **kw):
        fh.write('{"schema": "dtprofile.summ')
        raise OSError("disk full mid-write")

    monkeypatch.setattr("dtprofile.summary_file.json.dump", crash)
    with pytest.raises(OSError):
        write_summary({"schema": "dtprofile.summary/1", "n": 2}, str(path))
    assert json.loads(path.read_text())["n"] == 1  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["dtprofile_summary.json"]  # no temp left


# ---------------------------------------------------------------- 4. bounded resources
def _fake_steps(engine, n, out):
    for _ in range(n):
        engine.passes.forward_pre_hook(None, (), {})
        engine.passes.forward_post_hook(None, (), out)
        engine.updates.pre_hook(engine.updates.primary, (), {})
        engine.updates.post_hook(engine.updates.primary, (), {})


@pytest.mark.slow
def test_memory_threads_files_and_event_file_stay_flat_over_100k_steps(tmp_path):
    model, opt = _fresh()
    from dtprofile.sinks.tensorboard import TensorBoardSink

    engine = Engine(
        Options(logdir=str(tmp_path), every_n_steps=20_000, warmup_steps=5),
        sink_factory=lambda: TensorBoardSink(logdir=str(tmp_path), image_every=None),
    )
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    out = torch.zeros(2)  # no grad: the fast fake step has no backward
    _fake_steps(engine, 20_000, out)  # first interval logged: writer, layout, images exist
    assert engine.intervals._worker.flush(timeout_s=60)
    gc.collect()
    tracemalloc.start()
    base_mem = tracemalloc.get_traced_memory()[0]
    base_threads = threading.active_count()
    base_fds = len(os.listdir("/proc/self/fd"))
    event_files = [f for f in os.listdir(tmp_path) if "tfevents" in f]
    size_before = os.path.getsize(tmp_path / event_files[0])
    _fake_steps(engine, 19_999, out)  # just short of the next interval
    assert engine.intervals._worker.flush(timeout_s=60)
    size_mid = os.path.getsize(tmp_path / event_files[0])
    _fake_steps(engine, 60_001, out)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - base_mem
    tracemalloc.stop()
    assert engine.steps.steps_seen == 100_000
    assert grown < 2_000_000, grown  # bytes: windows are fixed-size ring buffers
    assert threading.active_count() <= base_threads
    assert len(os.listdir("/proc/self/fd")) <= base_fds + 1  # 4 more intervals: a leak per interval shows
    assert size_mid == size_before  # the event file grows only per log interval
    assert len(engine.steps.pending) == 0 and len(engine.steps.run) == engine.steps.run.capacity
    engine.stop()


# ---------------------------------------------------------------- 6. odd but legal runs
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_zero_single_and_fewer_than_warmup_steps(steps, tmp_path):
    model, opt = _fresh()
    with dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=5) as prof:
        _train(model, opt, prof, steps=steps)
    s = prof.report().to_dict()
    assert s["steps_total"] == steps and s["steps_profiled"] == 0
    assert s["per_step_ms"]["step"] is None  # not measured: null, not zero
    assert json.loads((tmp_path / "dtprofile_summary.json").read_text())["steps_profiled"] == 0
    assert "R_O" in str(prof.report())


def test_loader_that_raises_mid_epoch_propagates_and_still_reports(tmp_path):
    model, opt = _fresh()

    def loader():
        for i in range(10):
            if i == 7:
                raise OSError("corrupt shard")
            yield torch.randn(4, 6), torch.randn(4, 3)

    with pytest.raises(OSError, match="corrupt shard"):
        with dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=2) as prof:
            for x, y in prof.loader(loader()):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    s = prof.report().to_dict()
    assert s["complete"] is False and s["steps_total"] == 7 and s["steps_profiled"] == 5


def test_second_profile_after_the_first_ended_and_no_hooks_remain():
    model, opt = _fresh()
    for _ in range(2):
        with dtprofile.profile(model, opt, warmup_steps=1) as prof:
            _train(model, opt, prof, steps=4)
        assert prof.report().to_dict()["steps_profiled"] == 3
        assert not model._forward_pre_hooks and not model._forward_hooks
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.slow
def test_unused_and_frozen_parameters_and_uneven_step_counts():
    res = run_ranks(ddp_odd, 2, dict(steps=10, extra_rank1=3, timeout_s=4), timeout_s=120)
    r0, r1 = res
    assert r0["steps_total"] == 10 and r1["steps_total"] == 13
    assert r0["comm_total"] and r0["comm_total"] > 0
    # DDP keeps its own all-reduce; its reducer reduces the probe steps after backward.
    assert r0["comm_source"] == "ddp_probe" and r0["comm_hooks"] == 0
    # frozen Linear(16,16) is not reduced; used + unused Linear(16,4) are
    assert r0["grad_bytes"] == 2 * (16 * 4 + 4) * 4


def _open_reduction(engine):
    engine.comm.manual_start(100)


def _open_fsdp_wait(engine):
    engine.passes.forward_open = True  # as inside a training forward
    engine.comm.wait_start()
    engine.passes.forward_open = False


@pytest.mark.parametrize("leave_open", [_open_reduction, _open_fsdp_wait])
def test_a_reduction_whose_end_never_comes_does_not_block_later_steps(leave_open):
    model, opt = _fresh()
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    with pytest.warns(RuntimeWarning, match="comm disabled"), dtprofile.profile(model, opt, warmup_steps=1) as prof:
        for i in range(10):
            nn.functional.mse_loss(model(x), y).backward()
            if i == 3:
                leave_open(prof._engine)  # its end is never marked
                prof._engine.parts["comm"].fail(RuntimeError("injected comm fault"))
            opt.step()
            opt.zero_grad()
    s = prof.report().to_dict()
    assert s["steps_total"] == 10 and s["steps_profiled"] == 9
    assert "comm" in s["parts_disabled"]


def test_an_optimizer_step_that_raised_and_was_caught_does_not_stop_the_profile():
    """A loop that survives an exception inside optimizer.step() (say an OOM it recovers
    from): the failed step's post hook never runs; later steps are still measured."""

    class FlakyAdam(torch.optim.Adam):
        calls = 0

        def step(self, closure=None):
            FlakyAdam.calls += 1
            if FlakyAdam.calls == 4:
                raise RuntimeError("injected failure inside step")
            return super().step(closure)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = FlakyAdam(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    failed = 0
    with dtprofile.profile(model, opt, warmup_steps=1) as prof:
        for _ in range(12):
            nn.functional.mse_loss(model(x), y).backward()
            try:
                opt.step()
            except RuntimeError:
                failed += 1
            opt.zero_grad()
    s = prof.report().to_dict()
    assert failed == 1
    # The failed iteration updated nothing: it is a skipped step, every other one a step.
    assert s["steps_total"] == 12 and s["steps_skipped_update"] == 1
    assert s["steps_profiled"] == 12 - 1 - 1
    assert s["per_step_ms"]["optimizer"] > 0


def test_warnings_come_from_rank_0_only(monkeypatch, caplog):
    import logging

    from dtprofile import console
    from dtprofile.engine import Part

    monkeypatch.setattr(console, "rank_of_process", lambda: 1)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="dtprofile"):
        warnings.simplefilter("always")
        Part("timing").fail(RuntimeError("injected"))
    assert not caught  # nothing on the console of rank 1 ...
    assert "timing disabled after an internal error" in caplog.text  # ... but in its log
    monkeypatch.setattr(console, "rank_of_process", lambda: 0)
    with pytest.warns(RuntimeWarning, match="timing disabled"):
        Part("timing").fail(RuntimeError("injected"))


def test_an_internal_error_where_warnings_are_errors_does_not_stop_training(caplog):
    """Under python -W error (or pytest's filterwarnings = error) the one warning of a
    failing part would raise inside a training hook: it is logged instead."""
    import logging

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="dtprofile"):
        warnings.simplefilter("error")
        with dtprofile.profile(model, opt, warmup_steps=1) as prof:
            prof._engine.steps.close_step = None  # the next optimizer step's hook fails inside training
            for _ in range(3):
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert "timing disabled after an internal error" in caplog.text


def test_a_failed_summary_write_where_warnings_are_errors_does_not_raise(caplog, monkeypatch, tmp_path):
    """A disk that fills up at stop(): the warning is logged, the with-block ends normally
    (it raised RuntimeWarning out of stop() under python -W error)."""
    import logging

    from dtprofile import summary_file as summary_module

    def full_disk(summary, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(summary_module, "write_summary", full_disk)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="dtprofile"):
        warnings.simplefilter("error")
        with dtprofile.profile(model, opt, warmup_steps=1, logdir=str(tmp_path / "logs")):
            for _ in range(3):
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert "could not write the summary: [Errno 28] No space left on device" in caplog.text


def test_a_part_that_needs_a_missing_package_says_what_to_install():
    from dtprofile.engine import Part

    with pytest.warns(
        RuntimeWarning, match="sink disabled: it needs 'tensorboard', which is not installed: pip install tensorboard"
    ):
        Part("sink").fail(ModuleNotFoundError("No module named 'tensorboard'", name="tensorboard"))


def _hooks_on(model, opt) -> int:
    return (
        len(model._forward_hooks)
        + len(model._forward_pre_hooks)
        + len(opt._optimizer_step_pre_hooks)
        + len(opt._optimizer_step_post_hooks)
    )


def _steps(model, opt, n):
    for _ in range(n):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_profile_left_running_by_an_interrupted_cell_is_taken_over():
    """prof.start() in a cell whose loop was interrupted, the cell run again: the new
    profile stops the old one (reported incomplete) instead of both timing the model."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old = dtprofile.profile(model, opt, warmup_steps=1).start()
    _steps(model, opt, 3)  # ... KeyboardInterrupt: stop() never ran
    with pytest.warns(RuntimeWarning, match="still running"):
        new = dtprofile.profile(model, opt, warmup_steps=1).start()
    assert not old._engine.active and old.report().to_dict()["complete"] is False
    _steps(model, opt, 4)
    assert new.stop().to_dict()["steps_total"] == 4
    assert _hooks_on(model, opt) == 0


def test_a_start_interrupted_leaves_no_hooks(monkeypatch):
    from dtprofile.engine import Engine

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dtprofile.profile(model, opt).start()
    assert _hooks_on(model, opt) == 0


def test_pauses_between_passes_over_the_loader_are_not_steps():
    """A notebook: each cell runs a pass over prof.loader, and the user reads the output
    in between. That time (like an epoch's end) is not part of any step."""
    import time

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(8, 4) for _ in range(8)]
    with dtprofile.profile(model, opt, warmup_steps=1) as prof:
        for _ in range(4):
            for x in prof.loader(data):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            time.sleep(0.2)  # between cells
    per = prof.report().to_dict()["per_step_ms"]
    assert per["step"] < 5.0 and per["data_wait"] < 5.0, per  # the pauses: 200 ms each


def test_the_summary_is_written_before_the_images(monkeypatch, tmp_path):
    """A Ctrl-C while stop() draws the TensorBoard images still leaves the summary file."""
    from dtprofile.sinks.tensorboard import TensorBoardSink

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(TensorBoardSink, "close", interrupted)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = dtprofile.profile(model, opt, warmup_steps=1, logdir=str(tmp_path)).start()
    _steps(model, opt, 5)
    with pytest.raises(KeyboardInterrupt):
        prof.stop()
    assert json.loads((tmp_path / "dtprofile_summary.json").read_text())["steps_total"] == 5


def test_a_logdir_that_holds_an_earlier_run_is_warned_about(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dtprofile.profile(model, opt, warmup_steps=1, logdir=str(tmp_path)):
        _steps(model, opt, 3)
    with pytest.warns(RuntimeWarning, match="holds an earlier run"):
        with dtprofile.profile(model, opt, warmup_steps=1, logdir=str(tmp_path)):
            _steps(model, opt, 3)
