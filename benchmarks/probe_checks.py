"""What a DDP probe step's agreement and safety net cost, in real runs.

    python benchmarks/probe_checks.py           # full mode (about a minute on 2 cores)
    python benchmarks/probe_checks.py --quick   # a short run (the test suite runs this)

A probe step (``dtprofile/capture/probe.py``, ``NoSyncProbe``) runs its passes as under
``no_sync()`` and all-reduces the gradients by hand once backward ends. Around that
reduction the ranks meet on the job's store (``dtprofile/capture/agree.py``):

- ``StoreAgreement.any_flag``: before the reduction, "was this pass a plain one on every
  rank" (the *shape* meeting, which also starts the reduction together on every rank);
  before each chunk launched onto an idle wire (*chunk* meetings); and, on the probe
  steps whose passes run one rank at a time, whether a rank missed its turn (*turns*);
- the safety net (``NoSyncProbe._confirm``): ``_fingerprint`` (per-gradient float32
  sums, read to the host) and ``StoreAgreement.same_value`` (the fingerprints compared
  across ranks; it makes one ``any_flag`` meeting of its own, counted here in
  ``same_value``, not in ``any_flag``).

Two gloo processes (127.0.0.1, one thread each) train each shape for ``--steps`` steps
under ``dtprofile.profile(ddp, opt, warmup_steps=5, probe_every=4)`` (no logdir), with
those three functions wrapped in ``perf_counter`` timers (restored afterwards), and
``NoSyncProbe._close`` wrapped to tell the probe steps (the step in which a probe
window closed) and whether their passes ran one rank at a time. Each step's wall time is
``perf_counter`` between consecutive optimizer-step ends, in the loop.

Shapes: *GPU-like* and *small buckets* are the left-on shapes of
``benchmarks/overhead.py`` (the device's time emulated by sleeping, 8.4 MB of gradients
in 2 MB buckets; 64 layers of 256 in 0.25 MB buckets); *comm-heavy MLP* is the tests'
``comm_heavy`` model (1024 -> 6144 -> 1024, 50 MB of gradients, DDP's 25 MB buckets).

The table, per shape: the median ordinary step (after warm-up, probes left out) and the
median probe step (those whose passes ran together; the ones that ran one rank at a time
are counted apart, their shape meeting holds the other rank's whole pass by design);
per probe step (ran together), the mean over probe steps of the mean over the ranks of
the time in ``any_flag``, ``same_value`` and ``_fingerprint``; their sum as a share of
the median probe step, and of a whole run at the default schedule (one probe step in 50
after the first few: sum / (50 x ordinary step)). A second table splits the meetings, and
gives each one's time on the rank that waited least (the last to arrive: the store's own
round trips, what the step pays beyond what the reduction would wait anyway) beside the
mean over the ranks (which also holds a rank's wait for the slower one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import Deadline, Emulated, comm_heavy, describe_machine, fixed_batch, fmt, launch, machine, mlp, table  # noqa: E402
from overhead import LEAVE_ON_SHAPES  # noqa: E402
from torch import nn  # noqa: E402

WORLD = 2
WARMUP = 5
PROBE_EVERY = 4
#: ``probe_every="auto"`` after its first few probe steps: one step in this many.
DEFAULT_EVERY = 50

SHAPES: dict[str, dict] = {
    "GPU-like": dict(LEAVE_ON_SHAPES["GPU-like"], kind="emulated"),
    "small buckets": dict(LEAVE_ON_SHAPES["small buckets"], kind="emulated"),
    "comm-heavy MLP": dict(kind="comm_heavy", inp=1024, classes=1024, batch=32, bucket_cap_mb=25.0),
}
MEETINGS = ("shape", "chunk", "turns")

QUICK = dict(steps=14, rounds=1, budget_s=150)
FULL = dict(steps=60, rounds=2, budget_s=900)


# --------------------------------------------------------------------------- in each rank


class _Timers:
    """Calls and seconds spent in the wrapped functions during the current step."""

    def __init__(self) -> None:
        self.inside_same_value = 0
        self.reset()

    def reset(self) -> None:
        self.step: dict[str, float] = {k: 0.0 for k in ("same_value", "fingerprint", *MEETINGS)}
        self.calls: dict[str, int] = {k: 0 for k in self.step}
        self.closes: list[bool] = []  # probe windows closed in this step (True: ran one rank at a time)

    def add(self, key: str, seconds: float) -> None:
        self.step[key] += seconds
        self.calls[key] += 1


def _meeting_kind(meeting: str) -> str:
    """'3/shape' -> 'shape', '3/chunk2' -> 'chunk', '3/turns' -> 'turns'."""
    last = str(meeting).rsplit("/", 1)[-1]
    return last.rstrip("0123456789") or last


def _install(timers: _Timers) -> list[tuple[Any, str, Any]]:
    """Wrap the agreement, the fingerprint and the window's close; the originals, to restore."""
    from dtprofile.capture import probe as probe_mod
    from dtprofile.capture.agree import StoreAgreement

    clock = time.perf_counter
    any_flag, same_value = StoreAgreement.any_flag, StoreAgreement.same_value
    fingerprint, close = probe_mod._fingerprint, probe_mod.NoSyncProbe._close

    def timed_any_flag(self: Any, meeting: str, flag: bool) -> Any:
        if timers.inside_same_value:  # (same_value's own meeting: counted there)
            return any_flag(self, meeting, flag)
        t0 = clock()
        try:
            return any_flag(self, meeting, flag)
        finally:
            kind = _meeting_kind(meeting)
            timers.add(kind if kind in MEETINGS else "shape", clock() - t0)

    def timed_same_value(self: Any, meeting: str, value: bytes) -> Any:
        t0 = clock()
        timers.inside_same_value += 1
        try:
            return same_value(self, meeting, value)
        finally:
            timers.inside_same_value -= 1
            timers.add("same_value", clock() - t0)

    def timed_fingerprint(params: list) -> bytes:
        t0 = clock()
        try:
            return fingerprint(params)
        finally:
            timers.add("fingerprint", clock() - t0)

    def watched_close(self: Any, window: Any) -> None:
        timers.closes.append(bool(getattr(window, "turn", False)))
        return close(self, window)

    saved = [
        (StoreAgreement, "any_flag", any_flag),
        (StoreAgreement, "same_value", same_value),
        (probe_mod, "_fingerprint", fingerprint),
        (probe_mod.NoSyncProbe, "_close", close),
    ]
    StoreAgreement.any_flag = timed_any_flag
    StoreAgreement.same_value = timed_same_value
    probe_mod._fingerprint = timed_fingerprint
    probe_mod.NoSyncProbe._close = watched_close
    return saved


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, original in saved:
        setattr(owner, name, original)


