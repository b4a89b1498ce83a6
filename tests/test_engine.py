"""The engine on one process: lazy device timestamps (through the fake event clock),
accumulation, the unmeasured-communication path, bounded windows, summary shape."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings

import numpy as np
import pytest
import torch
from fakes import TimedNet, TimedSGD
from torch import nn

import dtprofile
from dtprofile.capture.clocks import FakeEventClock, HostClock
from dtprofile.capture.lane import SteadyLane
from dtprofile.capture.records import FIELDS, PendingStep, StepRecord, Window, union_length
from dtprofile.engine import Engine
from dtprofile.options import Options


def _fake_engine(warmup=2, loader=False):
    """A started engine on the fake device clock, with a model and optimizer that move it."""
    clock = FakeEventClock()
    model = TimedNet(clock)
    opt = TimedSGD(model.parameters(), clock)
    engine = Engine(Options(warmup_steps=warmup, every_n_steps=1000), clock=clock)
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    if loader:
        engine.data.use_loader()
    return engine, clock, model, opt


def _fake_run(steps=12, accumulate=1, data_ms=2.0, complete_every=None, warmup=2, skip=(), loader=False):
    engine, clock, model, opt = _fake_engine(warmup, loader)
    records_seen = []
    for i in range(steps * accumulate):
        clock.advance(data_ms)  # the device idles while the host fetches the batch
        if loader:
            engine.data.add(data_ms / 1e3)
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        if i % accumulate == accumulate - 1:
            if i // accumulate not in skip:  # skipped: what GradScaler does on inf/NaN gradients
                opt.step()
            opt.zero_grad()
            records_seen.append(engine.steps.steps_finalized)  # steps whose events were read
            if complete_every and (i // accumulate) % complete_every == complete_every - 1:
                clock.complete_all()
    return engine, clock, records_seen


def _host_engine(model, opt, warmup_steps, **options):
    """A started engine on the host clock, timing ``model`` and ``opt``."""
    engine = Engine(Options(warmup_steps=warmup_steps, every_n_steps=1000, **options), clock=HostClock())
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    return engine


def test_a_timed_call_is_a_forward_pass_of_its_module_and_goes_back_at_stop():
    """A framework that runs its model's step through a method (Lightning's single-device
    strategy.training_step): each call is a forward pass of the module, timed without a
    module call around it; evaluation (the module in eval mode, no grad) is left out.
    Another wrapper set on top keeps working, passing through once the profiler is gone."""

    class Runner:
        def __init__(self, model):
            self.model = model

        def training_step(self, x, scale=1.0):
            time.sleep(0.004)
            return self.model(x).sum() * scale

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    runner = Runner(model)
    engine = Engine(Options(warmup_steps=1, every_n_steps=1000), clock=HostClock())
    engine.attach_call(runner, "training_step", model)
    engine.attach_optimizer(opt)
    engine.start()
    assert "training_step" in vars(runner) and engine.modules == [model]
    for i in range(6):
        loss = runner.training_step(torch.randn(8, 4), scale=2.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            model.eval()
            with torch.no_grad():
                runner.training_step(torch.randn(8, 4))
            model.train()
    outer = runner.training_step
    runner.training_step = lambda *a, **k: outer(*a, **k)  # another wrapper, after the profiler's
    engine.steps.drain()
    averages = engine.steps.run.averages()
    assert engine.steps.steps_seen == 6 and engine.steps.steps_with_eval_forwards == 1
    assert 4.0 <= averages["forward"] < 200.0 and averages["step"] >= averages["forward"]
    assert engine.data.batch_size == 8
    engine.stop(complete=True)
    assert "training_step" in vars(runner)  # the other wrapper stays, and passes through ours
    with torch.no_grad():
        assert float(runner.training_step(torch.ones(1, 4))) == pytest.approx(float(model(torch.ones(1, 4)).sum()))
    del runner.training_step
    engine2 = Engine(Options(warmup_steps=1, every_n_steps=1000), clock=HostClock())
    engine2.attach_call(runner, "training_step", model)
    engine2.start()
    engine2.stop(complete=True)
    assert "training_step" not in vars(runner)


def test_a_framework_marking_the_update_start_keeps_its_closure_out_of_the_optimizer():
    """A closure run inside optimizer.step (Lightning's: forward, backward, then hooks and
    clipping) with the update's start marked where it ends: the closure is forward,
    backward and other compute, not optimizer, and its backward is timed on a sample of
    the steps only (the optimizer's figure does not need it)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = Engine(
        Options(warmup_steps=1, every_n_steps=1000, backward_timing_every=5),
        clock=HostClock(),
        update_start_marked=True,
    )
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()

    def closure():
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        time.sleep(0.004)  # the hooks after backward, gradient clipping
        engine.updates.update_starts()
        return loss

    for _ in range(40):
        opt.step(closure)
        opt.zero_grad()
    s = engine.stop(complete=True).to_dict()
    per = s["per_step_ms"]
    assert per["optimizer"] < 2.0, per
    assert per["compute"] - per["forward"] - per["backward"] - per["optimizer"] >= 3.5, per
    assert 0 < s["backward_timed_steps"] < s["steps_profiled"]


def _train_steps(model, opt, n, before=None):
    """``n`` plain training steps; ``before(i)`` runs ahead of each (a fetch, say)."""
    for i in range(n):
        if before is not None:
            before(i)
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def _zeroing_closure(model, opt):
    """An ``optimizer.step(closure)`` closure (LBFGS, SAM): zero the gradients, forward,
    backward."""

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        return loss

    return closure


def _settled_averages(engine, clock):
    """Every event complete, every step recorded: the run window's averages."""
    clock.complete_all()
    engine.steps.drain()
    return engine.steps.run.averages()


def test_pending_steps_are_never_read_before_their_events_complete():
    engine, clock, seen = _fake_run(steps=12)
    # No event ever completed: every step is still pending, nothing was read.
    assert seen == [0] * 12
    assert len(engine.steps.pending) == 12
    clock.complete_all()
    engine.steps.drain()
    assert len(engine.steps.run) == 12 - 2  # warm-up skipped
    med = engine.steps.run.averages()
    assert med["forward"] == pytest.approx(3.0)
    assert med["backward"] == pytest.approx(7.0)
    assert med["optimizer"] == pytest.approx(1.0)
    assert med["data_wait"] == pytest.approx(2.0)  # gap mode: device idle before forward
    assert med["step"] == pytest.approx(13.0)
    assert med["compute"] == pytest.approx(11.0)
    assert math.isnan(engine.steps.run._data[0, 5])  # comm_total unmeasured: nan, not 0


def test_lazy_readback_drains_in_order_as_events_complete():
    engine, clock, seen = _fake_run(steps=12, complete_every=4)
    # Steps are read only after the device caught up (every 4th step here), at the next
    # step boundary.
    assert seen[:5] == [0, 0, 0, 0, 4]
    assert clock.released > 0  # events go back to the pool


def test_gradient_accumulation_is_one_step():
    engine, clock, _ = _fake_run(steps=6, accumulate=3, warmup=0)
    clock.complete_all()
    engine.steps.drain()
    med = engine.steps.run.averages()
    assert len(engine.steps.run) == 6
    assert med["forward"] == pytest.approx(9.0)
    assert med["backward"] == pytest.approx(21.0)
    assert med["step"] == pytest.approx(3 * (2 + 3 + 7) + 1)


@pytest.mark.parametrize("loader", [False, True])
def test_skipped_update_ends_its_step_and_stays_out_of_the_medians(loader):
    """No optimizer.step() after a backward, then zero_grad: the next forward ends the
    skipped step where its backward synced; the data wait fetched after it moves on."""
    engine, clock, _ = _fake_run(steps=12, skip=(1, 4, 8), loader=loader)
    clock.complete_all()
    engine.steps.drain()
    assert engine.steps.steps_seen == 12
    assert engine.steps.steps_skipped_update == 2  # step 1 was in the warm-up
    assert len(engine.steps.run) == 12 - 2 - 2
    med = engine.steps.run.averages()
    for key, ms in (("step", 13.0), ("forward", 3.0), ("backward", 7.0), ("optimizer", 1.0), ("data_wait", 2.0)):
        column = engine.steps.run._data[: len(engine.steps.run), FIELDS.index(key)]
        assert column.tolist() == pytest.approx([ms] * 8), key
        assert med[key] == pytest.approx(ms)
    assert engine.steps.micro_batches_last == 1  # not mistaken for accumulation
    summary = engine.stop()
    assert summary["steps_total"] == 12 and summary["steps_skipped_update"] == 2


