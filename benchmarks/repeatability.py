"""The same job profiled again and again: one verdict, overlapping GPU-count ranges?

    python benchmarks/repeatability.py            # 10 runs quiet, 10 loaded (a few minutes)
    python benchmarks/repeatability.py --quick    # 2 pooled runs each, 60 steps (the test suite runs this)

The job: 2-rank gloo DDP on 127.0.0.1, a 3-layer MLP (3.2 MB of fp32 gradients), batch 32,
on an accelerator emulated on the CPU (``_common.Emulated``: 10 ms forward and 20 ms
backward slept per step while the host idles, so the ranks do not compete for the cores
and the all-reduce is real), profiled by ``dtprofile.profile(ddp, opt, warmup_steps=5,
logdir=None)``. Its projected efficiency falls to about the 0.80 target at 4 GPUs and stays
near it up to 64 (the curve flattens): the case where the point recommendation can move
from one run to the next, and that ``gpus_range`` is for.
``--job cpu`` trains the same MLP with real CPU compute instead (batch 256, no device
time): on 2 shared cores its communication dominates.

The job runs ``--runs`` times on the machine as it is ("quiet"), then ``--runs`` times
"loaded": one process per core spinning a busy Python loop, started before the loaded
runs and killed after them (always, in a ``finally``; each also exits by itself when this
script's process is gone or after ``--hog-max-s``).

Each run is profiled twice in turn (``--modes``): *alone* (``logdir=None``: the intervals
hold the run's own variation) and *pooled* (a logdir per run, ``<tmp>/<condition>/runN``,
beside the condition's earlier ones: the intervals pool their spread, ``pool_runs``).

Printed: one table per condition and mode (each run's step, R_O, exposed communication's share of
the step and the projected efficiency at ``--eff-at`` GPUs, each with its interval; the
verdict ``advice[0]`` and the other findings; the recommended GPU count and its range),
then a summary per condition and across both: the verdicts seen, whether every two
``gpus_range`` overlap (and their intersection), the spread of the point recommendation,
and how many pairs of R_O intervals overlap. Nothing is tuned to agree: the tables show
what happened. Exits 1 if a run failed.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import Emulated, describe_machine, fixed_batch, fmt, launch, machine, mlp, table  # noqa: E402
from torch import nn  # noqa: E402

MODEL = dict(width=512, depth=3, inp=512)
JOBS: dict[str, dict] = {
    # batch, emulated device ms (forward, backward): None for real CPU compute
    "emulated": dict(batch=32, device_ms=(10.0, 20.0)),
    "cpu": dict(batch=256, device_ms=None),
}
CONDITIONS = ("quiet", "loaded")
MODES = ("alone", "pooled")
WARMUP = 5
LAUNCH_TIMEOUT_S = 300.0

# One busy loop per core; it also ends when its parent is gone or after a deadline, so a
# killed benchmark leaves nothing spinning.
HOG = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(200000):
        pass
"""


# --------------------------------------------------------------------------- the job


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import dtprofile

    torch.manual_seed(0)
    net = mlp(**MODEL)
    if cfg["device_ms"]:
        net = Emulated(net, *cfg["device_ms"])
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = fixed_batch(dict(MODEL, batch=cfg["batch"]), seed=rank)
    logdir = cfg.get("logdir") if rank == 0 else None  # (rank 0 writes; the others ignore it)
    prof = dtprofile.profile(ddp, opt, warmup_steps=WARMUP, logdir=logdir).start()
    for _ in range(cfg["steps"]):
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return prof.stop().to_dict()


# --------------------------------------------------------------------------- the load


def start_hogs(n: int, max_s: float) -> list[subprocess.Popen]:
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", HOG, str(os.getpid()), str(max_s)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    except BaseException:
        stop_hogs(procs)
        raise
    return procs


