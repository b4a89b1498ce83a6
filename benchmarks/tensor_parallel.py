"""dtprofile on tensor-parallel (DTensor) models, against references it does not produce.

    python benchmarks/tensor_parallel.py            # full mode (a few minutes)
    python benchmarks/tensor_parallel.py --quick    # a short run (the test suite runs this)

The model: a tensor-parallel MLP block as ``parallelize_module`` builds it (LayerNorm, then
``Linear(IN, HIDDEN)`` Colwise, ReLU, ``Linear(HIDDEN, IN)`` Rowwise): forward all-reduces
the Rowwise output and backward the Colwise input's gradient, each ``batch x IN`` fp32
(1 MB at the default sizes), on a 1-D gloo mesh of 2 ranks on 127.0.0.1. The device's
time is emulated (``_common.DeviceTime``): between the two layers each rank sleeps
``FORWARD_MS`` in forward and ``BACKWARD_MS`` in backward while the host idles (the
matmuls' time on a device; the CPU's own matmuls are kept small), so that the compute is
known and the ranks do not compete for the cores; the all-reduces are real. The sleep sits
where a device's matmuls run: before the forward all-reduce, before the backward one.

1. *Communication and compute of the TP run.* ``dtprofile.profile(model, opt)`` on the 2
   ranks; in the same steps the same collectives are timed by hand, outside dtprofile:
   DTensor's ``_functional_collectives`` entry points and the ``wait_tensor`` that
   ``AsyncCollectiveTensor`` calls wrapped with ``perf_counter`` (launch to the end of the
   wait: the total; the time inside the launch and inside the wait: what the caller was
   blocked). Beside them: ``dist.all_reduce`` of the same bytes on the same group, alone,
   and each rank's shard of the layers as plain local modules (the same shapes and sleep,
   no collective), its forward and backward timed by hand: the compute without
   communication.
2. *The projection's what-if against reality.* ``project_summary(summary, tp=1,
   gpus=[1])`` from the tp=2 run against the same model unsharded on 1 process with the
   whole model's device time (twice a rank's), its step timed by wall clock without
   dtprofile. Then a 2 x 2 mesh (dp=2, tp=2; ``fully_shard`` on dp over the TP block, as
   tests/tp_workers.py's ``fsdp_tp``): ``project_summary(summary, gpus=[2])`` from the
   1-replica tp=2 run against the 2-replica run's measured step (weak scaling: the same
   batch per replica), and the 2-replica run's own projection to 1 replica against the
   1-replica run's measured step.

Segments alternate over rounds (profiled, then the plain references), so load from
elsewhere hits them alike; figures are medians over rounds. Nothing is tuned to agree:
the tables show what happened. Exits 1 if a run failed.
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
import torch.distributed as dist  # noqa: E402
from _common import Deadline, DeviceTime, describe_machine, fmt, launch, machine, median, pct, rel_err, table  # noqa: E402
from torch import nn  # noqa: E402

IN, HIDDEN, BATCH = 1024, 128, 256
FORWARD_MS, BACKWARD_MS = 10.0, 20.0  # a rank's device time at tp=2; the whole model's is twice that
WARMUP = 3
QUICK = dict(rounds=1, steps=14, single_steps=12, mesh_steps=12)
FULL = dict(rounds=3, steps=60, single_steps=60, mesh_steps=60)

PHASES = ("forward", "backward")
#: Table 1: (label, key of _tp_figures, what the reference is).
ROWS = (
    ("TP collectives per step", "count", "funcol calls timed by hand, same steps"),
    ("TP bytes per step (MB)", "bytes", "funcol calls timed by hand (the input tensors' bytes)"),
    ("TP comm total (launch to end of wait)", "total", "by hand: funcol launch to the end of wait_tensor"),
    ("TP comm waited (exposed)", "waited", "by hand: time inside the launch and wait_tensor, same steps"),
    ("  of it launched in forward", "fwd_waited", "by hand, launched outside a backward"),
    ("  of it launched in backward", "bwd_waited", "by hand, launched inside a backward"),
    (
        "TP comm total vs the link alone",
        "alone",
        "dist.all_reduce of the same bytes, same group, back to back, x count",
    ),
    ("exposed comm (per_step_ms.comm_exposed)", "exposed", "by hand: time inside the launch and wait_tensor"),
    ("forward compute", "forward", "the TP model, funcol.all_reduce a local copy (no comm), by hand"),
    ("forward compute vs plain layers", "forward_local", "the rank's shard as plain nn.Linear layers, by hand"),
    ("backward compute", "backward", "the TP model, funcol.all_reduce a local copy (no comm), by hand"),
    ("backward compute vs plain layers", "backward_local", "the rank's shard as plain nn.Linear layers, by hand"),
    ("optimizer", "optimizer", "the TP model, funcol.all_reduce a local copy: opt.step(), by hand"),
    ("step", "step", "wall clock of the same steps, by hand"),
)
PROJ_ROWS = (
    "tp=2, 1 replica -> tp=1, 1 device",
    "tp=2, 1 replica -> 2 replicas",
    "tp=2, 1 replica -> 2 replicas, --bandwidth loopback",
    "dp=2 x tp=2 -> 1 replica",
)


class Sleep(nn.Module):
    """The device's time of the block's matmuls: slept in forward and in backward."""

    def __init__(self, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DeviceTime.apply(x, self.forward_s, self.backward_s)


def block(hidden: int, device_scale: float) -> nn.Sequential:
    """LayerNorm, Linear(IN, hidden), ReLU, the device's time, Linear(hidden, IN):
    ``device_scale`` times a tp=2 rank's device time."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LayerNorm(IN),
        nn.Linear(IN, hidden),
        nn.ReLU(),
        Sleep(FORWARD_MS * device_scale, BACKWARD_MS * device_scale),
        nn.Linear(hidden, IN),
    )


