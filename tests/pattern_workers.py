"""Rank functions and Lightning fits for tests/test_loop_patterns.py (the pattern matrix).

Each loop pattern is a function ``pattern(c)`` that builds its model(s) from a fixed seed,
wraps them in DDP and runs ``c.steps`` optimizer steps on data that depends only on
(rank, step, micro-batch), so that an unprofiled and a profiled run of the same pattern in
the same processes see the same numbers. Through ``c`` (a :class:`Cell`) it:

- opens ``c.profile(model, optimizer)``: ``dtprofile.profile(...)`` with the cell's
  options, or nothing for the unprofiled reference;
- calls ``c.step(optimizer, *modules)`` where the loop steps: it fingerprints every
  gradient of ``modules`` (sha1 of their bytes, plus the squared norm for the message)
  right before ``optimizer.step()``, then steps and zeroes the gradients;
- logs values with ``c.log(...)`` and ends with ``c.finish(*modules)`` (the weights' and
  buffers' fingerprint).

:func:`pattern_matrix` runs the cells (pattern x config) one after another on every rank
and appends each cell's result as a JSON line to ``OUTDIR/rank{r}.jsonl`` as it goes (a
"start" line first), so a hang still leaves what came before it and names the cell it hung
in. After each cell the ranks meet through the rendezvous store (not the process group);
if a cell failed on any rank, the default process group is re-created before the next
cell, since a collective mismatch leaves it unusable.

Run as a script for the Lightning fits (Lightning's ``ddp`` strategy re-launches it)::

    python tests/pattern_workers.py lightning OUTDIR
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

#: Seconds a collective of the default process group may wait before it raises: a cell
#: that hangs in one fails after this instead of blocking the launch.
PG_TIMEOUT_S = 20.0
#: dtprofile's cross-rank gather timeout in every profiled cell (the same reason).
GATHER_TIMEOUT_S = 20.0
STEPS = 22
WARMUP = 2
BATCH = 8
IN, HIDDEN, CLASSES = 8, 16, 4

#: The configurations every pattern runs under; None: unprofiled. "unprofiled" is the
#: reference, "repeat" the same again (a check of the harness: the reference must be
#: reproducible, or a difference would not be dtprofile's).
CONFIGS: dict[str, dict | None] = {
    "unprofiled": None,
    "repeat": None,
    "defaults": {},
    "bucket_timing_20": {"bucket_timing_every": 20},
    "no_probes": {"probe_every": 0},
    "probe_every_3": {"probe_every": 3},
}
COMMON = dict(warmup_steps=WARMUP, logdir=None, gather_timeout_s=GATHER_TIMEOUT_S)

ce = nn.functional.cross_entropy


# ----------------------------------------------------------------------------- the cell
def _fingerprint(tensors) -> tuple[str, float]:
    h, sq = hashlib.sha1(), 0.0
    for t in tensors:
        if t is None:
            h.update(b"<none>")
            continue
        t = t.detach().contiguous()
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.numpy().tobytes())
        if t.is_floating_point():
            sq += float(t.double().pow(2).sum())
    return h.hexdigest()[:16], sq


class Cell:
    """One pattern under one configuration on this rank: what the loop records."""

    def __init__(self, rank: int, world: int, options: dict | None, steps: int) -> None:
        self.rank, self.world, self.options, self.steps = rank, world, options, steps
        self.grads: list[str] = []  # "label:sha1" per optimizer step (per closure call for LBFGS)
        self.norms: list[float] = []  # the gradients' squared norm, same index
        self.logs: list[float] = []
        self.weights: str | None = None
        self.probe_steps: int | None = None
        self.notes: list[str] = []
        self._seed = 0

    # building
    def seed(self, offset: int = 0) -> None:
        torch.manual_seed(1234 + offset)

    def mlp(self, bn: bool = False, seed: int = 0, dims: tuple = (IN, HIDDEN, CLASSES)) -> nn.Module:
        self.seed(seed)
        a, h, o = dims
        layers: list[nn.Module] = [nn.Linear(a, h)]
        if bn:
            layers.append(nn.BatchNorm1d(h))
        layers += [nn.ReLU(), nn.Linear(h, o)]
        return nn.Sequential(*layers)

    def ddp(self, module: nn.Module, **kw: Any) -> DDP:
        return DDP(module, **kw)

    @staticmethod
    def sgd(module: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)

    def data(self, step: int, micro: int = 0, dim: int = IN) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch that differs between ranks (so an unreduced gradient shows) and steps."""
        g = torch.Generator().manual_seed(100_003 * self.rank + 1_009 * step + 17 * micro + 5)
        return torch.randn(BATCH, dim, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)

    # the loop
    @contextlib.contextmanager
    def profile(self, model: nn.Module, optimizer: Any):
        if self.options is None:
            yield None
            return
        import dtprofile

        prof = dtprofile.profile(model, optimizer, **{**COMMON, **self.options})
        with prof:
            yield prof
        self.probe_steps = _probe_steps(prof, self.notes)

    def record(self, label: str, *modules: nn.Module) -> None:
        fp, sq = _fingerprint([p.grad for m in modules for p in m.parameters()])
        self.grads.append(f"{label}:{fp}")
        self.norms.append(sq)

    def step(self, optimizer: torch.optim.Optimizer, *modules: nn.Module, label: str = "step") -> None:
        self.record(label, *modules)
        optimizer.step()
        optimizer.zero_grad()

    def log(self, value: Any) -> None:
        self.logs.append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))

    def finish(self, *modules: nn.Module) -> None:
        self.weights = _fingerprint([t for m in modules for t in m.state_dict().values()])[0]


