"""dtprofile on pipeline-parallel stages (``torch.distributed.pipelining``): the bubble and
the waits against references it does not produce, and its predictions against measured runs.

    python benchmarks/pipeline.py            # full mode (a few minutes)
    python benchmarks/pipeline.py --quick    # a short run (the test suite runs this)

The model: a stage a rank (2 or 4 ranks, gloo on 127.0.0.1), each a ``Linear(32, 32)``
whose device time is emulated: its forward sleeps ``fwd_ms`` and its backward ``bwd_ms``
a step, in proportion to the microbatch's share of the global batch (``BATCH`` samples,
fixed: m microbatches of ``BATCH / m``), while the host idles, so that the stages'
compute is known and the ranks do not compete for the cores; the point-to-point sends and
receives are real. The same model is split in 4 stages of ``STAGE_MS`` (forward, backward)
a step, or in 2 of twice that. Unequal: one stage ``SLOW``x the others (the last of 2, the
third of 4). Schedules: ``ScheduleGPipe`` and ``Schedule1F1B``; in full mode also
``ScheduleInterleaved1F1B`` with ``CHUNKS`` stages a rank (each rank's time split evenly
over them).

Each configuration runs plain (no dtprofile) and profiled (``dtprofile.profile(stage_module,
opt)``), in turn. In both, before dtprofile starts (so that dtprofile wraps it and both see
the same waits), ``schedules._wait_batch_p2p`` and ``schedules._batch_p2p`` are wrapped
by hand with ``perf_counter``: the time each stage spends waiting for its neighbours, a
step; and the stage's own module times its sleeps (the emulated compute, as slept).

1. *The bubble.* dtprofile's ``pipeline.bubble_fraction`` (the median stage's waits over
   its step) against the hand-timed waits over the wall-clock step of the same steps (the
   median stage's), against (p - 1)/(m + p - 1) (the formula for equal stages), and against
   the timeline of the emulated times: the step is ``sum(s_i) + (m - 1) max(s_i)`` with
   ``s_i`` stage i's compute a microbatch, stage i idle for that less its ``m s_i``. Each
   stage's waits: dtprofile's ``stage_figures[].wait_ms`` against the hand-timed waits and
   against the wall step less the slept compute; each stage's forward and backward against
   the time slept in them.
2. *Predictions against measured runs.* From a profiled run at m microbatches: the step
   dtprofile predicts at the ``pipeline_bubble`` finding's ``n_microbatches=m'`` (its
   ``step_ms_at_more_microbatches``) and at 2m (``projection.step_ms_by_microbatches``)
   against the plain run's wall-clock step at m' and at 2m (the same global batch); for
   unequal stages ``projection.balanced_step_ms`` against a plain run of the stages'
   emulated times evened out (the same total); for 4 stages ``step_ms_by_stages`` at 2
   against a plain 2-stage run, each stage holding two of the 4 stages' time; for 1F1B,
   ``step_ms_by_stages_per_rank`` at ``CHUNKS`` against a plain interleaved run.

Figures are medians over rounds (full mode) of means over each run's steady steps (the
plain runs' step: the median step). Nothing is tuned to agree: the tables show what
happened. Exits 1 if a run failed or a figure is missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import Deadline, describe_machine, fmt, launch, machine, median, pct, rel_err, table  # noqa: E402
from torch import nn  # noqa: E402

WIDTH, BATCH = 32, 64
#: A stage's emulated device time a step (forward, backward, ms) with the model in 4 stages.
STAGE_MS = (12.0, 24.0)
SLOW = 1.5
WARMUP = 2
SCHEDULES = ("gpipe", "1f1b")
SCHEDULE_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
#: Stages a rank of the interleaved runs (each rank's time split evenly over them).
CHUNKS = 2
#: Per mode: the schedules run at each stage count, the microbatch counts profiled, those the
#: predictions start from, steps a run (after ``WARMUP``).
QUICK = dict(
    rounds=1,
    steps=6,
    plain_steps=5,
    schedules={2: ("gpipe",), 4: ("1f1b",)},
    microbatches={2: (4,), 4: (4,)},
    predict_from={2: (4,), 4: (4,)},
)
FULL = dict(
    rounds=2,
    steps=16,
    plain_steps=12,
    schedules={2: SCHEDULES, 4: SCHEDULES},
    microbatches={2: (2, 4, 8), 4: (4, 8, 16)},  # (1F1B: m >= p)
    predict_from={2: (2, 4), 4: (4, 8)},
    interleaved=True,  # (1F1B's runs -> ScheduleInterleaved1F1B of CHUNKS stages a rank, profiled and plain)
)


# --------------------------------------------------------------------------- the stages


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, seconds: float, log: dict) -> torch.Tensor:
        ctx.seconds, ctx.log = seconds, log
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        t0 = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.log["bwd"] += time.perf_counter() - t0
        return grad, None, None


class Stage(nn.Module):
    """``Linear(WIDTH, WIDTH)`` with ``fwd_ms`` slept in forward and ``bwd_ms`` in backward a
    step (a microbatch its share of ``BATCH``); ``log`` holds the seconds slept."""

    def __init__(self, fwd_ms: float, bwd_ms: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.fwd_ms, self.bwd_ms = fwd_ms, bwd_ms
        self.log = {"fwd": 0.0, "bwd": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = x.shape[0] / BATCH
        t0 = time.perf_counter()
        time.sleep(self.fwd_ms * share / 1e3)
        self.log["fwd"] += time.perf_counter() - t0
        return _SleepInBackward.apply(self.lin(x), self.bwd_ms * share / 1e3, self.log)


def stage_ms(p: int, unequal: bool, balanced: bool = False) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) ms a step: the model's 4 stages of ``STAGE_MS``
    in ``p``; ``unequal``: one ``SLOW``x; ``balanced``: that total evened out."""
    f, b = (x * 4 / p for x in STAGE_MS)
    out = [(f, b)] * p
    if unequal:
        slow = 1 if p == 2 else 2
        out[slow] = (f * SLOW, b * SLOW)
    if balanced:
        out = [(sum(x[0] for x in out) / p, sum(x[1] for x in out) / p)] * p
    return out


