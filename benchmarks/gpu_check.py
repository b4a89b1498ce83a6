"""dtprofile on a real GPU: one short script (62-116 s for every check on one H200).

    python benchmarks/gpu_check.py [--steps N] [--out FILE.json] [--checks A,B] [--batch N] [--image N]

It runs from a plain checkout (dtprofile need not be installed: the script maps
``integrations/`` to ``dtprofile.integrations`` itself). On a borrowed machine whose
console output comes back truncated, keep everything in a file as well, e.g.
``python3 benchmarks/gpu_check.py --steps 40 --out $OUT/gpu_check.json 2>&1 | tee
$OUT/gpu_check.log``: the JSON is rewritten after every check, so what ran survives a
later kill; process groups time out after 120 s and a DDP/FSDP check is killed after
240 s.

On a machine without CUDA it prints "no CUDA device: nothing to check" and exits 0.
``--cpu-dry-run`` runs every check on the CPU instead, to test the script before a GPU
session spends its minutes on it (tests/test_gpu.py runs it): a small input, the model
a quarter as wide, and the DDP/FSDP checks' ranks spawned once for all of them (each
check still has its own process group); it measures nothing.
With a GPU it runs, on a ResNet-style CNN built here (no torchvision) with synthetic
data already on the device:

1. no-sync: the plain integration (``dtprofile.profile``) with
   ``torch.cuda.set_sync_debug_mode("error")`` during every profiled step after warm-up
   (any synchronising call raises); the debug mode is reset before ``stop()``, which
   synchronises once on purpose. It also counts what those steps cost the host: the
   CUDA events each recorded (``marks_per_step``) and how many took the steady lane
   (``steady_lane_steps``).
2. accuracy: the same steps under ``torch.profiler``: the sum of CUDA kernel (and
   memcpy/memset) time per step against dtprofile's forward + backward + optimizer
   (dtprofile measures stream intervals, gaps between kernels included, so it is >= the
   kernel sum; a large ratio means launch gaps), NCCL kernel time against ``comm_total``.
   Like with like: the device's period per step in the trace (first kernel's start to
   last kernel's end, over the steps), gaps included, against dtprofile's step
   (``step_vs_device_period_ratio``); under the profiler's own host cost a loop can
   turn host-bound, and then both hold launch gaps that the kernel sum does not.
3. data wait with the GPU ahead of the host: a loader that sleeps a quarter of the
   step (the GPU never idles: data wait ~0) and twice the step (the GPU idles).
4. overhead: step time with and without dtprofile in back-to-back pairs of blocks, each
   timed after as many untimed steps (the steady state of a long run), the median of the
   pairs' differences; on the model above and on a host-bound one (batch 4 of 32x32: the
   GPU waits for launches, so all of dtprofile's host time shows).
5. the Lightning integration (``dtprofile.DTProfileCallback``) on one GPU, when
   Lightning is installed.
6. DDP over NCCL (2 processes, spawned) when there are >= 2 GPUs (over gloo with both
   ranks on the one GPU otherwise, plus one rank over NCCL, whose all-reduce is a local
   copy on NCCL's stream), with the overlap interference probe (``probe_every``: a step
   that defers the all-reduce to the end of backward, measuring compute alone), plus
   the no-sync check (``"warn"`` mode: DDP itself may synchronise; counted, not failed)
   and the NCCL kernel comparison.
7. FSDP2 (``fully_shard`` on every block and the root) over NCCL when there are >= 2
   GPUs: dtprofile's all-gather/reduce-scatter time against the NCCL kernels of the
   same steps, the exposed part (the compute stream's waits and the tail after
   backward), the no-sync count. One GPU cannot check it (NCCL needs a GPU per rank),
   so it is skipped there; the CPU dry run runs it over gloo.
8. the NVML telemetry (``run.telemetry``) and discovered hardware (``run.hardware``)
   of the plain run's summary.

Exit status 1 if a check that must hold failed (no-sync of the plain loop, a profiled
run raising); the comparisons are printed for a person to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _map_integrations() -> None:
    """``dtprofile.integrations`` is ``<repo>/integrations`` (pyproject's package-dir), which
    only an install maps. On a machine where dtprofile is not pip-installed, map it here; this
    runs again in every spawned rank (spawn re-runs this file's top level as __mp_main__)."""
    import importlib.abc
    import importlib.util

    class _IntegrationsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "dtprofile.integrations":
                return None
            return importlib.util.spec_from_file_location(
                name, ROOT / "integrations" / "__init__.py", submodule_search_locations=[str(ROOT / "integrations")]
            )

    sys.meta_path.append(_IntegrationsFinder())  # after PathFinder and any editable install's finder


_map_integrations()

import torch  # noqa: E402
from torch import nn  # noqa: E402

BATCH = 64
IMAGE = 64
CLASSES = 100
# --cpu-dry-run: every check on the CPU with a small input, so the script itself is
# tested here before it spends a GPU session's few minutes (tests/test_gpu.py runs it).
DRY = {"on": False}
#: The dry run's model is the same network a quarter as wide (0.7M parameters, not 11M):
#: every layer, block and FSDP unit is there, its steps take milliseconds on a CPU core.
WIDTH_DIVISOR = {"n": 1}
# A hung collective must not eat the GPU session: process groups time out after this, and
# a DDP/FSDP check whose ranks are still running after DDP_DEADLINE_S is killed.
PG_TIMEOUT_S = 120
DDP_DEADLINE_S = 240
#: The checks run seconds, not minutes: sample NVML often enough for a median.
NVML_INTERVAL_S = 0.1
#: ...but the overhead is measured at dtprofile's own default (read before main() changes it).
USER_NVML_INTERVAL: dict = {"s": None}
OUT: dict = {"path": None}  # results are written after every check, not only at the end


def _sync() -> None:
    if not DRY["on"]:
        torch.cuda.synchronize()


def _sync_debug(mode: str | int) -> None:
    if not DRY["on"]:
        torch.cuda.set_sync_debug_mode(mode)


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet_ish() -> nn.Module:
    widths = [w // WIDTH_DIVISOR["n"] for w in (64, 128, 256, 512)]
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES)]
    return nn.Sequential(*layers)


def batches(
    device: torch.device, n: int = 4, seed: int = 0, batch: int | None = None, image: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    batch, image = batch or BATCH, image or IMAGE
    return [
        (
            torch.randn(batch, 3, image, image, generator=g).to(device),
            torch.randint(0, CLASSES, (batch,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = resnet_ish().to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


# --------------------------------------------------------------------------- torch.profiler


def kernel_times_ms(prof: torch.profiler.profile, steps: int) -> dict:
    """Per-step CUDA kernel time from a torch.profiler trace: all, NCCL, the rest; and the
    device's period per step (first kernel's start to last kernel's end over all the
    steps, divided by their number), which, like CUDA events, counts the GPU's idle gaps."""
    from torch.autograd import DeviceType

    total = nccl = memcpy = 0.0
    n = annotations = 0
    first_us, last_us = float("inf"), float("-inf")
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        if getattr(evt, "is_user_annotation", False):
            # gpu_user_annotation: a record_function range ("nccl:all_reduce",
            # "Optimizer.step#SGD.step", "DistributedDataParallel.forward") projected onto the
            # GPU timeline. It spans kernels that are counted on their own (pytorch#130730).
            annotations += 1
            continue
        us = evt.time_range.elapsed_us()
        first_us, last_us = min(first_us, evt.time_range.start), max(last_us, evt.time_range.end)
        n += 1
        total += us
        name = evt.name.lower()
        if "nccl" in name:
            nccl += us
        elif name.startswith(("memcpy", "memset")):
            memcpy += us
    return {
        "kernel_ms": total / 1e3 / steps,
        "nccl_ms": nccl / 1e3 / steps,
        "compute_kernel_ms": (total - nccl) / 1e3 / steps,
        "memcpy_memset_ms": memcpy / 1e3 / steps,
        "kernel_events": n,
        "annotation_events_skipped": annotations,
        "device_period_ms": (last_us - first_us) / 1e3 / steps if n else None,
    }


def compare(summary: dict, kernels: dict) -> dict:
    per = summary.get("per_step_ms") or {}
    phases = [per.get(k) for k in ("forward", "backward", "optimizer")]
    dt_compute = sum(p for p in phases if p is not None) if all(p is not None for p in phases) else None
    out = {
        "dtprofile_fwd_bwd_opt_ms": dt_compute,
        "dtprofile_compute_ms": per.get("compute"),
        "dtprofile_comm_total_ms": per.get("comm_total"),
        "dtprofile_step_ms": per.get("step"),
        **kernels,
    }
    if dt_compute:
        out["compute_diff_ms"] = dt_compute - kernels["compute_kernel_ms"]
        out["compute_ratio"] = dt_compute / kernels["compute_kernel_ms"] if kernels["compute_kernel_ms"] else None
    # Like for like: CUDA events time stream intervals, gaps between kernels included,
    # which a kernel sum leaves out and the device's period per step keeps.
    if per.get("step") and kernels.get("device_period_ms"):
        out["step_vs_device_period_ratio"] = per["step"] / kernels["device_period_ms"]
    if per.get("comm_total") is not None:
        out["comm_diff_ms"] = per["comm_total"] - kernels["nccl_ms"]
    return out


# --------------------------------------------------------------------------- checks


def check_no_sync(device: torch.device, steps: int, logdir: str) -> tuple[dict, dict]:
    import dtprofile

    model, opt = make(device)
    data = batches(device)
    warm = 5
    prof = dtprofile.profile(model, opt, warmup_steps=warm, every_n_steps=max(5, steps // 4), logdir=logdir)
    result: dict = {"ok": False, "error": None, "steps": steps}
    prof.start()
    engine = prof._engine  # (what the steps cost the host: marks taken, steps in the steady lane)
    marks = [0]
    mark = engine.clock.mark

    def counted_mark():
        marks[0] += 1
        return mark()

    try:
        for i in range(warm):
            train_step(model, opt, data[i % len(data)])
        _sync()
        _sync_debug("error")
        engine.clock.mark = counted_mark
        lane_before = engine.steps.lane.steps_taken
        for i in range(steps):
            train_step(model, opt, data[i % len(data)])
        result["ok"] = True
        result["marks_per_step"] = marks[0] / steps
        result["steady_lane_steps"] = engine.steps.lane.steps_taken - lane_before
    except Exception as exc:  # a synchronising call inside a profiled step
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=6)
    finally:
        _sync_debug(0)
        engine.clock.mark = mark
    summary = prof.stop().to_dict()
    result["parts_disabled"] = summary.get("parts_disabled")
    result["steps_profiled"] = summary.get("steps_profiled")
    # A synchronising call inside one of dtprofile's hooks does not reach the loop: the
    # guard disables that part and warns. That is a failure of this check too; the sink,
    # which writes from its own thread, is reported but is not.
    in_step = {k: v for k, v in (result["parts_disabled"] or {}).items() if k != "sink"}
    if in_step:
        result["ok"] = False
        result["error"] = result["error"] or f"parts disabled: {in_step}"
    return result, summary


def check_vs_torch_profiler(device: torch.device, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import dtprofile

    model, opt = make(device)
    data = batches(device)
    warm = 5
    prof = dtprofile.profile(model, opt, warmup_steps=warm, every_n_steps=10_000)
    prof.start()
    for i in range(warm):
        train_step(model, opt, data[i % len(data)])
    _sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for i in range(steps):
            train_step(model, opt, data[i % len(data)])
        _sync()
    summary = prof.stop().to_dict()
    return compare(summary, kernel_times_ms(tp, steps))


def check_data_wait(device: torch.device, steps: int) -> dict:
    """A loader that sleeps a quarter of the GPU's step, then twice it, with no sync in the loop.

    A quarter: the host (sleep + launches) keeps ahead of the GPU, which never idles, so
    the data wait should be ~0 although next() blocks every step. Twice: the GPU idles
    for most of the sleep, and that is the data wait (capped by the time in next()).
    On the CPU (dry run) both are simply the sleep.
    """
    import dtprofile

    model, opt = make(device)
    data = batches(device)
    for i in range(5):
        train_step(model, opt, data[i % len(data)])
    _sync()
    t0 = time.perf_counter()
    for i in range(10):
        train_step(model, opt, data[i % len(data)])
    _sync()
    gpu_step_ms = (time.perf_counter() - t0) / 10 * 1e3
    out: dict = {"step_ms_unprofiled": gpu_step_ms}
    for label, factor in (("sleep_quarter_step", 0.25), ("sleep_twice_step", 2.0)):
        sleep_s = gpu_step_ms * factor / 1e3

        def loader(n: int = steps + 5):
            for i in range(n):
                time.sleep(sleep_s)
                yield data[i % len(data)]

        prof = dtprofile.profile(model, opt, warmup_steps=5, every_n_steps=10_000)
        prof.start()
        for batch in prof.loader(loader()):
            train_step(model, opt, batch)
        per = prof.stop().to_dict()["per_step_ms"]
        out[label] = {"sleep_ms": sleep_s * 1e3, "data_wait_ms": per.get("data_wait"), "step_ms": per.get("step")}
    return out


def check_overhead(
    device: torch.device, steps: int, rounds: int = 4, batch: int | None = None, image: int | None = None
) -> dict:
    """Step time with and without dtprofile: ``rounds`` back-to-back pairs of blocks of ``steps``.

    NVML samples at its default interval here (a user's setting), not the checks' faster one.
    A small ``batch``/``image`` makes the loop host-bound (the GPU waits for launches), where
    every microsecond dtprofile's hooks add on the host shows in the step time.
    """
    import dtprofile
    import dtprofile.nvml

    model, opt = make(device)
    data = batches(device, batch=batch, image=image)
    fast_interval = dtprofile.nvml.DEFAULT_INTERVAL_S
    dtprofile.nvml.DEFAULT_INTERVAL_S = USER_NVML_INTERVAL["s"] or fast_interval
    try:
        return _overhead_blocks(model, opt, data, steps, rounds) | {
            "batch": len(data[0][1]),
            "image": data[0][0].shape[-1],
        }
    finally:
        dtprofile.nvml.DEFAULT_INTERVAL_S = fast_interval


def _overhead_blocks(model: nn.Module, opt: torch.optim.Optimizer, data: list, steps: int, rounds: int) -> dict:
    import dtprofile

    for i in range(10):
        train_step(model, opt, data[i % len(data)])

    start_ms: list[float] = []
    stop_ms: list[float] = []

    def block(profiled: bool) -> float:
        prof = dtprofile.profile(model, opt, warmup_steps=0, every_n_steps=10_000) if profiled else None
        if prof is not None:
            t0 = time.perf_counter()
            prof.start()
            start_ms.append((time.perf_counter() - t0) * 1e3)
        # Steady state, as in a long run: start()'s one-off work (the NVML thread's first
        # samples, hardware discovery) is over before the timed steps.
        for i in range(steps):
            train_step(model, opt, data[i % len(data)])
        _sync()
        t0 = time.perf_counter()
        for i in range(steps):
            train_step(model, opt, data[i % len(data)])
        _sync()
        elapsed = (time.perf_counter() - t0) / steps * 1e3
        if prof is not None:
            t0 = time.perf_counter()
            prof.stop()
            stop_ms.append((time.perf_counter() - t0) * 1e3)
        return elapsed

    plain, profiled = [], []
    for r in range(rounds):  # interleaved, order alternating: drift in clocks and load hits both alike
        pair = {True: 0.0, False: 0.0}
        for is_profiled in (True, False) if r % 2 else (False, True):
            pair[is_profiled] = block(is_profiled)
        plain.append(pair[False])
        profiled.append(pair[True])
    a, b = statistics.median(plain), statistics.median(profiled)
    # Each round's pair ran back to back: the median of their differences is less exposed
    # to the block-to-block drift of a shared machine than the difference of medians.
    diffs = sorted(p - q for p, q in zip(profiled, plain, strict=False))
    paired = statistics.median(diffs)
    return {
        "plain_step_ms": a,
        "profiled_step_ms": b,
        "overhead_ms": b - a,
        "overhead_fraction": (b - a) / a,
        "overhead_ms_paired": paired,
        "overhead_fraction_paired": paired / a,
        "overhead_ms_paired_quartiles": [diffs[len(diffs) // 4], diffs[(3 * len(diffs)) // 4]],
        "start_ms": statistics.median(start_ms),
        "stop_ms": statistics.median(stop_ms),
        "plain_blocks_ms": plain,
        "profiled_blocks_ms": profiled,
    }


def check_lightning(steps: int, logdir: str) -> dict:
    try:
        import lightning.pytorch as pl  # type: ignore[import-not-found]
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[import-not-found, no-redef]
        except ImportError:
            return {"skipped": "Lightning not installed"}
    import dtprofile

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = resnet_ish().to(memory_format=torch.channels_last)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    x = torch.randn(BATCH * 4, 3, IMAGE, IMAGE)
    y = torch.randint(0, CLASSES, (BATCH * 4,))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=BATCH, pin_memory=not DRY["on"]
    )
    callback = dtprofile.DTProfileCallback(warmup_steps=5, logdir=logdir)
    trainer = pl.Trainer(
        accelerator="cpu" if DRY["on"] else "gpu",
        devices=1,
        max_steps=steps + 5,
        max_epochs=-1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), loader)
    summary = callback.report().to_dict()
    return {
        "steps_profiled": summary.get("steps_profiled"),
        "per_step_ms": summary.get("per_step_ms"),
        "data_wait_source": summary.get("data_wait_source"),
        "parts_disabled": summary.get("parts_disabled"),
        "advice": [f.get("id") for f in summary.get("advice", [])],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2: each residual block, the stem and the head its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()) and not isinstance(layer, nn.BatchNorm2d):
            fully_shard(layer)
    fully_shard(model)
    return model


def _is_sync_warning(message: str) -> bool:
    """A synchronising call reported by ``set_sync_debug_mode("warn")``, not the notice that
    the mode itself is a prototype ("Synchronization debug mode is a prototype feature")."""
    text = message.lower()
    return "synchroniz" in text and "debug mode is a prototype" not in text


def _ddp_worker(
    rank: int,
    world: int,
    port: int,
    steps: int,
    out_dir: str,
    backend: str,
    dry: bool = False,
    sharded: bool = False,
    size: tuple[int, int] | None = None,
) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import dtprofile
    import dtprofile.nvml

    dtprofile.nvml.DEFAULT_INTERVAL_S = NVML_INTERVAL_S  # a spawned process: set again
    if world == 1:  # one GPU: time its one-rank all-reduces, to run the hook's code on it
        from dtprofile.capture.comm import CommRecorder

        CommRecorder.time_one_rank = True
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    # Both ranks on this machine: keep gloo's and NCCL's sockets on loopback (a sandbox's
    # hostname may resolve to an interface that leads nowhere).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    _dry_run(dry)
    global BATCH, IMAGE
    BATCH, IMAGE = size or (BATCH, IMAGE)  # the parent's --batch/--image (spawn re-imports this file)
    # NCCL needs a GPU per rank; gloo (one GPU) puts both ranks on device 0.
    index = rank if backend == "nccl" else 0
    if dry:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    from datetime import timedelta

    pg_timeout = timedelta(seconds=PG_TIMEOUT_S)  # defaults: NCCL 10 min, gloo 30 min
    if backend == "nccl":
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=pg_timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=pg_timeout)
    result: dict = {"rank": rank, "batch": BATCH, "image": IMAGE}
    try:
        if sharded:
            torch.manual_seed(0)
            ddp = _shard(resnet_ish().to(device))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        else:
            model, opt = make(device)
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if dry else [index])
        data = batches(device, seed=rank)  # each rank its own batches, as a DistributedSampler gives
        warm = 5
        prof = dtprofile.profile(ddp, opt, warmup_steps=warm, every_n_steps=10, probe_every=0 if sharded else 10)
        prof.start()
        for i in range(warm):
            train_step(ddp, opt, data[i % len(data)])
        _sync()
        # Gloo on CUDA tensors synchronises its own streams in its worker thread, by design;
        # c10 logs each of those (not through Python's warnings) whenever the debug mode is
        # on, so the no-sync check is only meaningful, and only run, under NCCL.
        check_sync = backend == "nccl" or dry
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if check_sync:
                _sync_debug("warn")
            try:
                for i in range(steps):
                    train_step(ddp, opt, data[i % len(data)])
            finally:
                _sync_debug(0)
        if check_sync:
            syncs = [str(w.message) for w in caught if _is_sync_warning(str(w.message))]
            result["sync_warnings"] = len(syncs)
            result["sync_warning_examples"] = sorted({m[:160] for m in syncs})[:3]
        else:
            result["sync_warnings"] = "not checked: gloo synchronises CUDA streams itself"
        k = min(20, steps)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for i in range(k):
                train_step(ddp, opt, data[i % len(data)])
            _sync()
        result["steady_lane_steps"] = prof._engine.steps.lane.steps_taken  # (DDP's own all-reduce: most steps)
        summary = prof.stop().to_dict()
        result["compare"] = compare(summary, kernel_times_ms(tp, k))
        result["parts_disabled"] = summary.get("parts_disabled")
        if rank == 0:
            result["summary"] = summary
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=8)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _ddp_ranks(rank: int, runs: list[tuple], dry: bool, size: tuple[int, int]) -> None:
    """This process's rank of each of ``runs`` (world, port, steps, out_dir, backend,
    sharded) it takes part in (those of more than ``rank`` ranks), one after another."""
    for world, port, steps, out_dir, backend, sharded in runs:
        if rank < world:
            _ddp_worker(rank, world, port, steps, out_dir, backend, dry, sharded, size)


def check_ddp(steps: int, backend: str = "nccl", sharded: bool = False, world: int = 2) -> dict:
    """One distributed check in processes spawned for it."""
    return ddp_checks([(steps, backend, sharded, world)])[0]


def ddp_checks(checks: list[tuple[int, str, bool, int]]) -> list[dict]:
    """Each of ``checks`` (check_ddp's arguments, all four), one after another in the same
    spawned processes (as many as the largest world; a check of fewer ranks runs on the
    first ones): their interpreters, torch and dtprofile start once for all of them. Each
    check has its own process group, port and results; the deadline is DDP_DEADLINE_S a
    check."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, (steps, backend, sharded, world) in enumerate(checks):
            out_dir = os.path.join(tmp, str(i))
            os.mkdir(out_dir)
            runs.append((world, _free_port(), steps, out_dir, backend, sharded))
        ctx = mp.start_processes(
            _ddp_ranks,
            args=(runs, DRY["on"], (BATCH, IMAGE)),
            nprocs=max(run[0] for run in runs),
            join=False,
            start_method="spawn",
        )
        limit_s = DDP_DEADLINE_S * len(runs)
        deadline = time.monotonic() + limit_s
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks still running after {limit_s} s; killed")
        return [
            _ddp_result([json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)], backend)
            for world, _, _, out_dir, backend, _ in runs
        ]


def _ddp_result(ranks: list[dict], backend: str) -> dict:
    """One distributed check's result from its ranks' reports."""
    world = len(ranks)
    summary = ranks[0].pop("summary", None) or {}
    errors = {r["rank"]: r.get("error") for r in ranks if r.get("error")}
    errors.update(
        {
            r["rank"]: f"parts disabled: {r['parts_disabled']}"
            for r in ranks
            if r.get("parts_disabled") and not r.get("error")
        }
    )
    return {
        "backend": backend,
        "world_size": world,
        "batch": ranks[0].get("batch"),
        "image": ranks[0].get("image"),
        "errors": errors,
        "sync_warnings_per_rank": [r.get("sync_warnings") for r in ranks],
        "sync_warning_examples": ranks[0].get("sync_warning_examples"),
        "steady_lane_steps_per_rank": [r.get("steady_lane_steps") for r in ranks],
        "compare_per_rank": [r.get("compare") for r in ranks],
        "per_step_ms": summary.get("per_step_ms"),
        "busbw_GBps": summary.get("busbw_GBps"),
        "probe": summary.get("probe"),
        "comm_source": summary.get("comm_source"),
        "fsdp": (summary.get("run") or {}).get("fsdp"),
        "projection_bandwidth_source": (summary.get("projection") or {}).get("bandwidth_source"),
        "telemetry_ranks": ((summary.get("run") or {}).get("telemetry") or {}).get("ranks"),
        "advice": [f.get("id") for f in summary.get("advice", [])],
        **(
            {
                "note": "gloo completes its futures from the default (training) stream, so each bucket's end "
                "mark waits for the compute queued before it: comm_total is an upper bound here"
            }
            if backend == "gloo" and not DRY["on"]
            else {}
        ),
    }


# --------------------------------------------------------------------------- main


def _run(name: str, fn, results: dict, *args) -> object:
    t0 = time.monotonic()
    try:
        value = fn(*args)
    except Exception as exc:
        value = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    results[name] = value if not isinstance(value, tuple) else value[0]
    print(f"\n== {name} ({time.monotonic() - t0:.1f} s)", flush=True)
    print(json.dumps(results[name], indent=2, default=str), flush=True)
    if OUT["path"]:  # what ran so far survives a later hang or kill
        Path(OUT["path"]).write_text(json.dumps(results, indent=2, default=str))
    return value


def _dry_run(on: bool) -> None:
    global BATCH, IMAGE
    DRY["on"] = on
    WIDTH_DIVISOR["n"] = 4 if on else 1
    if on:
        BATCH, IMAGE = 8, 16
        torch.set_num_threads(1)


def _report_plain_run(value: object, results: dict) -> None:
    """The plain run's telemetry, hardware, memory and advice, from its summary."""
    summary = value[1] if isinstance(value, tuple) else {}
    run = summary.get("run") or {}
    results["telemetry"] = run.get("telemetry")
    results["hardware"] = run.get("hardware")
    results["memory"] = run.get("memory")
    results["plain_summary"] = {k: summary.get(k) for k in ("per_step_ms", "ratios", "projection", "recommendations")}
    results["plain_advice"] = [f.get("id") for f in summary.get("advice", [])]
    print("\n== telemetry (run.telemetry)\n" + json.dumps(results["telemetry"], indent=2))
    print("\n== hardware (run.hardware)\n" + json.dumps(results["hardware"], indent=2))
    print(
        "\n== memory (run.memory) and max_batch_size: "
        + json.dumps(
            {
                "memory": results["memory"],
                "max_batch_size": (summary.get("recommendations") or {}).get("max_batch_size"),
            }
        )
    )


def _ddp_arguments(steps: int, backend: str = "nccl", sharded: bool = False, world: int = 2) -> tuple:
    """check_ddp's arguments, all four."""
    return steps, backend, sharded, world


def _result_of(value: object) -> object:
    """A result computed earlier, or the exception that computing it raised."""
    if isinstance(value, BaseException):
        raise value
    return value


def _skip(name: str, why: str, wanted: set[str], results: dict) -> None:
    """A check asked for that this machine cannot run: said so in the results, not left out."""
    if name in wanted:
        results[name] = {"skipped": why}
        print(f"\n== {name}: skipped, {why}")


#: Every check, in the order they run (``--checks`` picks some; the DDP ones run only
#: where the GPU count allows, see the module docstring).
CHECKS = (
    "no_sync_plain",
    "data_wait_gpu_ahead",
    "vs_torch_profiler",
    "overhead",
    "overhead_host_bound",
    "lightning",
    "ddp_nccl",
    "ddp_gloo_cuda",
    "ddp_nccl_1rank",
    "fsdp2",
)


def _check_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {unknown or text!r}; accepted: {', '.join(CHECKS)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    global BATCH, IMAGE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="profiled steps per check (default 40)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--checks",
        type=_check_names,
        default=list(CHECKS),
        help=f"comma-separated checks to run (default all): {', '.join(CHECKS)}",
    )
    parser.add_argument("--batch", type=_positive, help=f"batch size of the model's steps (default {BATCH})")
    parser.add_argument(
        "--image",
        type=_positive,
        help=f"image side in pixels (default {IMAGE}); a larger batch or "
        "image makes the loop compute-bound, where the kernel sum and the step agree",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every check on the CPU with a small input and a model a quarter as wide "
        "(tests the script, measures nothing)",
    )
    args = parser.parse_args(argv)
    OUT["path"] = args.out
    _dry_run(args.cpu_dry_run)
    BATCH, IMAGE = args.batch or BATCH, args.image or IMAGE
    wanted = set(args.checks)
    if not DRY["on"] and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    steps = max(5, args.steps)
    torch.backends.cudnn.benchmark = True
    import dtprofile.nvml

    USER_NVML_INTERVAL["s"] = dtprofile.nvml.DEFAULT_INTERVAL_S
    dtprofile.nvml.DEFAULT_INTERVAL_S = NVML_INTERVAL_S
    device = torch.device("cpu") if DRY["on"] else torch.device("cuda", 0)
    gpus = 1 if DRY["on"] else torch.cuda.device_count()
    results: dict = {
        "device": "cpu (dry run)" if DRY["on"] else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "gpus": gpus,
        "steps": steps,
        "batch": BATCH,
        "image": IMAGE,
        "checks": args.checks,
    }

    def run_check(name: str, fn: Callable, *args: object) -> None:
        if name in wanted:
            _run(name, fn, results, *args)

    print(f"dtprofile GPU check on {results['device']} ({results['gpus']} GPU(s)), torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as logdir:
        if "no_sync_plain" in wanted:
            _report_plain_run(_run("no_sync_plain", check_no_sync, results, device, steps, logdir), results)
        run_check("data_wait_gpu_ahead", check_data_wait, device, min(steps, 20))
        run_check("vs_torch_profiler", check_vs_torch_profiler, device, min(steps, 20))
        # Short blocks, many rounds: a step's time drifts by 10-20% between blocks on a
        # shared host, so the figure is the median of back-to-back pairs. A dry run only
        # exercises the code: one round of a few steps.
        rounds = (3, 1) if DRY["on"] else (25, 16)
        run_check("overhead", check_overhead, device, *rounds)
        run_check("overhead_host_bound", check_overhead, device, *rounds, 4, 32)
        run_check("lightning", check_lightning, steps, os.path.join(logdir, "pl"))
        if gpus >= 2:
            run_check("ddp_nccl", check_ddp, steps)
            for name in ("ddp_gloo_cuda", "ddp_nccl_1rank"):
                _skip(name, "runs where there is one GPU (ddp_nccl runs here)", wanted, results)
        else:
            _skip("ddp_nccl", "needs >= 2 GPUs (ddp_gloo_cuda and ddp_nccl_1rank run instead)", wanted, results)
        # Each check of its own processes: check_ddp's arguments.
        distributed: dict[str, tuple] = {}
        if gpus < 2:
            # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors, so the CUDA-event
            # communication path, the probe and the no-sync check still run (ddp_gloo_cuda).
            distributed["ddp_gloo_cuda"] = (min(steps, 20), "gloo")
            # One rank over NCCL: the all-reduce is a local copy, but it runs on NCCL's
            # stream, so the hook's CUDA events and the no-sync check see NCCL's real path.
            distributed["ddp_nccl_1rank"] = (min(steps, 20), "gloo" if DRY["on"] else "nccl", False, 1)
        if gpus >= 2 or DRY["on"]:
            distributed["fsdp2"] = (min(steps, 20), "gloo" if DRY["on"] else "nccl", True)
        todo = {name: check for name, check in distributed.items() if name in wanted}
        if DRY["on"] and len(todo) > 1:
            # The dry run spawns the ranks once for all these checks (each one's processes
            # would start an interpreter, torch and dtprofile again; the checks are short).
            # The one-rank check goes last: it leaves one-rank timing switched on.
            order = sorted(todo, key=lambda name: _ddp_arguments(*todo[name])[3] == 1)
            t0 = time.monotonic()
            try:
                shared: dict[str, object] = dict(
                    zip(order, ddp_checks([_ddp_arguments(*todo[name]) for name in order]), strict=True)
                )
            except Exception as exc:
                shared = {name: exc for name in order}
            print(f"\n== {', '.join(order)}: their ranks spawned once ({time.monotonic() - t0:.1f} s)", flush=True)
            for name in todo:
                run_check(name, _result_of, shared[name])
        else:
            for name, check in todo.items():
                run_check(name, check_ddp, *check)
        if not (gpus >= 2 or DRY["on"]):
            _skip("fsdp2", "needs >= 2 GPUs (NCCL: one GPU per rank)", wanted, results)
    failed = []
    if "no_sync_plain" in wanted and not (results.get("no_sync_plain") or {}).get("ok"):
        failed.append("no_sync_plain")
    for name in CHECKS[1:]:
        entry = results.get(name) or {}
        if entry.get("error") or entry.get("errors"):
            failed.append(name)
    results["failed"] = failed
    print(f"\n== result: {'FAILED: ' + ', '.join(failed) if failed else 'all checks ran'}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