def _probe_steps(prof: Any, notes: list[str]) -> int | None:
    """The number of probe steps the summary reports (None: no probe section)."""
    try:
        summary = prof.summary() if hasattr(prof, "summary") else prof.report().to_dict()
        if not isinstance(summary, dict):
            summary = summary.to_dict()
        probe = summary.get("probe")
        return int(probe["steps"]) if isinstance(probe, dict) and probe.get("steps") is not None else 0
    except Exception as exc:  # the summary is not what is tested here; say so and go on
        notes.append(f"summary unreadable: {type(exc).__name__}: {exc}")
        return None


# ----------------------------------------------------------------------------- patterns
def plain(c: Cell, **ddp_kw: Any) -> None:
    """1 (and 16 with static_graph=True): forward, backward, step."""
    model = c.ddp(c.mlp(), **ddp_kw)
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            loss = ce(model(x), y)
            loss.backward()
            c.log(loss)
            c.step(opt, model)
    c.finish(model)


def static_graph(c: Cell) -> None:
    plain(c, static_graph=True)


def gradient_penalty(c: Cell) -> None:
    """2: a penalty on d(out)/d(x), so backward runs through a create_graph=True grad."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            x.requires_grad_(True)
            out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = ce(out, y) + 0.1 * gx.pow(2).sum(1).mean()
            loss.backward()
            c.log(loss)
            c.step(opt, model)
    c.finish(model)


def grad_for_logging(c: Cell) -> None:
    """3: autograd.grad of the loss w.r.t. the output (no create_graph), then backward."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            out = model(x)
            loss = ce(out, y)
            (g,) = torch.autograd.grad(loss, out, retain_graph=True)
            c.log(g.norm())
            loss.backward()
            c.step(opt, model)
    c.finish(model)


def token_count_all_reduce(c: Cell) -> None:
    """4: the global token count all-reduced between forward and backward, dividing the loss."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            out = model(x)
            tokens = (y != 0).sum().float().reshape(1) + 1.0
            dist.all_reduce(tokens)
            loss = ce(out, y, reduction="sum") / tokens
            loss.backward()
            c.log(tokens)
            c.step(opt, model)
    c.finish(model)


def loss_all_reduce_for_logging(c: Cell) -> None:
    """5: the loss cloned, all-reduced and averaged for logging, before backward."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            loss = ce(model(x), y)
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            c.log(logged / c.world)
            loss.backward()
            c.step(opt, model)
    c.finish(model)


def siamese(c: Cell, bn: bool = False, **ddp_kw: Any) -> None:
    """6: two forwards of the DDP model, one backward on a loss of both."""
    model = c.ddp(c.mlp(bn=bn), **ddp_kw)
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x1, y = c.data(step)
            x2, _ = c.data(step, micro=1)
            out1, out2 = model(x1), model(x2)
            loss = ce(out1, y) + 0.5 * (out1 - out2).pow(2).mean()
            loss.backward()
            c.log(loss)
            c.step(opt, model)
    c.finish(model)


def siamese_bn(c: Cell) -> None:
    siamese(c, bn=True)


def siamese_bucket_view(c: Cell) -> None:
    siamese(c, gradient_as_bucket_view=True)