def _model(shape: dict) -> nn.Module:
    if shape["kind"] == "comm_heavy":
        return comm_heavy()
    return Emulated(mlp(**shape), shape["forward_ms"], shape["backward_ms"])


def _run(rank: int, name: str, steps: int, timers: _Timers) -> dict:
    """One run of ``steps`` steps of shape ``name`` under a fresh profiler."""
    import dtprofile

    shape = SHAPES[name]
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model(shape), bucket_cap_mb=shape["bucket_cap_mb"])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = fixed_batch(shape, seed=rank)
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
    rows = []
    prof = dtprofile.profile(ddp, opt, warmup_steps=WARMUP, probe_every=PROBE_EVERY)
    prof.start()
    try:
        clock = time.perf_counter
        t_last = clock()
        for _ in range(steps):
            timers.reset()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            now = clock()
            rows.append(
                {
                    "ms": (now - t_last) * 1e3,
                    "probe": bool(timers.closes),
                    "alone": any(timers.closes),
                    "s": dict(timers.step),
                    "calls": dict(timers.calls),
                }
            )
            t_last = now
    finally:
        summary = prof.stop().to_dict()
    probe = summary.get("probe") or {}
    return {
        "grad_mb": grad_bytes / 1e6,
        "rows": rows,
        "summary_probe_steps": probe.get("steps"),
        "probes_stopped": summary.get("probes_stopped"),
    }


