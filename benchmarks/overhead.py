"""What profiling costs: dtprofile against no profiler and the tools people compare it with.

    python benchmarks/overhead.py            # full mode (a few minutes)
    python benchmarks/overhead.py --quick    # a smoke run of every table and row (the test suite runs this)
    python benchmarks/overhead.py --memory-only  # the long-run memory and per-step cost tables

One training loop (an MLP, SGD, a fixed batch: no data loading), on one core per process
(``torch.set_num_threads(1)``), in two sizes: about 5 ms and about 50 ms per step. Each
setting is one process (two for the distributed ones) that runs every profiler
configuration in turn, round-robin over several rounds (the starting configuration
rotates each round), so that drift and other load on the machine hit every
configuration alike:

- *1 process*: a plain loop under no profiler; ``dtprofile.profile`` (with a logdir, so
  the TensorBoard writing every 50 steps is included); ``torch.profiler`` with the usual
  schedule (wait=1, warmup=1, active=3, repeat=0; no trace handler, so no trace export
  cost) and with always-on recording (no schedule).
- *2 processes*: the same under gloo DDP (127.0.0.1). dtprofile's rows use their own DDP
  instance (its communication hook stays registered after the profiler stops), the
  others share one that never had a hook.
- *2 processes (FSDP2)*: the same model with ``fully_shard`` on every linear layer and
  the root, under no profiler and under dtprofile (which then times FSDP's
  all-gathers and reduce-scatters); one model, its instrumentation removed between
  segments.
- *2 processes (HSDP)*: the same on a 2 x 1 mesh (two replicas of one shard): FSDP
  all-reduces each layer's gradient across the replicas, which dtprofile times through
  its proxy of ``dist`` in FSDP's collectives module.
- *Lightning, 1 process*: the same model as a LightningModule in one Trainer
  configuration without a callback, with ``dtprofile.DTProfileCallback`` and with
  Lightning's ``SimpleProfiler``.

Step time is measured by the loop itself (``perf_counter`` between optimizer-step ends;
a tiny callback under Lightning, present in every Lightning configuration); the first
steps of each segment are dropped, start/stop of the profilers is outside the timings.
The table gives the median and mean step over all rounds, their ratios to the
unprofiled run of the same setting, and the range of the per-round median ratios (the
noise).

The *left on* table runs two shapes a profiler left on for a whole run meets, 1 and 2
processes, each configuration on its own DDP instance built from the same seed: no
profiler (a DDP model with no communication hook at all), dtprofile with a logdir (as
it comes: no communication hook, the totals from the probe steps; with
``bucket_timing_every=20``: its hook, each bucket timed on every 20th step; and with
``bucket_timing_every=0``: no hook and no probe steps, the wait after backward only),
PyTorch's own Python ``allreduce_hook`` with no profiler, and a bare Python hook that
launches each bucket and waits for them all in one callback at backward's end (the
least any Python communication hook costs: dtprofile's hook does this on the steps that
do not time each bucket), and PyTorch's builtin C++ all-reduce hook (no Python at all:
what any registered hook costs on the CPU, where DDP without a hook divides the
gradients while it copies them into the buckets, and with one needs a pass of its own).
*GPU-like*: the device's time emulated by sleeping in
forward and backward (the host idles meanwhile, as beside a GPU), 8.4 MB of gradients
in about 5 buckets, about 70 ms a step. *Small buckets*: 64 layers, one 0.25 MB bucket
each. The median ratio is the cost of an ordinary step; the mean ratio also holds the
probe steps (communication not overlapped with backward, one step in 50 after the first
few), which is what a whole run pays.

The memory table runs a fast fake step (a 16 -> 4 linear layer) for 40k steps per
profiler (20k under Lightning) in a fresh process and reports the RSS growth after the
first 10% of the steps, and the step time (the absolute per-step cost of each
profiler). Its *CUDA-event path (CPU twin)* row is dtprofile on a clock whose marks are
host timestamps in event objects, all done at once: the path a GPU run takes (each
event recorded, queried and read), what its Python costs a step without the driver's
share. Its *empty hooks* row has no profiler, only hooks of the kinds dtprofile
registers, each doing nothing (backward's on every 50th step, as dtprofile times it on
steps this short: once per log interval): the floor of dtprofile's per-step cost. Its *timestamps only* row has the
same hooks and a timed loader, each only taking its timestamp (and the optimizer's post
hook keeping the step's as a row): what timing these phases costs at the least with
these hooks. The table after
it runs the same fast step as a DDP model over gloo on 2 processes, no profiler against
dtprofile left on, in interleaved rounds: the per-step cost of a step that communicates.

``--quick`` checks that every table and row comes out, in about 20-30 s on 2 cores; its
figures mean little: one round of a few steps, no untimed warm-up segments (dtprofile's
left-on profilers still pass their warm-up), the GPU-like shape's emulated device time a
fifth of the full mode's, short memory runs, and the launches shared: every 1-process
job in one process and every 2-process job in one pair (instead of fresh processes per
setting), the two side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import CASES, Deadline, Emulated, describe_machine, fixed_batch, fmt, launch, machine, mlp, rss_mb, table  # noqa: E402
from torch import nn  # noqa: E402

PLAIN_MODES = ("none", "dtprofile", "torch.profiler schedule", "torch.profiler always-on")
LIGHTNING_MODES = ("Lightning, no callback", "Lightning + DTProfileCallback", "Lightning + SimpleProfiler")
EMPTY_HOOKS = "empty hooks, no profiler"
MARKS_ONLY = "timestamps only, no profiler"
ALWAYS_ON = "torch.profiler always-on"
DEVICE_TWIN = "dtprofile, CUDA-event path (CPU twin)"
MEMORY_MODES = (
    "none",
    "dtprofile",
    DEVICE_TWIN,
    EMPTY_HOOKS,
    MARKS_ONLY,
    "torch.profiler schedule",
    ALWAYS_ON,
    "Lightning, no callback",
    "Lightning + DTProfileCallback",
    "Lightning + SimpleProfiler",
)
FSDP_MODES = ("none", "dtprofile")
SETTINGS = ("1 process", "2 processes (DDP)", "2 processes (FSDP2)", "2 processes (HSDP)", "Lightning, 1 process")
TARGETS = {"50ms": 1.01, "5ms": 1.03}

QUICK = dict(  # (a smoke run: every table and row, a few steps each; the figures mean little)
    rounds=1,
    steps={"5ms": 8, "50ms": 3},
    skip=1,
    warmup=0,
    mem_steps=400,
    mem_steps_lightning=100,
    dt_warmup=0,
    leave_on_dt_warmup=4,
    leave_on_steps={"GPU-like": 2, "small buckets": 3},
    leave_on_device_time=0.2,  # the GPU-like shape's emulated device time, a fifth of it
    ddp_fast_steps=100,
)
FULL = dict(
    rounds=4,
    steps={"5ms": 150, "50ms": 56},
    skip=5,
    warmup=7,
    mem_steps=40000,
    mem_steps_lightning=20000,
    dt_warmup=55,
    leave_on_dt_warmup=55,
    ddp_fast_steps=1500,
    leave_on_steps={"GPU-like": 60, "small buckets": 120},
    leave_on_device_time=1.0,
)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _torch_profiler(scheduled: bool):
    from torch.profiler import ProfilerActivity, profile, schedule

    if scheduled:
        return profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=0))
    return profile(activities=[ProfilerActivity.CPU])


# --------------------------------------------------------------------------- plain loop


def _plain_segment(
    mode: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple,
    steps: int,
    logdir: str,
    probe: Any = None,
    running: Any = None,
) -> list[float]:
    """``steps`` training steps under ``mode``; the wall time of each (ms).

    ``running``: a dtprofile profiler already started on ``model`` (left on across
    segments), used as it is and not stopped here.
    """
    import dtprofile

    x, y = batch
    batches: Any = itertools.repeat((x, y), steps)
    prof = tprof = None
    if running is not None:
        batches = running.loader(batches)
    elif mode == DEVICE_TWIN:
        from dtprofile import engine

        make_clock, engine.make_clock = engine.make_clock, lambda device: HostEventClock()
        try:
            prof = dtprofile.profile(model, opt, logdir=logdir).start()
        finally:
            engine.make_clock = make_clock
        batches = prof.loader(batches)
    elif mode.startswith("dtprofile"):
        options = DTPROFILE_OPTIONS.get(mode, {})
        prof = dtprofile.profile(model, opt, logdir=logdir, **options)
        prof.start()
        batches = prof.loader(batches)
    elif mode.startswith("torch.profiler"):
        tprof = _torch_profiler(scheduled=mode.endswith("schedule"))
        tprof.__enter__()
    handles = []
    if mode == EMPTY_HOOKS:
        handles = _empty_hooks(model, opt)
    elif mode == MARKS_ONLY:
        marks: list[float] = []
        handles = _empty_hooks(model, opt, marks)
        batches = _marked_batches(batches, marks)
    scheduled = mode == "torch.profiler schedule"
    times = []
    clock = time.perf_counter
    t_last = clock()
    for i, (xb, yb) in enumerate(batches):
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        if scheduled:
            tprof.step()
        now = clock()
        times.append((now - t_last) * 1e3)
        t_last = now
        if probe is not None:
            probe(i)
    if prof is not None:
        prof.stop()
    if tprof is not None:
        tprof.__exit__(None, None, None)
    for handle in handles:
        handle.remove()
    return times


class _HostEvent:
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()


class HostEventClock:
    """The CPU twin of dtprofile's CUDA-event clock: its marks are objects, done at once,
    that hold a host timestamp. dtprofile takes its device path with it (every event
    recorded, queried and read as on a GPU), so the twin's row gives what that path's
    Python costs a step; the driver's part of each call, which a GPU adds, costs nothing
    here."""

    kind = "cuda_event"

    def mark(self) -> _HostEvent:
        return _HostEvent()

    def ready(self, mark: _HostEvent) -> bool:
        return True

    def elapsed_ms(self, start: _HostEvent, end: _HostEvent) -> float:
        return (end.t - start.t) * 1e3

    def release(self, mark: _HostEvent) -> None:
        pass


def _empty_hooks(
    model: nn.Module, opt: torch.optim.Optimizer, marks: list[float] | None = None, backward_every: int = 50
) -> list[Any]:
    """Hooks of the kinds dtprofile puts on a single process's loop, each doing nothing
    (kept out of compiled graphs as dtprofile's are): a forward pre- and post-hook, the
    optimizer's two step hooks, and on every ``backward_every``-th step (as dtprofile's
    ``backward_timing_every="auto"`` does on steps this short: once per log interval) a
    hook on the node that takes the output's gradient and one autograd callback at
    backward's end. What having them costs, whatever they do.

    With ``marks``, each hook only appends a timestamp there, and the optimizer's post
    hook moves the step's marks into a bounded list of rows: the least a profiler that
    times these phases can do with these hooks.
    """
    queue = torch.autograd.Variable._execution_engine.queue_callback
    clock = time.perf_counter
    rows: list[tuple[float, ...]] = []
    forwards = itertools.count()

    def backward_done() -> None:
        if marks is not None:
            marks.append(clock())

    def backward_started(grads: Any) -> None:
        if marks is not None:
            marks.append(clock())
        queue(backward_done)

    def before_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if marks is not None:
            marks.append(clock())

    def after_forward(module: nn.Module, args: tuple, output: Any) -> None:
        if marks is not None:
            marks.append(clock())
        if next(forwards) % backward_every == 0 and output.grad_fn is not None:
            output.grad_fn.register_prehook(backward_started)

    def step_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if marks is not None:
            marks.append(clock())

    def step_done(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if marks is not None:
            marks.append(clock())
            rows.append(tuple(marks))
            marks.clear()
            if len(rows) >= 1000:
                rows.clear()

    eager = torch.compiler.disable
    return [
        model.register_forward_pre_hook(eager(before_forward), with_kwargs=True),
        model.register_forward_hook(eager(after_forward)),
        opt.register_step_pre_hook(eager(step_hook)),
        opt.register_step_post_hook(eager(step_done)),
    ]


def _marked_batches(batches: Any, marks: list[float]) -> Any:
    """``batches``, each fetch's wall and CPU time appended to ``marks`` (as dtprofile's
    loader wrapper times them)."""
    clock, cpu_clock = time.perf_counter, time.thread_time
    t0, c0 = clock(), cpu_clock()
    for batch in batches:
        marks.append(clock() - t0)
        marks.append(cpu_clock() - c0)
        yield batch
        t0, c0 = clock(), cpu_clock()


def plain_worker(rank: int, world: int, cfg: dict) -> dict:
    """Every PLAIN_MODES configuration, round-robin, for each case; per-mode step times."""
    _quiet()
    return {case: _plain_case(rank, world, case, cfg) for case in cfg["cases"]}


def _plain_case(rank: int, world: int, case_name: str, cfg: dict) -> dict:
    case = CASES[case_name]
    steps = cfg["steps"][case_name]
    import dtprofile

    torch.manual_seed(0)
    # One model for every mode: two instances of the same DDP model differ by up to 10%
    # in step time on this machine (measured 1.092 between two unprofiled ones), which
    # would swamp what is measured. DDP cannot unregister a comm hook, so dtprofile's is
    # registered from the start and runs idle (PyTorch's allreduce_hook arithmetic) when
    # no profiler is attached: every mode pays for the same Python hook.
    net = mlp(**case)
    modes = PLAIN_MODES
    if world > 1 and cfg.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if cfg["fsdp"] == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        modes = FSDP_MODES
    elif world > 1:
        net = nn.parallel.DistributedDataParallel(net)
        net.register_comm_hook(None, dtprofile.timed_hook())
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    batch = fixed_batch(case, seed=rank)
    out: dict[str, dict] = {m: {"times": [], "rounds": []} for m in modes}
    with tempfile.TemporaryDirectory(prefix="dtprofile-overhead-") as tmp:
        # Warm-up, not timed: allocator, kineto, and dtprofile's first log (imports of the
        # TensorBoard writer and matplotlib happen once per process, not per segment).
        for mode in modes:
            n = cfg["dt_warmup"] if mode == "dtprofile" else cfg["warmup"]
            if n:
                _plain_segment(mode, net, opt, batch, n, os.path.join(tmp, "warmup"))
        for r in range(cfg["rounds"]):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                logdir = os.path.join(tmp, f"r{r}")
                times = _plain_segment(mode, net, opt, batch, steps, logdir)[cfg["skip"] :]
                out[mode]["times"].extend(times)
                out[mode]["rounds"].append(statistics.median(times))
    return out


# --------------------------------------------------------------------------- left on for the whole run
# Two shapes a profiler left on meets, each against a DDP model that has no
# communication hook at all (the real "no profiler"): dtprofile registers its hook on
# its own instance, built from the same seed (DDP cannot unregister a hook).
#
# - "GPU-like": the device's time emulated by sleeping in forward and in backward (the
#   host idles while "the device computes", as on a GPU), 2.1M parameters (8.4 MB of
#   gradients) in about 5 buckets, about 70 ms a step;
# - "small buckets": 64 linear layers of 256 and 0.25 MB buckets (one layer each): many
#   reductions per step, each a Python hook call and callback under dtprofile.
LEAVE_ON_SHAPES: dict[str, dict] = {
    "GPU-like": dict(width=724, depth=4, inp=724, batch=8, forward_ms=20.0, backward_ms=45.0, bucket_cap_mb=2.0),
    "small buckets": dict(width=256, depth=64, inp=256, batch=16, forward_ms=0.0, backward_ms=0.0, bucket_cap_mb=0.25),
}
DTPROFILE_NO_HOOK = "dtprofile, bucket_timing_every=0"
DTPROFILE_HOOK = "dtprofile, bucket_timing_every=20"
DTPROFILE_OPTIONS = {DTPROFILE_NO_HOOK: {"bucket_timing_every": 0}, DTPROFILE_HOOK: {"bucket_timing_every": 20}}
LEAVE_ON_MODES = (
    "no profiler",
    "dtprofile",
    DTPROFILE_HOOK,
    DTPROFILE_NO_HOOK,
    "allreduce_hook, no profiler",
    "bare batched hook, no profiler",
    "C++ allreduce hook, no profiler",
)
LEAVE_ON_TARGETS = {"GPU-like": 1.005, "small buckets": 1.05}
#: A DDP model that searches for unused parameters (``find_unused_parameters=True``, the
#: Transformers Trainer's default), 2 processes: against the same DDP with no profiler.
UNUSED_SEARCH = "2 processes (DDP, find_unused_parameters=True)"
UNUSED_SEARCH_MODES = ("no profiler", "dtprofile", DTPROFILE_HOOK)


class _BareBatchedHook:
    """The least any Python communication hook costs: launch each bucket's all-reduce and
    complete DDP's futures in one autograd callback (what dtprofile's hook does on the
    steps that do not time each bucket), and nothing else."""

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = "bare_batched_hook"  # DDP logs a hook by its name
        self.held: list = []

    def __call__(self, state, bucket):  # (DDP checks annotations: none here, as strings would fail)
        import torch.distributed as dist

        if not self.held:
            torch.autograd.Variable._execution_engine.queue_callback(self.complete)
        group = dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        held = torch.futures.Future()
        self.held.append((group.allreduce([tensor]), tensor, held))
        return held

    def complete(self) -> None:
        held, self.held = self.held, []
        for work, tensor, future in held:
            work.wait()
            future.set_result(tensor)


def leave_on_worker(rank: int, world: int, cfg: dict) -> dict:
    """Each LEAVE_ON_MODES configuration round-robin, on its own DDP instance, per shape."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    _quiet()
    own_group = not dist.is_initialized()
    if own_group:  # one process: DDP over a group of one, as a one-GPU DDP run is
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return _leave_on_shapes(rank, cfg, default_hooks)
    finally:
        if own_group:
            dist.destroy_process_group()


