"""A custom training loop under DDP (gloo, CPU), profiled by dtprofile.

Run it with torchrun::

    torchrun --nproc-per-node 2 examples/custom_loop_ddp.py

or by itself (it then starts two local processes on a free port)::

    python examples/custom_loop_ddp.py [--steps 60] [--logdir runs/custom-loop]
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import dtprofile


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def train(steps: int, logdir: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(SmallCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    samples = steps * 16 * dist.get_world_size()  # the sampler splits them: `steps` batches per rank
    images = torch.randn(samples, 3, 32, 32)
    labels = torch.randint(0, 10, (samples,))
    dataset = torch.utils.data.TensorDataset(images, labels)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)

    with dtprofile.profile(model, optimizer, logdir=logdir, every_n_steps=20) as prof:
        for x, y in prof.loader(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        print(prof.report())


def _worker(rank: int, world: int, port: int, train_fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    main_distributed(train_fn, *args)


def main_distributed(train_fn: Callable[..., None], *args: object) -> None:
    """``train_fn(*args)`` in a gloo process group (this process is one rank of it)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train_fn(*args)
    finally:
        dist.destroy_process_group()


def run_distributed(train_fn: Callable[..., None], *args: object, world: int = 2) -> None:
    """Run ``train_fn(*args)`` on every rank: torchrun's ranks, or ``world`` local processes."""
    if "RANK" in os.environ:  # launched by torchrun
        main_distributed(train_fn, *args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(
        _worker, args=(world, port, train_fn, args), nprocs=world, start_method="spawn"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--logdir", default="runs/custom-loop")
    args = parser.parse_args()
    run_distributed(train, args.steps, args.logdir)


if __name__ == "__main__":
    main()