def worker(rank: int, world: int, cfg: dict) -> dict:
    """Every shape, ``cfg["rounds"]`` runs each (shapes interleaved): {shape: [run, ...]}."""
    import warnings

    warnings.filterwarnings("ignore")
    timers = _Timers()
    saved = _install(timers)
    out: dict[str, list] = {name: [] for name in cfg["shapes"]}
    try:
        for _ in range(cfg["rounds"]):
            for name in cfg["shapes"]:
                out[name].append(_run(rank, name, cfg["steps"], timers))
    finally:
        _restore(saved)
    return out


# --------------------------------------------------------------------------- in the launcher


def _per_probe(per_rank: list[list[dict]]) -> dict:
    """The probe and ordinary steps of one shape's runs, ranks side by side (lock-step)."""
    ordinary, together, alone = [], [], []
    comp: dict[str, list[tuple[float, ...]]] = {k: [] for k in ("same_value", "fingerprint", *MEETINGS)}
    calls: dict[str, list[float]] = {k: [] for k in comp}
    for runs in zip(*per_rank, strict=False):  # one run, every rank
        for i, steps in enumerate(zip(*(run["rows"] for run in runs), strict=False)):
            times = [s["ms"] for s in steps]
            probe = [s["probe"] for s in steps]
            if not any(probe):
                if i > WARMUP:  # (the warm-up steps are no ordinary ones)
                    ordinary.extend(times)
                continue
            if any(s["alone"] for s in steps):
                alone.extend(times)
                continue
            together.extend(times)
            for key in comp:
                comp[key].append(tuple(s["s"][key] * 1e3 for s in steps))
                calls[key].append(statistics.fmean(s["calls"][key] for s in steps))
    return {"ordinary": ordinary, "together": together, "alone": alone, "comp": comp, "calls": calls}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _analyse(name: str, per_rank: list[list[dict]]) -> dict:
    d = _per_probe(per_rank)
    comp = d["comp"]
    rank_mean = {k: _mean([statistics.fmean(v) for v in vals]) for k, vals in comp.items()}
    least = {k: _mean([min(v) for v in vals]) for k, vals in comp.items()}
    rank_median = {k: _median([statistics.fmean(v) for v in vals]) for k, vals in comp.items()}
    any_flag = sum(rank_mean[k] or 0.0 for k in MEETINGS) if comp["shape"] else None
    total = (any_flag + rank_mean["same_value"] + rank_mean["fingerprint"]) if any_flag is not None else None
    ordinary, probe = _median(d["ordinary"]), _median(d["together"])
    runs = [run for rank_runs in per_rank for run in rank_runs]
    return {
        "shape": name,
        "grad_mb": runs[0]["grad_mb"],
        "ordinary_ms": ordinary,
        "probe_ms": probe,
        "alone_ms": _median(d["alone"]),
        "probes": len(comp["shape"]),
        "alone": len(d["alone"]) // WORLD,
        "summary_probes": sum(run["summary_probe_steps"] or 0 for run in per_rank[0]),
        "stopped": [run["probes_stopped"] for run in runs if run["probes_stopped"]],
        "any_flag_ms": any_flag,
        "any_flag_calls": sum(_mean(d["calls"][k]) or 0.0 for k in MEETINGS),
        "same_value_ms": rank_mean["same_value"],
        "fingerprint_ms": rank_mean["fingerprint"],
        "sum_ms": total,
        "pct_probe": total / probe if total is not None and probe else None,
        "run_share": total / (DEFAULT_EVERY * ordinary) if total is not None and ordinary else None,
        "rank_mean": rank_mean,
        "least": least,
        "rank_median": rank_median,
        "calls": {k: _mean(v) for k, v in d["calls"].items()},
    }