def _leave_on_shapes(rank: int, cfg: dict, default_hooks: Any) -> dict:
    import torch.distributed as dist

    import dtprofile

    out: dict[str, dict] = {}
    modes = tuple(cfg.get("modes", LEAVE_ON_MODES))
    for name in cfg["shapes"]:
        shape = LEAVE_ON_SHAPES[name]
        device_time = cfg.get("device_time", 1.0)  # --quick: a fraction of the emulated device's time
        models = {}
        for mode in modes:
            torch.manual_seed(0)
            ddp = nn.parallel.DistributedDataParallel(
                Emulated(mlp(**shape), shape["forward_ms"] * device_time, shape["backward_ms"] * device_time),
                bucket_cap_mb=shape["bucket_cap_mb"],
                find_unused_parameters=cfg.get("find_unused", False),
            )
            if mode == "allreduce_hook, no profiler":
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            elif mode == "bare batched hook, no profiler":
                ddp.register_comm_hook(None, _BareBatchedHook())
            elif mode == "C++ allreduce hook, no profiler":
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
            models[mode] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
        batch = fixed_batch(shape, seed=rank)
        steps = cfg["steps"][name]
        res = {m: {"times": [], "rounds": []} for m in modes}
        with tempfile.TemporaryDirectory(prefix="dtprofile-leave-on-") as tmp:
            # Each dtprofile configuration is one profiler left on through every round, as
            # for a whole run: its warm-up, first log and first probe steps happen in the
            # untimed warm-up segment, then it runs as it would for the rest of a run.
            profilers = {
                mode: dtprofile.profile(
                    ddp, opt, logdir=os.path.join(tmp, str(i)), **DTPROFILE_OPTIONS.get(mode, {})
                ).start()
                for i, (mode, (ddp, opt)) in enumerate(models.items())
                if mode.startswith("dtprofile")
            }
            for mode, (ddp, opt) in models.items():  # warm-up, not timed
                _plain_segment(
                    mode,
                    ddp,
                    opt,
                    batch,
                    cfg["dt_warmup"] if mode in profilers else cfg["warmup"],
                    tmp,
                    running=profilers.get(mode),
                )
            for r in range(cfg["rounds"]):
                k = r % len(modes)
                order = modes[k:] + modes[:k]
                for mode in order:
                    ddp, opt = models[mode]
                    times = _plain_segment(mode, ddp, opt, batch, steps, tmp, running=profilers.get(mode))
                    times = times[cfg["skip"] :]
                    res[mode]["times"].extend(times)
                    res[mode]["rounds"].append(statistics.median(times))
            for prof in profilers.values():
                prof.stop()
        out[name] = res
    return out


