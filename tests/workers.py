"""Training functions the multi-process tests run on each rank (see distributed.py)."""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


class SleepyDataset(torch.utils.data.Dataset):
    """Synthetic samples; each batch costs ``sleep_ms`` of (simulated) loading time."""

    def __init__(self, n: int, shape: tuple, classes: int, sleep_ms: float, batch: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.sleep_s = sleep_ms / 1e3 / batch
        self.walls_ms: list[float] = []  # each item's own loading time (where it is loaded)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.sleep_s:
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)  # (a busy machine oversleeps: 25 ms for 8 x 2.5 once)
            self.walls_ms.append((time.perf_counter() - t0) * 1e3)
        return self.x[i], self.y[i]


def make_model(kind: str) -> tuple[nn.Module, tuple, int]:
    """(model, input shape, classes)."""
    if kind == "comm_heavy":  # ~50 MB of fp32 gradients, little compute per sample
        return nn.Sequential(nn.Linear(1024, 6144), nn.ReLU(), nn.Linear(6144, 1024)), (1024,), 1024
    if kind == "conv":  # compute-bound: heavy convolutions, few parameters
        return (
            nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(32, 32, 3, padding=1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(32, 10),
            ),
            (3, 48, 48),
            10,
        )
    if kind == "bn":  # buffers: DDP broadcasts BatchNorm's running statistics before each forward
        return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10)), (32,), 10
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), (32,), 10


# The same recovery of DDP's per-iteration timings the fidelity benchmark uses.
from _common import DDP_KEYS  # noqa: E402
from _common import ddp_steady_medians as _ddp_steady_medians
from distributed import run_ranks  # noqa: E402,F401  (puts benchmarks/ on sys.path)


def environment_of(rank: int, world: int, cfg: dict) -> dict:
    """The rank's environment variables named in ``cfg["names"]`` (None: unset)."""
    return {name: os.environ.get(name) for name in cfg["names"]}


def _nosync_step(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, prof) -> float:
    """One training step of the batch ``x, y`` under ``ddp.no_sync()`` with the profiler
    suspended (its time left out of the profiled steps): its wall time (ms), which is all
    compute (no fetch, no communication)."""
    if prof is not None:
        prof._engine.suspend()
    t0 = time.perf_counter()
    with ddp.no_sync():
        nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
    ms = (time.perf_counter() - t0) * 1e3
    if prof is not None:
        prof._engine.resume()
    return ms


def ddp_train(rank: int, world: int, cfg: dict) -> dict:
    """Train with DDP under dtprofile; the summary, wall-clock step times, DDP's own stats."""
    import dtprofile

    torch.manual_seed(cfg.get("seed", 0))
    model, shape, classes = make_model(cfg.get("model", "small"))
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if world > 1:
        ddp._set_ddp_runtime_logging_sample_rate(1)  # DDP's own timings on every iteration
    ddp_avgs: list[tuple[int, dict]] = []
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.get("lr", 0.01))
    steps, batch, accumulate = cfg.get("steps", 30), cfg.get("batch", 8), cfg.get("accumulate", 1)
    # The same samples on every rank unless asked (a DDP loop without DistributedSampler).
    seed = rank if cfg.get("distinct_data") else 0
    sleep_ms = cfg.get("rank_sleep_ms", {}).get(rank, cfg.get("sleep_ms", 0.0))  # a slow loader on one rank
    data = SleepyDataset(steps * batch * accumulate, shape, classes, sleep_ms, batch, seed)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, num_workers=cfg.get("num_workers", 0))
    sync = cfg.get("sync", True)
    slow_rank, slow_ms = cfg.get("slow_rank"), cfg.get("slow_ms", 0.0)
    opts = dict(
        warmup_steps=cfg.get("warmup", 5),
        every_n_steps=cfg.get("every", 10),
        probe_every=cfg.get("probe_every", 0),
        logdir=cfg.get("logdir"),
    )
    walls = []
    warm = cfg.get("warmup", 5)
    nosync_every, nosync = cfg.get("nosync_every", 0), []
    if "worker_share" in cfg:  # the interval worker's share of wall time (its rests coalesce intervals)
        from dtprofile.sinks import background

        background.MAX_SHARE = cfg["worker_share"]
    prof = dtprofile.profile(ddp, opt, **opts) if cfg.get("profile", True) else None
    if prof is not None:
        prof.start()
    batches = prof.loader(loader) if (prof is not None and cfg.get("use_loader", True)) else iter(loader)
    t_last = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        micro = i % accumulate
        last_micro = micro == accumulate - 1
        # naive_accumulation: every micro-batch synchronises (no no_sync), a common mistake.
        skip_sync = not sync or (not last_micro and not cfg.get("naive_accumulation"))
        ctx = ddp.no_sync() if (world > 1 and skip_sync) else contextlib.nullcontext()
        with ctx:
            loss = nn.functional.cross_entropy(ddp(x), y)
            if rank == slow_rank:
                time.sleep(slow_ms / 1e3)  # a straggler: slow compute before backward
            loss.backward()
        if last_micro:
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            walls.append((now - t_last) * 1e3)
            if world > 1 and sync:
                d = ddp._get_ddp_logging_data()
                ddp_avgs.append((d.get("iteration", 0), {k: d.get(k) for k in DDP_KEYS}))
            if nosync_every and world > 1 and i >= warm and (i - warm) % nosync_every == nosync_every // 2:
                # A step without communication between the profiled ones (the profiler
                # suspended): the run's own reference, at the same moment as its steps.
                nosync.append(_nosync_step(ddp, opt, x, y, prof))
            t_last = time.perf_counter()
    report = prof.stop() if prof is not None else None
    stats = _ddp_steady_medians(ddp_avgs, skip=warm)
    # Steps without communication in the same processes, after the profiled run (no
    # profiler): what the run's steps take without it, measured within the run, since
    # runs a minute apart on the 2 shared cores differ by 15-40%.
    reference_walls, reference_compute = [], []
    if world > 1 and cfg.get("reference_steps"):
        # Every rank done with stop() (rank 0 writes the summary) before they start, together.
        dist.barrier()
        t_last = time.perf_counter()
        for i, (x, y) in enumerate(itertools.islice(itertools.cycle(loader), cfg["reference_steps"] + 2)):
            t0 = time.perf_counter()
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            if i >= 2:
                reference_walls.append((now - t_last) * 1e3)
                reference_compute.append((now - t0) * 1e3)
            t_last = time.perf_counter()
    return {
        "summary": report.to_dict() if report is not None else None,
        "report": str(report) if report is not None else None,
        "wall_step_ms": statistics.median(walls[warm:]) if len(walls) > warm else None,
        "wall_step_mean_ms": statistics.fmean(walls[warm:]) if len(walls) > warm else None,
        "reference_wall_ms": statistics.median(reference_walls) if reference_walls else None,
        "reference_compute_ms": statistics.median(reference_compute) if reference_compute else None,
        "walls_ms": walls,
        # The dataset's own time a batch, as its items measured it (main-process loading).
        "load_ms_per_batch": statistics.fmean(data.walls_ms) * batch if data.walls_ms else None,
        "nosync_ms": statistics.median(nosync) if nosync else None,
        "nosync_steps": len(nosync),
        "ddp_stats": stats,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }


def ddp_hooks(rank: int, world: int, cfg: dict) -> dict:
    """A user's own comm hook: its wait only without timed_hook, all of it with it; the
    weights as the same model's with the hook and no profiler."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import dtprofile

    out = {}
    weights = {}
    for mode in ("unprofiled", "plain_user_hook", "timed_user_hook"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        ddp = nn.parallel.DistributedDataParallel(model)
        hook = default_hooks.fp16_compress_hook
        ddp.register_comm_hook(None, dtprofile.timed_hook(hook) if mode == "timed_user_hook" else hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        prof = dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode != "unprofiled":
                prof.start()
            for _ in range(12):
                x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
            if mode != "unprofiled":
                prof.stop()
        weights[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
        if mode == "unprofiled":
            continue
        s = prof.report().to_dict()
        out[mode] = {
            "comm_total": s["per_step_ms"]["comm_total"],
            "comm_exposed": s["per_step_ms"]["comm_exposed"],
            "comm_source": s["comm_source"],
            "comm_unmeasured": s["comm_unmeasured"],
            "grad_bytes": s["grad_bytes"],
            "warnings": [str(w.message) for w in caught],
            "ddp": s["run"]["ddp"],
            "identical": bool(torch.equal(weights["unprofiled"], weights[mode])),
            "lane_steps": prof._engine.steps.lane.steps_taken,
        }
    return out


def ddp_second_profile(rank: int, world: int, cfg: dict) -> dict:
    """Two profiles in a row on one DDP model: the hook is re-used, then passes through
    (``cfg["opts"]``: the profiles' options; without a hook nothing is left behind)."""
    import dtprofile

    opts = dict(warmup_steps=1, every_n_steps=4, **cfg.get("opts", {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def train(n):
        for _ in range(n):
            nn.functional.cross_entropy(ddp(torch.randn(8, 32)), torch.randint(0, 10, (8,))).backward()
            opt.step()
            opt.zero_grad()

    results = []
    for _ in range(2):
        with dtprofile.profile(ddp, opt, **opts) as prof:
            train(6)
        results.append(prof.report().to_dict()["per_step_ms"]["comm_total"])
    # Two at once (the first left running, say by an interrupted notebook cell): the
    # second stops the first, reported incomplete, and times the communication itself.
    import warnings

    first = dtprofile.profile(ddp, opt, **opts).start()
    train(3)
    second = dtprofile.profile(ddp, opt, **opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with second:
            train(6)
    both = [p.report().to_dict() for p in (first, second)]
    train(3)  # after exit: plain all-reduce through the pass-through hook
    hooks = [type(h).__name__ for h, _ in ddp._comm_hooks]
    return {
        "comm_total": results,
        "hooks": hooks,
        "left_hooks": len(ddp._forward_hooks) + len(opt._optimizer_step_post_hooks) + ("_sync_buffers" in vars(ddp)),
        "concurrent": [
            {
                "comm_total": s["per_step_ms"]["comm_total"],
                "comm_unmeasured": s["comm_unmeasured"],
                "complete": s["complete"],
                "steps_total": s["steps_total"],
            }
            for s in both
        ],
        "concurrent_warnings": [str(w.message) for w in caught],
    }


def gather_missing_rank(rank: int, world: int, cfg: dict) -> dict:
    """Rank 1 stops reporting (stuck or gone), or a rank simply ends first ("ended": uneven
    step counts); the others must go on, not hang."""
    import os
    import warnings

    import dtprofile

    torch.manual_seed(rank)
    model = nn.Linear(8, 2)  # not DDP: only dtprofile's own gather connects the ranks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=5, gather_timeout_s=cfg["timeout_s"])
    steps = cfg["steps_rank1"] if rank == 1 else cfg["steps_rank0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof.start()
        for _ in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(cfg.get("step_s", 0.0))
        if cfg["mode"] == "raises":
            if rank == 1:  # the loop raised: the `with` block's exit stops incomplete
                t0 = time.monotonic()
                report = prof._stop(complete=False, failed=True).to_dict()  # what __exit__ does on an exception
                return {
                    "stop_s": time.monotonic() - t0,
                    "ranks": [r["rank"] for r in report["ranks"]],
                    "complete": report["complete"],
                }
            time.sleep(cfg["stuck_s"])  # rank 0: stuck in the collective rank 1 left
        elif rank == 1 and cfg["mode"] != "ended":
            if cfg["mode"] == "killed":
                os._exit(0)  # gone without a word
            time.sleep(cfg["stuck_s"])  # stuck in a long step
        t0 = time.monotonic()
        report = prof.stop().to_dict()
    return {
        "stop_s": time.monotonic() - t0,
        "ranks": [r["rank"] for r in report["ranks"]],
        "rank_steps": [r["steps"] for r in sorted(report["ranks"], key=lambda r: r["rank"])],
        "warnings": [str(w.message) for w in caught],
        "steps": report["steps_profiled"],
        "steps_total": report["steps_total"],
    }


def ddp_odd(rank: int, world: int, cfg: dict) -> dict:
    """Legal but odd DDP runs: unused parameters, a frozen part, uneven step counts."""
    import dtprofile

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(16, 16)
            self.used = nn.Linear(16, 4)
            self.unused = nn.Linear(16, 4)
            for p in self.frozen.parameters():
                p.requires_grad_(False)

        def forward(self, x):
            return self.used(torch.relu(self.frozen(x)))

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    steps = cfg.get("steps", 10) + (cfg.get("extra_rank1", 0) if rank == 1 else 0)
    with dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=4, gather_timeout_s=cfg.get("timeout_s", 5)) as prof:
        for i in range(steps):
            if i >= cfg.get("steps", 10):
                # only rank 1 gets here: extra steps without DDP (its peer has stopped)
                with ddp.no_sync():
                    ddp(torch.randn(8, 16)).sum().backward()
            else:
                ddp(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    s = prof.report().to_dict()
    return {
        "steps_total": s["steps_total"],
        "comm_total": s["per_step_ms"]["comm_total"],
        "grad_bytes": s["grad_bytes"],
        "world_size": s["world_size"],
        "ranks": len(s["ranks"]),
        "comm_source": s["comm_source"],
        "comm_hooks": len(ddp._comm_hooks),
    }


def ddp_compiled(rank: int, world: int, cfg: dict) -> dict:
    """torch.compile on a DDP model (DDPOptimizer splits the graph at bucket boundaries)
    and on a plain module compiled in place: hooks run eagerly, no graph breaks, same
    weights as the unprofiled compiled run."""
    import warnings

    import torch._dynamo

    import dtprofile

    def train(profiled: bool, give_compiled: bool = False) -> tuple[dict | None, list[str], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        ddp = nn.parallel.DistributedDataParallel(model)
        compiled = torch.compile(ddp, backend="aot_eager")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        prof = dtprofile.profile(compiled if give_compiled else ddp, opt, warmup_steps=3, every_n_steps=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if profiled:
                prof.start()
            for _ in range(12):
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                nn.functional.cross_entropy(compiled(x), y).backward()
                opt.step()
                opt.zero_grad()
            summary = prof.stop().to_dict() if profiled else None
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        return summary, [str(w.message) for w in caught], weights

    def graph_breaks() -> dict:
        return dict(torch._dynamo.utils.counters["graph_break"])

    torch._dynamo.reset()
    _, _, w0 = train(False)
    plain_breaks = graph_breaks()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    summary, caught, w1 = train(True)
    breaks = graph_breaks()
    torch._dynamo.reset()
    given_compiled, caught_compiled, w2 = train(True, give_compiled=True)  # profile(torch.compile(ddp))
    return {
        "same_weights": bool(torch.equal(w0, w1)),
        "warnings": caught,
        "compiled_given": {
            "same_weights": bool(torch.equal(w0, w2)),
            "warnings": caught_compiled,
            "comm_source": given_compiled["comm_source"],
            "grad_bytes": given_compiled["grad_bytes"],
            "comm_total": given_compiled["per_step_ms"]["comm_total"],
        },
        "graph_breaks": breaks,
        "graph_breaks_unprofiled": plain_breaks,
        "steps_profiled": summary["steps_profiled"],
        "probe_steps": (summary["probe"] or {}).get("steps", 0),
        "per_step_ms": summary["per_step_ms"],
        "grad_bytes": summary["grad_bytes"],
        "comm_source": summary["comm_source"],
    }


def manual_reduction(rank: int, world: int, cfg: dict) -> dict:
    """No DDP: the loop all-reduces each gradient itself, timed with prof.communication()
    (and once without it: unmeasured, with one warning that says why)."""
    import warnings

    import dtprofile

    out = {}
    for mode in ("timed", "untimed", "unprofiled"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        prof = dtprofile.profile(model, opt, warmup_steps=2, every_n_steps=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode != "unprofiled":
                prof.start()
            for _ in range(12):
                x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
                nn.functional.cross_entropy(model(x), y).backward()
                block = prof.communication(grad_bytes) if mode == "timed" else contextlib.nullcontext()
                with block:
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= world
                opt.step()
                opt.zero_grad()
            s = prof.stop().to_dict() if mode != "unprofiled" else None
        out[mode] = {
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()[:64],
            "warnings": [str(w.message) for w in caught],
        }
        if s is not None:
            out[mode].update(
                comm_source=s["comm_source"],
                comm_unmeasured=s["comm_unmeasured"],
                grad_bytes=s["grad_bytes"],
                per_step_ms=s["per_step_ms"],
                expected_bytes=grad_bytes,
            )
    return out


def _trimmed_mean(values: list[float], step_walls: list[float]) -> float:
    """The mean of ``values`` (one per step) without the steps dtprofile leaves out of
    its averages: the fastest and slowest few by step time."""
    from dtprofile.capture.records import trim_count

    k = trim_count(len(values))
    kept = sorted(range(len(values)), key=step_walls.__getitem__)[k : len(values) - k]
    return statistics.fmean(values[i] for i in kept)


def fsdp_train(rank: int, world: int, cfg: dict) -> dict:
    """FSDP2 (``fully_shard`` per layer and at the root) under dtprofile, or without it.

    ``cfg["layout"]``: ``"fsdp"`` (sharded over both ranks, the default), ``"hsdp"``
    (a 2 x 1 mesh: two replicas of one shard, all-reduced across replicas),
    ``"hsdp_1x2"`` (a 1 x 2 mesh: sharded over both ranks, then all-reduced across a
    replicate group of one), ``"replicate"`` (FSDP's ``replicate``, DDP built on FSDP),
    ``"fsdp1"`` / ``"fsdp1_no_shard"`` (``FullyShardedDataParallel`` per layer and at the
    root, ``FULL_SHARD`` / ``NO_SHARD``).

    Returns the summary, a checksum of the weights (sharded: each rank its shards) and
    every collective's wall time, timed independently of dtprofile by wrapping
    ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (what FSDP2's default
    comm objects call; in older torch ``all_gather_into_tensor`` /
    ``reduce_scatter_tensor``) and ``dist.all_reduce`` (HSDP's) in this process.
    """
    from torch.distributed.fsdp import fully_shard

    import dtprofile

    walls: list[tuple[str, float]] = []
    layout = cfg.get("layout", "fsdp")
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    if layout.startswith("fsdp1"):
        gather = "all_gather"  # FSDP1 on the CPU gathers into a list
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    originals = {name: getattr(dist, name) for name in (gather, scatter, "all_reduce")}

    where = {"step": -1, "training": True}  # each wall's step, and whether it was training's

    def timed(name):
        def call(*args, **kwargs):
            if kwargs.get("async_op"):  # dtprofile's own cross-rank gather, not the model's
                return originals[name](*args, **kwargs)
            t0 = time.perf_counter()
            out = originals[name](*args, **kwargs)
            walls.append((name, (time.perf_counter() - t0) * 1e3, where["step"], where["training"]))
            return out

        return call

    for name in originals:
        setattr(dist, name, timed(name))
    try:
        torch.manual_seed(0)
        width, layers = cfg.get("width", 512), cfg.get("layers", 4)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)], nn.Linear(width, 10)
        )
        if layout.startswith("fsdp1"):
            from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

            strategy = ShardingStrategy.NO_SHARD if layout == "fsdp1_no_shard" else ShardingStrategy.FULL_SHARD

            def wrap(module):
                return FullyShardedDataParallel(
                    module,
                    device_id=torch.device("cpu"),
                    sharding_strategy=strategy,
                    use_orig_params=cfg.get("use_orig_params", False),
                )

            for i in range(len(model) - 1):
                model[i] = wrap(model[i])
            model = wrap(model)
        elif layout == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate as wrap

            kwargs: dict = {}
        else:
            wrap, kwargs = fully_shard, {"reshard_after_forward": cfg.get("reshard_after_forward", True)}
            if layout in ("hsdp", "hsdp_1x2"):
                from torch.distributed.device_mesh import init_device_mesh

                shape = (world, 1) if layout == "hsdp" else (1, world)
                kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        if not layout.startswith("fsdp1"):
            for layer in model[:-1]:
                wrap(layer, **kwargs)
            kwargs.pop("reshard_after_forward", None)
            wrap(model, **kwargs)
        if cfg.get("async_unshard"):
            for m in model.modules():
                if hasattr(m, "_set_unshard_async_op"):
                    m._set_unshard_async_op(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        steps, batch, warmup = cfg.get("steps", 20), cfg.get("batch", 16), cfg.get("warmup", 3)
        g = torch.Generator().manual_seed(0 if cfg.get("same_data") else rank)
        prof = dtprofile.profile(model, opt, warmup_steps=warmup, every_n_steps=5) if cfg.get("profile", True) else None
        if prof is not None:
            prof.start()
        accumulate = cfg.get("accumulate", 1)
        step_walls = []  # each step's wall time, to trim the steps dtprofile trims
        for i in range(steps):
            where["step"] = i
            if i == warmup:
                walls.clear()
            t_step = time.perf_counter()
            for micro in range(accumulate):
                if cfg.get("all_reduce_on_last"):  # HSDP: all-reduce across replicas on the last only
                    model.set_requires_all_reduce(micro == accumulate - 1)
                if cfg.get("no_sync_accumulation"):  # FSDP2's no_sync: reduce-scatter on the last only
                    model.set_requires_gradient_sync(micro == accumulate - 1)
                x = torch.randn(batch, width, generator=g)
                # Mostly class 0: a gradient signal well above the per-sample noise.
                y = torch.where(x[:, 0] > -1.0, 0, (x[:, 1:10]).argmax(dim=1) + 1)
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step_walls.append(time.perf_counter() - t_step)
            if cfg.get("evaluate") and i % 4 == 0:
                x = torch.randn(batch, width, generator=g)
                where["training"] = False
                with torch.no_grad():  # all-gathers outside a training step
                    model(x)
                where["training"] = True
        summary = prof.stop().to_dict() if prof is not None else None
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    checksum = sum(float(getattr(p, "to_local", lambda: p)().double().sum()) for p in model.parameters())
    measured = steps - warmup
    from torch.distributed.fsdp import _flat_param, _runtime_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return {  # dtprofile's proxies gone after stop()
        "fsdp_dist_restored": all(m.dist is dist for m in (_fsdp_collectives, _flat_param, _runtime_utils)),
        "summary": summary,
        "checksum": checksum,
        "all_gather_ms": sum(ms for n, ms, _, _ in walls if n == gather) / measured,
        "reduce_scatter_ms": sum(ms for n, ms, _, _ in walls if n == scatter) / measured,
        "all_reduce_ms": sum(ms for n, ms, _, _ in walls if n == "all_reduce") / measured,
        # The training collectives per step, averaged over the steps dtprofile averages:
        # the fastest and slowest few by step time left out (records.trim_count).
        "training_collectives_ms": _trimmed_mean(
            [sum(ms for _, ms, step, training in walls if step == i and training) for i in range(warmup, steps)],
            step_walls[warmup:],
        ),
        "collectives": len(walls) / measured,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),  # DTensor: global
    }


def fsdp_two_profilers(rank: int, world: int, cfg: dict) -> dict:
    """Two profilers started on one FSDP model (FSDP2, or FSDP1 with cfg["fsdp1"]): the
    second stops the first (left running, say by an interrupted notebook cell) and times
    the collectives itself."""
    import warnings

    import dtprofile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if cfg.get("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=100)
    second = dtprofile.profile(model, opt, warmup_steps=1, every_n_steps=100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first.start()
        second.start()
        for _ in range(6):
            nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
            opt.step()
            opt.zero_grad()
        second.stop()
        first.stop()
    out = [p.report().to_dict() for p in (first, second)]
    return {
        "comm_total": [s["per_step_ms"]["comm_total"] for s in out],
        "comm_unmeasured": [s["comm_unmeasured"] for s in out],
        "complete": [s["complete"] for s in out],
        "steps_total": [s["steps_total"] for s in out],
        "warnings": [str(w.message) for w in caught],
    }


def ddp_join_uneven(rank: int, world: int, cfg: dict) -> dict:
    """Uneven inputs under DDP's join(): rank 1 has fewer batches and shadows rank 0's
    all-reduces until rank 0 is done, so it reaches its final gather after rank 0 has."""
    import warnings

    import dtprofile

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = cfg["steps"][rank]
    prof = dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=5, gather_timeout_s=cfg["timeout_s"])
    inner = cfg.get("inner", False)  # the profile inside join(): stop() before join's shadowing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t_loop = time.monotonic()
        if not inner:
            prof.start()
        with ddp.join():
            if inner:
                prof.start()
            for _ in range(steps):
                ddp(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            t0 = time.monotonic()
            if inner:
                report = prof.stop().to_dict()
        if not inner:
            t0 = time.monotonic()
            report = prof.stop().to_dict()
    return {
        "stop_s": time.monotonic() - t0,
        "loop_s": t0 - t_loop,
        "ranks": [r["rank"] for r in report["ranks"]],
        "steps_total": report["steps_total"],
        "warnings": [str(w.message) for w in caught],
        "comm_source": report["comm_source"],
        "probe_steps": (report["probe"] or {}).get("steps", 0),
        "comm_total": report["per_step_ms"]["comm_total"],
        "comm_hooks": len(ddp._comm_hooks),
    }


def repeated_profiles(rank: int, world: int, cfg: dict) -> dict:
    """Profile several short runs in one process, one after another (a profile per epoch):
    the threads and file descriptors alive after each stop()."""
    import threading

    import dtprofile

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    threads, fds = [], []
    for _ in range(cfg["runs"]):
        with dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=3, gather_timeout_s=20.0) as prof:
            for _ in range(6):
                ddp(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        threads.append(threading.active_count())
        fds.append(len(os.listdir("/proc/self/fd")))
    return {"threads": threads, "fds": fds, "ranks": [r["rank"] for r in prof.report().to_dict()["ranks"]]}


def one_rank_raises(rank: int, world: int, cfg: dict) -> dict:
    """Rank 1's loop raises at step 20 of a DDP run; rank 0 goes on and blocks in DDP's
    next all-reduce until rank 1's process is gone: how long it stays blocked."""
    import dtprofile

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    last = time.monotonic()
    try:
        with dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=10, gather_timeout_s=cfg["timeout_s"]):
            for step in range(200):
                if rank == 1 and step == 20:
                    raise RuntimeError("the loop failed")
                ddp(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                last = time.monotonic()
    except RuntimeError as exc:
        return {"error": str(exc)[:80], "blocked_s": time.monotonic() - last}
    return {"error": None}


def join_then_late_stop(rank: int, world: int, cfg: dict) -> dict:
    """Even inputs under a join() whose block has ended (the Join kept in a variable);
    rank 1 then works 5 s more before stop(): not uneven inputs, so rank 0 waits for it."""
    import dtprofile

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    prof = dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=5, gather_timeout_s=30.0)
    prof.start()
    join = ddp.join()
    with join:
        for _ in range(12):
            ddp(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    if rank == 1:
        time.sleep(5.0)  # e.g. saving a checkpoint inside the profiled block
    t0 = time.monotonic()
    report = prof.stop().to_dict()
    return {"stop_s": time.monotonic() - t0, "ranks": [r["rank"] for r in report["ranks"]]}


def profile_on_rank_0_only(rank: int, world: int, cfg: dict) -> dict:
    """A common mistake: ``profile()`` under ``if rank == 0``. DDP connects the ranks;
    only rank 0 profiles. How long its start() holds it, and what it says."""
    import warnings

    import dtprofile
    import dtprofile.gather

    dtprofile.gather.START_WAIT_S = cfg["start_wait_s"]
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    prof = dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=5, gather_timeout_s=cfg["timeout_s"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        if rank == 0:
            prof.start()
        start_s = time.monotonic() - t0
        for _ in range(12):
            ddp(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        report = prof.stop().to_dict() if rank == 0 else None
        # Then both ranks profile, as they should: the earlier start that rank 1 missed
        # does not keep them apart.
        with dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=5, gather_timeout_s=cfg["timeout_s"]) as both:
            for _ in range(6):
                ddp(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    return {
        "start_s": start_s,
        "warnings": [str(w.message) for w in caught],
        "steps": report["steps_total"] if report else None,
        "ranks": [r["rank"] for r in report["ranks"]] if report else None,
        "ranks_after": [r["rank"] for r in both.report().to_dict()["ranks"]],
    }


def peer_dies_mid_run(rank: int, world: int, cfg: dict) -> dict:
    """Rank 1's loop raises (or its process is killed) at step ``at`` of a DDP run; what
    rank 0's profiler says while its own training fails in the next all-reduce."""
    import warnings

    import dtprofile

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=5, gather_timeout_s=20.0):
                for step in range(60):
                    if rank == 1 and step == cfg["at"]:
                        if cfg["how"] == "killed":
                            os._exit(3)
                        raise RuntimeError("the loop failed")
                    ddp(torch.randn(8, 16)).sum().backward()
                    opt.step()
                    opt.zero_grad()
        except RuntimeError as exc:
            error = str(exc)[:200]
    return {"error": error, "warnings": [str(w.message) for w in caught]}


def ddp_batched_buckets(rank: int, world: int, cfg: dict) -> dict:
    """Two DDP models from one seed, trained in lockstep on the same batches: one under
    dtprofile (its hook times some steps' buckets and batches the others'), then on after
    the profiler stopped (the hook passes through); the other never profiled. Which steps
    ran a per-bucket callback, and whether the weights stay identical."""
    import dtprofile
    from dtprofile.capture.comm import CommRecorder

    view = cfg.get("bucket_view", False)  # gradients as views of DDP's buckets, zeroed in place
    torch.manual_seed(0)
    plain = nn.parallel.DistributedDataParallel(_layers(), bucket_cap_mb=0.01, gradient_as_bucket_view=view)
    torch.manual_seed(0)
    profiled = nn.parallel.DistributedDataParallel(_layers(), bucket_cap_mb=0.01, gradient_as_bucket_view=view)
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, profiled)}
    timed_at: list[int] = []  # the step index of each per-bucket callback
    done = CommRecorder.bucket_done

    def counted(self, interval, future):
        timed_at.append(self.steps.current.index)
        return done(self, interval, future)

    CommRecorder.bucket_done = counted
    copies: list[int] = []  # a probe's copies of its chunks
    if cfg.get("chunks_in_flight"):
        from dtprofile.capture import probe

        probe.PROBE_CHUNKS_IN_FLIGHT = cfg["chunks_in_flight"]
        copy = probe._scaled_copy

        def slow_copy(*args):
            copies.append(1)
            if rank == 1:
                time.sleep(cfg.get("rank1_copy_ms", 0.0) / 1e3)  # rank 0 leads into each chunk
            return copy(*args)

        probe._scaled_copy = slow_copy
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
        for _ in range(cfg["steps"] + cfg["after"])
    ]
    prof = dtprofile.profile(
        profiled, opts[profiled], warmup_steps=cfg["warmup"], bucket_timing_every=cfg["every"], every_n_steps=1000
    )
    prof.start()
    for i, (x, y) in enumerate(batches):
        if i == cfg["steps"]:
            prof.stop()
        for model in (plain, profiled):
            if model is profiled and rank == 1 and cfg.get("rank1_sleep_ms"):
                time.sleep(cfg["rank1_sleep_ms"] / 1e3)  # rank 0 waits for it after backward
            nn.functional.cross_entropy(model(x), y).backward()
            opts[model].step()
            opts[model].zero_grad(set_to_none=not view)
    CommRecorder.bucket_done = done
    return {
        "summary": prof.report().to_dict(),
        "timed_steps": sorted(set(timed_at)),
        "buckets": timed_at.count(timed_at[-1]) if timed_at else 0,  # of the last timed step
        "identical": all(torch.equal(a, b) for a, b in zip(plain.parameters(), profiled.parameters(), strict=False)),
        "param_bytes": sum(p.numel() * p.element_size() for p in profiled.parameters()),
        "comm_hooks": len(getattr(profiled, "_comm_hooks", None) or []),
        "chunk_copies": len(copies),
        "lane_steps": prof._engine.steps.lane.steps_taken,
    }


def ddp_unused_params(rank: int, world: int, cfg: dict) -> dict:
    """Two DDP models that search for unused parameters (``find_unused_parameters``), from
    one seed, trained in lockstep on the same batches with AdamW (a gradient of zeros and
    no gradient update a parameter differently): one under dtprofile's defaults, the
    other never profiled. A head is used on both ranks, on rank 0 only, or on neither,
    step by step, so that the steps after the probe steps include ones where no rank
    uses it. It shares its weight with the first head (DDP reduces a shared parameter
    once: the parameters' order skips it)."""
    import dtprofile

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(16, 32)
            self.head = nn.Linear(32, 4)
            self.extra = nn.Linear(32, 4)
            self.extra.weight = self.head.weight

        def forward(self, x, extra):
            h = torch.relu(self.body(x))
            out = self.head(h) + self.extra(h) if extra else self.head(h)
            return (out, h) if cfg.get("two_outputs") else out

    def uses_extra(step: int) -> bool:
        return step % 3 != 2 and (rank == 0 or step % 2 == 0)

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(
            nn.parallel.DistributedDataParallel(
                Net(), find_unused_parameters=True, gradient_as_bucket_view=cfg.get("bucket_view", False)
            )
        )
    plain, profiled = models
    opts = {m: torch.optim.AdamW(m.parameters(), lr=0.01) for m in models}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 16, generator=g) for _ in range(cfg["steps"])]
    from dtprofile.capture.records import PendingStep

    to_record = PendingStep.to_record
    probe_marks = []  # each probe step's (reductions waited for, its communication's last end)

    def noted(self, *args):
        if self.probe and self.backward and self.comm:
            probe_marks.append((self.backward[-1][2], max(interval.end for interval in self.comm)))
        return to_record(self, *args)

    PendingStep.to_record = noted
    from dtprofile.noise import NoiseSampler

    sample = NoiseSampler.sample_by_hand
    samples = []  # each probe's gradient-noise sample: |g|^2 of this rank's gradient and of the mean

    def sampled(self, interval, local_sq, reduced_sq, local_scale):
        samples.append((float(sum(local_sq)) / local_scale**2, float(sum(reduced_sq))))
        return sample(self, interval, local_sq, reduced_sq, local_scale)

    NoiseSampler.sample_by_hand = sampled
    prof = dtprofile.profile(profiled, opts[profiled], warmup_steps=cfg["warmup"], every_n_steps=1000)
    prof.start()
    probe = prof._engine.comm.ddp_attachment.probe_by_hand
    stopped_at = None
    for i, x in enumerate(batches):
        for model in models:
            out = model(x, uses_extra(i))
            if model is profiled and cfg.get("stop_in_probe") and stopped_at is None and probe.window_open:
                stopped_at = i
                prof.stop()  # between a probe's forward and its backward
            loss = out[0].square().mean() + out[1].mean() if cfg.get("two_outputs") else out.square().mean()
            loss.backward()
            opts[model].step()
            opts[model].zero_grad(set_to_none=not cfg.get("bucket_view", False))
    summary = (prof.report() if stopped_at is not None else prof.stop()).to_dict()
    PendingStep.to_record = to_record
    NoiseSampler.sample_by_hand = sample
    return {
        "stopped_at": stopped_at,
        "noise_samples": samples,
        "summary": summary,
        "probes_synced_after_comm": [synced >= end for synced, end in probe_marks],
        "identical": all(torch.equal(a, b) for a, b in zip(plain.parameters(), profiled.parameters(), strict=False)),
        "param_bytes": sum(p.numel() * p.element_size() for p in profiled.parameters()),
        "comm_hooks": len(getattr(profiled, "_comm_hooks", None) or []),
        "lane_steps": prof._engine.steps.lane.steps_taken,
    }


def backward_inside_forward(rank: int, world: int, cfg: dict) -> dict:
    """A DDP model whose forward is the whole training step (loss, backward, optimizer
    step), as Lightning's manual optimization runs it: trained with and without dtprofile
    on the same batches, in lockstep."""
    import warnings
    import weakref

    import dtprofile

    class Step(nn.Module):
        """Lightning's way: DDP's flag off around the module's call, the reducer prepared
        by hand before backward when the call was to synchronise."""

        def __init__(self):
            super().__init__()
            self.net = _layers()
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05)
            self.ddp = lambda: None

        def forward(self, x, y):
            ddp = self.ddp()
            sync = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False  # DDP's own preparation after forward: none
            self.opt.zero_grad()
            loss = nn.functional.cross_entropy(self.net(x), y)
            if sync:
                ddp.reducer._rebuild_buckets()
                ddp.reducer.prepare_for_backward([])
            loss.backward()
            self.opt.step()
            return loss.detach()

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        step = Step()
        models.append(nn.parallel.DistributedDataParallel(step))
        step.ddp = weakref.ref(models[-1])
    plain, profiled = models
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = dtprofile.profile(profiled, profiled.module.opt, warmup_steps=2, every_n_steps=1000).start()
        for _ in range(cfg["steps"]):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            for model in models:
                model(x, y)
                model.require_backward_grad_sync = True
        summary = prof.stop().to_dict()
    return {
        "summary": summary,
        "warnings": [str(w.message) for w in caught],
        "identical": all(torch.equal(a, b) for a, b in zip(plain.parameters(), profiled.parameters(), strict=False)),
    }


def _layers() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def passes_slower_together(rank: int, world: int, cfg: dict) -> dict:
    """A DDP model whose forward is slower while another rank's forward runs (as ranks
    sharing a host's cores and memory are): each forward marks itself busy in a file,
    sleeps, and sleeps ``cfg["shared_ms"]`` more if another rank was busy meanwhile."""
    import dtprofile

    flags = cfg["flags"]

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _layers()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mine = os.path.join(flags, f"busy{rank}")
            open(mine, "w").close()
            time.sleep(cfg["alone_ms"] / 1e3)
            others = [f for f in os.listdir(flags) if f != f"busy{rank}"]
            if others:
                time.sleep(cfg["shared_ms"] / 1e3)
            os.unlink(mine)
            return self.inner(x)

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Shared())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(cfg["steps"])]
    with dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=1000) as prof:
        for x, y in prof.loader(batches):
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"summary": prof.report().to_dict()}


