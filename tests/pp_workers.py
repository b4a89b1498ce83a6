"""Pipeline-parallel workers for tests/test_pipeline.py: a stage per rank on gloo, its device
time emulated (each microbatch's forward and backward sleep in proportion to its samples,
so that the CPU's own contention does not blur the bubble)."""

from __future__ import annotations

import hashlib
import time

import torch
from torch import nn

WIDTH = 32


class EmulatedStage(nn.Module):
    """A linear layer whose forward sleeps ``fwd_ms`` and backward ``bwd_ms`` per 8 samples."""

    def __init__(self, fwd_ms: float, bwd_ms: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.fwd_ms, self.bwd_ms = fwd_ms, bwd_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.shape[0] / 8
        time.sleep(self.fwd_ms * scale / 1e3)
        return _SleepInBackward.apply(self.lin(x), self.bwd_ms * scale / 1e3)


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, seconds):  # noqa: ANN001, ANN205
        ctx.seconds = seconds
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        time.sleep(ctx.seconds)
        return grad, None


def pp_train(rank: int, world: int, cfg: dict) -> dict:
    """``cfg["steps"]`` steps of a ``world``-stage pipeline (``cfg["schedule"]``: gpipe or
    1f1b, ``cfg["mb"]`` microbatches of 8 samples), profiled (``cfg["profile"]``, default
    True; ``cfg["target"]`` "schedule" passes the schedule to profile()) or not: the stage's
    weights' sum, its median wall step, and the summary."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import dtprofile

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    fwd_ms, bwd_ms = cfg.get("stage_ms", [[4.0, 8.0]] * world)[rank]
    module = EmulatedStage(fwd_ms, bwd_ms)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.get("schedule", "gpipe")]
    mb = cfg.get("mb", 4)
    schedule = schedule_cls(stage, mb, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * mb, WIDTH, generator=generator)
    y = torch.randn(8 * mb, WIDTH, generator=generator)
    prof = None
    if cfg.get("profile", True):
        target = schedule if cfg.get("target") == "schedule" else module
        prof = dtprofile.profile(target, opt, warmup_steps=2).start()
    times = []
    for _ in range(cfg.get("steps", 12)):
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    out: dict = {
        "weights": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest(),
        "step_ms": sorted(times[2:])[len(times[2:]) // 2],
    }
    if prof is not None:
        out["summary"] = prof.stop().to_dict()
    import torch.distributed.pipelining.schedules as schedules

    left = [schedules._batch_p2p, schedules._wait_batch_p2p, schedules.PipelineScheduleSingle.step]
    out["wrappers_left"] = [f.__qualname__ for f in left if "dtprofile" in (f.__module__ or "")]
    return out