def _leave_on_rows(one: dict, two: list[dict], unused_search: list[dict]) -> list[list[Any]]:
    rows = []
    for name in LEAVE_ON_SHAPES:
        for ranks, raw, modes in (
            ("1 process", one[name], LEAVE_ON_MODES),
            ("2 processes (DDP)", _avg_ranks([r[name] for r in two]), LEAVE_ON_MODES),
            (UNUSED_SEARCH, _avg_ranks([r[name] for r in unused_search]), UNUSED_SEARCH_MODES),
        ):
            for r in _summarise(raw, modes, "no profiler"):
                base = statistics.median(raw["no profiler"]["times"])
                rows.append(
                    [
                        name,
                        ranks,
                        r["mode"],
                        fmt(r["median"]),
                        f"{r['median'] - base:+.2f}",
                        f"{r['ratio']:.3f}",
                        f"{r['ratio_mean']:.3f}",
                        f"{r['round_lo']:.3f}-{r['round_hi']:.3f}",
                        r["steps"],
                    ]
                )
    return rows


# --------------------------------------------------------------------------- Lightning


def _lightning_parts():
    import pytorch_lightning as pl

    class LitNet(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class StepClock(pl.Callback):
        """Wall time between consecutive training-batch ends (ms); RSS every ``rss_every``."""

        def __init__(self, rss_every: int = 0) -> None:
            self.times: list[float] = []
            self.rss: list[tuple[int, float]] = []
            self.rss_every = rss_every
            self._last: float | None = None
            self._n = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self._last is not None:
                self.times.append((now - self._last) * 1e3)
            self._last = now
            self._n += 1
            if self.rss_every and self._n % self.rss_every == 0:
                self.rss.append((self._n, rss_mb()))

    class Repeat(torch.utils.data.IterableDataset):
        def __init__(self, batch: tuple, n: int) -> None:
            self.batch, self.n = batch, n

        def __iter__(self):
            return itertools.repeat(self.batch, self.n)

    return pl, LitNet, StepClock, Repeat


def _lightning_fit(mode: str, lit: Any, batch: tuple, steps: int, tmp: str, rss_every: int = 0) -> Any:
    from pytorch_lightning.profilers import SimpleProfiler

    import dtprofile

    pl, _, StepClock, Repeat = _lightning_parts()
    clock = StepClock(rss_every)
    callbacks: list = [clock]
    profiler = None
    if mode == "Lightning + DTProfileCallback":
        callbacks.append(dtprofile.DTProfileCallback(logdir=os.path.join(tmp, "dtprofile")))
    elif mode == "Lightning + SimpleProfiler":
        profiler = SimpleProfiler(dirpath=tmp, filename="simple")
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        profiler=profiler,
        default_root_dir=tmp,
    )
    loader = torch.utils.data.DataLoader(Repeat(batch, steps + 1), batch_size=None)
    devnull = open(os.devnull, "w")
    saved, sys.stdout = sys.stdout, devnull  # the callback prints its report, SimpleProfiler its summary
    try:
        trainer.fit(lit, train_dataloaders=loader)
    finally:
        sys.stdout = saved
        devnull.close()
    return clock