def test_gpu_ahead_of_the_host_data_wait_costs_only_device_idle():
    """Loader mode on a device timeline: the host blocks 5 ms in next(), but while the GPU
    still runs the previous step (no device idle) that wait costs nothing; when the GPU
    idles 2 ms of it, 2 ms is data wait."""
    for idle_ms, expected in ((0.0, 0.0), (2.0, 2.0), (8.0, 5.0)):
        engine, clock, model, opt = _fake_engine(warmup=1, loader=True)
        for _ in range(6):
            engine.data.add(0.005)  # host time in next(loader)
            clock.advance(idle_ms)  # what the device spent waiting for it
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        clock.complete_all()
        engine.steps.drain()
        assert engine.steps.run.averages()["data_wait"] == pytest.approx(expected), idle_ms
        assert engine.steps.run.averages()["step"] == pytest.approx(idle_ms + 3 + 7 + 1)


def test_a_loader_that_keeps_up_every_third_batch_is_averaged_as_it_ran():
    """Three workers handing over batches together: the host waits 150 ms, then not at
    all twice. A median would say no data wait and an 11 ms step; the run took 61 ms a step."""
    engine, clock, model, opt = _fake_engine(warmup=0, loader=True)

    def fetch(i):
        wait_ms = 150.0 if i % 3 == 2 else 0.0
        engine.data.add(wait_ms / 1e3)
        clock.advance(wait_ms)

    _train_steps(model, opt, 30, fetch)
    typical = _settled_averages(engine, clock)
    # 10 slow steps of 30: one dropped at each end of the sort, 9 of the 28 left are slow.
    assert typical["data_wait"] == pytest.approx(150.0 * 9 / 28)
    assert typical["step"] == pytest.approx(150.0 * 9 / 28 + 11.0)


def test_micro_batches_are_the_runs_not_the_last_steps():
    """An epoch that ends in a partial accumulation (2 of 4) leaves micro_batches at 4."""
    engine, clock, model, opt = _fake_engine()
    for i in range(6 * 4):
        model(torch.randn(8, 4)).sum().backward()
        if i % 4 == 3:
            opt.step()
            opt.zero_grad()
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    clock.complete_all()
    assert engine.steps.micro_batches_last == 2
    assert engine.stop()["run"]["micro_batches"] == 4


def test_skipped_update_is_not_confused_with_accumulation():
    # Gradients stay between micro-batches, so the second forward continues the step.
    engine, clock, _ = _fake_run(steps=6, accumulate=3, warmup=0, skip=(2,))
    clock.complete_all()
    engine.steps.drain()
    assert engine.steps.steps_seen == 6 and engine.steps.steps_skipped_update == 1
    assert len(engine.steps.run) == 5
    assert engine.steps.run.averages()["forward"] == pytest.approx(9.0)


class _StepsLogged:
    """A stand-in for the interval worker: the steps intervals go to the sink at."""

    def __init__(self):
        self.steps = []

    def submit(self, job):
        if job.to_sink:
            self.steps.append(job.step)

    def rest_left_s(self):
        return 0.0  # takes every interval at once


def _two_backward_run(steps, call_step=True, passes=2, every=1000):
    """backward, zero_grad, backward, step: the loop zeroes the gradients mid-step itself."""
    clock = FakeEventClock()
    model = TimedNet(clock)
    opt = TimedSGD(model.parameters(), clock)
    engine = Engine(Options(warmup_steps=2, every_n_steps=every), clock=clock)
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    engine.intervals.sink, engine.intervals._worker = object(), _StepsLogged()
    for _ in range(steps):
        for i in range(passes):
            clock.advance(2.0)
            model(torch.randn(8, 4)).sum().backward()
            if call_step and i < passes - 1:
                opt.zero_grad()
        if call_step:
            opt.step()
        opt.zero_grad()
    clock.complete_all()
    engine.steps.drain()
    return engine


def test_zero_grad_between_two_backward_passes_is_not_a_skipped_update():
    engine = _two_backward_run(12)
    # The first alternations look like skips; three in a row turn the inference off and
    # take them back, and the rest of the run is two micro-batches per step.
    assert engine.steps.steps_skipped_update == 0 and not engine.updates.infer_skips
    assert engine.steps.micro_batches_last == 2
    # The steps counted twice (a skipped half, a stepped half) count once, and their
    # halves are in no window: every step held has both passes.
    assert engine.steps.steps_seen == 12 and len(engine.steps.run) == 12 - 4
    forward = engine.steps.run._data[: len(engine.steps.run), FIELDS.index("forward")]
    assert forward.tolist() == pytest.approx([6.0] * 8)
    # Three or four passes a step, each after a zero_grad: every split is taken back.
    for passes in (3, 4):
        engine = _two_backward_run(12, passes=passes)
        assert engine.steps.steps_seen == 12 and engine.steps.steps_skipped_update == 0, passes
        assert engine.steps.micro_batches_last == passes and len(engine.steps.run) == 12 - 4
        assert engine.steps.run.averages()["forward"] == pytest.approx(3.0 * passes)
    # Intervals logged before the take-back keep their steps: the axis never goes back.
    logged = _two_backward_run(12, passes=3, every=3).intervals._worker.steps
    assert logged == sorted(set(logged)) and logged[-1] == 12, logged
    # An optimizer whose step hooks never fire (e.g. SAM's first_step/second_step) arms nothing.
    never = _two_backward_run(6, call_step=False)
    assert never.steps.steps_skipped_update == 0 and never.steps.steps_seen == 0


def test_grad_scaler_skips_with_a_real_model_weights_unchanged():
    """torch.amp.GradScaler on the CPU, with inf losses on some steps: each skipped update is
    its own step, counted, and training is bit-identical with and without the profiler."""

    def train(profiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        prof = dtprofile.profile(model, opt, warmup_steps=2, every_n_steps=5)
        skipped = 0
        if profiled:
            prof.start()
        for i in range(20):
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            loss = nn.functional.mse_loss(model(x), y) * (float("inf") if i % 6 == 3 else 1.0)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            opt.zero_grad()
        return model, (prof.stop().to_dict() if profiled else None), skipped

    m0, _, _ = train(False)
    m1, s, skipped = train(True)
    assert skipped == 3
    for a, b in zip(m0.parameters(), m1.parameters(), strict=False):
        assert torch.equal(a, b)
    assert s["steps_total"] == 20
    assert s["steps_skipped_update"] == 3
    assert s["steps_profiled"] == 20 - 2 - 3
    assert s["run"]["micro_batches"] == 1


def test_profile_single_process_loader_mode_and_summary(tmp_path):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(20)]
    with dtprofile.profile(model, opt, logdir=str(tmp_path), warmup_steps=3, every_n_steps=5) as prof:
        for x, y in prof.loader(data):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    summary = prof.report().to_dict()
    assert summary["schema"] == "dtprofile.summary/1"
    assert summary["steps_profiled"] == 17 and summary["steps_total"] == 20
    assert summary["data_wait_source"] == "loader"
    assert summary["world_size"] == 1 and summary["device"] == "cpu"
    assert summary["per_step_ms"]["comm_total"] is None  # no DDP: unmeasured, never 0
    assert summary["run"]["batch_size"] == 8
    assert summary["projection"]["gpus"] == [1, 2, 4, 8, 16, 32, 64]
    assert len(summary["projection"]["alpha_paper"]) == 7
    on_disk = json.loads((tmp_path / "dtprofile_summary.json").read_text())
    assert on_disk["steps_profiled"] == 17
    # After exit no dtprofile hook is left on the model or the optimizer.
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "R_O" in str(prof.report())


def test_start_stop_without_with_and_gap_mode():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = dtprofile.profile(model, opt, warmup_steps=0)
    prof.start()
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    report = prof.stop()
    assert report.to_dict()["data_wait_source"] == "gap"
    assert report.to_dict()["steps_profiled"] == 5


def test_eval_forward_is_not_a_training_step():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dtprofile.profile(model, opt, warmup_steps=0) as prof:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            with torch.no_grad():
                model(torch.randn(2, 4))
            opt.step()
            opt.zero_grad()
    # One forward per step counted: the no-grad evaluation pass is skipped.
    assert prof._engine.steps.run.averages()["forward"] is not None
    assert prof._engine.steps.micro_batches_last == 1


