"""The steady lane (dtprofile/capture/lane.py) against the general path.

A loop runs on a virtual clock (marks read a time the loop sets; nothing here depends
on how many marks a path takes), once with the lane and once without it. Every figure
the windows hold, and every count, must come out the same, while the loop mixes into its
common steps the moves that leave the lane: evaluation forwards, accumulated
micro-batches, skipped updates, a no-grad forward in train mode, a reader of the open
step before and after the forward, a fetch inside the forward, a second loader pass;
under DDP also passes under ``no_sync()``.
"""

from __future__ import annotations

import contextlib
import random
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

import dtprofile
from dtprofile import _torch_internals as internals
from dtprofile import engine as engine_module
from dtprofile.capture import data_wait
from dtprofile.capture.clocks import FakeEvent, FakeEventClock, HostClock
from dtprofile.capture.lane import SteadyLane
from dtprofile.capture.windows import FIELDS

STEPS = 260


class _Virtual:
    """A clock that reads ``now``, moved on by the loop as work "takes" time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.device_behind = 0.0  # how far a device clock's events are behind ``now`` (s)

    def __call__(self) -> float:
        return self.now


class _Tick(torch.autograd.Function):
    """Identity whose backward moves the virtual clock on (backward "takes" time)."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += ctx.seconds
        return grad, None, None


class _Net(nn.Module):
    def __init__(self, clock: _Virtual) -> None:
        super().__init__()
        self.clock = clock
        self.lin = nn.Linear(8, 4)
        self.inside = None  # called in the forward (a fetch inside it)

    def forward(self, x):
        self.clock.now += 0.004 if self.training else 0.002
        if self.inside is not None:
            self.inside()
        return _Tick.apply(self.lin(x), self.clock, 0.007)


class _VirtualEvents(FakeEventClock):
    """A device clock on the virtual time: each mark an event at ``now`` plus
    ``device_behind``, which the device passes ``lag_s`` later (each mark completes the
    events it has passed)."""

    def __init__(self, clock: _Virtual, lag_s: float = 0.015) -> None:
        super().__init__()
        self.clock, self.lag_s = clock, lag_s

    def mark(self) -> FakeEvent:
        passed_ms = (self.clock.now - self.lag_s) * 1e3
        while self.marks and self.marks[0].time_ms <= passed_ms:
            self.marks.pop(0).done = True
        self.now_ms = (self.clock.now + self.clock.device_behind) * 1e3
        return super().mark()


def _virtual_clock(
    monkeypatch: pytest.MonkeyPatch, lane: bool, *modules: Any, device: bool = False, lag_s: float = 0.015
) -> _Virtual:
    """Every dtprofile mark and wait read from a virtual clock; the lane on or off;
    ``device``: the marks are events of a device clock on that time, which the device
    passes ``lag_s`` later."""
    clock = _Virtual()
    monkeypatch.setattr(HostClock, "mark", staticmethod(clock))
    if device:
        monkeypatch.setattr(engine_module, "make_clock", lambda device: _VirtualEvents(clock, lag_s))
    for module in (data_wait, *modules):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock, thread_time=clock))
    monkeypatch.setattr(SteadyLane, "enabled", lane)
    # (whatever another test compiled before: nothing here is)
    monkeypatch.setattr(internals, "_frames_compiled", lambda: False)
    return clock


def _counts_and_windows(steps: Any) -> tuple[dict, dict]:
    counts = dict(
        seen=steps.steps_seen,
        finalized=steps.steps_finalized,
        skipped=steps.steps_skipped_update,
        without_backward=steps.steps_without_backward,
        eval=steps.steps_with_eval_forwards,
        micro=dict(steps.micro_batches_seen),
        recent=list(steps.micro_batches_recent),
        sync_passes=list(steps.sync_passes_recent),
        lane_steps=steps.lane.steps_taken,
        lean_steps=steps.lane.lean_steps,
    )
    steps.flush()
    return counts, {name: getattr(steps, name).rows() for name in ("run", "interval", "probes", "alone")}


