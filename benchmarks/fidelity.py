"""How close dtprofile's figures are to ground truth, on 2-process CPU (gloo) DDP runs.

    python benchmarks/fidelity.py            # full mode (a few minutes)
    python benchmarks/fidelity.py --quick    # a short run (the test suite runs this)

Every figure dtprofile reports is set against a reference measured another way:

1. *Data wait* against a dataset that sleeps a known time per batch (with
   ``prof.loader(...)``, and without it: the gap between a step's end and the next
   forward).
2. *Exposed communication* against its true cost: the step-time difference to the same
   run with gradient synchronisation switched off (``ddp.no_sync()`` on every step).
   On loopback gloo shares the 2 cores with compute, so communication that backward
   hides still slows backward: the wait after backward (dtprofile's default figure) is
   a lower bound; with ``probe_every=4`` dtprofile also measures compute alone, and
   reports ``comm_exposed + comm_interference``. Both are shown beside the true cost.
3. *Total communication* against PyTorch's own DDP statistics
   (``_get_ddp_logging_data()`` at sample rate 1, per-iteration values recovered from
   the running averages) and against a ``torch.profiler`` trace of the same steps (the
   ``gloo:all_reduce`` events per step: the union of their intervals, which is what
   dtprofile reports, and the plain sum of their durations, which counts the buckets
   gloo reduces in parallel twice). The probe run (as dtprofile runs by default, with no
   communication hook) takes its total from the probe steps, communication alone: set
   against DDP's figure for the overlapped steps of the sync run.
4. *Projection*: the projected 1-process step (``summary["projection"]``, G=1) from
   the 2-process run against a measured 1-process run with the same per-process batch
   (weak scaling).
5. *Advice*: a data-bound run (``num_workers=0``, sleepy dataset); its
   ``recommendations["num_workers"]`` is applied and the run repeated; the predicted
   speedup (the advice's ``expected_gain``) against the measured one, and the data wait
   that remains.
6. *Compute*: T_C of the sync run (the wait-based residual) and of the probe run (the
   probe steps' compute alone) against the no-sync segments' step (all compute).
7. *A compute-bound run* (heavy convolutions, 42 KB of gradients, dtprofile's defaults):
   R_O with its range, against the ideal of 0, and its parts (a table of its own).

Segments of the 2-process runs alternate (sync, probe, no-sync) over several rounds,
so that load from elsewhere hits them alike; figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    CASES,
    DDP_KEYS,
    Deadline,
    SleepyBatches,
    comm_heavy,
    ddp_steady_medians,
    describe_machine,
    fmt,
    launch,
    machine,
    median,
    mlp,
    pct,
    rel_err,
    table,
    union_ms,
)
from torch import nn  # noqa: E402

QUICK = dict(
    rounds=1, comm_steps=12, data_steps=14, trace_steps=6, single_steps=12, advice_steps=24, warmup=3, bound_steps=16
)
FULL = dict(
    rounds=4, comm_steps=30, data_steps=40, trace_steps=12, single_steps=40, advice_steps=60, warmup=4, bound_steps=60
)

DATA_SLEEP_MS = 20.0
ADVICE_SLEEP_MS = 12.0
COMM_BATCH = 8
SMALL = dict(width=64, depth=2, inp=32)

ROWS = (
    "data wait (prof.loader)",
    "data wait (gap, no prof.loader)",
    "exposed comm, wait-based",
    "exposed comm, probe-based (probe_every=4)",
    "comm total vs DDP avg_backward_comm_time",
    "comm total vs torch.profiler gloo:all_reduce union",
    "comm total vs torch.profiler gloo:all_reduce sum",
    "projected 1-process step (sync run)",
    "projected 1-process step (probe run)",
    "advice: speedup from num_workers",
    "advice: data wait after applying it",
    "comm total from probe steps vs DDP avg_backward_comm_time",
    "compute T_C, wait-based (sync run)",
    "compute T_C, probe-based (probe_every=4)",
)


def _opts(warmup: int, **kw: Any) -> dict:
    return dict(warmup_steps=warmup, **kw)


# --------------------------------------------------------------------------- 1. data wait


def _data_wait(rank: int, world: int, cfg: dict, use_loader: bool) -> dict:
    import dtprofile

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(mlp(**SMALL))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    batch, steps = 8, cfg["data_steps"]
    data = SleepyBatches(steps * batch, (SMALL["inp"],), 10, DATA_SLEEP_MS, batch)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, num_workers=0)
    with dtprofile.profile(ddp, opt, **_opts(cfg["warmup"])) as prof:
        for x, y in prof.loader(loader) if use_loader else loader:
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    s = prof.report().to_dict()
    return {"data_wait": s["per_step_ms"]["data_wait"], "source": s["data_wait_source"]}


# --------------------------------------------------------------------------- 2-4. communication


def _comm_segment(
    kind: str,
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    warmup: int,
    ddp_avgs: list | None = None,
    trace: bool = False,
) -> dict:
    """One profiled segment: kind is "sync", "probe" or "nosync"."""
    import dtprofile

    opts = _opts(warmup, probe_every=4 if kind == "probe" else 0)
    walls = []
    tprof = None
    if trace:
        from torch.profiler import ProfilerActivity, profile

        tprof = profile(activities=[ProfilerActivity.CPU])
    with dtprofile.profile(ddp, opt, **opts) as prof:
        if tprof is not None:
            tprof.__enter__()
        t_last = time.perf_counter()
        for i in range(steps):
            rf = (
                torch.profiler.record_function("bench_step")
                if tprof is not None and i >= warmup
                else contextlib.nullcontext()
            )
            with rf:
                ctx = ddp.no_sync() if kind == "nosync" else contextlib.nullcontext()
                with ctx:
                    nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
            now = time.perf_counter()
            walls.append((now - t_last) * 1e3)
            t_last = now
            if ddp_avgs is not None:
                d = ddp._get_ddp_logging_data()
                ddp_avgs.append((d.get("iteration", 0), {k: d.get(k) for k in DDP_KEYS}))
        if tprof is not None:
            tprof.__exit__(None, None, None)
    s = prof.report().to_dict()
    out = {
        "wall_ms": statistics.median(walls[warmup:]),
        "per_step": s["per_step_ms"],
        "probe": s.get("probe"),
        "projection": s.get("projection"),
        "grad_bytes": s.get("grad_bytes"),
    }
    if tprof is not None:
        out["trace"] = _trace_comm(tprof)
    return out


def _trace_comm(tprof: Any) -> dict:
    """Per step of the trace: union and sum of the gloo all-reduce intervals (ms), medians."""
    steps, comm, names = [], [], set()
    for e in tprof.events():
        name = e.name
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3
        if name == "bench_step":
            steps.append((start, end))
        low = name.lower()
        if ("allreduce" in low or "all_reduce" in low) and ("gloo" in low or "c10d" in low):
            names.add(name)
            comm.append((name, start, end))
    # gloo:all_reduce spans the reduction on gloo's worker thread; c10d::allreduce_ only
    # the enqueue on the caller's thread. Use the former when the trace has it.
    use = "gloo:all_reduce" if "gloo:all_reduce" in names else None
    spans = [(s, e) for n, s, e in comm if use is None or n == use]
    unions, sums = [], []
    for s0, s1 in steps:
        mine = [(s, e) for s, e in spans if s0 <= s < s1]
        if mine:
            unions.append(union_ms(mine))
            sums.append(sum(e - s for s, e in mine))
    return {"union_ms": median(unions), "sum_ms": median(sums), "steps": len(unions), "event": use or sorted(names)}


def fidelity_worker(rank: int, world: int, cfg: dict) -> dict:
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    out["data_loader"] = _data_wait(rank, world, cfg, use_loader=True)
    out["data_gap"] = _data_wait(rank, world, cfg, use_loader=False)

    # Two DDP instances of the same model: one synchronises (its logging at sample rate 1
    # gives DDP's own timings), the other runs every step under no_sync().
    torch.manual_seed(0)
    nets = {k: comm_heavy() for k in ("sync", "nosync")}
    nets["nosync"].load_state_dict(nets["sync"].state_dict())
    ddps = {k: nn.parallel.DistributedDataParallel(v) for k, v in nets.items()}
    ddps["sync"]._set_ddp_runtime_logging_sample_rate(1)
    opts = {k: torch.optim.SGD(v.parameters(), lr=1e-3) for k, v in ddps.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(COMM_BATCH, 1024, generator=g)
    y = torch.randint(0, 1024, (COMM_BATCH,), generator=g)
    segs: dict[str, list] = {"sync": [], "probe": [], "nosync": []}
    ddp_avgs: list = []
    steps, warmup = cfg["comm_steps"], cfg["warmup"]
    for kind in ("sync", "nosync"):  # warm-up, not used
        _comm_segment(kind, ddps[kind], opts[kind], x, y, warmup + 2, warmup)
    for r in range(cfg["rounds"]):
        order = ("sync", "probe", "nosync")[r % 3 :] + ("sync", "probe", "nosync")[: r % 3]
        for kind in order:
            key = "nosync" if kind == "nosync" else "sync"
            segs[kind].append(
                _comm_segment(
                    kind, ddps[key], opts[key], x, y, steps, warmup, ddp_avgs=ddp_avgs if kind == "sync" else None
                )
            )
    out["segments"] = segs
    out["ddp_stats"] = ddp_steady_medians(ddp_avgs, skip=warmup)
    out["traced"] = _comm_segment(
        "sync", ddps["sync"], opts["sync"], x, y, cfg["trace_steps"] + warmup, warmup, trace=True
    )
    return out


def single_worker(rank: int, world: int, cfg: dict) -> dict:
    """The same model and per-process batch on one process, no profiler: wall step (ms)."""
    torch.manual_seed(0)
    model = comm_heavy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(COMM_BATCH, 1024, generator=g)
    y = torch.randint(0, 1024, (COMM_BATCH,), generator=g)
    walls = []
    t_last = time.perf_counter()
    for _ in range(cfg["single_steps"] + cfg["warmup"]):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        walls.append((now - t_last) * 1e3)
        t_last = now
    return {"wall_ms": statistics.median(walls[cfg["warmup"] :])}


# --------------------------------------------------------------------------- 5. advice


def _advice_run(rank: int, cfg: dict, num_workers: int) -> dict:
    import dtprofile

    torch.manual_seed(0)
    case = CASES["5ms"]
    ddp = nn.parallel.DistributedDataParallel(mlp(**case))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    batch, steps = case["batch"], cfg["advice_steps"]
    data = SleepyBatches(steps * batch, (case["inp"],), 10, ADVICE_SLEEP_MS, batch)
    kw = dict(num_workers=num_workers, persistent_workers=True) if num_workers else {}
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, **kw)
    walls = []
    warmup = cfg["warmup"] + 2  # worker start-up
    with dtprofile.profile(ddp, opt, **_opts(warmup)) as prof:
        t_last = time.perf_counter()
        for x, y in prof.loader(loader):
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            walls.append((now - t_last) * 1e3)
            t_last = now
    s = prof.report().to_dict()
    finding = next((a for a in s.get("advice", []) if a.get("id") == "data_bound"), None)
    return {
        "wall_ms": statistics.median(walls[warmup:]),
        "per_step": s["per_step_ms"],
        "recommended": (s.get("recommendations") or {}).get("num_workers"),
        "needed": (s.get("recommendations") or {}).get("num_workers_needed"),
        "gain": finding.get("expected_gain") if finding else None,
        "action": finding.get("action") if finding else None,
    }


def advice_worker(rank: int, world: int, cfg: dict) -> dict:
    warnings.filterwarnings("ignore")
    before = _advice_run(rank, cfg, 0)
    choice = [before["recommended"]]
    dist.broadcast_object_list(choice, src=0)  # every rank applies rank 0's advice
    workers = int(choice[0] or 0)
    after = _advice_run(rank, cfg, workers) if workers > 0 else None
    return {"before": before, "after": after, "workers": workers}


# --------------------------------------------------------------------------- 7. compute-bound


def conv_net() -> nn.Module:
    """Heavy convolutions, few parameters (the tests' ``conv``): 42 KB of gradients."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def compute_bound_worker(rank: int, world: int, cfg: dict) -> dict:
    """The compute-bound run under dtprofile's defaults (probe steps, no hook)."""
    import dtprofile

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(conv_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 3, 48, 48, generator=g), torch.randint(0, 10, (32,), generator=g)
    with dtprofile.profile(ddp, opt, **_opts(cfg["warmup"])) as prof:
        for _ in range(cfg["bound_steps"]):
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    s = prof.report().to_dict()
    unc = (s.get("uncertainty") or {}).get("ratios") or {}
    return {
        "per_step": s["per_step_ms"],
        "R_O": s["ratios"].get("R_O"),
        "R_O_range": unc.get("R_O"),
        "probe": s.get("probe"),
        "grad_bytes": s.get("grad_bytes"),
        "advice": [f"{f['id']} ({f.get('severity')})" for f in s.get("advice", [])[:2]],
    }


# --------------------------------------------------------------------------- main


def _predicted_speedup(gain: str | None) -> float | None:
    m = re.search(r"\(([\d.]+)x throughput\)", gain or "")
    return float(m.group(1)) if m else None


def _proj_g1(projection: dict | None) -> float | None:
    if not projection:
        return None
    gpus, step = projection.get("gpus") or [], projection.get("step_ms") or []
    return step[gpus.index(1)] if 1 in gpus and gpus.index(1) < len(step) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (< ~40 s on 2 cores)")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    budget = Deadline(180 if args.quick else 1200)
    print(f"dtprofile fidelity benchmark ({'quick' if args.quick else 'full'} mode): 2 gloo ranks on 127.0.0.1")
    print(describe_machine(machine()))
    t0 = time.monotonic()

    fid = launch(fidelity_worker, 2, p, budget.left(900))
    single = launch(single_worker, 1, p, budget.left(300))[0]
    adv = launch(advice_worker, 2, p, budget.left(300))
    bound = launch(compute_bound_worker, 2, p, budget.left(300))

    r0 = fid[0]
    segs = {k: [s for r in fid for s in r["segments"][k]] for k in ("sync", "probe", "nosync")}
    # Per rank and round, then the median: the ranks are in lock-step.
    wall = {k: median(s["wall_ms"] for s in v) for k, v in segs.items()}
    ps = lambda kind, key: median(s["per_step"].get(key) for s in segs[kind])  # noqa: E731
    true_comm = wall["sync"] - wall["nosync"]
    exposed_wait = ps("sync", "comm_exposed")
    probe_over = median(
        (s["per_step"]["overhead"] - s["per_step"]["data_wait"])
        for s in segs["probe"]
        if s["per_step"].get("overhead") is not None
    )
    comm_total = ps("sync", "comm_total")
    ddp_comm = median(r["ddp_stats"]["avg_backward_comm_time"] for r in fid)
    ddp_comm = ddp_comm / 1e6 if ddp_comm is not None else None
    traced_total = median(r["traced"]["per_step"]["comm_total"] for r in fid)
    tr_union = median(r["traced"]["trace"]["union_ms"] for r in fid)
    tr_sum = median(r["traced"]["trace"]["sum_ms"] for r in fid)
    proj_sync = median(_proj_g1(s["projection"]) for s in segs["sync"])
    proj_probe = median(_proj_g1(s["projection"]) for s in segs["probe"])
    single_ms = single["wall_ms"]

    a0 = adv[0]
    before, after = a0["before"], a0["after"]
    predicted = _predicted_speedup(before["gain"])
    measured = before["wall_ms"] / after["wall_ms"] if after else None
    wait_after = median(r["after"]["per_step"]["data_wait"] for r in adv if r["after"]) if after else None
    # Reference for the remaining wait: what the model behind the advice expects, the
    # loading time per batch spread over the workers, minus the compute it overlaps.
    busy = median(r["before"]["per_step"]["step"] - r["before"]["per_step"]["data_wait"] for r in adv)
    expected_wait = max(0.0, ADVICE_SLEEP_MS / a0["workers"] - busy) if a0["workers"] and busy is not None else None

    data_loader = median(r["data_loader"]["data_wait"] for r in fid)
    data_gap = median(r["data_gap"]["data_wait"] for r in fid)

    rows_spec = [
        (ROWS[0], data_loader, DATA_SLEEP_MS, f"dataset sleeps {DATA_SLEEP_MS:g} ms per batch"),
        (ROWS[1], data_gap, DATA_SLEEP_MS, f"dataset sleeps {DATA_SLEEP_MS:g} ms per batch"),
        (ROWS[2], exposed_wait, true_comm, "step(sync) - step(no_sync), wall clock"),
        (ROWS[3], probe_over, true_comm, "step(sync) - step(no_sync), wall clock"),
        (ROWS[4], comm_total, ddp_comm, "DDP logging data, per iteration, median"),
        (ROWS[5], traced_total, tr_union, "torch.profiler, same steps, per-step median"),
        (ROWS[6], traced_total, tr_sum, "torch.profiler, same steps, per-step median"),
        (
            ROWS[11],
            ps("probe", "comm_total"),
            ddp_comm,
            "DDP logging data (sync run; it times the overlapped span, from the first bucket to the last)",
        ),
        (ROWS[12], ps("sync", "compute"), wall["nosync"], "step(no_sync), wall clock (all compute)"),
        (ROWS[13], ps("probe", "compute"), wall["nosync"], "step(no_sync), wall clock (all compute)"),
        (ROWS[7], proj_sync, single_ms, "measured 1-process run, same per-process batch"),
        (ROWS[8], proj_probe, single_ms, "measured 1-process run, same per-process batch"),
        (
            ROWS[9],
            predicted,
            measured,
            f"measured: step {fmt(before['wall_ms'], '.1f')} -> {fmt(after['wall_ms'] if after else None, '.1f')} ms "
            f"with num_workers={a0['workers']}",
        ),
        (
            ROWS[10],
            wait_after,
            expected_wait,
            f"model: load {ADVICE_SLEEP_MS:g} ms / {a0['workers']} worker(s) - compute {fmt(busy, '.1f')} ms",
        ),
    ]
    rows = []
    for label, value, ref, what in rows_spec:
        unit = "x" if "speedup" in label else " ms"
        err = rel_err(value, ref)
        if label == ROWS[10] and value is not None and ref is not None and ref < 1.0:
            err_s = f"{value - ref:+.2f} ms abs"
        else:
            err_s = pct(err)
        rows.append(
            [
                label,
                fmt(value) + (unit if value is not None else ""),
                fmt(ref) + (unit if ref is not None else ""),
                err_s,
                what,
            ]
        )
    print(
        table(
            ["figure (dtprofile)", "reported", "reference", "rel. error", "reference is"],
            rows,
            title=f"dtprofile vs ground truth ({p['rounds']} round(s) of {p['comm_steps']} steps per segment)",
        )
    )

    print("\nContext")
    print(
        f"  comm-heavy model: {fmt((r0['segments']['sync'][0].get('grad_bytes') or 0) / 1e6, '.1f')} MB of gradients, "
        f"batch {COMM_BATCH} per rank; wall step sync {fmt(wall['sync'])} ms, probe run {fmt(wall['probe'])} ms, "
        f"no_sync {fmt(wall['nosync'])} ms; 1 process {fmt(single_ms)} ms"
    )
    print(
        f"  dtprofile (sync run): comm_total {fmt(comm_total)} ms, comm_exposed {fmt(exposed_wait)} ms, "
        f"compute {fmt(ps('sync', 'compute'))} ms; probe run: compute alone "
        f"{fmt(median((s['probe'] or {}).get('compute_ms') for s in segs['probe']))} ms, comm alone "
        f"{fmt(median((s['probe'] or {}).get('comm_ms') for s in segs['probe']))} ms, comm_interference "
        f"{fmt(ps('probe', 'comm_interference'))} ms"
    )
    print(
        f"  torch.profiler: event {r0['traced']['trace']['event']!r}, {r0['traced']['trace']['steps']} steps traced "
        f"(dtprofile comm_total on the traced steps {fmt(traced_total)} ms; torch.profiler also slows them)"
    )
    print(
        f"  advice on the data-bound run: {before['action']!r}; expected gain {before['gain']!r}; "
        f"num_workers_needed {before['needed']}; data wait before {fmt(before['per_step']['data_wait'])} ms"
    )
    b0 = bound[0]
    bper = b0["per_step"]
    bprobe = b0["probe"] or {}
    r_o_range = b0["R_O_range"]
    print(
        table(
            [
                "run",
                "gradients KB",
                "step ms",
                "T_C ms",
                "R_O [range]",
                "data wait ms",
                "exposed comm ms",
                "comm slowing compute ms",
                "waiting for the other rank ms",
                "comm alone / T_C (probe)",
                "advice",
            ],
            [
                [
                    f"conv, batch 32, {p['bound_steps']} steps",
                    fmt((b0["grad_bytes"] or 0) / 1e3, ".0f"),
                    fmt(bper.get("step"), ".1f"),
                    fmt(bper.get("compute"), ".1f"),
                    f"{fmt(b0['R_O'], '.3f')} [{fmt(r_o_range[0], '.3f')}, {fmt(r_o_range[1], '.3f')}]"
                    if r_o_range
                    else fmt(b0["R_O"], ".3f"),
                    fmt(bper.get("data_wait")),
                    fmt(bper.get("comm_exposed")),
                    fmt(bper.get("comm_interference")),
                    fmt(bper.get("comm_peer_wait")),
                    fmt(bprobe["comm_ms"] / bprobe["compute_ms"], ".3f") if bprobe.get("compute_ms") else "n/a",
                    ", ".join(b0["advice"]),
                ]
            ],
            title="A compute-bound run (reference: R_O = 0; dtprofile's defaults, probe steps)",
        )
    )

    print(
        f"\nwall time {time.monotonic() - t0:.0f} s; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in machine()['load'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