def tp_model(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(block(HIDDEN, 1.0), mesh, {"1": ColwiseParallel(), "4": RowwiseParallel()})


def batch_for(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, IN, generator=g)


class ByHand:
    """DTensor's collectives timed outside dtprofile: ``funcol``'s entry points and its
    ``wait_tensor`` wrapped with perf_counter (installed before dtprofile, so each span
    holds dtprofile's own timing). Per collective: its bytes, the phase it was launched in
    (backward: inside an autograd backward, else forward), launch to the end of its wait
    (total), and the time inside the launch call and inside the wait call."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.funcol = funcol
        self.saved = {n: getattr(funcol, n) for n in (*self.NAMES, "wait_tensor")}
        self.open: dict[int, tuple[float, float, int, str]] = {}
        self.spans: list[tuple[int, str, float, float, float]] = []
        for name in self.NAMES:
            setattr(funcol, name, self._launch(self.saved[name]))
        funcol.wait_tensor = self._wait

    def _launch(self, original: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            t0 = time.perf_counter()
            out = original(tensor, *args, **kwargs)
            t1 = time.perf_counter()
            nbytes = tensor.numel() * tensor.element_size()
            elem = getattr(out, "elem", None)
            if elem is not None and not getattr(out, "completed", True):
                self.open[elem.data_ptr()] = (t0, (t1 - t0) * 1e3, nbytes, phase)
            else:  # waited inside the call
                self.spans.append((nbytes, phase, (t1 - t0) * 1e3, (t1 - t0) * 1e3, 0.0))
            return out

        return call

    def _wait(self, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.saved["wait_tensor"](tensor)
        t1 = time.perf_counter()
        entry = self.open.pop(tensor.data_ptr(), None)
        if entry is not None:
            start, launch_ms, nbytes, phase = entry
            self.spans.append((nbytes, phase, (t1 - start) * 1e3, launch_ms, (t1 - t0) * 1e3))
        return out

    def take(self) -> list[tuple[int, str, float, float, float]]:
        """This step's collectives: (bytes, phase, total ms, launch call ms, wait call ms)."""
        spans, self.spans = self.spans, []
        return spans

    def remove(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.funcol, name, fn)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _plain_steps(model: nn.Module, steps: int, replica: int) -> list[float]:
    """``steps`` SGD steps without dtprofile: each step's wall time (ms)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    x, y = batch_for(replica)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        walls.append((time.perf_counter() - t0) * 1e3)
    return walls


def _profiled(model: nn.Module, steps: int, replica: int, by_hand: ByHand | None = None) -> dict:
    """``steps`` SGD steps inside ``dtprofile.profile``: rank 0's summary, each step's
    wall time and (with ``by_hand``) its collectives as timed by hand."""
    import dtprofile

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    x, y = batch_for(replica)
    walls, spans = [], []
    with dtprofile.profile(model, opt, warmup_steps=WARMUP, every_n_steps=10_000) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            walls.append((time.perf_counter() - t0) * 1e3)
            if by_hand is not None:
                spans.append(by_hand.take())
    return {"summary": prof.report().to_dict(), "walls": walls, "spans": spans}


def _timed_passes(model: nn.Module, steps: int) -> dict:
    """Forward, backward and the update of ``steps`` SGD steps, each timed by hand (ms)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    x, y = batch_for(0)
    fwd, bwd, opt_ms = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        loss = (out - y).pow(2).mean()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t3 - t2) * 1e3)
        opt_ms.append((t4 - t3) * 1e3)
    return {"forward": fwd[WARMUP:], "backward": bwd[WARMUP:], "optimizer": opt_ms[WARMUP:]}