def lightning_worker(rank: int, world: int, cfg: dict) -> dict:
    """Every LIGHTNING_MODES configuration, round-robin, for each case."""
    _lightning_parts()
    _quiet()  # after Lightning's import, which sets its loggers to INFO
    return {case: _lightning_case(case, cfg) for case in cfg["cases"]}


def _lightning_case(case_name: str, cfg: dict) -> dict:
    _, LitNet, _, _ = _lightning_parts()
    case = CASES[case_name]
    steps = cfg["steps"][case_name]
    torch.manual_seed(0)
    lit = LitNet(mlp(**case))
    batch = fixed_batch(case)
    out: dict[str, dict] = {m: {"times": [], "rounds": []} for m in LIGHTNING_MODES}
    with tempfile.TemporaryDirectory(prefix="dtprofile-overhead-") as tmp:
        for mode in LIGHTNING_MODES:  # warm-up, not timed (as in the plain loop)
            n = cfg["dt_warmup"] if "DTProfile" in mode else cfg["warmup"]
            if n:
                _lightning_fit(mode, lit, batch, n, os.path.join(tmp, "warmup"))
        for r in range(cfg["rounds"]):
            order = LIGHTNING_MODES[r % len(LIGHTNING_MODES) :] + LIGHTNING_MODES[: r % len(LIGHTNING_MODES)]
            for mode in order:
                times = _lightning_fit(mode, lit, batch, steps, os.path.join(tmp, f"r{r}")).times[cfg["skip"] :]
                out[mode]["times"].extend(times)
                out[mode]["rounds"].append(statistics.median(times))
    return out