def _run_with_no_grad_forwards(eval_mode: bool | None):
    """Six steps; after each, three no-grad forwards (in eval mode, in train mode, or none)."""
    engine, clock, model, opt = _fake_engine(warmup=1)
    for _ in range(6):
        clock.advance(2.0)  # data
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if eval_mode is None:
            continue
        model.train(not eval_mode)
        with torch.no_grad():
            for j in range(3):
                if j:
                    clock.advance(1.0)  # host work between evaluation forwards is evaluation too
                model(torch.randn(8, 4))
        model.train()
    clock.complete_all()
    engine.steps.drain()
    return engine


def test_eval_passes_inside_the_loop_are_left_out_of_the_step():
    # Evaluation forwards (eval mode, no grad) between steps: without prof.loader they would
    # be the gap before forward (data wait); with it, compute. Either way not training.
    evaluated, plain = _run_with_no_grad_forwards(True), _run_with_no_grad_forwards(None)
    with_eval, without = evaluated.steps.run.averages(), plain.steps.run.averages()
    for key in ("step", "data_wait", "forward", "compute"):
        assert with_eval[key] == pytest.approx(without[key]), key
    assert evaluated.steps.micro_batches_last == 1
    # No-grad forwards in train mode (reentrant checkpointing, an RL rollout) are the
    # step's own work: they stay in it (3 forwards of 3 ms, 2 ms between them).
    kept = _run_with_no_grad_forwards(False).steps.run.averages()
    assert kept["step"] == pytest.approx(without["step"] + 11.0)


def test_every_backward_pass_that_reduced_has_its_wait_exposed():
    """Accumulation without no_sync(): each of the 2 passes waits for its own all-reduce
    (6 ms after its compute). Only the last pass's wait counted; the first one's was
    compute (helper: T_C 130.7 ms, phases 88.9 ms, R_O 0.095 for about 0.5)."""
    from dtprofile.capture.records import CommInterval

    ms = 1e-3
    step = PendingStep(start=0.0)
    step.forward = [[1 * ms, 5 * ms], [20 * ms, 24 * ms]]
    step.backward = [[5 * ms, 12 * ms, 18 * ms], [24 * ms, 31 * ms, 37 * ms]]  # start, compute end, synced
    step.comm = [
        CommInterval(start=9 * ms, end=17 * ms, nbytes=100, pass_index=1),
        CommInterval(start=28 * ms, end=36 * ms, nbytes=100, pass_index=2),
    ]
    step.comm_measured = True
    step.optimizer = (37 * ms, 40 * ms)
    step.end = 40 * ms
    record = step.to_record(HostClock(), "loader")
    assert record.comm_exposed == pytest.approx(12.0)  # 12 -> 18 and 31 -> 37
    assert record.comm_total == pytest.approx(18.0)  # 9 -> 18 and 28 -> 37
    assert record.compute == pytest.approx(28.0)  # step 40 - 12 exposed


def test_window_is_bounded():
    w = Window(capacity=4)
    rec = PendingStep(start=0.0)
    rec.end = 0.01
    record = rec.to_record(HostClock(), "loader")
    for _ in range(10_000):
        w.add(record)
    assert len(w) == 4 and w._data.shape == (4, len(FIELDS))


def test_window_averages_add_up_as_each_step_does():
    """Averages of the same steps: per-column trimming (0.2.0) dropped a different step
    from each column, and the demo's overhead read 23.29 ms for 19.41 + 3.77 ms of parts."""
    rng = np.random.default_rng(0)
    w = Window(capacity=64)
    for _ in range(40):
        data, exposed = rng.exponential(5.0), rng.exponential(4.0)
        fwd, bwd, opt = rng.uniform(1, 3), rng.uniform(2, 6), rng.uniform(0.1, 0.5)
        compute = fwd + bwd + opt + rng.uniform(0, 1)
        w.add(
            StepRecord(
                compute + data + exposed, data, fwd, bwd, opt, exposed + 3.0, exposed, compute, data + exposed, 1000.0
            )
        )
    a = w.averages()
    assert a["overhead"] == pytest.approx(a["data_wait"] + a["comm_exposed"], abs=1e-9)
    assert a["step"] == pytest.approx(a["compute"] + a["overhead"], abs=1e-9)
    assert a["compute"] >= a["forward"] + a["backward"] + a["optimizer"]
    # The slowest and fastest 5% (2 of 40) by step time are the steps left out.
    steps = np.sort(w._data[:40, 0])
    assert a["step"] == pytest.approx(steps[2:38].mean())


def test_a_backward_timed_on_a_sample_averages_every_timed_step():
    """Timing backward makes a step slower: of 40 steps, the 4 that timed it are the
    slowest, and trimming by step time would leave out 2 of them."""
    w = Window(capacity=64)
    for i in range(40):
        timed = i % 10 == 0
        backward = 5.0 + i / 10 if timed else float("nan")
        w.add(
            StepRecord(
                20.0 + (1.0 if timed else i / 100),
                0.0,
                3.0,
                backward,
                1.0,
                float("nan"),
                float("nan"),
                20.0,
                0.0,
                float("nan"),
            )
        )
    a = w.averages()
    assert a["backward_timed_steps"] == 4
    assert a["backward"] == pytest.approx((5.0 + 6.0 + 7.0 + 8.0) / 4)


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(every_n_steps=0), "every_n_steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(target_efficiency=1.5), "target_efficiency"),
        (dict(target_efficiency=0), "target_efficiency"),
        (dict(scaling="sideways"), "scaling"),
        (dict(project_gpus=[0, 2]), "project_gpus"),
        (dict(link_bandwidth="fast"), "link_bandwidth"),
        (dict(probe_every=-2), "probe_every"),
        (dict(probe_every=1), "probe_every must be .auto., 0 .* or an integer >= 2"),
        (dict(probe_every=4, bucket_timing_every=0), "probe_every must be 0 when bucket_timing_every is 0"),
        (dict(bucket_timing_every=-1), "bucket_timing_every must be 'auto' or an integer >= 0"),
        (dict(bucket_timing_every="often"), "bucket_timing_every must be 'auto' or an integer >= 0"),
        (dict(project_gpus=5), "project_gpus"),
        (dict(project_gpus=None), "project_gpus"),
        (dict(project_gpus={1: 2}), "project_gpus"),
        (dict(gather_timeout_s=1e20), "gather_timeout_s must be .* at most 604800"),  # overflowed in gloo
        (dict(logdir=""), "logdir must be a directory path or None"),  # wrote into . and ./runs
        (dict(telemetry_interval_s=0.001), "telemetry_interval_s must be None .* from 0.05 to 3600"),
        (dict(telemetry_interval_s=-1), "telemetry_interval_s"),
        (dict(telemetry_interval_s="1s"), "telemetry_interval_s"),
    ],
)
def test_bad_options_name_the_argument(kwargs, needle):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=needle):
        dtprofile.profile(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_bad_model_and_optimizer_and_logdir(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dtprofile.profile(object(), opt)
    for bad in (object(), [], [opt, object()]):
        with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or a list"):
            dtprofile.profile(model, bad)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="logdir"):
        dtprofile.profile(model, opt, logdir=str(a_file))
    # Under a file: the nearest existing ancestor is that file (it passed, and failed at
    # the first write).
    with pytest.raises(ValueError, match="logdir must be a directory path, but .* is a file"):
        dtprofile.profile(model, opt, logdir=str(a_file / "sub" / "runs"))
    # A loader that is not iterable fails where it is given, not at the first next().
    with pytest.raises(TypeError, match="loader needs an iterable of batches .* got int"):
        dtprofile.profile(model, opt).loader(5)


def test_a_loop_with_two_optimizers_steps_once_and_times_both():
    """Weights and biases in two optimizers (a Muon/AdamW-style split): the first one's
    step ends the training step, the second one's time is optimizer time too."""

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.005)
            return super().step(closure)

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    opt_w, opt_b = torch.optim.SGD(weights, lr=0.1), SlowSGD(biases, lr=0.1)
    with dtprofile.profile(model, (opt_w, opt_b), warmup_steps=2) as prof:
        for _ in range(10):
            model(torch.randn(4, 8)).sum().backward()
            opt_w.step()
            opt_b.step()
            opt_w.zero_grad()
            opt_b.zero_grad()
    s = prof.report().to_dict()
    assert s["steps_total"] == 10 and s["steps_profiled"] == 8
    assert s["per_step_ms"]["optimizer"] >= 5.0  # the second optimizer's sleep is in it
    assert prof.optimizers == [opt_w, opt_b] and prof.optimizer is opt_w
    assert dtprofile.profile(model, [opt_w, opt_w, opt_b]).optimizers == [opt_w, opt_b]  # once each