def _pct(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else f"{value * 100:{spec}}%"


def _tables(results: list[dict]) -> str:
    rows = []
    for r in results:
        rows.append(
            [
                r["shape"],
                fmt(r["grad_mb"], ".1f"),
                f"{r['probes']} (+{r['alone']})",
                fmt(r["ordinary_ms"]),
                fmt(r["probe_ms"]),
                f"{fmt(r['any_flag_ms'], '.3f')} ({fmt(r['any_flag_calls'], '.0f')})",
                fmt(r["same_value_ms"], ".3f"),
                fmt(r["fingerprint_ms"], ".3f"),
                fmt(r["sum_ms"], ".3f"),
                _pct(r["pct_probe"], ".1f"),
                _pct(r["run_share"], ".3f"),
            ]
        )
    out = [
        table(
            [
                "shape",
                "gradients MB",
                "probe steps (+ alone)",
                "ordinary step ms",
                "probe step ms",
                "any_flag ms (calls)",
                "same_value ms",
                "fingerprint ms",
                "sum ms",
                "% of probe step",
                "share of a run (1 probe in 50)",
            ],
            rows,
            title=f"A probe step's agreement and safety net, {WORLD} gloo processes (medians of the steps; "
            "the calls' ms per probe step: mean over probe steps of the ranks' mean)",
        )
    ]
    rows = []
    labels = {
        "shape": "any_flag: plain pass? (shape)",
        "chunk": "any_flag: before a chunk (chunk)",
        "turns": "any_flag: a missed turn (turns)",
        "same_value": "same_value (the fingerprints compared)",
        "fingerprint": "_fingerprint (float32 sums, to the host)",
    }
    for r in results:
        for key in ("shape", "chunk", "same_value", "fingerprint"):
            rows.append(
                [
                    r["shape"],
                    labels[key],
                    fmt(r["calls"][key], ".1f"),
                    fmt(r["least"][key], ".3f"),
                    fmt(r["rank_mean"][key], ".3f"),
                    fmt(r["rank_median"][key], ".3f"),
                ]
            )
    out.append(
        table(
            [
                "shape",
                "call",
                "calls per probe step",
                "ms, the rank that waited least",
                "ms, mean of the ranks",
                "ms, mean of the ranks (median probe step)",
            ],
            rows,
            title="Each call per probe step (passes run together; mean over the probe steps unless said)",
        )
    )
    notes = []
    for r in results:
        notes.append(
            f"  {r['shape']}: {r['probes']} probe steps run together, {r['alone']} one rank at a time "
            f"(median {fmt(r['alone_ms'])} ms; left out above); the summaries counted "
            f"{r['summary_probes']} probe steps on rank 0"
            + (f"; PROBES STOPPED: {r['stopped']}" if r["stopped"] else "")
        )
    out.append("\n" + "\n".join(notes))
    return "\n".join(out)


def _finite(r: dict) -> bool:
    keys = ("ordinary_ms", "probe_ms", "any_flag_ms", "same_value_ms", "fingerprint_ms", "sum_ms")
    return all(isinstance(r[k], float) and math.isfinite(r[k]) for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (< ~40 s on 2 cores)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 60; --quick: 14)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="runs per shape, shapes interleaved (default: 2; --quick: 1)"
    )
    ap.add_argument("--json", metavar="PATH", help="also write every rank's raw step rows there")
    args = ap.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        p["steps"] = args.steps
    if args.rounds is not None:
        p["rounds"] = args.rounds
    if p["steps"] <= WARMUP + 1:
        ap.error(f"--steps must be more than {WARMUP + 1} (the warm-up)")
    print(
        f"dtprofile probe checks ({'quick' if args.quick else 'full'} mode): {p['rounds']} run(s) of "
        f"{p['steps']} steps per shape, warmup_steps={WARMUP}, probe_every={PROBE_EVERY}"
    )
    print(describe_machine(machine()))
    t_start = time.monotonic()
    budget = Deadline(p["budget_s"])
    cfg = dict(shapes=list(SHAPES), steps=p["steps"], rounds=p["rounds"])
    failed = False
    try:
        per_rank = launch(worker, WORLD, cfg, budget.left(p["budget_s"]))
    except (RuntimeError, TimeoutError) as exc:
        print(f"probe checks failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cfg": cfg, "machine": machine(), "ranks": per_rank}, fh)
    results = [_analyse(name, [r[name] for r in per_rank]) for name in SHAPES]
    print(_tables(results))
    for r in results:
        if not r["probes"] or r["stopped"] or not _finite(r):
            print(
                f"{r['shape']}: no usable probe steps (probes {r['probes']}, stopped {r['stopped']})", file=sys.stderr
            )
            failed = True
    print(
        f"\nwall time {time.monotonic() - t_start:.0f} s; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in machine()['load'])}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