def _assert_same(lane: tuple[dict, dict], general: tuple[dict, dict], steps: int, lean: bool = True) -> None:
    """The same counts and windows, and the lane's steps that do not time their passes
    had the lean forward hooks (``lean``; else none had)."""
    (lane_counts, lane_windows), (counts, windows) = lane, general
    assert counts.pop("lane_steps") == 0 and counts.pop("lean_steps") == 0
    taken, lean_steps = lane_counts.pop("lane_steps"), lane_counts.pop("lean_steps")
    assert taken > steps // 3, f"only {taken} of {steps} steps took the lane"
    if lean:
        assert lean_steps > taken // 3, f"only {lean_steps} of the {taken} lane steps had the lean forward hooks"
    else:
        assert lean_steps == 0
    assert lane_counts == counts
    for name, rows in windows.items():
        assert lane_windows[name].shape == rows.shape, name
        np.testing.assert_allclose(lane_windows[name], rows, rtol=1e-9, atol=1e-9, equal_nan=True, err_msg=name)
    assert len(windows["run"]) > steps // 2


def _run(
    monkeypatch: pytest.MonkeyPatch,
    lane: bool,
    tmp_path,
    shapes: dict[int, tuple],
    device: bool = False,
    lean: bool = True,
    comm_off: bool = False,
    ddp: bool = False,
    buffers: bool = True,
) -> tuple[dict, dict]:
    clock = _virtual_clock(monkeypatch, lane, device=device)
    torch.manual_seed(0)
    net = model = _Net(clock)
    if ddp:  # (in a process group of one rank: see _one_rank_ddp)
        if buffers:
            net.register_buffer("seen", torch.zeros(2))  # DDP broadcasts it before each forward
        model = nn.parallel.DistributedDataParallel(net)

        def wait():  # DDP's wait for the reductions "takes" time: after backward's end, before it is marked
            clock.now += 0.003

        # (a callback queued as backward runs: after the pass hooks' own, which mark its end)
        net.lin.weight.register_post_accumulate_grad_hook(
            lambda param: torch.autograd.Variable._execution_engine.queue_callback(wait)
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    prof = dtprofile.profile(
        model,
        opt,
        warmup_steps=3,
        every_n_steps=40,
        backward_timing_every=7,
        logdir=str(tmp_path / ("lane" if lane else "general")),
    )
    prof.start()
    engine = prof._engine
    if not lean:
        engine.steps.lane.unswitch()  # (as where several modules' forwards are timed)
    if comm_off:  # (as after an internal error there: each drain then looks at the open step)
        engine.parts["comm"].enabled = False

    # The update "takes" time: a pre hook after dtprofile's marks the update's start.
    # On a device clock the device finishes the update 1.5 ms after the host (it is
    # still busy while the next fetch starts: a device idles less than the host waits).
    def update(*args):
        clock.now += 0.002
        clock.device_behind = 0.0015 if device else 0.0

    opt.register_step_pre_hook(update)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    waits = random.Random(1)

    def batches(n):
        for _ in range(n):
            clock.now += waits.uniform(0.0005, 0.003)  # the fetch
            clock.device_behind = 0.0  # (caught up)
            yield x, y

    def train_pass(batch, shape=()):
        net.inside = (lambda: next(it)) if "fetch in forward" in shape else None
        # (DDP: a pass under no_sync(), which reduces nothing)
        with model.no_sync() if "no sync" in shape else contextlib.nullcontext():
            loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            if "reader after forward" in shape:
                assert engine.steps.current.forward
            clock.now += 0.0005
            loss.backward()

    it = iter(prof.loader(batches(10**6)))
    i = 0
    while i < STEPS:
        shape = shapes.get(i, ())
        if "new pass" in shape:  # a second pass over a loader (an epoch)
            it = iter(prof.loader(batches(10**6)))
        batch = next(it)
        clock.now += 0.0003
        if "eval" in shape:
            model.eval()
            with torch.no_grad():
                model(batch[0])
            model.train()
        if "no-grad train" in shape:
            with torch.no_grad():
                model(batch[0])
        if "reader" in shape:
            assert engine.steps.current is not None
        train_pass(batch, tuple(k for k in shape if k != "no sync") if "no-sync accumulate" in shape else shape)
        if "accumulate" in shape:
            train_pass(next(it))
        if "no-sync accumulate" in shape:  # (the first micro-batch under no_sync(), then one that reduces)
            train_pass(next(it), ("no sync",))
        if "skip" in shape:  # the update skipped (a loss scaler's inf): gradients zeroed, no step
            opt.zero_grad()
            i += 1
            continue
        clock.now += 0.0002
        opt.step()
        opt.zero_grad()
        clock.now += 0.001
        i += 1
    if device:
        assert 0 < len(engine.steps.pending) < 10  # the device behind: the last steps still wait
        engine.clock.complete_all()
        engine.steps.drain()
    result = _counts_and_windows(engine.steps)
    prof.stop()
    return result


def _shapes(seed: int, *more: str) -> dict[int, tuple]:
    rng = random.Random(seed)
    kinds = [
        "eval",
        "accumulate",
        "skip",
        "no-grad train",
        "reader",
        "reader after forward",
        "new pass",
        "fetch in forward",
        *more,
    ]
    return {i: tuple(rng.sample(kinds, rng.choice((1, 1, 2)))) for i in rng.sample(range(2, STEPS), 60)}


@pytest.mark.parametrize("seed", [0, 1])
def test_the_lane_gives_every_figure_the_general_path_gives(monkeypatch, tmp_path, seed):
    shapes = _shapes(seed)
    _assert_same(_run(monkeypatch, True, tmp_path, shapes), _run(monkeypatch, False, tmp_path, shapes), STEPS)


@pytest.mark.parametrize(
    "seed,lean,comm_off",
    [(0, True, False), (1, True, False), (0, False, False), (1, True, True)],
    ids=["0", "1", "full-hooks", "comm-part-off"],
)
def test_on_a_device_clock_the_lane_gives_every_figure_the_general_path_gives(
    monkeypatch, tmp_path, seed, lean, comm_off
):
    """Marks that are events the device passes 15 ms later, and that are 1.5 ms later
    than the host's from each update's end to the next fetch's end: the lane's steps
    wait in pending with the general path's and come out in order, with the device's
    data-wait rules (the device idles less than the host waits), and the same figures;
    also where each drain looks at the open step (the communication part disabled).
    (Except for a fetch inside a lean step's forward: on a device timeline the general
    path counts it as forward, the lane, which has not marked the forward's end, as
    data wait capped by the device's idle before the forward; on the host both count
    it as data wait.)"""
    shapes = {i: kinds for i, kinds in _shapes(seed).items() if "fetch in forward" not in kinds}
    lane = _run(monkeypatch, True, tmp_path, shapes, device=True, lean=lean, comm_off=comm_off)
    _assert_same(
        lane, _run(monkeypatch, False, tmp_path, shapes, device=True, lean=lean, comm_off=comm_off), STEPS, lean
    )


def test_plain_steps_stay_in_the_lane_and_time_backward_on_schedule(monkeypatch, tmp_path):
    counts, windows = _run(monkeypatch, True, tmp_path, {})
    assert counts["lane_steps"] == STEPS - 3  # every step after the warm-up
    # The first 20 after warm-up and each 7th after them time backward (7 ms on the clock).
    timed = 20 + len(range(23, STEPS, 7))
    backward = windows["run"][:, FIELDS.index("backward")]
    assert np.isfinite(backward).sum() == timed
    np.testing.assert_allclose(backward[np.isfinite(backward)], 7.0, rtol=1e-6)


@pytest.mark.parametrize(
    "framework", [{}, {"update_start_marked": True}, {"steps_end_at_batch": True}, {"steps_need_backward": True}]
)
def test_the_lane_is_only_for_steps_that_end_at_the_update(framework):
    from dtprofile.engine import Engine
    from dtprofile.options import Options

    engine = Engine(Options(warmup_steps=1), **framework)
    model = nn.Linear(4, 2)
    engine.attach_module(model)
    engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.start()
    try:
        assert engine.steps.lane.allowed == ("steps_end_at_batch" not in framework)
    finally:
        engine.stop()


def _lightning_run(
    monkeypatch: pytest.MonkeyPatch, lane: bool, tmp_path, skipped: set[int], device: bool = False
) -> tuple[dict, dict]:
    pl = pytest.importorskip("pytorch_lightning")
    from dtprofile.integrations import _lightning_patches

    # (on a device clock the device keeps up: the fit's end reads every step but the last)
    clock = _virtual_clock(monkeypatch, lane, _lightning_patches, device=device, lag_s=0.0)
    torch.manual_seed(0)
    x, y = torch.randn(480, 8), torch.randint(0, 4, (480,))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            clock.now += 0.0001 * (1 + i % 3)  # the fetch "takes" time
            return x[i], y[i]

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Net(clock)

        def training_step(self, batch, batch_idx):
            if batch_idx in skipped:
                return None  # a batch the training code skips
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer):
            if self.global_step % 9 == 4:  # a reader of the open step, after its backward
                assert cb.engine.steps.current.forward

        def validation_step(self, batch, batch_idx):
            self.net(batch[0])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1e-3)
            # The update "takes" time: a post hook that runs before dtprofile's marks its end.
            opt.register_step_post_hook(lambda *a: setattr(clock, "now", clock.now + 0.002))
            return opt

    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    cb = dtprofile.DTProfileCallback(
        warmup_steps=3,
        every_n_steps=40,
        backward_timing_every=7,
        logdir=str(tmp_path / f"lit-{'lane' if lane else 'general'}-{device}"),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=200,
        val_check_interval=50,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Lit(), loader, loader)
    assert cb.engine.clock.kind == ("cuda_event" if device else "perf_counter")
    return _counts_and_windows(cb.engine.steps)


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_the_lane_gives_lightnings_figures_as_the_general_path_does(monkeypatch, tmp_path, device):
    """Lightning's automatic optimization: the forward inside optimizer.step's closure,
    the update's start marked after it, skipped batches, a reader of the open step before
    the update, validation and an epoch's end; on the host clock and on a device clock."""
    skipped = {10, 33, 34, 71, 100}
    lane = _lightning_run(monkeypatch, True, tmp_path, skipped, device)
    general = _lightning_run(monkeypatch, False, tmp_path, skipped, device)
    # 120 batches an epoch: 200 updates take the first epoch and 89 batches of the second.
    assert lane[0]["without_backward"] == len(skipped) + len([i for i in skipped if i < 89])
    _assert_same(lane, general, 200)