def test_optimizer_subclass_calling_super_step_is_one_step():
    # Once a plain SGD exists, torch wraps SGD.step with the hook caller, so a subclass
    # whose step() calls super().step() runs the step hooks twice, nested.
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    engine, clock, _ = _fake_run(steps=6, warmup=0)
    clock.complete_all()
    engine.steps.drain()
    assert engine.steps.steps_seen == 6
    assert engine.steps.run.averages()["optimizer"] == pytest.approx(1.0)


class _ClosureOptimizer(torch.optim.SGD):
    """Evaluates the closure ``evals`` times inside its step, 1 ms of its own work after
    each (LBFGS's line search, SAM's second pass)."""

    def __init__(self, params, clock, evals):
        super().__init__(params, lr=0.01)
        self._clock, self._evals = clock, evals

    def step(self, closure):
        for _ in range(self._evals):
            with torch.enable_grad():
                closure()
            self._clock.advance(1.0)
        return super().step()


@pytest.mark.parametrize("evals", [1, 3])
def test_closures_inside_the_optimizer_step_are_passes_of_one_step(evals):
    """The closure zeroes the gradients, then runs forward and backward: inside
    optimizer.step that is not a skipped update, and its passes are not the update."""
    clock = FakeEventClock()
    model = TimedNet(clock)
    opt = _ClosureOptimizer(model.parameters(), clock, evals)
    engine = Engine(Options(warmup_steps=2, every_n_steps=1000), clock=clock)
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()

    closure = _zeroing_closure(model, opt)
    for _ in range(10):
        clock.advance(2.0)
        opt.step(closure)
    med = _settled_averages(engine, clock)
    assert engine.steps.steps_seen == 10 and engine.steps.steps_skipped_update == 0 and len(engine.steps.run) == 8
    assert med["forward"] == pytest.approx(3.0 * evals) and med["backward"] == pytest.approx(7.0 * evals)
    assert med["optimizer"] == pytest.approx(1.0 * evals)
    assert med["step"] == pytest.approx(2.0 + 11.0 * evals)
    assert engine.steps.micro_batches_last == 1  # one batch, evaluated `evals` times


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: tuple = ()


class _AuxNet(nn.Module):
    """Returns its logits in a dataclass, after ``aux`` other outputs that take part in
    no loss, or (``opaque``) inside an object dtprofile does not look into."""

    def __init__(self, clock, aux=0, opaque=False):
        super().__init__()
        self.net, self.aux, self.opaque = TimedNet(clock), aux, opaque

    def forward(self, x):
        logits = self.net(x)
        out = _Out(logits, tuple(logits * i for i in range(self.aux)))
        return type("Opaque", (), {"logits": logits})() if self.opaque else out


@pytest.mark.parametrize("aux", [0, 40])
def test_backward_through_a_dataclass_output_and_past_many_outputs(aux, recwarn):
    clock = FakeEventClock()
    model = _AuxNet(clock, aux)
    opt = TimedSGD(model.parameters(), clock)
    engine = Engine(Options(warmup_steps=1, every_n_steps=1000), clock=clock)
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    for _ in range(6):
        model(torch.randn(8, 4)).logits.sum().backward()
        opt.step()
        opt.zero_grad()
    med = _settled_averages(engine, clock)
    assert med["backward"] == pytest.approx(7.0) and med["forward"] == pytest.approx(3.0)
    assert not [w for w in recwarn if "dtprofile" in str(w.message)]


def test_a_backward_the_outputs_do_not_show_is_warned_once():
    clock = FakeEventClock()
    model = _AuxNet(clock, opaque=True)
    opt = TimedSGD(model.parameters(), clock)
    with pytest.warns(RuntimeWarning, match="no backward pass reached its outputs") as caught:
        with dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=1000):
            for _ in range(4):
                model(torch.randn(8, 4)).logits.sum().backward()
                opt.step()
                opt.zero_grad()
    assert sum("no backward pass" in str(w.message) for w in caught) == 1


def test_micro_batches_are_the_batches_fetched_when_the_loader_is_profiled():
    """Two forward/backward passes of one batch (SAM's two-step form, or a model applied
    to two views) are one micro-batch when prof.loader says one batch came; three
    fetches a step (accumulation) are three."""
    for fetches, passes in ((1, 2), (3, 3)):
        engine, clock, model, opt = _fake_engine(warmup=1, loader=True)
        for _ in range(6):
            for _ in range(fetches):
                engine.data.add(0.001)
            for _ in range(passes):
                model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert engine.steps.micro_batches_last == fetches and engine.steps.steps_skipped_update == 0
        run = engine.stop().to_dict()["run"]
        assert run["micro_batches"] == fetches and run["micro_batches_seen"] is None
    # A schedule that changes the accumulation: every size is named.
    engine, clock, model, opt = _fake_engine(warmup=1, loader=True)
    for fetches in (1, 1, 1, 2, 2, 4, 4, 4):
        for _ in range(fetches):
            engine.data.add(0.001)
            model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    run = engine.stop().to_dict()["run"]
    assert run["micro_batches_seen"] == [1, 2, 4] and run["micro_batches"] == 4
    # One short step (an epoch's last, partial accumulation) among many is not a size of its own.
    engine, clock, model, opt = _fake_engine(warmup=1, loader=True)
    for fetches in [4] * 12 + [2]:
        for _ in range(fetches):
            engine.data.add(0.001)
            model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert engine.stop().to_dict()["run"]["micro_batches_seen"] is None


def test_pooled_events_are_released_once_and_never_while_still_in_use():
    engine, clock, _ = _fake_run(steps=8, warmup=0)
    clock.complete_all()
    engine.steps.drain()
    assert len(engine.steps.run) == 8 and clock.released > 0
    # The latest step's end is the open step's start: it must not be back in the pool.
    assert not any(m is engine.steps.current.start for m in clock.released_marks)


def test_without_a_process_group_backward_ends_and_syncs_on_one_event(monkeypatch):
    """Nothing can wait for gradients after backward without a process group: the end
    of backward's compute is also the moment they are synced, one event fewer a step.
    (On the general path; the steady lane's rows hold one backward end as well.)"""
    monkeypatch.setattr(SteadyLane, "enabled", False)
    marks_per_step = {}
    for synced_apart in (False, True):
        engine, clock, model, opt = _fake_engine(warmup=0)
        assert engine.passes.synced_apart is False  # no process group here
        engine.passes.synced_apart = synced_apart  # (as in a process group)
        taken = []
        mark = clock.mark
        clock.mark = lambda: taken.append(mark()) or taken[-1]
        _train_steps(model, opt, 6)
        backward = [step.backward[0] for step in engine.steps.pending]
        assert len(backward) == 6
        assert all((b1 is b2) is not synced_apart for _, b1, b2 in backward)
        marks_per_step[synced_apart] = len(taken) / 6
        settled = _settled_averages(engine, clock)  # (a shared event goes back to the pool once)
        assert settled["backward"] == pytest.approx(7.0) and settled["step"] == pytest.approx(11.0)
    assert marks_per_step[True] - marks_per_step[False] == 1


def test_under_fsdp_backward_start_is_marked_before_later_hooks_on_the_output():
    """FSDP2 hooks the forward's outputs for its pre-backward after dtprofile's hook has
    hooked them: under FSDP, dtprofile's mark must come first (autograd runs a node's own
    hooks after every hook on its tensors, so there it hooks the tensor). Elsewhere, in a
    process group too (DDP), the node's hook is the cheaper one."""
    seen_by_later_hook = {}
    for sharded in (True, False):
        engine, clock, model, opt = _fake_engine(warmup=0)
        engine.passes.synced_apart = True  # (as in a process group)
        engine.updates.sharded = sharded  # (as under FSDP)
        seen = []

        def later_hook(module, args, out, seen=seen, engine=engine):  # after dtprofile's, as FSDP's is
            out.register_hook(lambda grad: seen.append(len(engine.steps.current.backward)))

        model.register_forward_hook(later_hook)
        _train_steps(model, opt, 2)
        seen_by_later_hook[sharded] = seen
    assert seen_by_later_hook[True] == [1, 1]  # backward's start already marked
    assert seen_by_later_hook[False] == [0, 0]  # (the node's hook, after the tensor's)


