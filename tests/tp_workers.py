"""Rank functions for the tensor-parallel tests (tests/test_collectives.py): DTensor
models on a gloo DeviceMesh, trained with and without :class:`CollectiveTimer`.

Each is ``fn(rank, world, cfg) -> dict``, launched by :func:`distributed.run_ranks`.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch
import torch.distributed as dist
from distributed import run_ranks  # noqa: F401  (puts benchmarks/ on sys.path for the ranks)
from torch import nn

IN, HIDDEN = 64, 256
_TIMED = ("_TimedPacket", "_TimedWait")


def _mlp() -> nn.Module:
    """A plain input projection (so that backward all-reduces the TP block's input
    gradient), then the TP block: Linear 64->256 (Colwise), ReLU, Linear 256->64 (Rowwise)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, IN), nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN))


def _sp_block() -> nn.Module:
    """Sequence parallel: LayerNorm on sequence shards, then the TP block."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, IN), nn.LayerNorm(IN), nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN))


def build(kind: str, mesh, tp_dim: str = "tp") -> nn.Module:
    """``kind``: "tp" (Colwise / Rowwise), "sp" (SequenceParallel LayerNorm, the block
    on sequence shards), "fsdp_tp" (``tp`` on the mesh's tp dimension, ``fully_shard``
    on its dp dimension)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    if kind == "sp":
        model = _sp_block()
        return parallelize_module(
            model,
            mesh,
            {
                "1": SequenceParallel(),
                "2": ColwiseParallel(input_layouts=Shard(1)),
                "4": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    model = _mlp()
    tp_mesh = mesh[tp_dim] if kind == "fsdp_tp" else mesh
    model = parallelize_module(model, tp_mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
    if kind == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model, mesh=mesh["dp"])
    return model


def _batch(kind: str, step: int, batch: int, seq: int, seed_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed_rank + step)
    shape = (batch, seq, IN) if kind == "sp" else (batch, IN)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _ops_state() -> dict:
    """What a timer patches, by identity: the namespaces' packets and torch.distributed's
    functions (to tell that remove() put back exactly what was there)."""
    import torch.distributed.distributed_c10d as c10d

    out = {}
    for ns in ("_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
        namespace = getattr(torch.ops, ns)
        for name, value in vars(namespace).items():
            if name.startswith("_") and name != "_wrap_tensor_autograd":
                continue
            out[f"{ns}.{name}"] = (id(value), type(value).__name__)
    for name in (
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_to_all_single",
        "broadcast",
        "all_gather",
        "reduce_scatter",
    ):
        for module in (dist, c10d):
            out[f"{module.__name__}.{name}"] = id(getattr(module, name, None))
    return out


class ByHand:
    """The same collectives timed apart from the timer: ``funcol``'s entry points and its
    ``wait_tensor`` (which ``AsyncCollectiveTensor`` calls at first use) wrapped with
    perf_counter, outside the timer's packets (so each span holds the timer's)."""

    NAMES = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.funcol = funcol
        self.saved = {n: getattr(funcol, n) for n in (*self.NAMES, "wait_tensor")}
        self.open: dict[int, tuple[str, float]] = {}
        self.spans: list[tuple[str, float]] = []  # this step's (kind, ms from launch to the wait's end)
        for name, kind in self.NAMES.items():
            setattr(funcol, name, self._launch(self.saved[name], kind))
        funcol.wait_tensor = self._wait

    def _launch(self, original, kind):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            elem = getattr(out, "elem", None)
            if elem is not None and not getattr(out, "completed", True):
                self.open[elem.data_ptr()] = (kind, t0)
            else:  # waited inside (a gather on another dimension)
                self.spans.append((kind, (time.perf_counter() - t0) * 1e3))
            return out

        return call

    def _wait(self, tensor):
        out = self.saved["wait_tensor"](tensor)
        entry = self.open.pop(tensor.data_ptr(), None)
        if entry is not None:
            self.spans.append((entry[0], (time.perf_counter() - entry[1]) * 1e3))
        return out

    def take(self) -> list[tuple[str, float]]:
        spans, self.spans = self.spans, []
        return spans

    def remove(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.funcol, name, fn)


def _train(
    kind: str,
    mesh,
    steps: int,
    batch: int,
    seq: int,
    model: nn.Module | None = None,
    timer=None,
    data_rank: int = 0,
    reference: dict | None = None,
    by_hand: ByHand | None = None,
) -> tuple[nn.Module, list, list]:
    """``steps`` SGD steps of ``kind`` on ``mesh`` (of ``model``, else a new one); each
    step's figures and wall time (ms); ``by_hand``: each step's spans too (in
    ``reference["by_hand"]``)."""
    model = build(kind, mesh) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    figures, walls = [], []
    for step in range(steps):
        x, y = _batch(kind, step, batch, seq, data_rank)
        t0 = time.perf_counter()
        if timer is not None:
            timer.begin_step()
        loss = (model(x) - y).pow(2).mean()  # (sp: x, the output and y are this rank's sequence shard)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if timer is not None:
            figures.append(timer.end_step())
        walls.append((time.perf_counter() - t0) * 1e3)
        if by_hand is not None:
            reference.setdefault("by_hand", []).append(by_hand.take())
        if reference is not None:  # the same bytes, all-reduced apart on the same group, timed by hand
            buf = torch.randn(batch, IN)
            for _ in range(reference.get("repeats", 3)):
                t = time.perf_counter()
                dist.all_reduce(buf, group=reference["group"])
                reference.setdefault("ms", []).append((time.perf_counter() - t) * 1e3)
    return model, figures, walls


def tp_run(rank: int, world: int, cfg: dict) -> dict:
    """A TP (or SP) model trained twice from the same weights and batches: without the
    timer, then with it; the weights' digests, the timer's figures per step, a
    by-hand reference for the all-reduce of the same bytes, and the patched state
    before install, while installed and after remove."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtprofile.capture.collectives import CollectiveTimer, find_mesh

    torch.set_num_threads(1)
    kind, steps, batch, seq = cfg.get("kind", "tp"), cfg.get("steps", 10), cfg.get("batch", 16), cfg.get("seq", 8)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    before = _ops_state()
    data_rank = rank if kind == "sp" else 0  # (sp: each rank its own shard of the sequence)
    plain, _, walls_plain = _train(kind, mesh, steps, batch, seq, data_rank=data_rank)
    timed = build(kind, mesh)
    info = find_mesh(timed)
    timer = CollectiveTimer(info)  # (the default phase watches info's model's forward)
    installed = timer.install()
    during = _ops_state()
    reference: dict = {"group": mesh.get_group(0), "repeats": cfg.get("repeats", 3)}
    by_hand = ByHand()
    try:
        _, figures, walls = _train(
            kind,
            mesh,
            steps,
            batch,
            seq,
            model=timed,
            timer=timer,
            data_rank=data_rank,
            reference=reference,
            by_hand=by_hand,
        )
    finally:
        by_hand.remove()
    timer.remove()
    after = _ops_state()
    out = {
        "installed": installed,
        "enabled": timer.enabled,
        "error": timer.error,
        "mesh": info.to_dict() if info is not None else None,
        "digest_plain": _weights_digest(plain),
        "digest_timed": _weights_digest(timed),
        "figures": figures,
        "walls_plain": walls_plain,
        "walls": walls,
        "reference_ms": reference.get("ms", []),
        "by_hand": reference.get("by_hand", []),
        "patched_during": sorted(k for k, v in during.items() if isinstance(v, tuple) and v[1] in _TIMED),
        "left_after": sorted(k for k in before if after.get(k) != before[k]),
        "timed_after": sorted(k for k, v in after.items() if isinstance(v, tuple) and v[1] in _TIMED),
        "is_packet_after": type(torch.ops._c10d_functional.all_reduce) is torch._ops.OpOverloadPacket,
    }
    return out


def tp_phase_model(rank: int, world: int, cfg: dict) -> dict:
    """The default phase without the model's forward hooks (the timer built without a
    model), so the test can show why the hooks are needed."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtprofile.capture.collectives import CollectiveTimer, find_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = build("tp", mesh)
    info = find_mesh(model)
    info.model_ref = None
    timer = CollectiveTimer(info)
    timer.install()
    _, figures, _ = _train("tp", mesh, 2, 8, 1, model=model, timer=timer)
    timer.remove()
    return {"figures": figures}


def fsdp_tp_run(rank: int, world: int, cfg: dict) -> dict:
    """A 2 x 2 mesh ("dp", "tp"): TP on tp, FSDP2 on dp; the timer also times the
    ``torch.distributed`` calls on the mesh's groups (FSDP's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtprofile.capture.collectives import CollectiveTimer, find_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = build("fsdp_tp", mesh)
    info = find_mesh(model)
    timer = CollectiveTimer(info, c10d=True)
    timer.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    dp_rank = mesh.get_local_rank("dp")
    figures = []
    for step in range(cfg.get("steps", 4)):
        x, y = _batch("tp", step, cfg.get("batch", 8), 1, dp_rank)
        timer.begin_step()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        figures.append(timer.end_step())
    timer.remove()
    return {
        "mesh": info.to_dict(),
        "figures": figures,
        "enabled": timer.enabled,
        "error": timer.error,
        "tp_group": info.dim("tp").group_name,
        "dp_group": info.dim("dp").group_name,
        "ranks": {d.label: d.ranks for d in info.dims},
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


def _profiled_steps(model: nn.Module, kind: str, steps: int, batch: int, data_rank: int, cfg: dict) -> dict:
    """``steps`` SGD steps of ``model`` inside ``dtprofile.profile``: its report's summary,
    and the packets' state while profiling and after."""
    import dtprofile

    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    options = dict(warmup_steps=cfg.get("warmup", 2), every_n_steps=cfg.get("every", 1000))
    if cfg.get("logdir"):
        options["logdir"] = cfg["logdir"]
    with dtprofile.profile(model, opt, **options) as prof:
        during = _ops_state()
        for step in range(steps):
            x, y = _batch(kind, step, batch, 1, data_rank)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "summary": prof.report().to_dict(),
        "patched_during": sorted(k for k, v in during.items() if isinstance(v, tuple) and v[1] in _TIMED),
    }


def tp_profiled(rank: int, world: int, cfg: dict) -> dict:
    """A TP MLP trained without dtprofile, then the same from the same weights inside
    ``dtprofile.profile``: the weights' digests, the summary, the patched state."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    steps, batch = cfg.get("steps", 12), cfg.get("batch", 16)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    before = _ops_state()
    plain, _, _ = _train("tp", mesh, steps, batch, 1)
    profiled = build("tp", mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _profiled_steps(profiled, "tp", steps, batch, 0, cfg)
    after = _ops_state()
    out.update(
        digest_plain=_weights_digest(plain),
        digest_profiled=_weights_digest(profiled),
        left_after=sorted(k for k in before if after.get(k) != before[k]),
        warnings=[str(w.message) for w in caught],
    )
    return out


def fsdp_tp_profiled(rank: int, world: int, cfg: dict) -> dict:
    """The 2 x 2 mesh ("dp", "tp"), TP on tp and FSDP2 on dp, inside ``dtprofile.profile``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = build("fsdp_tp", mesh)
    before = _ops_state()
    out = _profiled_steps(model, "tp", cfg.get("steps", 8), cfg.get("batch", 8), mesh.get_local_rank("dp"), cfg)
    after = _ops_state()
    out["left_after"] = sorted(k for k in before if after.get(k) != before[k])
    return out
