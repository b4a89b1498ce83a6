"""PyTorch Lightning with ``strategy="ddp_spawn"`` on 2 CPU processes, profiled by dtprofile.

For tests/test_launch.py::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python lightning_spawn.py OUTDIR

Lightning spawns the two ranks (``torch.multiprocessing``, start method "spawn"); each
one, at the end of its fit, writes ``OUTDIR/rank<R>.json`` (its rank, "finished", figures
from its own dtprofile report), and ends through interpreter teardown. The launching
process writes ``OUTDIR/launcher.json``: every rank's exit code (Lightning keeps its
processes in ``trainer.strategy.launcher.procs``) and the report handed back to it.
"""

from __future__ import annotations

import json
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtprofile

STEPS = 12


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(512, 32, generator=g), torch.randint(0, 4, (512,), generator=g))
        return DataLoader(data, batch_size=8)


class RankRecord(pl.Callback):
    """Each rank's own word that its fit finished, with its dtprofile report's figures."""

    def __init__(self, outdir: str, profiler: dtprofile.DTProfileCallback) -> None:
        self.outdir = outdir
        self.profiler = profiler

    def on_fit_end(self, trainer, pl_module) -> None:
        summary = self.profiler.report().to_dict()  # after the profiler's own on_train_end: final
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "global_step": trainer.global_step,
            "status": "finished",
            "summary": {
                "steps_total": summary["steps_total"],
                "world_size": summary["world_size"],
                "comm_source": summary["comm_source"],
                "step_ms": summary["per_step_ms"]["step"],
                "complete": summary["complete"],
            },
        }
        path = os.path.join(self.outdir, f"rank{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)


def main() -> int:
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)  # this process; Lightning sets each spawned rank's
    pl.seed_everything(0)
    profiler = dtprofile.DTProfileCallback(warmup_steps=2, every_n_steps=4, gather_timeout_s=60.0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=STEPS,
        callbacks=[profiler, RankRecord(outdir, profiler)],
        default_root_dir=outdir,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=4,
    )
    result: dict = {}
    try:
        trainer.fit(Net())
        summary = profiler.report().to_dict()  # rank 0's, handed back to this process
        result["summary"] = {"steps_total": summary["steps_total"], "world_size": summary["world_size"]}
    finally:
        result["exitcodes"] = [p.exitcode for p in trainer.strategy.launcher.procs]
        with open(os.path.join(outdir, "launcher.json"), "w") as fh:
            json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
