"""Lightning models and multi-process scenarios for tests/test_lightning.py.

Run as a script (the test launches it with ``subprocess.run(..., timeout=...)``)::

    python tests/lightning_workers.py SCENARIO OUTDIR

Lightning's ``ddp`` strategy re-launches this script for the other ranks; every rank runs
the same fits in the same order, rank 0 writes ``OUTDIR/result.json``. MASTER_ADDR and
MASTER_PORT come from the environment (the test picks a free port).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

FAST = dict(
    max_steps=12,
    log_every_n_steps=5,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
)
CB = dict(warmup_steps=2, every_n_steps=5, gather_timeout_s=30.0)


class Images(Dataset):
    """Synthetic 3x8x8 images, 4 classes, the same on every rank and every run."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    """The same images as an IterableDataset (Lightning prefetches one batch ahead)."""

    def __iter__(self):
        data = Images(128)
        for i in range(len(data)):
            yield data[i]


class Net(pl.LightningModule):
    def __init__(self, unused_branch: bool = False, iterable: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4) if unused_branch else None
        self.iterable = iterable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        if self.iterable:
            return DataLoader(Stream(), batch_size=8)
        return DataLoader(Images(), batch_size=8, shuffle=False)


class ManualNet(Net):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss


def plain_allreduce(state, bucket):
    """A user's comm hook: the same arithmetic as DDP's default."""
    world = torch.distributed.get_world_size()
    fut = torch.distributed.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class CpuHookDDP(DDPStrategy):
    """DDPStrategy that registers ``ddp_comm_hook`` on CPU too (Lightning does so on CUDA only)."""

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def _summary(cb) -> dict:
    return cb.report().to_dict() if cb is not None else None


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(strategy="ddp", devices=2, callback=True, module=Net, module_kw=None, root=None, cb_kw=None, **trainer_kw):
    """One seeded fit; returns (trainer, model, callback or None)."""
    pl.seed_everything(0, workers=True)
    torch.set_num_threads(1)
    model = module(**(module_kw or {}))
    cb = None
    callbacks = list(trainer_kw.pop("callbacks", []))
    if callback:
        import dtprofile

        cb = dtprofile.DTProfileCallback(**{**CB, **(cb_kw or {})})
        callbacks.append(cb)
    kw = {**FAST, **trainer_kw}
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks, default_root_dir=root, **kw
    )
    trainer.fit(model)
    return trainer, model, cb


def _record(trainer, cb, **extra) -> dict:
    out = {
        "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
        "default_root_dir": trainer.default_root_dir,
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("dtprofile/")},
        "callbacks": [type(c).__name__ for c in trainer.callbacks],
    }
    if cb is None:
        found = [c for c in trainer.callbacks if type(c).__name__ == "DTProfileCallback"]
        active = [c for c in found if c.engine is not None]
        out["env_callbacks"] = len(found)
        out["active_callbacks"] = len(active)
        cb = active[0] if active else None
    out["summary"] = _summary(cb)
    out.update(extra)
    return out


def scenario_ddp(root: str) -> dict:
    """strategy="ddp": weights with/without the callback, accumulation, manual, bf16, iterable,
    find_unused_parameters."""
    results = {}
    t0, m0, _ = fit(root=os.path.join(root, "plain"), callback=False, logger=False)
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

    profiled = os.path.join(root, "profiled")
    t1, m1, cb = fit(root=profiled, logger=[TensorBoardLogger(profiled), CSVLogger(profiled, name="csv")])
    w0, w1 = _weights(m0), _weights(m1)
    results["profiled"] = _record(
        t1,
        cb,
        weights_equal=all(torch.equal(w0[k], w1[k]) for k in w0),
        max_weight_diff=max(float((w0[k] - w1[k]).abs().max()) for k in w0),
        csv_log_dir=t1.loggers[1].log_dir,
    )
    t, _, cb = fit(root=os.path.join(root, "accum"), accumulate_grad_batches=2)
    results["accum"] = _record(t, cb)
    _, m0, _ = fit(root=os.path.join(root, "manual_plain"), module=ManualNet, callback=False, logger=False)
    t, m1, cb = fit(root=os.path.join(root, "manual"), module=ManualNet)
    w0, w1 = _weights(m0), _weights(m1)
    results["manual"] = _record(t, cb, weights_equal=all(torch.equal(w0[k], w1[k]) for k in w0))
    t, _, cb = fit(root=os.path.join(root, "bf16"), precision="bf16-mixed")
    results["bf16"] = _record(t, cb)
    t, _, cb = fit(root=os.path.join(root, "iterable"), module_kw={"iterable": True}, max_steps=10)
    results["iterable"] = _record(t, cb)
    _, m0, _ = fit(
        strategy="ddp_find_unused_parameters_true",
        module_kw={"unused_branch": True},
        root=os.path.join(root, "unused_plain"),
        callback=False,
        logger=False,
    )
    t, m1, cb = fit(
        strategy="ddp_find_unused_parameters_true", module_kw={"unused_branch": True}, root=os.path.join(root, "unused")
    )
    w0, w1 = _weights(m0), _weights(m1)
    results["unused"] = _record(t, cb, weights_equal=all(torch.equal(w0[k], w1[k]) for k in w0))
    return results


def scenario_spawn(root: str) -> dict:
    """ddp_spawn: the report is handed back to the launching process.

    (Not mixed with "ddp" fits: those re-launch this script, which would spawn again.)
    """
    t, _, cb = fit(strategy="ddp_spawn", root=os.path.join(root, "spawn"))
    return {"spawn": _record(t, cb)}


def scenario_hooks(root: str) -> dict:
    """A user's comm hook set through the strategy: unwrapped, wrapped, and ignored on CPU."""
    import dtprofile

    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, _, cb = fit(strategy=CpuHookDDP(ddp_comm_hook=plain_allreduce), root=os.path.join(root, "unwrapped"))
    results["unwrapped"] = _record(
        t, cb, warnings=[str(w.message) for w in caught if "communication hook" in str(w.message)]
    )
    hook = dtprofile.timed_hook(plain_allreduce)
    t, _, cb = fit(strategy=CpuHookDDP(ddp_comm_hook=hook), root=os.path.join(root, "wrapped"))
    results["wrapped"] = _record(t, cb, hook_engine_cleared=hook.recorder is None)
    t, _, cb = fit(strategy=DDPStrategy(ddp_comm_hook=plain_allreduce), root=os.path.join(root, "stock"))
    results["stock"] = _record(t, cb)
    return results