def stop_hogs(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


# --------------------------------------------------------------------------- one run as a row


def _range(value: Any) -> list | None:
    return list(value) if isinstance(value, (list, tuple)) and len(value) == 2 else None


def row_of(summary: dict, eff_at: int) -> dict:
    unc = summary.get("uncertainty") or {}
    proj = summary.get("projection") or {}
    rec = summary.get("recommendations") or {}
    advice = summary.get("advice") or []
    gpus = list(proj.get("gpus") or [])
    eff = eff_range = None
    if eff_at in gpus:
        i = gpus.index(eff_at)
        eff = (proj.get("efficiency") or [None] * len(gpus))[i]
        ranges = (unc.get("projection") or {}).get("efficiency")
        if ranges and unc.get("projection", {}).get("gpus") == gpus:
            eff_range = _range(ranges[i])
    return {
        "step_ms": (summary.get("per_step_ms") or {}).get("step"),
        "step_range": _range((unc.get("per_step_ms") or {}).get("step")),
        "R_O": (summary.get("ratios") or {}).get("R_O"),
        "R_O_range": _range((unc.get("ratios") or {}).get("R_O")),
        "comm_fraction": (summary.get("ratios") or {}).get("comm_fraction"),
        "comm_fraction_range": _range((unc.get("ratios") or {}).get("comm_fraction")),
        "verdict": advice[0]["id"] if advice else None,
        "verdict_severity": advice[0].get("severity") if advice else None,
        "findings": [a.get("id") for a in advice],
        "gpus": rec.get("gpus"),
        "gpus_range": _range(rec.get("gpus_range")),
        "eff_at": eff_at,
        "efficiency": eff,
        "efficiency_range": eff_range,
        "steps_profiled": summary.get("steps_profiled"),
        "pooled_runs": unc.get("pooled_runs"),
        "projection_gpus": gpus,
        "projection_efficiency": proj.get("efficiency"),
        "projection_efficiency_ranges": (unc.get("projection") or {}).get("efficiency"),
    }


def run_condition(condition: str, args: argparse.Namespace, cfg: dict, parent: str) -> dict[str, list[dict]]:
    """The condition's runs, each mode's in turn (``alone`` then ``pooled``) for every run:
    pooled runs profile into a log directory each, beside the condition's earlier ones."""
    rows: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for i in range(args.runs):
        for mode in args.modes:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            t0 = time.monotonic()
            row: dict[str, Any] = {"condition": condition, "mode": mode, "run": i + 1, "load_1min": load}
            logdir = os.path.join(parent, condition, f"run{i + 1}") if mode == "pooled" else None
            try:
                summary = launch(_rank, 2, dict(cfg, logdir=logdir), timeout_s=LAUNCH_TIMEOUT_S)[0]
                row.update(row_of(summary, args.eff_at))
            except Exception as exc:  # noqa: BLE001 (reported in the table; the exit status says it)
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"run {i + 1} ({condition}, {mode}) failed: {row['error']}", file=sys.stderr, flush=True)
            row["wall_s"] = time.monotonic() - t0
            rows[mode].append(row)
            print(
                f"  {condition} {mode} run {i + 1}/{args.runs}: {row.get('verdict', 'failed')}, "
                f"gpus {row.get('gpus')} {row.get('gpus_range')}, {row['wall_s']:.1f} s",
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- tables


def _iv(value: Any, rng: list | None, spec: str) -> str:
    s = fmt(value, spec)
    return s if rng is None else f"{s} [{fmt(rng[0], spec)}, {fmt(rng[1], spec)}]"


def _gr(rng: list | None) -> str:
    return "n/a" if rng is None else f"[{rng[0]}, {rng[1]}]"


def run_table(condition: str, rows: list[dict], eff_at: int, title: str) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["run"], "failed", *[""] * 8, f"{r['wall_s']:.0f}", f"{r['load_1min']:.2f}"])
            continue
        body.append(
            [
                r["run"],
                _iv(r["step_ms"], r["step_range"], ".1f"),
                _iv(r["R_O"], r["R_O_range"], ".3f"),
                _iv(r["comm_fraction"], r["comm_fraction_range"], ".3f"),
                _iv(r["efficiency"], r["efficiency_range"], ".3f"),
                f"{r['verdict']} ({r['verdict_severity']})" if r["verdict_severity"] else r["verdict"],
                ", ".join(r["findings"][1:]) or "-",
                r["gpus"],
                _gr(r["gpus_range"]),
                r["pooled_runs"] if r["pooled_runs"] is not None else "-",
                f"{r['wall_s']:.0f}",
                f"{r['load_1min']:.2f}",
            ]
        )
    return table(
        [
            "run",
            "step ms [range]",
            "R_O [range]",
            "comm_fraction [range]",
            f"efficiency at {eff_at} [range]",
            "verdict",
            "other findings",
            "gpus",
            "gpus_range",
            "pooled",
            "wall s",
            "load 1 min",
        ],
        body,
        title=title,
    )