@pytest.mark.parametrize("every", [5, 1])
def test_without_a_process_group_backward_is_timed_on_a_sample_of_the_steps(every):
    """Nothing waits for gradients after backward without a process group, and the hook
    that marks backward's start, registered on each step's output anew, is most of what
    timing backward costs a step: it is timed on the first 20 steps after warm-up, then
    on every ``backward_timing_every``-th. The other steps time everything else."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = Engine(Options(warmup_steps=2, every_n_steps=1000, backward_timing_every=every), clock=HostClock())
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "backward unseen" on the steps it is not timed on
        for i in range(40):
            step = engine.steps.current
            model(torch.randn(8, 4)).sum().backward()
            seen.append((step.times_backward, len(step.backward), step.backward_untimed))
            opt.step()
            opt.zero_grad()
    timed = [i - 2 < 20 or (i - 2) % every == 0 for i in range(40)]
    assert seen == [(t, int(t), not t) for t in timed]
    summary = engine.stop()
    assert summary["steps_profiled"] == 38 and summary["backward_timed_steps"] == sum(timed[2:])
    per = summary["per_step_ms"]
    assert per["backward"] > 0 and per["forward"] > 0 and per["optimizer"] > 0
    assert summary["steps_skipped_update"] == 0 and summary["steps_without_backward"] == 0
    assert summary["run"]["micro_batches"] == 1


@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("step_us, every_n_steps, every", [(150, 1000, 134), (150, 50, 50), (5000, 1000, 10)])
def test_auto_backward_timing_samples_short_steps_less_often(monkeypatch, step_us, every_n_steps, every, lane):
    """``backward_timing_every="auto"`` (the default) times every 10th step, or fewer where
    steps are so short that the timed ones would cost the run more than 0.5%: chosen
    from the host time of the first 20 steps after warm-up (their median: a pause among
    them is not a step's time), and at least once per log interval. The same steps in
    the steady lane and on the general path."""
    import dtprofile.capture.steps

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = Engine(Options(warmup_steps=2, every_n_steps=every_n_steps), clock=HostClock())
    assert engine.options.backward_timing_every == "auto"

    # The host's time: each step takes step_us (whatever the machine's speed).
    def host_s():  # (and a pause of half a second, an evaluation's, among the steps the choice is made from)
        return engine.steps.steps_seen * step_us / 1e6 + (0.5 if engine.steps.steps_seen > 12 else 0.0)

    fake_time = type("FakeTime", (), {"perf_counter": staticmethod(host_s)})
    monkeypatch.setattr(dtprofile.capture.steps, "time", fake_time)
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    for _ in range(2 + 20 + 2 * every + 1):
        if not lane:
            engine.steps.leave_lane()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert (engine.steps.lane.steps_taken > 0) is lane
    expected = [i < 20 or i % every == 0 for i in range(20 + 2 * every + 1)]  # (after warm-up)
    engine.steps.flush()
    rows = engine.steps.run.rows()
    assert np.isfinite(rows[:, FIELDS.index("backward")]).tolist() == expected
    assert engine.steps.backward_every == every
    summary = engine.stop()
    assert summary["backward_timed_steps"] == sum(expected)


def test_backward_timing_every_takes_auto_or_a_positive_integer(monkeypatch):
    assert Options(backward_timing_every=3).backward_timing_every == 3
    with pytest.raises(ValueError, match="backward_timing_every must be 'auto' or an integer >= 1, got 0"):
        Options(backward_timing_every=0)
    with pytest.raises(ValueError, match="backward_timing_every must be 'auto' or an integer >= 1, got 'often'"):
        Options(backward_timing_every="often")
    from dtprofile.options import options_from_env

    monkeypatch.setenv("DTPROFILE_BACKWARD_TIMING_EVERY", "AUTO")
    assert options_from_env() == {"backward_timing_every": "auto"}
    monkeypatch.setenv("DTPROFILE_BACKWARD_TIMING_EVERY", "7")
    assert options_from_env() == {"backward_timing_every": 7}


def _sampled_engine(make_model, monkeypatch, warmup_steps=0):
    """A host-clock engine that times backward on the first step after warm-up only, on a
    model made by ``make_model`` (seeded) and its SGD; the engine, the model, the SGD."""
    import dtprofile.capture.schedule

    monkeypatch.setattr(dtprofile.capture.schedule, "BACKWARD_TIMING_FIRST", 1)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = Engine(
        Options(warmup_steps=warmup_steps, every_n_steps=1000, backward_timing_every=1000), clock=HostClock()
    )
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    return engine, model, opt


class _SlowBackward(torch.autograd.Function):
    """Identity forward; a backward that takes 5 ms."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.005)
        return grad


class _SlowBackwardNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return _SlowBackward.apply(self.lin(x))


def test_a_closure_inside_the_update_still_times_its_backward(monkeypatch):
    """optimizer.step(closure) (LBFGS, SAM): the update is what its span holds besides
    the passes, so a backward inside it is timed on every step, or the update would
    swallow it."""
    engine, model, opt = _sampled_engine(_SlowBackwardNet, monkeypatch)

    closure = _zeroing_closure(model, opt)
    for _ in range(12):
        opt.step(closure)
    summary = engine.stop()
    per = summary["per_step_ms"]
    assert summary["backward_timed_steps"] == summary["steps_profiled"] == 12
    assert per["backward"] >= 5.0 and per["optimizer"] < 2.0, per


def test_updates_skipped_silently_are_told_on_steps_that_do_not_time_backward(monkeypatch):
    """Without a loss scaler that speaks, a skipped update is told at the next forward from
    a backward that ran and gradients cleared since. On a step that does not time
    backward, the hook that stays on a parameter says a backward ran (else each skipped
    iteration merged into the next step, two forwards in one)."""
    engine, model, opt = _sampled_engine(lambda: nn.Linear(4, 2), monkeypatch, warmup_steps=2)
    for i in range(40):
        model(torch.randn(8, 4)).sum().backward()
        if i % 7 != 6:  # every 7th update skipped (a NaN guard of the loop's own)
            opt.step()
        opt.zero_grad()
    summary = engine.stop()
    assert summary["steps_skipped_update"] == 5  # iterations 6, 13, 20, 27 and 34
    assert summary["run"]["micro_batches"] == 1 and summary["run"]["micro_batches_seen"] is None


def test_a_backward_while_suspended_is_not_the_open_steps(monkeypatch):
    """The hook on the watched parameter runs while the engine is suspended (a tuner's
    trial steps): what it sees then is not the open step's, and what it saw before stays."""
    engine, model, opt = _sampled_engine(lambda: nn.Linear(4, 2), monkeypatch, warmup_steps=2)
    for _ in range(4):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    for seen_before in (False, True):
        if seen_before:
            model(torch.randn(8, 4)).sum().backward()
        assert engine.steps.backward_seen is seen_before
        engine.suspend()
        model(torch.randn(8, 4)).sum().backward()  # a trial step's
        opt.zero_grad()
        engine.resume()
        assert engine.steps.backward_seen is seen_before
    engine.stop()
    assert not engine.steps.backward_reached  # (no reference to the model's parameter kept)


def test_evaluation_on_both_sides_of_an_untimed_backward_leaves_the_backward_in_the_step(monkeypatch):
    """Evaluation forwards with no training pass between them are one span; an untimed
    backward between two of them is a training pass nothing marked, so they stay apart."""
    engine, model, opt = _sampled_engine(_SlowBackwardNet, monkeypatch)

    def evaluate():
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 4))
        model.train()

    for _ in range(8):
        loss = model(torch.randn(8, 4)).sum()
        evaluate()
        loss.backward()
        evaluate()
        opt.step()
        opt.zero_grad()
    engine.steps.drain()
    compute = engine.steps.run.rows()[:, FIELDS.index("compute")]
    assert len(compute) == 8 and np.all(compute >= 5.0), compute  # the 5 ms backward, timed or not
    engine.stop()