def scenario_env(root: str) -> dict:
    """DTPROFILE=1 in the environment: no callback in the code, then one in the code too."""
    results = {}
    t, _, _ = fit(callback=False, root=os.path.join(root, "env"))
    results["env"] = _record(t, None)
    t, _, cb = fit(callback=True, root=os.path.join(root, "both"))
    rec = _record(t, None)
    rec["code_callback_active"] = cb.engine is not None
    results["both"] = rec
    return results


class Crash(Net):
    def training_step(self, batch, batch_idx):
        if self.global_step == 8:
            raise RuntimeError("crash at step 8")
        return super().training_step(batch, batch_idx)


def scenario_crash(root: str) -> dict:
    """Both ranks raise at the same step: the report is incomplete, written, and quick."""
    import time

    t0 = time.monotonic()
    try:
        fit(module=Crash, root=os.path.join(root, "crash"), logger=False, cb_kw={"gather_timeout_s": 120.0})
    except RuntimeError as exc:
        error = str(exc)
    else:
        error = None
    path = os.path.join(root, "crash", "dtprofile_logs", "dtprofile_summary.json")
    return {"crash": {"error": error, "seconds": time.monotonic() - t0, "summary_path": path}}


class ShardedNet(Net):
    """FSDP2 through Lightning's ModelParallelStrategy: fully_shard in configure_model."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.features, mesh=mesh)
        fully_shard(self.head, mesh=mesh)
        fully_shard(self, mesh=mesh)


def scenario_fsdp(root: str) -> dict:
    """ModelParallelStrategy (FSDP2) on two CPU processes, with and without the callback."""
    from pytorch_lightning.strategies import ModelParallelStrategy

    def strategy():
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    t0, m0, _ = fit(
        strategy=strategy(), module=ShardedNet, root=os.path.join(root, "plain"), callback=False, logger=False
    )
    t1, m1, cb = fit(strategy=strategy(), module=ShardedNet, root=os.path.join(root, "profiled"))
    checksum = [sum(float(p.detach().to_local().double().sum()) for p in m.parameters()) for m in (m0, m1)]
    return {"fsdp": _record(t1, cb, weights_equal=checksum[0] == checksum[1])}


SCENARIOS = {
    "fsdp": scenario_fsdp,
    "crash": scenario_crash,
    "ddp": scenario_ddp,
    "spawn": scenario_spawn,
    "hooks": scenario_hooks,
    "env": scenario_env,
}


def main() -> None:
    scenario, outdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    results = SCENARIOS[scenario](outdir)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    if rank == 0:
        tmp = os.path.join(outdir, "result.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(results, fh, default=str)
        os.replace(tmp, os.path.join(outdir, "result.json"))


if __name__ == "__main__":
    main()