def overlap(ranges: list[list]) -> tuple[int, int, list | None]:
    """(pairs that overlap, pairs, the intersection of all or None)."""
    pairs = list(itertools.combinations(ranges, 2))
    ok = sum(1 for a, b in pairs if max(a[0], b[0]) <= min(a[1], b[1]))
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    return ok, len(pairs), ([lo, hi] if lo <= hi else None)


def _counts(values: list) -> str:
    c = collections.Counter(values)
    return ", ".join(f"{k} x{n}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def summary_rows(groups: dict[str, list[dict]]) -> list[list]:
    out = []
    for name, rows in groups.items():
        good = [r for r in rows if "error" not in r]
        ranges = [r["gpus_range"] for r in good if r["gpus_range"] is not None]
        if len(ranges) >= 2 and len(ranges) == len(good):
            ok, n, inter = overlap(ranges)
            overlaps = f"{'yes' if ok == n else 'no'} ({ok}/{n} pairs)"
            inter_s = _gr(inter) if inter else "empty"
        elif len(ranges) == 1 and len(good) == 1:
            overlaps, inter_s = "(one run)", _gr(ranges[0])
        else:
            overlaps, inter_s = "n/a", "n/a"
        r_o_ranges = [r["R_O_range"] for r in good if r["R_O_range"] is not None]
        if len(r_o_ranges) >= 2:
            ok, n, _ = overlap(r_o_ranges)
            r_o_overlap = f"{ok}/{n} pairs"
        else:
            r_o_overlap = "n/a"
        points = [r["gpus"] for r in good if r["gpus"] is not None]
        spread = f"{min(points)}-{max(points)} ({_counts(points)})" if points else "n/a"
        steps = [r["step_ms"] for r in good if r["step_ms"] is not None]
        r_o = [r["R_O"] for r in good if r["R_O"] is not None]
        out.append(
            [
                name,
                f"{len(good)}/{len(rows)}",
                _counts([r["verdict"] for r in good]) or "n/a",
                overlaps,
                inter_s,
                spread,
                f"{min(steps):.1f}-{max(steps):.1f}" if steps else "n/a",
                f"{min(r_o):.3f}-{max(r_o):.3f}" if r_o else "n/a",
                r_o_overlap,
            ]
        )
    return out


# --------------------------------------------------------------------------- main


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that the finally below kills the hogs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=None, help="runs per condition (default 10; --quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 150; --quick: 60)")
    ap.add_argument("--quick", action="store_true", help="a short run: 2 runs per condition of 60 steps")
    ap.add_argument(
        "--job",
        choices=sorted(JOBS),
        default="emulated",
        help="emulated (default): an emulated accelerator; cpu: real CPU compute",
    )
    ap.add_argument(
        "--eff-at", type=int, default=4, help="the GPU count whose projected efficiency is shown (default 4)"
    )
    ap.add_argument("--hogs", type=int, default=None, help="busy processes while loaded (default: one per core)")
    ap.add_argument(
        "--hog-max-s",
        type=float,
        default=3600.0,
        help="each busy process ends by itself after this long (default 3600)",
    )
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated: 'alone' (logdir=None, the run's own variation) and/or 'pooled' (a logdir "
        "per run beside the condition's earlier ones, whose spread the intervals pool); default both, "
        "--quick: pooled",
    )
    ap.add_argument("--json", metavar="PATH", default=None, help="write the raw rows as JSON to PATH")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in (args.modes or ("pooled" if args.quick else "alone,pooled")).split(",")]
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--modes must be a comma-separated list of {', '.join(MODES)}")
    args.runs = args.runs if args.runs is not None else (2 if args.quick else 10)
    args.steps = args.steps if args.steps is not None else (60 if args.quick else 150)
    if args.runs < 1 or args.steps <= WARMUP:
        ap.error(f"--runs must be at least 1 and --steps more than {WARMUP}")
    hogs_n = args.hogs if args.hogs is not None else (os.cpu_count() or 1)
    job = JOBS[args.job]
    cfg = dict(batch=job["batch"], device_ms=job["device_ms"], steps=args.steps)
    signal.signal(signal.SIGTERM, _terminate)

    m = machine()
    print(describe_machine(m))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    device = (
        "real CPU compute"
        if job["device_ms"] is None
        else "emulated device %g ms forward + %g ms backward" % tuple(job["device_ms"])
    )
    what = (
        f"job {args.job}: 2-rank gloo DDP, MLP {MODEL['inp']}-{MODEL['width']}x{MODEL['depth']}-10, "
        f"batch {job['batch']}, {device}, {args.steps} steps (warmup {WARMUP}); {args.runs} runs per condition; "
        f"loaded: {hogs_n} busy processes"
    )
    print(what, flush=True)
    t_all = time.monotonic()
    by_condition: dict[str, dict[str, list[dict]]] = {}
    hogs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="dtprofile-repeat-") as parent:
        by_condition["quiet"] = run_condition("quiet", args, cfg, parent)
        try:
            hogs = start_hogs(hogs_n, args.hog_max_s)
            time.sleep(1.0)  # let them reach full speed
            by_condition["loaded"] = run_condition("loaded", args, cfg, parent)
        finally:
            stop_hogs(hogs)
    wall = time.monotonic() - t_all
    results = {f"{cond} {mode}": by_condition[cond][mode] for cond in CONDITIONS for mode in args.modes}

    stamp = f"{started}, {m['cores']} cores {m['cpu']}"
    for name, rows in results.items():
        cond, mode = name.split()
        load = "no other load" if cond == "quiet" else f"{hogs_n} busy processes"
        print(run_table(cond, rows, args.eff_at, title=f"{cond.capitalize()}, {mode} ({load}); {stamp}"))
    groups = dict(results)
    for mode in args.modes:
        groups[f"both {mode}"] = by_condition["quiet"][mode] + by_condition["loaded"][mode]
    print(
        table(
            [
                "condition",
                "runs ok",
                "verdicts",
                "gpus_range overlap",
                "intersection",
                "gpus (point) spread",
                "step ms spread",
                "R_O spread",
                "R_O ranges overlap",
            ],
            summary_rows(groups),
            title=f"Across runs; {stamp}",
        )
    )
    failed = sum("error" in r for rows in results.values() for r in rows)
    print(
        f"\n{sum(len(v) for v in results.values())} runs in {wall:.0f} s; {failed} failed; "
        f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "machine": m,
                    "started": started,
                    "job": args.job,
                    "model": MODEL,
                    "cfg": cfg,
                    "hogs": hogs_n,
                    "wall_s": wall,
                    "rows": [r for rows in results.values() for r in rows],
                },
                fh,
                indent=1,
                default=str,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
