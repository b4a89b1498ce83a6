"""A LightningModule fitted with strategy="ddp" on 2 CPU processes, profiled by dtprofile.

    python examples/lightning_ddp.py [--steps 60] [--root runs/lightning_ddp]

Lightning starts the second process itself (it re-runs this script). The one dtprofile
line is ``callbacks=[dtprofile.DTProfileCallback()]``; the report is printed on rank 0
and the same figures are in TensorBoard::

    tensorboard --logdir runs/lightning_ddp     # the dtprofile/ tags and the advice text
    dtprofile report runs/lightning_ddp/lightning_logs/version_0

Without the line, ``DTPROFILE=1 python examples/lightning_ddp.py`` attaches the same
callback through Lightning's callbacks_factory entry point.
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dtprofile


class SmallCNN(pl.LightningModule):
    def __init__(self, classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(32 * 16, 128),
            nn.ReLU(),
            nn.Linear(128, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def synthetic_images(n: int = 4096, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--root", default="runs/lightning_ddp")
    args = parser.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # two processes share the cores
    pl.seed_everything(0)
    callback = dtprofile.DTProfileCallback()  # <- the one dtprofile line
    trainer = pl.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=args.steps,
        log_every_n_steps=10,  # also dtprofile's interval (every_n_steps)
        default_root_dir=args.root,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(synthetic_images(), batch_size=32, shuffle=True)
    trainer.fit(SmallCNN(), train_dataloaders=loader)
    if trainer.is_global_zero:
        print(callback.report())
        print(f"\nTensorBoard: tensorboard --logdir {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
