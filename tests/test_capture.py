"""The capture parts on their own: the guard, the gather's vector, the internals' fallbacks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dtprofile import _torch_internals as internals
from dtprofile.capture.parts import Parts, guarded
from dtprofile.gather import STEP_KEYS, VECTOR_KEYS, pack, shard_samples_of, unpack
from dtprofile.noise import SHARD_SAMPLE_KEYS


class _Hooked:
    def __init__(self):
        self.parts = Parts()
        self.calls = 0

    @guarded("timing")
    def hook(self, fail=False):
        self.calls += 1
        if fail:
            raise RuntimeError("injected")
        return "ran"


def test_the_guard_runs_only_while_measuring_and_a_failure_disables_its_part_once():
    h = _Hooked()
    assert h.hook() is None and h.calls == 0  # not started
    h.parts.active = True
    assert h.hook() == "ran"
    h.parts.suspended = True
    assert h.hook() is None and h.calls == 1  # suspended: nothing runs
    h.parts.suspended = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert h.hook(fail=True) is None
        assert h.hook() is None  # disabled from now on
    assert [str(w.message) for w in caught] == [
        "dtprofile: timing disabled after an internal error (RuntimeError: injected); training continues"
    ]
    assert h.parts["timing"].error == "RuntimeError: injected" and h.parts["comm"].enabled


def test_a_ranks_vector_round_trips_with_missing_figures_as_none():
    row = {k: None for k in STEP_KEYS}
    row.update(rank=1, steps=7, step=12.5)
    telemetry = [float("nan")] * (len(VECTOR_KEYS) - len(STEP_KEYS) - len(SHARD_SAMPLE_KEYS))
    samples = [3.0, 1.0, 0.5] + [float("nan")] * (len(SHARD_SAMPLE_KEYS) - 3)
    vector = pack(row, telemetry, samples)
    assert len(vector) == len(VECTOR_KEYS)
    (back,) = unpack([vector])
    assert back["rank"] == 1 and back["steps"] == 7 and back["step"] == 12.5 and back["forward"] is None
    (shards,) = shard_samples_of([vector])
    assert shards[:3] == [3.0, 1.0, 0.5] and all(math.isnan(v) for v in shards[3:])


def test_the_internals_degrade_instead_of_raising():
    assert internals.in_backward() is False
    assert internals.optimizer_steps_running() is None  # not inside Optimizer.step
    assert internals.ddp_comm_hooks(object()) == [] and internals.ddp_logged_comm_hook(object()) is False
    assert internals.patch_ddp_buffer_sync(object(), lambda f: f) is None
    assert internals.watch_ddp_joins(object()) is None and internals.join_block_open(object()) is False
    assert internals.default_store() is None  # no process group here
    assert internals.grad_scaler_class() is torch.amp.GradScaler
    hook = internals.module_hook(lambda *a: "called")
    import copy

    assert hook() == "called" and copy.deepcopy(hook) is internals.inert_hook


def test_lean_hooks_put_every_hook_back_in_its_place(monkeypatch):
    import copy

    calls: list[str] = []
    model = torch.nn.Linear(2, 2)
    first = model.register_forward_hook(lambda *a: calls.append("user before"))
    pre = model.register_forward_pre_hook(internals._ModuleHook(lambda *a: calls.append("pre")), with_kwargs=True)
    post = model.register_forward_hook(internals._ModuleHook(lambda *a: calls.append("post")))
    after = model.register_forward_hook(lambda *a: calls.append("user after"))
    watch = internals.CompileWatch()
    switch = internals.LeanHooks(model, watch)
    switch.add(pre, internals._ModuleHook(lambda *a: calls.append("lean")))
    switch.add(post, None)
    assert not switch.usable() and not switch.lean()  # (nothing watches compilations yet)
    monkeypatch.setattr(internals.CompileWatch, "watching", True)
    x = torch.randn(1, 2)
    assert switch.lean()
    model(x)
    assert calls == ["lean", "user before", "user after"]
    assert copy.deepcopy(model)._forward_pre_hooks[pre.id] is internals.inert_hook  # a copy is not profiled
    assert not switch.lean()  # (already lean)
    calls.clear()
    switch.full()
    model(x)
    assert calls == ["pre", "user before", "post", "user after"]
    assert list(model._forward_hooks) == [first.id, post.id, after.id]
    model.compile()  # (in place: the compiled call holds what it traced)
    assert not switch.usable() and not switch.lean() and model._forward_pre_hooks[pre.id] is not internals.inert_hook
    pre.remove(), post.remove()
    switch.full()  # (nothing to put back)
    assert pre.id not in model._forward_pre_hooks and post.id not in model._forward_hooks


def test_comm_total_from_the_steps_that_timed_their_buckets():
    from dtprofile.capture.records import StepRecord, Window

    nan = float("nan")
    w = Window(capacity=16)
    # Timed steps: total 10, exposed 4 (6 hidden); batched steps: exposed only (2), no total.
    for _ in range(3):
        w.add(StepRecord(30.0, 0, 10, 15, 1, 10.0, 4.0, 26.0, 4.0, 1e6))
    for _ in range(9):
        w.add(StepRecord(28.0, 0, 10, 15, 1, nan, 2.0, 26.0, 2.0, 1e6))
    a = w.averages()
    assert a["comm_timed_steps"] == 3
    # The exposed average of every kept step, plus what the timed steps hid.
    assert a["comm_total"] == pytest.approx(a["comm_exposed"] + 6.0)
    assert a["comm_total"] >= a["comm_exposed"]

    every = Window(capacity=4)
    every.add(StepRecord(30.0, 0, 10, 15, 1, 10.0, 4.0, 26.0, 4.0, 1e6))
    assert every.averages()["comm_total"] == 10.0 and every.averages()["comm_timed_steps"] == 1


def _on_device(step):
    """A copy of a host step whose marks (seconds) are completed device events (ms), one
    event per mark: a mark shared by two spans stays one event."""
    import dataclasses

    from dtprofile.capture.clocks import FakeEvent

    events = {}

    def event(mark):
        if mark is None:
            return None
        if id(mark) not in events:
            events[id(mark)] = FakeEvent(mark * 1e3)
            events[id(mark)].done = True
        return events[id(mark)]

    return dataclasses.replace(
        step,
        start=event(step.start),
        end=event(step.end),
        forward=[[event(m) for m in span] for span in step.forward],
        backward=[[event(m) for m in span] for span in step.backward],
        optimizer=tuple(event(m) for m in step.optimizer),
        outside_update=[[event(m) for m in span] for span in step.outside_update],
        excluded=[[event(m) for m in span] for span in step.excluded],
        comm=[dataclasses.replace(c, start=event(c.start), end=event(c.end)) for c in step.comm],
    )


def test_rows_of_raw_marks_give_the_general_record():
    import random

    import numpy as np

    from dtprofile.capture.clocks import FakeEventClock, HostClock
    from dtprofile.capture.records import FIELDS, ROW_SPANS, CommInterval, PendingStep, simple_rows

    clock = HostClock()
    device = FakeEventClock()
    rng = random.Random(1)
    steps, expected, shapes = [], [], set()
    device_rows, device_expected = [], []
    broadcasts = 0
    for _ in range(2000):
        t = sorted(rng.uniform(0, 1) for _ in range(9))
        step = PendingStep(start=t[0])
        if rng.random() < 0.7:
            step.excluded.append([t[0], t[1]])  # the profiler's own work after the last step
        step.forward.append([t[2], t[3]])
        step.backward.append([t[4], t[5], t[6]])
        step.optimizer, step.end = (t[7], t[8]), t[8]
        shape = rng.random()
        if shape < 0.3:  # a closure's passes inside optimizer.step, clipping after them (Lightning)
            step.optimizer = (t[1] + 1e-6 if step.excluded else t[1], t[8])
            step.outside_update.extend([[t[2], t[6]], [t[6], t[7]]])
        elif shape < 0.4:  # a span of the framework's between the passes and the update
            step.outside_update.append([t[6], t[7]])
        elif shape < 0.5:  # spans that overlap each other, in no order, some outside the update
            step.optimizer = (t[3], t[8])
            step.outside_update.extend(
                sorted(([u, u + rng.uniform(0, 0.3)] for u in (t[2], t[5], t[1])), key=lambda _: rng.random())
            )
        step.data_wait_s = rng.uniform(0, 0.1)
        step.data_wait_in_forward_s = rng.choice([0.0, rng.uniform(0, 0.05)])
        step.data_transfer_s = rng.uniform(0, 0.01)
        if rng.random() < 0.4:  # DDP without a hook: its all-reduce waited for after backward
            if rng.random() < 0.2:
                step.backward[0][2] = step.backward[0][1]  # (no wait)
            if rng.random() < 0.5:  # its broadcast of the buffers, inside the forward
                s0, s1 = sorted(rng.uniform(t[2], t[3]) for _ in range(2))
                step.comm.append(
                    CommInterval(start=s0, end=s1, nbytes=512, bucket=False, kind="buffer_broadcast", blocking=True)
                )
                broadcasts += 1
            step.comm.append(
                CommInterval(
                    start=step.start, end=step.start, nbytes=rng.choice([None, 4096]), timed=False, pass_index=1
                )
            )
            step.comm_measured = True
        loader = rng.random() < 0.5
        row = step.raw_marks(from_loader=loader)
        assert row is not None
        shapes.add((len(step.outside_update), bool(step.comm)))
        steps.append(row)
        expected.append(step.to_record(clock, "loader" if loader else "gap").values())
        # The same step on a device timeline: its marks are events, read into the row.
        device_step = _on_device(step)
        device_rows.append(device_step.raw_marks(from_loader=loader, clock=device))
        device_expected.append(device_step.to_record(device, "loader" if loader else "gap").values())
    assert shapes == {(n, comm) for n in (0, 1, 2, 3) for comm in (False, True)}
    got = simple_rows(np.array(steps))
    assert got.shape == (2000, len(FIELDS))
    assert got == pytest.approx(np.array(expected), nan_ok=True, abs=1e-9)
    # On a device the data wait is capped by the device's idle gap and a fetch inside
    # forward stays in it: the rows follow the general record there too.
    got = simple_rows(np.array(device_rows))
    assert got == pytest.approx(np.array(device_expected), nan_ok=True, abs=1e-9)
    assert not np.allclose(got, simple_rows(np.array(steps)), equal_nan=True)
    assert np.isfinite(got[:, FIELDS.index("comm_exposed")]).sum() > 500  # the DDP steps' waits
    assert broadcasts > 250 and (got[:, FIELDS.index("comm_buffers")] > 0).sum() == broadcasts
    # A step of another shape is made into a record on its own: more spans, or timed
    # communication (a hook's buckets, a sampled bucket, DDP's buffer broadcast).
    for other in (
        lambda s: s.outside_update.extend([[t[1], t[2]]] * (ROW_SPANS + 1)),
        lambda s: s.comm.append(CommInterval(start=t[4], end=t[5], nbytes=64)),
        lambda s: setattr(
            s, "comm", [CommInterval(start=s.start, end=s.start, nbytes=64, timed=False, pass_index=1, local_sq=1.0)]
        ),
        lambda s: setattr(
            s,
            "comm",
            [CommInterval(start=t[1], end=t[2], nbytes=64, blocking=True, kind="buffer_broadcast", bucket=False)],
        ),
        # (a broadcast with the reduction is a row only inside the forward)
        lambda s: setattr(
            s,
            "comm",
            [
                CommInterval(start=t[1], end=t[2], nbytes=64, blocking=True, kind="buffer_broadcast", bucket=False),
                CommInterval(start=s.start, end=s.start, nbytes=64, timed=False, pass_index=1),
            ],
        ),
    ):
        step = PendingStep(start=t[0])
        step.forward.append([t[2], t[3]])
        step.backward.append([t[4], t[5], t[6]])
        step.optimizer, step.end = (t[7], t[8]), t[8]
        assert step.raw_marks(from_loader=True) is not None
        other(step)
        step.comm_measured = bool(step.comm)
        assert step.raw_marks(from_loader=True) is None


@pytest.mark.parametrize(
    "lengths, vary",
    [
        ([12] * 24 + [12], False),  # fixed shapes; the pass's last batch ragged (fewer samples)
        ([8, 12, 16, 20] * 6 + [8], True),  # variable-length sequences, padded per batch
    ],
)
def test_the_loader_tells_fixed_shapes_from_lengths_that_vary(lengths, vary):
    """``run.sample_shapes_vary`` (sampled batches' shapes past the batch dimension): what
    tells the straggler advice whether length bucketing means anything to this loop."""
    import dtprofile

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4 if i < len(lengths) - 1 else 1, n, 3) for i, n in enumerate(lengths)]
    with dtprofile.profile(model, opt, warmup_steps=2, every_n_steps=1000) as prof:
        for x in prof.loader(batches):
            model(x).mean().backward()
            opt.step()
            opt.zero_grad()
    run = prof.report().to_dict()["run"]
    assert run["sample_shapes_vary"] is vary
    assert run["batch_bytes"] == 4 * lengths[0] * 3 * 4  # the first batch's