# --------------------------------------------------------------------------- memory


def memory_worker(rank: int, world: int, cfg: dict) -> dict:
    """Long runs of fast fake steps under each of ``cfg["modes"]`` (in this order, in this
    process): RSS over time and step times, per mode."""
    if any(m.startswith("Lightning") for m in cfg["modes"]):
        _lightning_parts()
    _quiet()
    return {
        mode: _memory_run(mode, cfg["steps_lightning"] if mode.startswith("Lightning") else cfg["steps"])
        for mode in cfg["modes"]
    }


#: The per-step cost of a DDP step: no profiler, and dtprofile left on through every round.
DDP_FAST_MODES = ("none", "dtprofile")


def ddp_fast_worker(rank: int, world: int, cfg: dict) -> dict:
    """Fast fake steps (a 16 -> 4 linear layer) of a DDP model over gloo, each mode on its
    own DDP instance, in interleaved rounds: {mode: {"times": [...], "rounds": [...]}}
    (ms; the first tenth of each segment left out)."""
    import dtprofile

    _quiet()
    batch = fixed_batch(dict(width=16, depth=1, inp=16, batch=4, classes=4), seed=rank)
    models = {}
    for mode in DDP_FAST_MODES:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
        models[mode] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    res = {m: {"times": [], "rounds": []} for m in DDP_FAST_MODES}
    steps, skip = cfg["steps"], cfg["steps"] // 10
    with tempfile.TemporaryDirectory(prefix="dtprofile-ddp-fast-") as tmp:
        prof = dtprofile.profile(*models["dtprofile"], logdir=tmp).start()
        for r in range(cfg["rounds"]):
            for mode in DDP_FAST_MODES[r % 2 :] + DDP_FAST_MODES[: r % 2]:
                ddp, opt = models[mode]
                times = _plain_segment(
                    mode, ddp, opt, batch, steps, tmp, running=prof if mode == "dtprofile" else None
                )[skip:]
                res[mode]["times"].extend(times)
                res[mode]["rounds"].append(statistics.median(times))
        prof.stop()
    return res


def _ddp_fast_jobs(p: dict) -> list[Job]:
    return [(ddp_fast_worker, 2, dict(rounds=p["rounds"], steps=p["ddp_fast_steps"]))]


