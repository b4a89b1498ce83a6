"""Log intervals off the training thread: the worker, its duty cap, the hand-back at step
closes, the flush at stop, and its failures."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import dtprofile.intervals as intervals
from dtprofile.engine import Engine
from dtprofile.options import Options
from dtprofile.sinks import background
from dtprofile.sinks.background import BackgroundWorker


class _Sink:
    """Records what the engine hands a sink, and on which thread."""

    def __init__(self):
        self.logged: list[tuple[int, int, int]] = []  # (step, steps_total, thread)
        self.profiled: list[int] = []  # each summary's steps in its window
        self.closed: tuple[dict, int] | None = None

    def prepare(self):
        pass

    def log(self, summary, step):
        self.logged.append((step, summary["steps_total"], threading.get_ident()))
        self.profiled.append(summary["steps_profiled"])

    def close(self, summary, step):
        self.closed = (summary, step)


def _run(steps, *, sink=None, every=3, summarize_every_rank=False, on_interval=None):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(
        Options(warmup_steps=1, every_n_steps=every),
        sink_factory=(lambda: sink) if sink is not None else None,
        summarize_every_rank=summarize_every_rank,
        on_interval=on_interval,
    )
    engine.attach_module(model)
    engine.attach_optimizer(opt)
    engine.start()
    worker = engine.intervals._worker
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    return engine, worker


@pytest.mark.parametrize("with_sink", [True, False])
def test_intervals_are_built_off_the_training_thread_and_published_on_it(with_sink, monkeypatch):
    main = threading.get_ident()
    built_on = []

    def build(*args, **kwargs):
        built_on.append(threading.get_ident())
        return build_summary(*args, **kwargs)

    build_summary = intervals.build_summary
    monkeypatch.setattr("dtprofile.intervals.build_summary", build)
    monkeypatch.setattr(background, "MAX_SHARE", 1.0)  # no rest: more intervals are built
    published = []
    sink = _Sink() if with_sink else None
    engine, worker = _run(
        30,
        sink=sink,
        summarize_every_rank=not with_sink,
        on_interval=lambda summary, step: published.append((summary, step, threading.get_ident())),
    )
    report = engine.stop()

    assert worker is not None and engine.intervals._worker is None  # ended at stop
    assert built_on.count(main) == 1  # the run's summary, at stop
    interval_builds = [t for t in built_on if t != main]
    assert interval_builds and set(interval_builds) == {worker._thread.ident}
    # Each interval built went to on_interval, in order, on the training thread; its
    # figures are those of its own step (copied then, built later).
    assert [t for *_, t in published] == [main] * len(published) and len(published) == len(interval_builds)
    steps = [step for _, step, _ in published]
    assert steps == sorted(set(steps)) and steps[-1] == 30 and all(s % 3 == 0 for s in steps)
    assert all(summary["steps_total"] == step for summary, step, _ in published)
    if with_sink:
        assert [(s, n) for s, n, _ in sink.logged] == [(s, s) for s in steps]
        assert {t for *_, t in sink.logged} == {worker._thread.ident}
        assert sink.closed[0] is report.to_dict() and sink.closed[1] == 30
    assert engine.latest_summary() is report.to_dict() and engine.latest_summary_step == 30


def test_a_finished_interval_is_published_at_the_next_step_close():
    published = []
    engine, worker = _run(
        3, every=3, summarize_every_rank=True, on_interval=lambda summary, step: published.append(step)
    )
    assert worker.flush(timeout_s=60)  # built: waiting for the training thread
    assert published == [] and engine.latest_summary() is None
    model = engine.modules[0]
    opt = engine.updates.primary
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert published == [3]
    summary, step = engine.latest_summary_with_step()
    assert step == 3 and summary["steps_total"] == 3 and summary["complete"] is True
    engine.stop()


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_duty_cap_coalesces_jobs_newest_wins():
    clock = _FakeClock()
    ran, done = [], threading.Event()

    def work(job):
        clock.now += 1.0  # each job takes a second: then a rest of 49 at a 2% share
        ran.append(job)
        done.set()

    worker = BackgroundWorker(work, on_error=pytest.fail, max_share=0.02, clock=clock)
    worker.submit(1)
    assert worker.flush(timeout_s=60) and ran == [1]
    for job in (2, 3, 4):  # while it rests (the fake clock stands still): each replaces the last
        worker.submit(job)
    assert worker.coalesced == 2
    clock.now = 50.0  # the rest is over: the next submit wakes it and the newest runs
    done.clear()
    worker.submit(5)
    assert done.wait(60) and ran == [1, 5] and worker.coalesced == 3
    worker.submit(6)  # resting again (until 100): stop runs it at once all the same
    assert worker.stop(timeout_s=60)
    assert ran == [1, 5, 6] and worker.done == 3 and worker.coalesced == 3
    worker.submit(7)  # after stop: dropped
    assert ran == [1, 5, 6]


def test_the_worker_takes_at_most_its_share():
    clock = _FakeClock()

    def work(job):
        clock.now += 0.5

    worker = BackgroundWorker(work, on_error=pytest.fail, max_share=0.25, clock=clock)
    worker.submit(0)
    assert worker.flush(timeout_s=60)
    assert worker._rest_until == pytest.approx(0.5 + 0.5 * 3)  # busy 0.5 s of every 2 s
    assert worker.rest_left_s() == pytest.approx(1.5)  # (the clock stands at the job's end)
    clock.now += 2.0
    assert worker.rest_left_s() == 0.0
    with pytest.raises(ValueError, match="max_share"):
        BackgroundWorker(work, on_error=pytest.fail, max_share=0.0)


def test_stop_runs_the_pending_interval_at_once_and_closes_with_the_final_figures(monkeypatch):
    monkeypatch.setattr(background, "MAX_SHARE", 1e-9)  # after its first job, the worker rests for ages
    published = []
    sink = _Sink()
    engine, worker = _run(12, sink=sink, on_interval=lambda summary, step: published.append(step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = engine.stop()
    assert not [w for w in caught if "dtprofile" in str(w.message)]  # not "not ... written in time"
    steps = [s for s, *_ in sink.logged]
    # The first interval the worker took, then the last, handed over at stop and run at once;
    # those between were set aside as they ended (or queued while the first still ran: the
    # last replaced them).
    # (Which interval the worker took first depends on when its thread got a core: the
    # first ends at step 3, a busy machine may hand it a later one.)
    assert steps[0] in (3, 6, 9) and steps[1] == 12 and len(steps) == 2, steps
    assert worker.coalesced <= 3 and worker.done == 2
    # (after one warm-up step) each summary has its own interval's steps
    assert sink.profiled == [2 if steps[0] == 3 else 3, 3], (steps, sink.profiled)
    assert published == steps
    summary, step = sink.closed
    assert summary is report.to_dict() and step == 12
    assert summary["steps_total"] == 12 and summary["complete"] is True and summary["per_step_ms"]["step"] > 0


def test_a_failing_build_disables_only_the_summary_part(monkeypatch):
    main = threading.get_ident()
    build_summary = intervals.build_summary

    def build(*args, **kwargs):
        if threading.get_ident() != main:
            raise RuntimeError("injected worker fault")
        return build_summary(*args, **kwargs)

    monkeypatch.setattr("dtprofile.intervals.build_summary", build)
    published = []
    sink = _Sink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, worker = _run(12, sink=sink, on_interval=lambda summary, step: published.append(step))
        assert worker.flush(timeout_s=60)  # the first interval's build failed before the run's summary
        summary = engine.stop().to_dict()
    ours = [str(w.message) for w in caught if "dtprofile" in str(w.message)]
    assert len(ours) == 1 and "summary disabled" in ours[0] and "injected worker fault" in ours[0]
    parts = engine.parts
    assert not parts["summary"].enabled and parts["sink"].enabled and parts["timing"].enabled
    assert sink.logged == [] and published == []  # no interval summary was built
    # The run's summary still stands: its bare measurement, the failure named, to the sink.
    assert summary["steps_total"] == 12 and summary["per_step_ms"]["step"] > 0
    assert "injected worker fault" in summary["parts_disabled"]["summary"]
    assert sink.closed[0] is summary


def test_a_failing_sink_disables_only_the_sink_part():
    class Broken(_Sink):
        def log(self, summary, step):
            raise OSError(28, "No space left on device")

    published = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _ = _run(
            12, sink=Broken(), summarize_every_rank=True, on_interval=lambda summary, step: published.append(step)
        )
        engine.stop()
    ours = [str(w.message) for w in caught if "dtprofile" in str(w.message)]
    assert len(ours) == 1 and "sink disabled" in ours[0]
    assert not engine.parts["sink"].enabled and engine.parts["summary"].enabled
    assert published and published[-1] == 12  # summaries go on without the sink


def test_intervals_the_resting_worker_would_not_take_in_time_are_set_aside(monkeypatch):
    """With one rank, an interval whose job would only wait out the worker's rest until the
    next interval replaced it is neither flushed nor copied: its rows stay marks for the
    run's window, its window is set aside, and the next one starts empty."""
    monkeypatch.setattr(background, "MAX_SHARE", 1e-9)
    sink = _Sink()
    engine, worker = _run(3, sink=sink, every=3)
    assert worker.flush(timeout_s=60) and worker.rest_left_s() > 1e3  # the first interval taken; resting
    steps = engine.steps
    taken = []
    monkeypatch.setattr(engine.intervals._run_state, "take", lambda: taken.append(1) or {})
    model, opt = engine.modules[0], engine.updates.optimizers[0]
    for _ in range(5):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert steps.steps_seen == 8 and not taken  # the interval at 6: not copied
    assert steps.aside is not None and len(steps.aside) + len(steps._rows) >= 3
    assert engine.intervals._aside_step == 6 and len(steps.interval) <= 2
    steps.flush()
    assert len(steps.aside) == 3 and len(steps.run) == 7 and len(steps.interval) == 2
    monkeypatch.undo()  # (the run's figures as they are copied)
    # Training pauses (an evaluation forward): the interval set aside is handed over now,
    # with the step count at its end, and runs after the worker's rest (here: at stop).
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 6))
    model.train()
    assert steps.aside is None and engine.intervals._aside_step is None
    engine.stop()  # at step 8
    assert [(s, total) for s, total, _ in sink.logged] == [(3, 3), (6, 6)]
    assert sink.profiled == [2, 3]