@pytest.fixture
def _one_rank_ddp(monkeypatch):
    """A gloo process group of one rank (127.0.0.1, a free port), whose DDP models
    dtprofile attaches to as to a group of two: DDP's own all-reduce counted after each
    forward (no hook), probe steps that reduce by hand."""
    import torch.distributed as dist
    from distributed import free_port

    from dtprofile.capture.comm import CommRecorder

    init = CommRecorder.__init__

    def as_two_ranks(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.world_size = 2

    monkeypatch.setattr(CommRecorder, "__init__", as_two_ranks)
    sync_buffers = nn.parallel.DistributedDataParallel._sync_buffers

    def broadcast(self):  # the broadcast of the buffers "takes" time (on the virtual clock of the test)
        clock = getattr(self.module, "clock", None)
        if clock is not None:
            clock.now += 0.0004
        return sync_buffers(self)

    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "_sync_buffers", broadcast)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "seed,device,buffers",
    [(0, False, True), (1, False, True), (0, True, True), (2, False, False), (1, True, False)],
    ids=["0", "1", "device", "no-buffers", "device-no-buffers"],
)
def test_under_ddp_the_lane_gives_every_figure_the_general_path_gives(
    monkeypatch, tmp_path, _one_rank_ddp, seed, device, buffers
):
    """DDP with its own all-reduce: every step times its backward and marks when the
    reductions were waited for, and holds the bytes reduced and the broadcast of the
    buffers (or a model without them); the step before each probe step and the probe
    step take the general path; the same moves as above mixed in, and steps under
    no_sync() (a whole step: the broadcast without a reduction; the first micro-batch)."""
    shapes = {
        i: kinds
        for i, kinds in _shapes(seed, "no sync", "no-sync accumulate").items()
        if not (device and "fetch in forward" in kinds)
    }
    lane = _run(monkeypatch, True, tmp_path, shapes, device=device, ddp=True, buffers=buffers)
    general = _run(monkeypatch, False, tmp_path, shapes, device=device, ddp=True, buffers=buffers)
    _assert_same(lane, general, STEPS, lean=False)
    run = general[1]["run"]
    assert len(general[1]["probes"]) >= 5  # the probes reduced by hand, on the general path
    sync = general[0]["sync_passes"]
    assert sync.count(1) > 0.8 * len(sync) and set(sync) == {1, 2}  # (two where a step accumulated)
    grad_bytes = sum(p.numel() * 4 for p in nn.Linear(8, 4).parameters())
    assert (run[:, FIELDS.index("grad_bytes")] == grad_bytes).mean() > 0.8
    if not buffers:  # whole steps under no_sync() reduced nothing (with buffers: their broadcast, 0 bytes)
        assert np.isnan(run[:, FIELDS.index("grad_bytes")]).sum() >= 3
    assert np.isfinite(run[:, FIELDS.index("backward")]).all()  # (every step times it)
    # DDP's broadcast of the buffers before each training forward: 0.4 ms on the clock
    broadcast = np.abs(run[:, FIELDS.index("comm_buffers")] - 0.4) < 1e-6
    assert broadcast.mean() > 0.8 if buffers else not broadcast.any()