def _ddp_fast_table(p: dict, runs: _Runs) -> bool:
    """The per-step cost of a fast DDP step on 2 processes; whether the run failed."""
    try:
        two = runs(*_ddp_fast_jobs(p)[0], 300)
    except (RuntimeError, TimeoutError) as exc:
        print(f"DDP per-step rows unavailable: {exc}", file=sys.stderr)
        return True
    rows = []
    summary = _summarise(_avg_ranks(two), DDP_FAST_MODES, "none")
    base = summary[0]
    for r in summary:
        rows.append(
            [
                "2 processes (DDP)",
                r["mode"],
                fmt(r["median"] * 1e3, ".0f"),
                fmt((r["median"] - base["median"]) * 1e3, "+.0f"),
                fmt(r["mean"] * 1e3, ".0f"),
                fmt((r["mean"] - base["mean"]) * 1e3, "+.0f"),
                f"{r['round_lo']:.3f}-{r['round_hi']:.3f}",
                r["steps"],
            ]
        )
    print(
        table(
            [
                "setting",
                "profiler",
                "median step us",
                "added us",
                "mean step us",
                "added us (mean)",
                "per-round ratio",
                "steps",
            ],
            rows,
            title=f"Per-step cost of a fast DDP step over gloo (16->4 linear layer, batch 4), "
            f"{p['rounds']} interleaved round(s); dtprofile left on through every round",
        )
    )
    return False