def test_an_untimed_backward_of_a_checkpointed_model_is_left_untimed():
    """Reentrant activation checkpointing: the recompute inside backward is where a timed
    step's backward starts; on a step that does not time backward it starts nothing."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True)

    torch.manual_seed(0)
    outer = Checkpointed()
    opt = torch.optim.SGD(outer.parameters(), lr=0.01)
    engine = Engine(Options(warmup_steps=0, every_n_steps=1000, backward_timing_every=1000), clock=HostClock())
    engine.attach_module(outer.inner)  # checkpointed: its forward runs again inside backward
    engine.attach_optimizer(opt)
    engine.start()
    shapes = []
    for _ in range(24):
        step = engine.steps.current
        outer(torch.randn(8, 4).requires_grad_()).sum().backward()
        shapes.append((len(step.forward), len(step.backward), step.backward_untimed))
        opt.step()
        opt.zero_grad()
    assert shapes == [(1, 1, False)] * 20 + [(1, 0, True)] * 4
    summary = engine.stop()
    assert summary["backward_timed_steps"] == 20 and summary["per_step_ms"]["backward"] > 0


def test_host_steps_reach_the_windows_in_batches_and_before_anything_reads_them():
    from dtprofile.capture.steps import ROWS_BATCH

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = _host_engine(model, opt, warmup_steps=2, backward_timing_every=10)
    try:
        _train_steps(model, opt, 10)
        steps = engine.steps
        assert len(steps.run) == 0 and len(steps._rows) == 8  # rows of marks, no figures yet
        import threading

        other = threading.Thread(target=engine.summary, kwargs=dict(final=False, complete=False))
        other.start()
        other.join(timeout=30)
        assert len(steps._rows) == 8  # another thread reads what the windows hold, changes nothing
        summary = engine.summary(final=False, complete=False)  # a reader: they go in first
        assert len(steps.run) == 8 and not steps._rows
        assert summary["per_step_ms"]["step"] > 0 and summary["per_step_ms"]["backward"] > 0
        _train_steps(model, opt, ROWS_BATCH)
        assert len(steps.run) == 8 + ROWS_BATCH and not steps._rows  # a full batch goes in by itself
        rows = steps.run.rows()
        for name in ("step", "optimizer", "compute"):
            column = rows[:, FIELDS.index(name)]
            assert np.all(np.isfinite(column)) and np.all(column >= 0), name
        # Forward and backward are timed on the first 20 steps after warm-up, then on every 10th.
        for name in ("forward", "backward"):
            column = rows[:, FIELDS.index(name)]
            assert np.isfinite(column).tolist() == [i < 20 or i % 10 == 0 for i in range(len(rows))], name
            assert np.all(column[np.isfinite(column)] >= 0), name
        assert np.allclose(
            rows[:, FIELDS.index("step")], rows[:, FIELDS.index("compute")] + rows[:, FIELDS.index("data_wait")]
        )
        # A log interval that is summarised reads the interval window: the rows before it are in it.
        steps.options = dataclasses.replace(steps.options, every_n_steps=5)
        steps.interval.clear()
        engine.intervals.sink, engine.intervals._worker = object(), _StepsLogged()
        _train_steps(model, opt, 5 - steps.steps_seen % 5)
        assert not steps._rows and engine.intervals._worker.steps == [steps.steps_seen]
        engine.intervals.sink = engine.intervals._worker = None
    finally:
        engine.stop()


def test_model_compiled_in_place_keeps_one_graph():
    """model.compile() runs the module's hooks inside the compiled frame: dtprofile's run
    eagerly, so the forward stays one graph and no Dynamo warning appears."""
    import warnings

    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    graphs = []

    def counting_backend(gm, example_inputs):  # every graph Dynamo compiles passes here
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    model.compile(backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt, warmup_steps=2) as prof:
            for _ in range(8):
                nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
                opt.step()
                opt.zero_grad()
    assert not caught, [str(w.message) for w in caught]
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert len(graphs) == 1, graphs
    s = prof.report().to_dict()
    assert s["steps_profiled"] == 6 and s["run"]["batch_size"] == 8
    assert s["per_step_ms"]["forward"] > 0 and s["per_step_ms"]["backward"] > 0
    torch._dynamo.reset()


def test_hooks_run_plain_until_something_compiles_then_stay_out_of_its_graphs():
    """The per-step hooks go in plain (no torch.compiler.disable wrapper) while nothing is
    compiled, and the steps that do not time their passes get the lean forward hooks;
    a function compiled mid-run, which calls the profiled model, puts the full and
    disabled hooks in place before it is traced: no Dynamo warning, one graph, and the
    run goes on measuring."""
    import warnings

    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def kinds():
        hooks = (
            model._forward_pre_hooks,
            model._forward_hooks,
            opt._optimizer_step_pre_hooks,
            opt._optimizer_step_post_hooks,
        )
        return [type(h).__name__ for d in hooks for h in d.values()]

    call = model
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt, warmup_steps=2) as prof:
            lane = prof._engine.steps.lane
            for i in range(60):
                if i in (1, 36):
                    seen[i] = kinds()
                if i == 36:
                    seen["lean"] = lane.lean_steps
                    call = torch.compile(lambda t: model(t), backend=counting_backend)
                nn.functional.mse_loss(call(torch.randn(8, 16)), torch.randn(8, 1)).backward()
                opt.step()
                opt.zero_grad()
            seen["end"] = kinds()
            seen["lean_end"] = lane.lean_steps
    assert not caught, [str(w.message) for w in caught]
    assert not torch._dynamo.utils.counters["graph_break"] or all(
        "torch.compiler.disable" in k for k in torch._dynamo.utils.counters["graph_break"]
    )
    assert seen[1] == ["_ModuleHook", "_ModuleHook", "method", "method"]  # plain, full (a timed step)
    assert seen[36] == ["LeanPreHook", "method", "method"]  # lean: no post-hook
    assert seen["lean"] > 5 and seen["lean_end"] == seen["lean"]  # none lean once something compiles
    assert seen["end"] == ["_EagerModuleHook", "_EagerModuleHook", "function", "function"]
    assert len(graphs) == 1
    s = prof.report().to_dict()
    assert s["steps_profiled"] == 58 and s["per_step_ms"]["forward"] > 0 and s["per_step_ms"]["backward"] > 0
    assert not model._forward_pre_hooks and not model._forward_hooks and not opt._optimizer_step_pre_hooks
    torch._dynamo.reset()


def test_manual_communication_exposed_is_the_part_after_backward():
    from dtprofile.capture.records import CommInterval

    step = PendingStep(start=0.0)
    step.forward.append([0.000, 0.010])
    step.backward.append([0.010, 0.030, 0.030])
    step.comm_measured = True
    step.comm += [CommInterval(0.025, 100, 0.035, bucket=False), CommInterval(0.036, 50, 0.040, bucket=False)]
    step.optimizer = (0.041, 0.045)
    step.end = 0.045
    record = step.to_record(HostClock(), data_wait_from="gap")
    assert record.comm_total == pytest.approx(14.0)
    assert record.comm_exposed == pytest.approx(9.0)  # 30-35 and 36-40; 25-30 overlapped backward
    assert record.grad_bytes == 150
    step.comm.append(CommInterval(0.040, None, 0.041, bucket=False))
    assert math.isnan(step.to_record(HostClock(), data_wait_from="gap").grad_bytes)  # a size unknown


def test_ddp_copy_back_is_in_the_total_as_well_as_in_the_exposed_part():
    from dtprofile.capture.records import CommInterval

    # Buckets reduced 20-26 and 28-33 ms; backward compute ends at 30; DDP's wait and
    # copy-back into .grad end at 36: exposed 30-36, and the total holds it too.
    step = PendingStep(start=0.0)
    step.forward.append([0.000, 0.010])
    step.backward.append([0.010, 0.030, 0.036])
    step.comm_measured = True
    step.comm += [CommInterval(0.020, 100, 0.026), CommInterval(0.028, 100, 0.033)]
    step.optimizer = (0.037, 0.040)
    step.end = 0.040
    record = step.to_record(HostClock(), data_wait_from="gap")
    assert record.comm_exposed == pytest.approx(6.0)
    assert record.comm_total == pytest.approx(14.0)  # 20-26 and 28-36 (not 11: the bucket spans alone)
    assert record.comm_total >= record.comm_exposed


@pytest.mark.parametrize("nbytes", [-1, 1.5, "1MB", True])
def test_communication_block_rejects_bad_nbytes(nbytes):
    model = nn.Linear(4, 2)
    prof = dtprofile.profile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="nbytes"), prof.communication(nbytes):
        pass


def test_a_huge_log_interval_does_not_allocate_a_huge_window():
    engine = Engine(Options(every_n_steps=10**9))
    assert engine.steps.interval.capacity == engine.steps.run.capacity  # bounded by the run window


def test_an_optimizer_of_other_parameters_is_named():
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="the optimizer holds none of the profiled model's parameters"):
        prof = dtprofile.profile(model, torch.optim.SGD(other.parameters(), lr=0.1))
        prof.start()
    prof.stop()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own parameters: no warning
        prof = dtprofile.profile(model, torch.optim.SGD(model.parameters(), lr=0.1))
        prof.start()
        prof.stop()


def test_several_training_loaders_give_batch_size_and_workers():
    """A dict of loaders (Lightning's CombinedLoader holds them in .iterables), and a
    batch that is a dict of lists: before, both gave None."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from dtprofile.capture.passes import iter_tensors as _iter_tensors

    loaders = {
        "a": DataLoader(list(range(8)), batch_size=4, num_workers=2),
        "b": DataLoader(list(range(8)), batch_size=2),
    }
    for given in (loaders, SimpleNamespace(iterables=loaders), list(loaders.values())):
        engine = Engine(Options())
        engine.note_loader(given)
        assert (engine.data.batch_size, engine.data.num_workers) == (4, 2), given
    x = torch.zeros(6, 3)
    batch = {"a": [x, torch.zeros(2)], "b": [torch.zeros(5)]}
    assert next(_iter_tensors(((batch,), {}))) is x  # training_step(batch) as (args, kwargs)


def test_forwards_without_an_optimizer_step_stay_bounded():
    """Inference with gradients on (model.eval() without no_grad) never steps: the open
    step held every forward (12 MB per 100k forwards and a 4.8x slower loop). Now it
    keeps MAX_PASSES_PER_STEP, warns once, and training afterwards is measured."""
    from dtprofile.capture.steps import MAX_PASSES_PER_STEP

    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="forward passes with gradients and no optimizer step") as caught:
        with dtprofile.profile(net, opt, warmup_steps=0) as prof:
            engine = prof._engine
            for _ in range(MAX_PASSES_PER_STEP + 500):
                net(x)
            assert len(engine.steps.current.forward) == MAX_PASSES_PER_STEP
            assert len(engine.steps.current.backward) == 0
            net.train()
            for _ in range(3):
                net(x).sum().backward()
                opt.step()
                opt.zero_grad()
            assert len(engine.steps.current.forward) == 0  # a new step after the update
    assert sum("no optimizer step" in str(w.message) for w in caught) == 1
    assert prof.report()["steps_total"] == 3