def probe_safety_net(rank: int, world: int, cfg: dict) -> dict:
    """The same DDP training unprofiled and profiled (probe steps by hand), from one seed,
    in these processes; ``cfg["sabotage"]``: the probe's reduction leaves the gradients
    as they were on "every" rank or on "rank1" only (its copy back into them skipped), and
    ``cfg["siamese"]``: two forwards before one backward (no plain pass); and
    ``cfg["collective_at"]``: steps whose loop all-reduces between forward and backward.
    Returns the
    weights' agreement across runs and ranks, and the profiled run's summary."""
    import warnings

    import dtprofile
    from dtprofile.capture import probe as probe_module

    def train(profiled: bool) -> tuple[list[torch.Tensor], dict | None, list[str]]:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_layers())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        batches = [
            (torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(cfg["steps"])
        ]
        prof = dtprofile.profile(ddp, opt, warmup_steps=2, every_n_steps=1000) if profiled else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if prof is not None:
                prof.start()
            for i, (x, y) in enumerate(batches):
                if cfg.get("siamese"):
                    loss = nn.functional.cross_entropy(ddp(x), y) + ddp(x.flip(0)).square().mean()
                else:
                    loss = nn.functional.cross_entropy(ddp(x), y)
                if i in cfg.get("collective_at", ()):
                    logged = loss.detach().clone()
                    dist.all_reduce(logged)  # the loop's own, between forward and backward
                loss.backward()
                opt.step()
                opt.zero_grad()
            summary = prof.stop().to_dict() if prof is not None else None
        return [p.detach().clone() for p in ddp.parameters()], summary, [str(w.message) for w in caught]

    copy_back = probe_module._ChunkReduction.copy_back
    sabotaged: list[int] = []

    def no_copy_back(self, recorder, sampled):
        if not sabotaged or cfg["sabotage"] == "always":
            sabotaged.append(1)
            self.work.wait()  # the wire as usual; the gradients are left as they were
            return sampled
        return copy_back(self, recorder, sampled)

    plain, _, _ = train(False)
    if cfg.get("sabotage") == "every" or (cfg.get("sabotage") == "rank1" and rank == 1):
        probe_module._ChunkReduction.copy_back = no_copy_back
    try:
        start = time.perf_counter()
        profiled, summary, caught = train(True)
        wall_s = time.perf_counter() - start
    finally:
        probe_module._ChunkReduction.copy_back = copy_back
    mine = torch.cat([p.flatten() for p in profiled])
    others = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(others, mine)
    return {
        "same_as_unprofiled": all(torch.equal(a, b) for a, b in zip(plain, profiled, strict=False)),
        "wall_s": wall_s,
        "same_across_ranks": all(torch.equal(o, others[0]) for o in others),
        "sabotaged": len(sabotaged),
        "summary": summary,
        "warnings": caught,
    }