def gan(c: Cell, profiled: str = "G") -> None:
    """7: G and D each DDP; D's step (on G(z).detach()) between G's forward and backward."""
    G = c.ddp(c.mlp(seed=1, dims=(4, HIDDEN, IN)))
    D = c.ddp(c.mlp(seed=2, dims=(IN, HIDDEN, 1)))
    optG, optD = c.sgd(G, lr=0.05), c.sgd(D, lr=0.05)
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    model, opt = (G, optG) if profiled == "G" else (D, optD)
    with c.profile(model, opt):
        for step in range(c.steps):
            real, _ = c.data(step)
            z, _ = c.data(step, micro=1, dim=4)
            fake = G(z)
            optD.zero_grad()
            d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
            d_loss.backward()
            c.log(d_loss)
            c.step(optD, D, label="D")
            optG.zero_grad()
            g_loss = bce(D(fake), ones)
            g_loss.backward()
            c.log(g_loss)
            c.step(optG, G, label="G")
    c.finish(G, D)


def gan_profile_D(c: Cell) -> None:
    gan(c, profiled="D")


def validation_forward(c: Cell) -> None:
    """8: every 5th step, a forward in train mode with grad enabled and no backward."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            loss = ce(model(x), y)
            loss.backward()
            c.step(opt, model)
            if step % 5 == 4:
                xv, yv = c.data(step, micro=7)
                c.log(ce(model(xv), yv))
    c.finish(model)


def two_backwards(c: Cell) -> None:
    """9: two losses of one forward, two backward passes (DDP reduces the first only)."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            out = model(x)
            l1, l2 = ce(out, y), 0.1 * out.pow(2).mean()
            l1.backward(retain_graph=True)
            l2.backward()
            c.log(l1 + l2)
            c.step(opt, model)
    c.finish(model)


def retain_graph(c: Cell) -> None:
    """10: one backward with retain_graph=True."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            loss = ce(model(x), y)
            loss.backward(retain_graph=True)
            c.log(loss)
            c.step(opt, model)
    c.finish(model)


def lbfgs_closure(c: Cell) -> None:
    """11: LBFGS, optimizer.step(closure); gradients recorded after each closure's backward."""
    model = c.ddp(c.mlp())
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=5)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)

            def closure():
                opt.zero_grad()
                loss = ce(model(x), y)
                loss.backward()
                c.record("closure", model)
                return loss

            c.log(opt.step(closure))
    c.finish(model)


def two_models_one_profiled(c: Cell) -> None:
    """12: two DDP models trained each step (B's forward inside A's step), A profiled."""
    A, B = c.ddp(c.mlp(seed=1)), c.ddp(c.mlp(seed=2))
    optA, optB = c.sgd(A), c.sgd(B)
    with c.profile(A, optA):
        for step in range(c.steps):
            x, y = c.data(step)
            outA, outB = A(x), B(x)
            ce(outA, y).backward()
            c.step(optA, A, label="A")
            lossB = ce(outB, y)
            lossB.backward()
            c.log(lossB)
            c.step(optB, B, label="B")
    c.finish(A, B)


