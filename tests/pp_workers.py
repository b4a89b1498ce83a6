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


def _stages(rank: int, world: int, cfg: dict) -> tuple[list[nn.Module], list, int, int, object]:
    """This rank's stage modules, PipelineStages and data-parallel group: ``cfg["dp"]`` pipelines side by side
    (a (dp, pp) DeviceMesh: rank = replica * pp + stage), ``cfg["virtual"]`` stages a rank
    (looped: stage i on pipeline rank i % pp), each chunk 1/virtual of the rank's time."""
    from torch.distributed.pipelining import PipelineStage

    dp, virtual = cfg.get("dp", 1), cfg.get("virtual", 1)
    pp = world // dp
    group = dp_group = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank = rank % pp
    fwd_ms, bwd_ms = cfg.get("stage_ms", [[4.0, 8.0]] * pp)[pp_rank]
    modules = [EmulatedStage(fwd_ms / virtual, bwd_ms / virtual) for _ in range(virtual)]
    stages = [
        PipelineStage(m, pp_rank + i * pp, pp * virtual, torch.device("cpu"), group=group)
        for i, m in enumerate(modules)
    ]
    return modules, stages, pp_rank, pp, dp_group


def pp_train(rank: int, world: int, cfg: dict) -> dict:
    """``cfg["steps"]`` steps of a pipeline of ``world`` stages (``cfg["dp"]``: that many
    pipelines side by side, their gradients all-reduced by hand across them; ``cfg["virtual"]``:
    stages a rank, interleaved) with ``cfg["schedule"]`` (gpipe, 1f1b, interleaved) and
    ``cfg["mb"]`` microbatches of 8 samples, profiled (``cfg["profile"]``, default True;
    ``cfg["target"]`` "schedule" passes the schedule to profile()) or not: the stage's
    weights' digest, its median wall step, and the summary."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    import dtprofile

    torch.set_num_threads(1)
    torch.manual_seed(rank % (world // cfg.get("dp", 1)))
    modules, stages, pp_rank, pp, dp_group = _stages(rank, world, cfg)
    mb = cfg.get("mb", 4)
    loss = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    name = cfg.get("schedule", "gpipe")
    if name == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, mb, loss_fn=loss)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], mb, loss_fn=loss)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    generator = torch.Generator().manual_seed(rank // pp)
    x = torch.randn(8 * mb, WIDTH, generator=generator)
    y = torch.randn(8 * mb, WIDTH, generator=generator)
    prof = None
    if cfg.get("profile", True):
        target = schedule if cfg.get("target") == "schedule" or len(modules) > 1 else modules[0]
        prof = dtprofile.profile(target, opt, warmup_steps=2).start()
    times = []
    for _ in range(cfg.get("steps", 12)):
        t0 = time.perf_counter()
        if pp_rank == 0:
            schedule.step(x)
        elif pp_rank == pp - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        if dp_group is not None:  # (data parallel across the pipelines: the loop's own all-reduce)
            for p in params:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= world // pp
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    out: dict = {
        "weights": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest(),
        "step_ms": sorted(times[2:])[len(times[2:]) // 2],
    }
    if prof is not None:
        out["summary"] = prof.stop().to_dict()
    import torch.distributed.pipelining.schedules as schedules

    left = [schedules._batch_p2p, schedules._wait_batch_p2p, schedules.PipelineScheduleSingle.step]
    out["wrappers_left"] = [f.__qualname__ for f in left if "dtprofile" in (f.__module__ or "")]
    return out