def test_the_profilers_own_work_after_a_step_is_not_data_wait():
    """Closing a step, draining finished ones and an interval's summary run between the
    optimizer's end and the next forward: in gap mode that counted as data wait (73 us of
    a 0.41 ms step, "data_bound MEDIUM" for a loop that loads nothing)."""
    engine, clock, model, opt = _fake_engine(warmup=0)
    drain = engine.steps.drain

    def slow_drain(flush=True):
        drain(flush)
        clock.advance(5.0)  # 5 ms of the profiler's own bookkeeping

    engine.steps.drain = slow_drain
    for _ in range(6):
        clock.advance(2.0)  # the host fetches the next batch
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    clock.complete_all()
    drain()
    typical = engine.steps.run.averages()
    assert typical["data_wait"] == pytest.approx(2.0)
    assert typical["step"] == pytest.approx(2.0 + 3 + 7 + 1)


def test_reentrant_checkpointing_of_the_whole_model_is_not_data_wait():
    """checkpoint(model, x, use_reentrant=True) runs the first forward under no_grad in
    train mode: it is compute, so the gap before it is the only data wait (before, that
    whole forward was data wait: "data_bound HIGH, 11.7 ms of a 43.8 ms step")."""
    from torch.utils.checkpoint import checkpoint

    engine, clock, model, opt = _fake_engine(warmup=0)
    for _ in range(5):
        clock.advance(2.0)  # the host fetches the next batch
        x = torch.randn(8, 4, requires_grad=True)
        checkpoint(model, x, use_reentrant=True).sum().backward()
        opt.step()
        opt.zero_grad()
    clock.complete_all()
    engine.steps.drain()
    typical = engine.steps.run.averages()
    assert typical["data_wait"] == pytest.approx(2.0)


def test_a_fetch_inside_the_forward_is_data_wait_not_forward():
    """Lightning's training_step(self, dataloader_iter) fetches inside the step: that
    wait was counted twice, as data wait and as forward (26 ms forward for 12)."""
    import time

    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = _host_engine(net, opt, warmup_steps=0)
    engine.data.use_loader()

    waits_ms = []

    def fetch(module, args):
        t0 = time.perf_counter()
        time.sleep(0.02)
        waits_ms.append((time.perf_counter() - t0) * 1e3)
        engine.data.add(waits_ms[-1] / 1e3)

    hook = net.register_forward_pre_hook(fetch)  # runs inside the profiled forward, after its mark
    for _ in range(5):
        net(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    hook.remove()
    typical = engine.stop()["per_step_ms"]
    # The waits as measured (a loaded machine oversleeps): all of them data wait ...
    assert min(waits_ms) <= typical["data_wait"] <= max(waits_ms), (waits_ms, typical)
    # ... none of them forward (a 4x2 linear layer: microseconds, not the 20 ms sleep).
    assert typical["forward"] < 10.0, typical


def test_on_a_device_timeline_a_fetch_inside_the_forward_stays_in_it():
    """The host's wait says nothing of the device's: the device forward keeps what it idled."""
    engine, clock, model, opt = _fake_engine(warmup=0, loader=True)

    def fetch(module, args):
        engine.data.add(0.005)
        clock.advance(5.0)

    model.lin.register_forward_pre_hook(fetch)
    _train_steps(model, opt, 5)
    typical = _settled_averages(engine, clock)
    assert typical["data_wait"] == pytest.approx(0.0) and typical["forward"] == pytest.approx(8.0)
    assert typical["step"] == pytest.approx(5.0 + 3 + 7 + 1)


def test_a_no_grad_pass_before_a_fetch_does_not_end_the_data_wait():
    """A no-grad train-mode pass right after the step (a metric), then the fetch: the
    step's compute starts after the fetch, so the fetch stays data wait."""
    engine, clock, model, opt = _fake_engine(warmup=0, loader=True)
    for _ in range(5):
        with torch.no_grad():
            model(torch.randn(8, 4))  # 3 ms on the fake clock
        engine.data.add(0.020)
        clock.advance(20.0)  # the device idles for the fetch
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    clock.complete_all()
    engine.steps.drain()
    assert engine.steps.run.averages()["data_wait"] == pytest.approx(20.0)


def test_a_model_whose_forward_never_runs_is_warned_about_once():
    """The loop trains another module than the one profiled: forward and backward read 0
    and all compute is 'other'; nothing said so."""
    model, other = nn.Linear(8, 2), nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt, warmup_steps=1):
            for _ in range(20):
                other(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
    said = [str(w.message) for w in caught if "forward has not run" in str(w.message)]
    assert len(said) == 1 and "pass dtprofile.profile() the module your loop calls" in said[0]
    # A profile started between a forward and its step misses one forward: no warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(torch.randn(4, 8)).sum()
        with dtprofile.profile(model, opt, warmup_steps=1):
            loss.backward()
            opt.step()
            opt.zero_grad()
            for _ in range(5):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert not [w for w in caught if "forward has not run" in str(w.message)]


class _SleepyForward(nn.Module):
    """5 ms of forward, whoever calls it: a recompute inside backward costs it again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return self.lin(x)


@pytest.mark.parametrize("reentrant, early_stop", [(True, True), (False, True), (False, False)])
def test_checkpointing_the_whole_model_keeps_forward_and_backward_apart(reentrant, early_stop):
    """checkpoint(model, x) on the profiled model. Before: reentrant read the recompute as
    the forward and the real forward as host work (host_work high, 30%); non-reentrant
    left the recompute's forward open, so the next micro-batch's fetch came out of
    forward (2.2 ms for 16.5), or counted it as a second forward."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    torch.manual_seed(0)
    model = _SleepyForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():
        for _ in range(24):
            time.sleep(0.003)
            yield torch.randn(4, 8, requires_grad=reentrant), torch.randn(4, 2)

    with set_checkpoint_early_stop(early_stop), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt, warmup_steps=2) as prof:
            for i, (x, y) in enumerate(prof.loader(batches())):
                out = checkpoint(model, x, use_reentrant=reentrant)
                ((out - y) ** 2).mean().backward()
                if i % 2 == 1:  # two micro-batches per step
                    opt.step()
                    opt.zero_grad()
    assert not [w for w in caught if "dtprofile" in str(w.message)], [str(w.message) for w in caught]
    s = prof.report().to_dict()
    per = s["per_step_ms"]
    assert s["run"]["micro_batches"] == 2
    assert 9.0 <= per["forward"] <= 9.0 * 2.5, per  # two 5 ms forwards, not their recompute
    assert per["backward"] >= 9.0, per  # the recompute is backward's
    assert 5.0 <= per["data_wait"] <= 6.0 * 3, per  # two 3 ms fetches, none taken out of forward
    host = [f for f in s["advice"] if f["id"] == "host_work"]
    assert not host or host[0]["severity"] not in ("high", "medium"), host