def backward_several_roots(c: Cell) -> None:
    """13: torch.autograd.backward([loss1, loss2]): one pass from two roots."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            out = model(x)
            l1, l2 = ce(out, y), 0.1 * out.pow(2).mean()
            torch.autograd.backward([l1, l2])
            c.log(l1)
            c.step(opt, model)
    c.finish(model)


def accumulation(c: Cell, no_sync: bool = False) -> None:
    """14: 2 micro-batches per optimizer step, each reduced, or the first under no_sync()."""
    model = c.ddp(c.mlp())
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            for micro in range(2):
                x, y = c.data(step, micro)
                ctx = model.no_sync() if (no_sync and micro == 0) else contextlib.nullcontext()
                with ctx:
                    loss = ce(model(x), y) / 2
                    loss.backward()
                c.log(loss)
            c.step(opt, model)
    c.finish(model)


def accumulation_no_sync(c: Cell) -> None:
    accumulation(c, no_sync=True)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.aux = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + self.aux(h) if aux else self.head(h)


def find_unused_parameters(c: Cell) -> None:
    """15: find_unused_parameters=True; the aux head is used on every 3rd step only."""
    c.seed()
    model = c.ddp(_TwoHeads(), find_unused_parameters=True)
    opt = c.sgd(model)
    with c.profile(model, opt):
        for step in range(c.steps):
            x, y = c.data(step)
            loss = ce(model(x, aux=step % 3 == 0), y)
            loss.backward()
            c.log(loss)
            c.step(opt, model)
    c.finish(model)


#: name -> (function, whether DDP leaves every recorded gradient equal across ranks in
#: the unprofiled run). Declared: the test checks it on the reference (a harness check:
#: each rank's data differ, so equal gradients mean DDP reduced them).
PATTERNS: dict[str, tuple[Callable[[Cell], None], bool]] = {
    "plain": (plain, True),
    "gradient_penalty": (gradient_penalty, True),
    "grad_for_logging": (grad_for_logging, True),
    "token_count_all_reduce": (token_count_all_reduce, True),
    "loss_all_reduce_for_logging": (loss_all_reduce_for_logging, True),
    "siamese": (siamese, True),
    "siamese_bn": (siamese_bn, True),
    "siamese_bucket_view": (siamese_bucket_view, True),
    "gan_profile_G": (gan, True),
    "gan_profile_D": (gan_profile_D, True),
    "validation_forward": (validation_forward, True),
    "two_backwards": (two_backwards, False),
    "retain_graph": (retain_graph, True),
    "lbfgs_closure": (lbfgs_closure, True),
    "two_models_one_profiled": (two_models_one_profiled, True),
    "backward_several_roots": (backward_several_roots, True),
    "accumulation": (accumulation, True),
    "accumulation_no_sync": (accumulation_no_sync, True),
    "find_unused_parameters": (find_unused_parameters, True),
    "static_graph": (static_graph, True),
}


# ----------------------------------------------------------------------------- the matrix
def _reinit_process_group(store: Any, rank: int, world: int, generation: int) -> None:
    """A fresh default process group on the same rendezvous store (the old one may hold a
    mismatched or timed-out collective)."""
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"pattern-matrix-pg{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a rank that died is a zombie until the launcher joins it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return not os.path.isdir("/proc/self")  # (no /proc: assume it runs)


def _meet(
    store: Any, tag: str, rank: int, world: int, ok: bool, wait_s: float, pids: list[int] | None = None
) -> list[str] | None:
    """Every rank's "ok"/"failed" at ``tag`` (through the store); None if a peer died or
    did not arrive within ``wait_s``."""
    keys = [f"pattern-matrix/{tag}/{r}" for r in range(world)]
    deadline = time.monotonic() + wait_s
    try:
        store.set(keys[rank], "ok" if ok else "failed")
        while not store.check(keys):
            if time.monotonic() > deadline or (pids and not all(_alive(p) for p in pids)):
                return None
            time.sleep(0.005)
        return [store.get(k).decode() for k in keys]
    except Exception:  # the store's server (rank 0) is gone
        return None


def pattern_matrix(rank: int, world: int, cfg: dict) -> dict:
    """Run the cells ``cfg["cells"]`` ([pattern, config] pairs) in order on this rank;
    stream the results to ``cfg["outdir"]/rank{r}.jsonl``."""
    steps = cfg.get("steps", STEPS)
    store = dist.distributed_c10d._get_default_store()  # held: it outlives a re-created group
    if hasattr(dist.distributed_c10d, "_set_pg_timeout"):  # (the launcher's group waits 60 s)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=PG_TIMEOUT_S))
    store.set(f"pattern-matrix/pid/{rank}", str(os.getpid()))
    store.wait([f"pattern-matrix/pid/{r}" for r in range(world)], timedelta(seconds=60))
    pids = [int(store.get(f"pattern-matrix/pid/{r}")) for r in range(world) if r != rank]
    generation = 0
    path = os.path.join(cfg["outdir"], f"rank{rank}.jsonl")
    with open(path, "w", buffering=1) as out:
        for index, (pattern, config) in enumerate(cfg["cells"]):
            fn, _ = PATTERNS[pattern]
            key = {"pattern": pattern, "config": config}
            out.write(json.dumps({**key, "event": "start"}) + "\n")
            out.flush()
            cell = Cell(rank, world, CONFIGS[config], steps)
            t0 = time.monotonic()
            error = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fn(cell)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    cell.notes.append(traceback.format_exc(limit=-6))
            seconds = time.monotonic() - t0
            dtp_warnings = sorted({str(w.message)[:300] for w in caught if "dtprofile" in str(w.message)})
            out.write(
                json.dumps(
                    {
                        **key,
                        "event": "end",
                        "error": error,
                        "seconds": round(seconds, 3),
                        "grads": cell.grads,
                        "norms": cell.norms,
                        "logs": cell.logs,
                        "weights": cell.weights,
                        "probe_steps": cell.probe_steps,
                        "warnings": dtp_warnings,
                        "notes": cell.notes,
                        "pg_generation": generation,
                    }
                )
                + "\n"
            )
            out.flush()
            # Every rank done with the cell before the next (through the store: a failed
            # collective may have broken the process group).
            verdicts = _meet(store, str(index), rank, world, error is None, PG_TIMEOUT_S + 40, pids)
            if verdicts is None:
                out.write(json.dumps({**key, "event": "abandoned", "why": "a peer died or never finished"}) + "\n")
                return {"cells": index + 1, "abandoned": True}
            if "failed" in verdicts:
                generation += 1
                _reinit_process_group(store, rank, world, generation)
    # Rank 0 holds the store's server: it leaves once every other rank is done with it.
    with contextlib.suppress(Exception):
        store.set(f"pattern-matrix/exit/{rank}", "done")
        if rank == 0:
            _meet(store, "exit", rank, world, True, PG_TIMEOUT_S + 40, pids)
    return {"cells": len(cfg["cells"]), "abandoned": False}


# ----------------------------------------------------------------------------- Lightning
LIGHTNING_STEPS = 16


def _lightning_classes():
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        """Linear-ReLU-Linear; the loss logged with sync_dist=True; optionally a
        torchmetrics metric updated and computed (synced across ranks) in training_step."""

        def __init__(self, metric: bool = False) -> None:
            super().__init__()
            torch.manual_seed(1234)
            self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
            self.metric = None
            if metric:
                import torchmetrics

                self.metric = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
            self.history: list[dict] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            loss = ce(out, y)
            self.log("loss", loss, sync_dist=True)
            if self.metric is not None:
                self.metric.update(out.detach().argmax(1), y)
                acc = self.metric.compute()  # synced across ranks
                self.log("acc", acc)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            m = self.trainer.callback_metrics
            self.history.append({k: float(m[k]) for k in ("loss", "acc") if k in m})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(99)
            n = BATCH * 2 * LIGHTNING_STEPS
            data = TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
            return DataLoader(data, batch_size=BATCH, shuffle=False)  # Lightning adds a DistributedSampler

    return pl, Net


def _lightning_fit(pl: Any, Net: Any, root: str, metric: bool, profiled: bool) -> dict:
    cbs = []
    if profiled:
        import dtprofile

        cbs.append(dtprofile.DTProfileCallback(warmup_steps=WARMUP, gather_timeout_s=GATHER_TIMEOUT_S))
    pl.seed_everything(0, workers=True)
    model = Net(metric=metric)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=cbs,
        default_root_dir=root,
        max_steps=LIGHTNING_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    probe_steps = None
    if profiled:
        with contextlib.suppress(Exception):
            probe = cbs[0].report().to_dict().get("probe")
            probe_steps = int(probe["steps"]) if isinstance(probe, dict) else 0
    return {
        "weights": _fingerprint(list(model.state_dict().values()))[0],
        "history": model.history,
        "global_step": trainer.global_step,
        "probe_steps": probe_steps,
        "rank": trainer.global_rank,
    }


def lightning_main(outdir: str) -> None:
    """The fits: plain and with a metric, each without and with DTProfileCallback; each
    rank writes OUTDIR/result_rank{r}.json."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    pl, Net = _lightning_classes()
    results: dict[str, Any] = {}
    runs = [("plain", False)]
    try:
        import torchmetrics  # noqa: F401

        runs.append(("metric", True))
    except ImportError:
        pass
    rank = int(os.environ.get("LOCAL_RANK", 0))
    for name, metric in runs:
        for profiled in (False, True):
            key = f"{name}/{'profiled' if profiled else 'unprofiled'}"
            try:
                res = _lightning_fit(pl, Net, os.path.join(outdir, key.replace("/", "_")), metric, profiled)
            except Exception as exc:
                res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            results[key] = res
    tmp = os.path.join(outdir, f"result_rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(results, fh)
    os.replace(tmp, os.path.join(outdir, f"result_rank{rank}.json"))


if __name__ == "__main__":
    if sys.argv[1] == "lightning":
        lightning_main(sys.argv[2])
    else:
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