class HandTimer:
    """``schedules._wait_batch_p2p`` and ``_batch_p2p`` wrapped with ``perf_counter``."""

    def __init__(self) -> None:
        import torch.distributed.pipelining.schedules as schedules

        self.module = schedules
        self.wait_s = self.launch_s = 0.0
        self.originals = (schedules._wait_batch_p2p, schedules._batch_p2p)
        wait, batch = self.originals

        def _wait_batch_p2p(work: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wait(work)
            finally:
                self.wait_s += time.perf_counter() - t0

        def _batch_p2p(p2p_ops: Any, desc: str | None = None) -> Any:
            t0 = time.perf_counter()
            try:
                return batch(p2p_ops, desc=desc)
            finally:
                self.launch_s += time.perf_counter() - t0

        schedules._wait_batch_p2p, schedules._batch_p2p = _wait_batch_p2p, _batch_p2p

    def remove(self) -> None:
        self.module._wait_batch_p2p, self.module._batch_p2p = self.originals


def _run_job(rank: int, world: int, job: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    import dtprofile

    torch.manual_seed(rank)
    fwd_ms, bwd_ms = job["stage_ms"][rank]
    loss = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    if job["schedule"] == "interleaved":  # (the rank's layers in CHUNKS stages: rank, rank + p, ...)
        modules = [Stage(fwd_ms / CHUNKS, bwd_ms / CHUNKS) for _ in range(CHUNKS)]
        stages = [
            PipelineStage(m, rank + i * world, CHUNKS * world, torch.device("cpu")) for i, m in enumerate(modules)
        ]
        schedule: Any = ScheduleInterleaved1F1B(stages, job["m"], loss_fn=loss)
    else:
        modules = [Stage(fwd_ms, bwd_ms)]
        stage = PipelineStage(modules[0], rank, world, torch.device("cpu"))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[job["schedule"]](stage, job["m"], loss_fn=loss)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    dist.barrier()
    hand = HandTimer()  # (before dtprofile: dtprofile wraps it, both see the same waits)
    target = schedule if len(modules) > 1 else modules[0]
    prof = dtprofile.profile(target, opt, warmup_steps=WARMUP).start() if job["profile"] else None
    steps = []
    try:
        for _ in range(job["steps"] + WARMUP):
            hand.wait_s = hand.launch_s = 0.0
            for m in modules:
                m.log["fwd"] = m.log["bwd"] = 0.0
            t0 = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()
            wall = time.perf_counter() - t0
            slept = [sum(m.log[k] for m in modules) for k in ("fwd", "bwd")]
            steps.append([1e3 * v for v in (wall, hand.wait_s, hand.launch_s, *slept)])
        summary = prof.stop().to_dict() if prof is not None else None
    finally:
        hand.remove()
    steady = steps[WARMUP:]
    out = {
        "wall_ms": statistics.mean(s[0] for s in steady),
        "wall_median_ms": statistics.median(s[0] for s in steady),
        "wait_ms": statistics.mean(s[1] for s in steady),
        "launch_ms": statistics.mean(s[2] for s in steady),
        "fwd_slept_ms": statistics.mean(s[3] for s in steady),
        "bwd_slept_ms": statistics.mean(s[4] for s in steady),
    }
    if summary is not None and rank == 0:
        out["summary"] = {
            k: summary.get(k) for k in ("pipeline", "per_step_ms", "ranks", "advice", "comm_source", "comm_unmeasured")
        }
    return out


def pp_worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """Every job of ``cfg["jobs"]`` in turn (all ranks the same): its figures on this rank."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return [_run_job(rank, world, job) for job in cfg["jobs"]]


# --------------------------------------------------------------------------- the runs


def more_microbatches(p: int, m: int, v: int = 1) -> list[int]:
    """The counts the ``pipeline_bubble`` finding chooses its m' among (the run's doubled
    until the equal-stage bubble is at most 10%, at most ``BATCH``; v stages a rank): each
    is run beside it, so that whichever the finding picks is measured."""
    counts, more = [], 2 * m
    while more <= BATCH:
        counts.append(more)
        if (p - 1) / (more * v + p - 1) <= 0.10:
            break
        more *= 2
    return counts


def plan(mode: dict) -> dict[int, list[tuple[tuple, bool]]]:
    """Per stage count, the runs in the order they go: ((p, schedule, m, kind), profiled),
    kind: equal, unequal or balanced (the unequal stages' total evened out)."""
    out: dict[int, list[tuple[tuple, bool]]] = {2: [], 4: []}

    def add(key: tuple, profiled: bool) -> None:
        if (key, profiled) not in out[key[0]]:
            out[key[0]].append((key, profiled))

    for p in (2, 4):
        for schedule in mode["schedules"][p]:
            for m in mode["microbatches"][p]:
                add((p, schedule, m, "equal"), True)
                add((p, schedule, m, "unequal"), True)
                add((p, schedule, m, "balanced"), False)
                add((p, schedule, 2 * m, "equal"), False)
            for m in mode["predict_from"][p]:
                for more in more_microbatches(p, m):
                    add((p, schedule, more, "equal"), False)
    for schedule in mode["schedules"][4]:  # the 4-stage model in 2 stages of twice the time
        for m in mode["microbatches"][4]:
            add((2, schedule, m, "equal"), False)
    if mode.get("interleaved"):  # 1F1B's runs as ScheduleInterleaved1F1B: what its projection predicts
        for p in (2, 4):
            for m in mode["predict_from"][p]:
                add((p, "interleaved", m, "equal"), True)
                add((p, "interleaved", m, "equal"), False)
                add((p, "interleaved", 2 * m, "equal"), False)
                for more in more_microbatches(p, m, CHUNKS):
                    add((p, "interleaved", more, "equal"), False)
    return out


def job_of(key: tuple, profiled: bool, mode: dict) -> dict:
    p, schedule, m, kind = key
    return {
        "key": list(key),
        "profile": profiled,
        "schedule": schedule,
        "m": m,
        "stage_ms": stage_ms(p, kind in ("unequal", "balanced"), kind == "balanced"),
        "steps": mode["steps"] if profiled else mode["plain_steps"],
    }


# --------------------------------------------------------------------------- the figures


def label(key: tuple) -> str:
    p, schedule, m, kind = key
    return f"p={p} {SCHEDULE_NAMES[schedule][8:]} {kind}, m={m}"


def _timeline_bubble(ranks: list[dict], m: int) -> float:
    """The median stage's idle share of the step the emulated times (as slept) give:
    step ``sum(s_i) + (m - 1) max(s_i)``, stage i idle for it less ``m s_i``."""
    s = [(r["fwd_slept_ms"] + r["bwd_slept_ms"]) / m for r in ranks]
    step = sum(s) + (m - 1) * max(s)
    return statistics.median((step - m * si) / step for si in s)


def bubble_figures(key: tuple, ranks: list[dict]) -> dict:
    """One profiled run's figures (dtprofile's and the references) by name."""
    p, schedule, m, _ = key
    v = CHUNKS if schedule == "interleaved" else 1
    pipe = ranks[0]["summary"]["pipeline"] or {}
    stages = sorted(pipe.get("stage_figures") or [], key=lambda f: f["rank"])
    if len(stages) != p:
        raise ValueError(f"{len(stages)} stage figures for {p} stages")
    return {
        "bubble": pipe.get("bubble_fraction"),
        "hand": statistics.median(r["wait_ms"] / r["wall_ms"] for r in ranks),
        "theory": pipe.get("bubble_fraction_theory"),
        "formula": (p - 1) / (m * v + p - 1),
        "timeline": _timeline_bubble(ranks, m) if v == 1 else None,
        "waits": [f["wait_ms"] for f in stages],
        "hand_waits": [r["wait_ms"] for r in ranks],
        "idle": [r["wall_ms"] - r["fwd_slept_ms"] - r["bwd_slept_ms"] for r in ranks],
        "fwd": [f["forward_ms"] for f in stages],
        "fwd_slept": [r["fwd_slept_ms"] for r in ranks],
        "bwd": [f["backward_ms"] for f in stages],
        "bwd_slept": [r["bwd_slept_ms"] for r in ranks],
        "step": (ranks[0]["summary"].get("per_step_ms") or {}).get("step"),
        "wall": statistics.median(r["wall_ms"] for r in ranks),
        "launch": [r["launch_ms"] for r in ranks],
        "comm_source": ranks[0]["summary"].get("comm_source"),
    }


def predictions(key: tuple, ranks: list[dict]) -> dict:
    """What dtprofile predicts from one profiled run: {(what, m' or p'): step ms}."""
    from dtprofile.analysis.pipeline_plan import pipeline_view, step_at

    p, schedule, m, kind = key
    s = ranks[0]["summary"]
    proj = (s.get("pipeline") or {}).get("projection") or {}
    by_m = dict(zip(proj.get("microbatches") or [], proj.get("step_ms_by_microbatches") or [], strict=False))
    by_p = dict(zip(proj.get("stages") or [], proj.get("step_ms_by_stages") or [], strict=False))
    view = pipeline_view(s)
    out: dict = {}
    bubble = next((a for a in s.get("advice") or [] if a["id"] == "pipeline_bubble"), None)
    if kind == "equal":
        if bubble is not None and (bubble["evidence"].get("more_microbatches") or m) > m:
            # (none when the finding says more microbatches would not pay)
            more = bubble["evidence"].get("more_microbatches")
            out[("advice", more)] = bubble["evidence"].get("step_ms_at_more_microbatches")
            if f"n_microbatches={more}" not in (bubble.get("action") or ""):
                out[("advice", more)] = None  # (the action and the evidence disagree: shown as failed)
        out[("2m", 2 * m)] = by_m.get(2 * m, step_at(view, microbatches=2 * m) if view else None)
        if p == 4:
            out[("stages", 2)] = by_p.get(2)
        if schedule == "1f1b":  # (its interleaved counterpart, CHUNKS stages a rank)
            by_v = dict(
                zip(proj.get("stages_per_rank") or [], proj.get("step_ms_by_stages_per_rank") or [], strict=False)
            )
            out[("interleaved", CHUNKS)] = by_v.get(CHUNKS)
    else:
        out[("balanced", p)] = proj.get("balanced_step_ms")
    return out


def _ms(value: float | None) -> str:
    return fmt(value, ".1f", "failed") + (" ms" if value is not None else "")


def _list(values: list[float] | None, spec: str = ".1f") -> str:
    return "failed" if not values else " / ".join(format(v, spec) for v in values)


def _worst(values: list[float] | None, refs: list[float] | None) -> str:
    """The per-stage relative error furthest from 0, signed."""
    if not values or not refs:
        return "n/a"
    errs = [rel_err(v, r) for v, r in zip(values, refs, strict=True)]
    errs = [e for e in errs if e is not None]
    return pct(max(errs, key=abs)) if errs else "n/a"


def _median_lists(lists: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*lists, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (< ~40 s on 2 cores)")
    args = ap.parse_args(argv)
    mode = QUICK if args.quick else FULL
    budget = Deadline(150 if args.quick else 1800)
    (f4, b4), (f2, b2) = stage_ms(4, False)[0], stage_ms(2, False)[0]
    print(
        f"dtprofile pipeline benchmark ({'quick' if args.quick else 'full'} mode): torch.distributed.pipelining, "
        f"a stage a rank, gloo on 127.0.0.1; global batch {BATCH} in m microbatches; emulated device time a step "
        f"{f4:g} ms forward + {b4:g} ms backward a stage in 4 stages, {f2:g} + {b2:g} in 2; unequal: one stage "
        f"{SLOW:g}x (the last of 2, the third of 4)"
    )
    print(describe_machine(machine()))
    t0 = time.monotonic()
    failed: list[str] = []
    plans = plan(mode)
    # results[(key, profiled)]: per round, the ranks' figures
    results: dict[tuple, list[list[dict]]] = {}
    for rnd in range(mode["rounds"]):
        for p in (2, 4):
            jobs = [job_of(key, profiled, mode) for key, profiled in plans[p]]
            try:
                ranks = launch(pp_worker, p, {"jobs": jobs}, budget.left(900))
            except Exception as exc:  # report it as failed rows, go on with the rest
                failed.append(f"{p}-stage runs, round {rnd + 1}")
                print(
                    f"\n{p}-stage runs failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}",
                    file=sys.stderr,
                )
                continue
            for i, (key, profiled) in enumerate(plans[p]):
                results.setdefault((key, profiled), []).append([r[i] for r in ranks])

    # ---- 1. the bubble
    profiled_keys = [key for p in (2, 4) for key, profiled in plans[p] if profiled]
    figures: dict[tuple, dict | None] = {}
    for key in profiled_keys:
        try:
            per_round = [bubble_figures(key, ranks) for ranks in results.get((key, True), [])]
        except Exception as exc:
            print(f"\n{label(key)}: figures failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            per_round = []
        if not per_round:
            failed.append(label(key))
            figures[key] = None
            continue
        fig = {
            k: median(r[k] for r in per_round)
            for k in ("bubble", "hand", "theory", "formula", "timeline", "step", "wall")
        }
        for k in ("waits", "hand_waits", "idle", "fwd", "fwd_slept", "bwd", "bwd_slept", "launch"):
            fig[k] = _median_lists([r[k] for r in per_round])
        fig["comm_source"] = per_round[0]["comm_source"]
        figures[key] = fig
    rows = []
    for key in profiled_keys:
        f = figures[key]
        if f is None:
            rows.append([label(key)] + ["failed"] * 8)
            continue
        if f["bubble"] is None:
            failed.append(f"{label(key)}: bubble_fraction")
        rows.append(
            [
                label(key),
                fmt(f["bubble"], ".3f", "failed"),
                fmt(f["hand"], ".3f"),
                pct(rel_err(f["bubble"], f["hand"])),
                fmt(f["formula"], ".3f") + ("" if key[3] == "equal" else " (equal only)"),
                pct(rel_err(f["bubble"], f["formula"])) if key[3] == "equal" else "n/a",
                fmt(f["timeline"], ".3f"),
                pct(rel_err(f["bubble"], f["timeline"])),
                "yes" if f["theory"] is not None and abs(f["theory"] - f["formula"]) < 1e-9 else "no",
            ]
        )
    print(
        table(
            [
                "run",
                "bubble (dtprofile)",
                "by hand",
                "vs hand",
                "(p-1)/(m v+p-1)",
                "vs formula",
                "timeline",
                "vs timeline",
                "theory field = formula",
            ],
            rows,
            title=f"1a. The bubble: dtprofile's pipeline.bubble_fraction (the median stage's waits over its step) "
            f"against the waits timed by hand over the wall step, the formula and the emulated timeline "
            f"({mode['rounds']} round(s) of {mode['steps']} steps after {WARMUP} warm-up)",
        )
    )
    rows = []
    for key in profiled_keys:
        f = figures[key]
        if f is None:
            rows.append([label(key)] + ["failed"] * 10)
            continue
        rows.append(
            [
                label(key),
                _list(f["waits"]),
                _list(f["hand_waits"]),
                _worst(f["waits"], f["hand_waits"]),
                _list(f["idle"]),
                _list(f["fwd"]),
                _list(f["fwd_slept"]),
                _worst(f["fwd"], f["fwd_slept"]),
                _list(f["bwd"]),
                _list(f["bwd_slept"]),
                _worst(f["bwd"], f["bwd_slept"]),
            ]
        )
    print(
        table(
            [
                "run",
                "waits ms (dtprofile)",
                "by hand",
                "worst",
                "wall - slept",
                "forward ms (dtprofile)",
                "slept",
                "worst",
                "backward ms (dtprofile)",
                "slept",
                "worst",
            ],
            rows,
            title="1b. Each stage's waits, forward and backward a step (stage 0 / 1 / ...): dtprofile's stage_figures "
            "against the waits timed by hand, the wall step less the time slept, and the time slept in the passes",
        )
    )
    notes = [
        f"  {label(k)}: step {fmt(f['step'], '.1f')} ms (dtprofile) vs {fmt(f['wall'], '.1f')} ms (wall, same steps); "
        f"time inside the launches by hand {_list(f['launch'], '.2f')} ms; comm_source {f['comm_source']!r}"
        for k, f in figures.items()
        if f is not None
    ]
    print("\n".join(notes))

    # ---- 2. predictions against measured runs
    def measured(key: tuple) -> float | None:
        runs = results.get((key, False)) or []
        return median(statistics.median(r["wall_median_ms"] for r in ranks) for ranks in runs)

    def slept(key: tuple, profiled: bool) -> float | None:
        """The slowest stage's compute a step as slept (the emulated device time, its sleeps'
        overshoot included), the median over rounds."""
        runs = results.get((key, profiled)) or []
        return median(max(r["fwd_slept_ms"] + r["bwd_slept_ms"] for r in ranks) for ranks in runs)

    rows = []
    for key in profiled_keys:
        p, schedule, m, kind = key
        per_round = []
        for ranks in results.get((key, True), []):
            try:
                per_round.append(predictions(key, ranks))
            except Exception as exc:
                print(f"\n{label(key)}: predictions failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        expected = [("2m", 2 * m)] if kind == "equal" else [("balanced", p)]
        if kind == "equal" and m in mode["predict_from"][p]:
            expected.insert(0, ("advice", 0))  # (the finding's m', read below)
        if kind == "equal" and p == 4 and schedule != "interleaved":
            expected.append(("stages", 2))
        if kind == "equal" and schedule == "1f1b" and mode.get("interleaved") and m in mode["predict_from"][p]:
            expected.append(("interleaved", CHUNKS))
        for what, n in expected:
            if what == "advice":
                found = {w[1] for r in per_round for w in r if w[0] == "advice"}
                if not found:  # (the finding said more microbatches would not pay: nothing to run)
                    print(f"  {label(key)}: pipeline_bubble suggests no other microbatch count")
                    continue
                n = max(found)
            predicted = median(r.get((what, n)) for r in per_round)
            target = {
                "advice": (p, schedule, n, "equal"),
                "2m": (p, schedule, n, "equal"),
                "balanced": (p, schedule, m, "balanced"),
                "stages": (2, schedule, m, "equal"),
                "interleaved": (p, "interleaved", m, "equal"),
            }[what]
            actual = measured(target)
            change = {
                "advice": f"-> m'={n} (pipeline_bubble's n_microbatches)",
                "2m": f"-> 2m={n}",
                "balanced": "-> balanced (projection.balanced_step_ms)",
                "stages": "-> p'=2 (step_ms_by_stages)",
                "interleaved": f"-> {n} stages a rank (step_ms_by_stages_per_rank)",
            }[what]
            if predicted is None or actual is None:
                failed.append(f"{label(key)} {change}")
            rows.append(
                [
                    label(key),
                    change,
                    _ms(predicted),
                    _ms(actual),
                    pct(rel_err(predicted, actual)),
                    label(target) + ", plain",
                    f"{fmt(slept(key, True), '.1f')} -> {fmt(slept(target, False), '.1f')} ms",
                ]
            )
    print(
        table(
            [
                "profiled run",
                "what-if",
                "predicted step",
                "measured step",
                "rel. error",
                "measured run",
                "slowest stage's compute (slept): profiled -> measured run",
            ],
            rows,
            title="2. dtprofile's predictions from a profiled run against a run made that way (wall-clock median step, "
            "no dtprofile; the global batch fixed)",
        )
    )
    print(
        f"\nwall time {time.monotonic() - t0:.0f} s; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in machine()['load'])}"
    )
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