def _memory_run(mode: str, steps: int) -> dict:
    every = max(1, steps // 40)
    torch.manual_seed(0)
    case = dict(width=16, depth=1, inp=16, batch=4, classes=4)
    batch = fixed_batch(case)
    with tempfile.TemporaryDirectory(prefix="dtprofile-memory-") as tmp:
        if mode.startswith("Lightning"):
            _, LitNet, _, _ = _lightning_parts()
            clock = _lightning_fit(mode, LitNet(nn.Linear(16, 4)), batch, steps, tmp, rss_every=every)
            times, rss = clock.times, clock.rss
        else:
            model = nn.Linear(16, 4)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            rss: list[tuple[int, float]] = []

            def probe(i: int) -> None:
                if (i + 1) % every == 0:
                    rss.append((i + 1, rss_mb()))

            if mode == ALWAYS_ON:
                # Recording only: finalising a trace of this length takes minutes and is
                # not what is measured here, so the profiler is never exited: this mode
                # runs last in its process, which ends with os._exit (cfg["hard_exit"]).
                tprof = _torch_profiler(scheduled=False)
                tprof.__enter__()
                times = _plain_segment("none", model, opt, batch, steps, tmp, probe=probe)
            else:
                times = _plain_segment(mode, model, opt, batch, steps, tmp, probe=probe)
    base_step = max(1, steps // 10)
    base = next((v for n, v in rss if n >= base_step), rss[0][1] if rss else 0.0)
    after = [v for n, v in rss if n >= base_step]
    half = next((v for n, v in rss if n >= steps // 2), None)
    return {
        "rss_base_mb": base,
        "rss_peak_growth_mb": (max(after) - base) if after else None,
        "rss_second_half_mb": (after[-1] - half) if after and half is not None else None,
        "step_us": statistics.median(times[base_step:]) * 1e3 if len(times) > base_step else None,
        "mean_us": statistics.fmean(times[base_step:]) * 1e3 if len(times) > base_step else None,
        "steps": steps,
    }


# --------------------------------------------------------------------------- launches

#: One launch a table asks for: the worker, the number of processes, its configuration.
Job = tuple[Callable[[int, int, dict], Any], int, dict]


def group_worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """Several jobs' workers one after another in these processes (``cfg["jobs"]``: each
    worker's name and configuration); each one's ``{"ok": result}`` or ``{"error": ...}``,
    so that one failing job leaves the others' rows."""
    out = []
    for name, job_cfg in cfg["jobs"]:
        try:
            out.append({"ok": globals()[name](rank, world, job_cfg)})
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return out


def _job_key(fn: Callable, world: int, cfg: dict) -> str:
    return f"{fn.__name__}/{world}/{json.dumps(cfg, sort_keys=True)}"


class _Runs:
    """The launches the tables ask for, within the run's time budget.

    Full mode: each one when a table asks for it, in fresh processes (one setting's
    figures are not disturbed by what another left behind). ``--quick`` (the figures
    mean little): the tables' jobs are given up front (``shared``) and share processes:
    those of one process count run one after another in one launch (:func:`group_worker`),
    so the processes' start-up and first-use imports (matplotlib for dtprofile's images,
    Lightning, DDP's) are paid once rather than once a setting; a table then takes its
    results from there, failures included, as from a launch of its own.
    """

    def __init__(self, budget: Deadline, shared: Sequence[Job] = ()) -> None:
        self.budget = budget
        self.done: dict[str, list[dict] | BaseException] = {}
        groups: dict[int, list[Job]] = {}
        for job in shared:
            groups.setdefault(job[1], []).append(job)
        # The launches side by side: the ranks of one wait on each other (and rank 0 of a
        # DDP job draws dtprofile's images alone) while the other's process computes.
        with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
            for future in [pool.submit(self._group, world, jobs) for world, jobs in groups.items()]:
                future.result()

    def _group(self, world: int, jobs: list[Job]) -> None:
        # A job that leaves its process unable to exit cleanly (hard_exit) runs last.
        jobs = sorted(jobs, key=lambda job: bool(job[2].get("hard_exit")))
        cfg = dict(
            jobs=[(fn.__name__, job_cfg) for fn, _, job_cfg in jobs],
            hard_exit=any(job_cfg.get("hard_exit") for _, _, job_cfg in jobs),
        )
        try:
            per_rank = launch(group_worker, world, cfg, self.budget.left(600))
        except (RuntimeError, TimeoutError) as exc:
            self.done.update({_job_key(*job): exc for job in jobs})
            return
        for i, job in enumerate(jobs):
            self.done[_job_key(*job)] = [ranks[i] for ranks in per_rank]

    def __call__(self, fn: Callable, world: int, cfg: dict, cap_s: float) -> list[Any]:
        """``fn``'s results by rank (as :func:`launch`; RuntimeError or TimeoutError if it failed)."""
        done = self.done.pop(_job_key(fn, world, cfg), None)
        if done is None:
            return launch(fn, world, cfg, self.budget.left(cap_s))
        if isinstance(done, BaseException):
            raise type(done)(str(done))
        for rank, res in enumerate(done):
            if "error" in res:
                raise RuntimeError(f"rank {rank} failed: {res['error']}\n{res['traceback']}")
        return [res["ok"] for res in done]


# --------------------------------------------------------------------------- main


def _summarise(raw: dict, modes: tuple, baseline: str) -> list[dict]:
    base = raw[baseline]
    base_med = statistics.median(base["times"])
    base_mean = statistics.fmean(base["times"])
    rows = []
    for m in modes:
        t = raw[m]["times"]
        med, mean = statistics.median(t), statistics.fmean(t)
        per_round = [a / b for a, b in zip(raw[m]["rounds"], base["rounds"], strict=False)]
        rows.append(
            {
                "mode": m,
                "median": med,
                "mean": mean,
                "ratio": med / base_med,
                "ratio_mean": mean / base_mean,
                "round_lo": min(per_round),
                "round_hi": max(per_round),
                "steps": len(t),
            }
        )
    return rows


def _avg_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's and rank 1's step times pooled (DDP steps are in lock-step)."""
    out = {}
    for m in per_rank[0]:
        out[m] = {
            "times": [t for r in per_rank for t in r[m]["times"]],
            "rounds": [statistics.fmean(x) for x in zip(*(r[m]["rounds"] for r in per_rank), strict=False)],
        }
    return out


def _step_jobs(p: dict) -> list[Job]:
    """1 process, DDP, FSDP2, HSDP, Lightning."""
    cfg = dict(
        cases=list(CASES),
        rounds=p["rounds"],
        steps=p["steps"],
        skip=p["skip"],
        warmup=p["warmup"],
        dt_warmup=p["dt_warmup"],
    )
    return [
        (plain_worker, 1, cfg),
        (plain_worker, 2, cfg),
        (plain_worker, 2, dict(cfg, fsdp="fsdp2")),
        (plain_worker, 2, dict(cfg, fsdp="hsdp")),
        (lightning_worker, 1, cfg),
    ]


def _step_tables(p: dict, runs: _Runs) -> bool:
    """The step-time table and its targets; whether a part failed."""
    failed = False
    results: dict[tuple[str, str], list[dict]] = {}
    one_job, two_job, sharded_job, replicated_job, lightning_job = _step_jobs(p)
    one = runs(*one_job, 900)[0]
    two = runs(*two_job, 900)
    sharded = runs(*sharded_job, 900)
    replicated = runs(*replicated_job, 900)
    for case in CASES:
        results[("1 process", case)] = _summarise(one[case], PLAIN_MODES, "none")
        results[("2 processes (DDP)", case)] = _summarise(_avg_ranks([r[case] for r in two]), PLAIN_MODES, "none")
        results[("2 processes (FSDP2)", case)] = _summarise(_avg_ranks([r[case] for r in sharded]), FSDP_MODES, "none")
        results[("2 processes (HSDP)", case)] = _summarise(
            _avg_ranks([r[case] for r in replicated]), FSDP_MODES, "none"
        )
    try:
        lit = runs(*lightning_job, 900)[0]
        for case in CASES:
            results[("Lightning, 1 process", case)] = _summarise(lit[case], LIGHTNING_MODES, LIGHTNING_MODES[0])
    except (RuntimeError, TimeoutError) as exc:
        print(f"Lightning rows unavailable: {exc}", file=sys.stderr)
        failed = True
        for case in CASES:
            results[("Lightning, 1 process", case)] = [{"mode": mode, "error": True} for mode in LIGHTNING_MODES]

    rows = []
    for setting in SETTINGS:
        for case in ("5ms", "50ms"):
            for r in results[(setting, case)]:
                if r.get("error"):
                    rows.append([setting, case, r["mode"], "failed", "", "", "", "", ""])
                    continue
                rows.append(
                    [
                        setting,
                        case,
                        r["mode"],
                        fmt(r["median"]),
                        fmt(r["mean"]),
                        f"{r['ratio']:.3f}",
                        f"{r['ratio_mean']:.3f}",
                        f"{r['round_lo']:.3f}-{r['round_hi']:.3f}",
                        r["steps"],
                    ]
                )
    print(
        table(
            [
                "setting",
                "step",
                "profiler",
                "median ms",
                "mean ms",
                "ratio (median)",
                "ratio (mean)",
                "per-round ratio",
                "steps",
            ],
            rows,
            title=f"Step time, {p['rounds']} interleaved rounds (ratio: to the unprofiled run of the same setting)",
        )
    )

    print("\nTarget (dtprofile median ratio): <= 1.01 at ~50 ms/step, <= 1.03 at ~5 ms/step")
    for setting, label in (
        ("1 process", "dtprofile"),
        ("2 processes (DDP)", "dtprofile"),
        ("2 processes (FSDP2)", "dtprofile"),
        ("2 processes (HSDP)", "dtprofile"),
        ("Lightning, 1 process", "Lightning + DTProfileCallback"),
    ):
        for case, target in TARGETS.items():
            r = next(x for x in results[(setting, case)] if x["mode"] == label)
            if r.get("error"):
                print(f"  {setting}, {case}: not measured")
                continue
            verdict = "met" if r["ratio"] <= target else "MISSED"
            print(
                f"  {setting}, {case}: {r['ratio']:.3f} (target {target:.2f}): {verdict}; "
                f"mean ratio {r['ratio_mean']:.3f}"
            )
    return failed


def _left_on_jobs(p: dict) -> list[Job]:
    """1 process, 2 processes, 2 processes searching for unused parameters."""
    cfg = dict(
        shapes=list(LEAVE_ON_SHAPES),
        rounds=p["rounds"],
        steps=p["leave_on_steps"],
        skip=p["skip"],
        warmup=p["warmup"],
        dt_warmup=p["leave_on_dt_warmup"],
        device_time=p["leave_on_device_time"],
    )
    return [
        (leave_on_worker, 1, cfg),
        (leave_on_worker, 2, cfg),
        (leave_on_worker, 2, dict(cfg, find_unused=True, modes=UNUSED_SEARCH_MODES)),
    ]


def _left_on_table(p: dict, runs: _Runs) -> bool:
    """The left-on table and its targets; whether it failed."""
    failed = False
    one_job, two_job, unused_job = _left_on_jobs(p)
    try:
        one_on = runs(*one_job, 900)[0]
        two_on = runs(*two_job, 900)
        unused_on = runs(*unused_job, 900)
        print(
            table(
                [
                    "shape",
                    "setting",
                    "profiler",
                    "median ms",
                    "added ms",
                    "ratio (median)",
                    "ratio (mean)",
                    "per-round ratio",
                    "steps",
                ],
                _leave_on_rows(one_on, two_on, unused_on),
                title="Left on for the whole run: against a DDP model with no communication hook (with a "
                "logdir: TensorBoard writing on)",
            )
        )
        print(
            f"\nTarget (dtprofile against no profiler): {', '.join(f'{k} <= {v}' for k, v in LEAVE_ON_TARGETS.items())}"
        )
    except (RuntimeError, TimeoutError) as exc:
        print(f"left-on rows unavailable: {exc}", file=sys.stderr)
        failed = True
    return failed


def _memory_jobs(p: dict, quick: bool) -> list[Job]:
    """Full mode: a fresh process per profiler (RSS is not shared); quick mode: one
    process for all, the always-on torch.profiler last (it is never exited)."""
    groups = [[m] for m in MEMORY_MODES] if not quick else [[m for m in MEMORY_MODES if m != ALWAYS_ON] + [ALWAYS_ON]]
    return [
        (
            memory_worker,
            1,
            dict(
                modes=modes,
                steps=p["mem_steps"],
                steps_lightning=p["mem_steps_lightning"],
                hard_exit=ALWAYS_ON in modes,
            ),
        )
        for modes in groups
    ]


def _memory_table(args: argparse.Namespace, p: dict, runs: _Runs) -> bool:
    """The memory table over a long run of fast fake steps; whether a run failed."""
    failed = False
    mem: dict[str, dict | None] = {}
    for job in _memory_jobs(p, args.quick):
        modes = job[2]["modes"]
        try:
            mem.update(runs(*job, 300)[0])
        except (RuntimeError, TimeoutError) as exc:
            print(f"memory run {modes} failed: {exc}", file=sys.stderr)
            failed = True
            mem.update({m: None for m in modes})
    mem_rows = []
    for mode in MEMORY_MODES:
        res = mem.get(mode)
        if res is None:
            mem_rows.append([mode, "", "failed", "", "", ""])
            continue
        base = mem.get("Lightning, no callback" if mode.startswith("Lightning") else "none")
        added = res["step_us"] - base["step_us"] if base and None not in (base["step_us"], res["step_us"]) else None
        added_mean = (
            res["mean_us"] - base["mean_us"] if base and None not in (base["mean_us"], res["mean_us"]) else None
        )
        mem_rows.append(
            [
                mode,
                res["steps"],
                fmt(res["rss_peak_growth_mb"], ".1f"),
                fmt(res["rss_second_half_mb"], ".1f"),
                fmt(res["step_us"], ".0f"),
                fmt(added, "+.0f"),
                fmt(res["mean_us"], ".0f"),
                fmt(added_mean, "+.0f"),
            ]
        )
    print(
        table(
            [
                "profiler",
                "steps",
                "RSS growth MB (10% -> peak)",
                "RSS growth MB (2nd half)",
                "median step us",
                "added us",
                "mean step us",
                "added us (mean)",
            ],
            mem_rows,
            title="Memory over a long run of fast fake steps (16->4 linear layer, batch 4): RSS growth "
            "from 10% of the steps to the peak, and over the second half; 'added' is against no "
            "profiler (Lightning rows: against Lightning without callback)",
        )
    )
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of every table and row (~20-30 s on 2 cores; figures mean little)",
    )
    ap.add_argument("--skip-memory", action="store_true", help="leave out the long-run memory table")
    ap.add_argument("--memory-only", action="store_true", help="only the long-run memory and per-step cost table")
    ap.add_argument(
        "--left-on-only", action="store_true", help="only the table of a profiler left on for the whole run"
    )
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    budget = Deadline(270 if args.quick else 1500)  # quick: room for a loaded CI machine
    m = machine()
    print(f"dtprofile overhead benchmark ({'quick' if args.quick else 'full'} mode)")
    print(describe_machine(m))
    t_start = time.monotonic()
    failed = False

    steps = not (args.left_on_only or args.memory_only)
    left_on = not args.memory_only
    memory = not args.skip_memory and not args.left_on_only
    shared: list[Job] = []
    if args.quick:  # every launch up front, one per process count
        shared += _step_jobs(p) if steps else []
        shared += _left_on_jobs(p) if left_on else []
        shared += _memory_jobs(p, quick=True) + _ddp_fast_jobs(p) if memory else []
    runs = _Runs(budget, shared)
    if steps:
        failed = _step_tables(p, runs)
    if left_on:
        failed = _left_on_table(p, runs) or failed
    if memory:
        failed = _memory_table(args, p, runs) or failed
        failed = _ddp_fast_table(p, runs) or failed
    m_end = machine()
    print(
        f"\nwall time {time.monotonic() - t_start:.0f} s; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in m_end['load'])}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