def _local_shard_steps(steps: int, tp: int) -> dict:
    """A rank's shard as plain local layers (Linear(IN, HIDDEN/tp), Linear(HIDDEN/tp, IN),
    the same sleep), no DTensor, no collective: its passes timed by hand."""
    return _timed_passes(block(HIDDEN // tp, 1.0), steps)


def _no_comm_steps(mesh: Any, steps: int) -> dict:
    """The same TP model (DTensor, the same shards and sleep) with ``funcol.all_reduce``
    replaced by a local copy: DTensor's host work without communication, its passes timed
    by hand (the values are wrong; the shapes and the dispatch are the TP run's)."""
    import torch.distributed._functional_collectives as funcol

    saved = funcol.all_reduce
    funcol.all_reduce = lambda tensor, *args, **kwargs: tensor.clone()
    try:
        return _timed_passes(tp_model(mesh), steps)
    finally:
        funcol.all_reduce = saved


def _allreduce_alone(group: Any, repeats: int) -> list[float]:
    """``dist.all_reduce`` of one activation (BATCH x IN fp32) on ``group``, alone: after
    one barrier, ``repeats`` back to back, each timed (ms; two more first, not kept)."""
    buf = torch.randn(BATCH, IN)
    dist.barrier(group=group)
    out = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# --------------------------------------------------------------------------- the ranks


def tp_worker(rank: int, world: int, cfg: dict) -> dict:
    """The tp=2 run: rounds of (profiled with the by-hand timing, the local shard alone,
    the all-reduce alone), and a plain segment first (warm-up, weights apart)."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _plain_steps(tp_model(mesh), WARMUP + 2, 0)  # warm-up: DTensor's caches, gloo's pairs
    rounds = []
    for _ in range(cfg["rounds"]):
        by_hand = ByHand()
        try:
            prof = _profiled(tp_model(mesh), cfg["steps"], 0, by_hand)
        finally:
            by_hand.remove()
        rounds.append(
            {
                "summary": prof["summary"] if rank == 0 else None,
                "walls": prof["walls"][WARMUP:],
                "spans": prof["spans"][WARMUP:],
                "local": _local_shard_steps(cfg["steps"], world),
                "no_comm": _no_comm_steps(mesh, cfg["steps"]),
                "alone_ms": _allreduce_alone(mesh.get_group(0), 2 * cfg["steps"]),
            }
        )
    return {"rounds": rounds}


def single_worker(rank: int, world: int, cfg: dict) -> dict:
    """The unsharded model on 1 process, the whole model's device time: wall step (ms)."""
    warnings.filterwarnings("ignore")
    walls = []
    for _ in range(cfg["rounds"]):
        walls.append(statistics.median(_plain_steps(block(HIDDEN, 2.0), cfg["single_steps"] + WARMUP, 0)[WARMUP:]))
    return {"wall_ms": walls}


def mesh_worker(rank: int, world: int, cfg: dict) -> dict:
    """dp=2 x tp=2: TP on tp, FSDP2 on dp; rounds of (plain: wall step, profiled)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    replica = mesh.get_local_rank("dp")

    def build() -> nn.Module:
        return fully_shard(tp_model(mesh["tp"]), mesh=mesh["dp"])

    _plain_steps(build(), WARMUP + 2, replica)
    rounds = []
    for _ in range(cfg["rounds"]):
        walls = _plain_steps(build(), cfg["mesh_steps"] + WARMUP, replica)[WARMUP:]
        prof = _profiled(build(), cfg["mesh_steps"] + WARMUP, replica)
        rounds.append(
            {
                "wall_ms": statistics.median(walls),
                "profiled_wall_ms": statistics.mean(prof["walls"][WARMUP:]),
                "summary": prof["summary"] if rank == 0 else None,
            }
        )
    return {"rounds": rounds}


# --------------------------------------------------------------------------- the tables


def _per_step(ranks: list[dict], fn: Any) -> float | None:
    """The median over ranks of each rank's mean over its steps of ``fn(step's spans)``."""
    return median(statistics.mean(fn(step) for step in r["spans"]) for r in ranks)


def _tp_figures(rounds: list[list[dict]]) -> list[dict]:
    """Per round, (dtprofile, reference) pairs: dtprofile's from rank 0's summary (medians
    over ranks), the references the median over ranks of each rank's mean per step."""
    per_round = []
    for i, r0 in enumerate(rounds[0]):
        s = r0["summary"]
        tp = (s.get("comm_by_dim") or {}).get("tp") or {}
        total = tp.get("total") or {}
        phases = ((tp.get("kinds") or {}).get("all_reduce") or {}).get("phases") or {}
        per = s.get("per_step_ms") or {}
        ranks = [rank_rounds[i] for rank_rounds in rounds]
        count = _per_step(ranks, len)
        nbytes = _per_step(ranks, lambda st: sum(c[0] for c in st))
        # The caller waits in the launch call and in the wait call: both are dtprofile's "waited".
        waits = {ph: _per_step(ranks, lambda st, ph=ph: sum(c[3] + c[4] for c in st if c[1] == ph)) for ph in PHASES}
        hand = lambda key: median(statistics.mean(r[key[0]][key[1]]) for r in ranks)  # noqa: E731
        per_round.append(
            {
                "count": (total.get("count"), count),
                "bytes": (
                    None if total.get("bytes") is None else total["bytes"] / 1e6,
                    None if nbytes is None else nbytes / 1e6,
                ),
                "total": (total.get("total_ms"), _per_step(ranks, lambda st: sum(c[2] for c in st))),
                "waited": (total.get("waited_ms"), _per_step(ranks, lambda st: sum(c[3] + c[4] for c in st))),
                "fwd_waited": ((phases.get("forward") or {}).get("waited_ms"), waits["forward"]),
                "bwd_waited": ((phases.get("backward") or {}).get("waited_ms"), waits["backward"]),
                "alone": (total.get("total_ms"), median(statistics.median(r["alone_ms"]) for r in ranks) * count),
                "exposed": (per.get("comm_exposed"), _per_step(ranks, lambda st: sum(c[3] + c[4] for c in st))),
                "forward": (per.get("forward"), hand(("no_comm", "forward"))),
                "forward_local": (per.get("forward"), hand(("local", "forward"))),
                "backward": (per.get("backward"), hand(("no_comm", "backward"))),
                "backward_local": (per.get("backward"), hand(("local", "backward"))),
                "optimizer": (per.get("optimizer"), hand(("no_comm", "optimizer"))),
                "step": (per.get("step"), median(statistics.mean(r["walls"]) for r in ranks)),
                "launch": (None, _per_step(ranks, lambda st: sum(c[3] for c in st))),
                "comm_source": s.get("comm_source"),
                "mesh": [(d.get("label"), d.get("size"), d.get("role")) for d in (s.get("mesh") or {}).get("dims", [])],
            }
        )
    return per_round


def _med(per_round: list[dict], key: str, at: int) -> float | None:
    return median(r[key][at] for r in per_round)


def _proj_step(summary: dict, **kw: Any) -> tuple[float | None, dict]:
    from dtprofile.analysis.projection import project_summary

    p = project_summary(summary, scaling="weak", **kw)
    return (p.get("step_ms") or [None])[0], p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (< ~40 s on 2 cores)")
    ap.add_argument("--no-mesh", action="store_true", help="leave out the 4-rank dp=2 x tp=2 run")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    budget = Deadline(150 if args.quick else 1200)
    print(
        f"dtprofile tensor-parallel benchmark ({'quick' if args.quick else 'full'} mode): gloo on 127.0.0.1, "
        f"TP MLP block LayerNorm({IN}) -> Linear({IN}, {HIDDEN}) Colwise -> ReLU -> Linear({HIDDEN}, {IN}) Rowwise, "
        f"batch {BATCH}; emulated device time {FORWARD_MS:g} ms forward + {BACKWARD_MS:g} ms backward a rank at tp=2"
    )
    print(describe_machine(machine()))
    t0 = time.monotonic()
    failed: list[str] = []

    def run(name: str, fn: Any, world: int, cap: float) -> list | None:
        try:
            return launch(fn, world, p, budget.left(cap))
        except Exception as exc:  # report it as a failed row, go on with the rest
            failed.append(name)
            print(f"\n{name} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}", file=sys.stderr)
            return None

    tp = run("tp=2 run", tp_worker, 2, 600)
    single = run("1-process run", single_worker, 1, 300)
    meshed = None if args.no_mesh else run("dp=2 x tp=2 run", mesh_worker, 4, 600)

    # ---- 1. communication and compute
    rows = []
    per_round = _tp_figures([r["rounds"] for r in tp]) if tp else []
    for label, key, what in ROWS:
        if not per_round:
            rows.append([label, "failed", "failed", "n/a", what])
            continue
        value, ref = _med(per_round, key, 0), _med(per_round, key, 1)
        spec = ".1f" if key == "count" else ".3f" if key == "bytes" else ".2f"
        unit = "" if key in ("count", "bytes") else " ms"
        rows.append(
            [
                label,
                fmt(value, spec) + (unit if value is not None else ""),
                fmt(ref, spec) + (unit if ref is not None else ""),
                pct(rel_err(value, ref)),
                what,
            ]
        )
    print(
        table(
            ["figure (dtprofile)", "dtprofile", "reference", "rel. error", "reference is"],
            rows,
            title=f"1. TP communication and compute per step, tp=2 on 2 ranks "
            f"({p['rounds']} round(s) of {p['steps']} steps, {WARMUP} warm-up)",
        )
    )
    if per_round:
        print(
            f"  mesh found: {per_round[0]['mesh']}; comm_source {per_round[0]['comm_source']!r}; "
            f"emulated device time a step {FORWARD_MS + BACKWARD_MS:g} ms "
            f"(forward {FORWARD_MS:g}, backward {BACKWARD_MS:g}); by hand, time inside the funcol launch calls "
            f"{fmt(_med(per_round, 'launch', 1))} ms a step"
        )

    # ---- 2. the projection
    summaries_tp = [r["summary"] for r in (tp[0]["rounds"] if tp else [])]
    summaries_mesh = [r["summary"] for r in (meshed[0]["rounds"] if meshed else [])]
    measured_tp1 = median(single[0]["wall_ms"]) if single else None
    measured_tp2 = median(statistics.median(r["walls"]) for r in tp[0]["rounds"]) if tp else None
    measured_mesh = median(r["wall_ms"] for r in meshed[0]["rounds"]) if meshed else None
    # The loopback's rate as a user would give it (--bandwidth): the all-reduce alone of the
    # tp=2 run, 2 ranks (a 2-rank ring moves the buffer once: busbw = bytes / time).
    alone_ms = median(statistics.median(r["alone_ms"]) for rank in (tp or []) for r in rank["rounds"])
    loopback_Bps = BATCH * IN * 4 / (alone_ms / 1e3) if alone_ms else None
    spec = [
        (PROJ_ROWS[0], summaries_tp, dict(tp=1, gpus=[1]), measured_tp1, "1 process, unsharded, 2x device time"),
        (PROJ_ROWS[1], summaries_tp, dict(gpus=[2]), measured_mesh, "dp=2 x tp=2, 4 ranks, FSDP2 on dp"),
        (
            PROJ_ROWS[2],
            summaries_tp,
            dict(gpus=[2], bandwidth=loopback_Bps),
            measured_mesh,
            "dp=2 x tp=2, 4 ranks, FSDP2 on dp",
        ),
        (PROJ_ROWS[3], summaries_mesh, dict(gpus=[1]), measured_tp2, "the tp=2 run's plain steps (no FSDP2)"),
    ]
    proj_rows, notes = [], []
    for label, summaries, kw, actual, what in spec:
        if label != PROJ_ROWS[0] and args.no_mesh:
            continue
        predicted, projection = None, None
        try:
            if summaries and kw.get("bandwidth", 0) is not None:
                out = [_proj_step(s, **kw) for s in summaries]
                predicted = median(v for v, _ in out)
                # The parts shown below: the round whose step is nearest the median.
                projection = min(out, key=lambda o: abs((o[0] or 0.0) - (predicted or 0.0)))[1]
        except Exception as exc:
            print(f"\nprojection {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if predicted is None or actual is None:
            failed.append(f"projection {label}")
        proj_rows.append(
            [
                label,
                fmt(predicted, ".2f", "failed") + (" ms" if predicted is not None else ""),
                fmt(actual, ".2f", "failed") + (" ms" if actual is not None else ""),
                pct(rel_err(predicted, actual)),
                what,
            ]
        )
        if projection is not None:
            mesh = projection.get("mesh") or {}
            first = lambda key: (projection.get(key) or [None])[0]  # noqa: E731
            tp_part = (
                f"TP {fmt(mesh.get('tp_comm_ms'))} ms at tp={mesh.get('tp')}, "
                f"from {fmt(mesh.get('tp_comm_measured_ms'))} ms at tp={mesh.get('tp_measured')}"
            )
            dp_part = (
                f"DP {fmt(first('comm_ms'))} ms: {fmt((projection.get('grad_bytes') or 0) / 1e6, '.2f')} MB at "
                f"{fmt(projection.get('bandwidth_GBps'), '.3f')} GB/s, {projection.get('bandwidth_source')}"
            )
            notes.append(
                f"  {label}: compute {fmt(first('compute_ms'))} ms, comm exposed {fmt(first('comm_exposed_ms'))} ms "
                f"({tp_part}; {dp_part}); axis {mesh.get('axis')!r}"
            )
    print(
        table(
            ["projection (dtprofile)", "predicted step", "measured step", "rel. error", "measured run"],
            proj_rows,
            title="2. The projection's what-if against a measured run (wall clock, no dtprofile; weak scaling: "
            f"batch {BATCH} a replica)",
        )
    )
    print("\n".join(notes))
    if summaries_mesh:
        walls = [r["profiled_wall_ms"] for r in meshed[0]["rounds"]]
        at = walls.index(min(walls, key=lambda w: abs(w - median(walls))))  # the median round
        s = summaries_mesh[at]
        parts = ", ".join(
            f"{k} {fmt((v.get('total') or {}).get('total_ms'))} ms total / "
            f"{fmt((v.get('total') or {}).get('waited_ms'))} waited ({', '.join(sorted(v.get('kinds') or {}))})"
            for k, v in (s.get("comm_by_dim") or {}).items()
        )
        per = s.get("per_step_ms") or {}
        print(
            f"  dp=2 x tp=2 run (dtprofile, round {at + 1}): step {fmt(per.get('step'))} ms (wall clock of the same "
            f"steps {fmt(walls[at])} ms), forward {fmt(per.get('forward'))}, backward "
            f"{fmt(per.get('backward'))}, optimizer {fmt(per.get('optimizer'))}, comm_exposed "
            f"{fmt(per.get('comm_exposed'))}; comm_by_dim: {parts}; comm_source {s.get('comm_source')!r}; "
            f"mesh {[(d.get('label'), d.get('size'), d.get('role')) for d in (s.get('mesh') or {}).get('dims', [])]}"
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