def test_no_grad_passes_and_fetches_give_every_mark_back_once():
    """A no-grad train-mode pass (an EMA or metric pass, a rollout) before and after the
    fetch, for many steps: the strict fake clock raises on a mark released twice, and
    no more marks stay out than a few steps hold."""
    engine, clock, model, opt = _fake_engine(warmup=0, loader=True)
    taken, mark = [], clock.mark
    clock.mark = lambda: taken.append(1) or mark()
    for i in range(60):
        with torch.no_grad():
            model(torch.randn(8, 4))  # after the last step: not this step's compute
        engine.data.add(0.020)
        clock.advance(20.0)
        with torch.no_grad():
            model(torch.randn(8, 4))  # a rollout with the policy: compute of this step
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if i % 3 == 2:
            clock.complete_all()
            engine.steps.drain()
    clock.complete_all()
    engine.steps.drain()
    assert engine.parts["timing"].enabled
    a = engine.steps.run.averages()
    assert a["data_wait"] == pytest.approx(20.0) and a["forward"] == pytest.approx(3.0)
    assert len(taken) - clock.released <= 3, (len(taken), clock.released)  # the open step's start


def test_a_no_grad_pass_that_raises_does_not_hold_up_the_later_steps():
    """An environment error inside a rollout, caught by the loop: that pass never ends,
    and on a device clock the step waiting for its end blocked every later one."""
    engine, clock, model, opt = _fake_engine(warmup=0)

    def environment_error(module, args):  # runs after dtprofile's pre-hook, before forward
        raise RuntimeError("the environment crashed")

    for i in range(30):
        if i == 5:
            handle = model.register_forward_pre_hook(environment_error)
            with pytest.raises(RuntimeError, match="environment crashed"), torch.no_grad():
                model(torch.randn(8, 4))
            handle.remove()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        clock.complete_all()
        engine.steps.drain()
    assert engine.steps.steps_finalized == 30 and not engine.steps.pending


def test_a_profiled_model_can_be_saved_and_copied_and_its_copies_are_not_profiled(tmp_path):
    """torch.save(model) raised "Can't pickle local object" while profiling, and a
    deepcopy (an EMA model, a target network) shared the hooks: its forwards counted as
    the model's (forward 14.0 ms for 7.3, micro_batches 2) and it could not be saved
    even after stop()."""
    import copy

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with dtprofile.profile(model, opt, warmup_steps=1) as prof:
        target = copy.deepcopy(model)  # made after start()
        for i in range(12):
            x = torch.randn(4, 8)
            with torch.enable_grad():
                target(x).detach()  # run with grad on: looked like a second micro-batch
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 5:
                torch.save(model, tmp_path / "model.pt")
    assert prof.report().to_dict()["run"]["micro_batches"] == 1
    torch.save(target, tmp_path / "target.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded(torch.randn(4, 8)).shape == (4, 2)  # its hooks do nothing
    from dtprofile._torch_internals import inert_hook as _inert_hook

    hooks = [
        *target._forward_hooks.values(),
        *target._forward_pre_hooks.values(),
        *loaded._forward_hooks.values(),
        *loaded._forward_pre_hooks.values(),
    ]
    assert len(hooks) == 4 and all(h is _inert_hook for h in hooks)


def test_the_summary_keeps_the_time_of_every_step_beside_the_trimmed_averages():
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with dtprofile.profile(model, opt, warmup_steps=2) as prof:
        for i in range(42):
            if i % 20 == 10:
                time.sleep(0.030)  # a rollout every 20 updates: the slowest steps, trimmed
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    s = prof.report().to_dict()
    assert s["step_ms_all_steps"] >= s["per_step_ms"]["step"] + 2 * 30.0 / 40 * 0.9
    assert "rare_long_steps" in [f["id"] for f in s["advice"]]


def test_a_teacher_pass_in_eval_mode_every_step_is_named():
    """Self-distillation with the model itself in eval mode under no_grad every step:
    those passes are left out as evaluation (19% of the step in no figure); the summary
    counts the steps and the advice says so. An evaluation every 10 steps is not named."""

    def run(every):
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with dtprofile.profile(model, opt, warmup_steps=2) as prof:
            for i in range(24):
                x = torch.randn(4, 8)
                if i % every == 0:
                    model.eval()
                    with torch.no_grad():
                        model(x)
                    model.train()
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        return prof.report().to_dict()

    teacher = run(1)
    assert teacher["steps_with_eval_forwards"] == 22
    finding = [f for f in teacher["advice"] if f["id"] == "eval_forwards_in_steps"]
    assert finding and "22 of 22 steps" in finding[0]["title"]
    occasional = run(10)
    assert occasional["steps_with_eval_forwards"] == 2
    assert "eval_forwards_in_steps" not in [f["id"] for f in occasional["advice"]]


@pytest.mark.filterwarnings("ignore:dtprofile.*holds an earlier run")
def test_runs_of_one_job_in_one_logdir_pool_their_spread(tmp_path):
    """A finished run leaves its line in dtprofile_runs.jsonl; the next run of the same
    job in that logdir, or in one beside it, pools it (uncertainty.pooled_runs) where its
    figures could be the same job again (a busy machine can move them further: then it
    stands alone); another batch size is another job, and pool_runs=0 pools nothing."""
    from dtprofile.analysis.uncertainty import comparable

    def train(batch: int, logdir: str | None = str(tmp_path), **kw):
        torch.manual_seed(0)

        class Slept(nn.Linear):  # (20 ms a forward: steps about as long on a busy machine)
            def forward(self, x):
                time.sleep(0.02)
                return super().forward(x)

        model = nn.Sequential(Slept(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = [(torch.randn(batch, 16), torch.randn(batch, 4)) for _ in range(24)]
        with dtprofile.profile(model, opt, logdir=logdir, warmup_steps=3, every_n_steps=50, **kw) as prof:
            for x, y in prof.loader(data):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return prof.report().to_dict()

    def pooled(summary, *earlier):
        return sum(comparable(summary["per_step_ms"], e["per_step_ms"]) for e in earlier)

    train(8, logdir=None)  # (the process's first backward costs more than a run of the job differs by)
    first, second = train(8), train(8)
    assert first["uncertainty"]["pooled_runs"] == 0
    assert second["uncertainty"]["pooled_runs"] == pooled(second, first)
    if pooled(second, first):
        assert "1 earlier run of this job" in str(dtprofile.Report(second))
    lines = [json.loads(line) for line in (tmp_path / "dtprofile_runs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["job"] == lines[1]["job"]
    assert lines[1]["per_step_ms"]["step"] == second["per_step_ms"]["step"]
    assert train(16)["uncertainty"]["pooled_runs"] == 0  # another batch size: another job
    assert train(8, pool_runs=0)["uncertainty"]["pooled_runs"] == 0
    assert len((tmp_path / "dtprofile_runs.jsonl").read_text().splitlines()) == 3  # (pool_runs=0 adds none)
    # A logdir per run, as TensorBoard reads them: the runs beside it are pooled too.
    b = train(8, logdir=str(tmp_path / "b"))
    assert b["uncertainty"]["pooled_runs"] == 0  # (tmp_path is its parent, not beside it)
    c = train(8, logdir=str(tmp_path / "c"))
    assert c["uncertainty"]["pooled_runs"] == pooled(c, b)
