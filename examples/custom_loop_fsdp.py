"""A custom training loop with FSDP2 (``fully_shard``), profiled by dtprofile (gloo, CPU).

Run it with torchrun::

    torchrun --nproc-per-node 2 examples/custom_loop_fsdp.py [--layout hsdp]

or by itself (it then starts two local processes on a free port)::

    python examples/custom_loop_fsdp.py [--layout fsdp|hsdp|replicate] [--steps 40]

``--layout``: ``fsdp`` shards every block over all ranks (all-gathers and
reduce-scatters); ``hsdp`` puts the ranks on a replicas x 1 mesh (each block's gradient
all-reduced across replicas, as HSDP does between nodes); ``replicate`` is FSDP's
``replicate`` (DDP built on FSDP2). The profiler is given the root module, as for any
model; ``prof.report()`` says which collectives it timed (``run.fsdp`` in the summary).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from custom_loop_ddp import run_distributed  # the launcher: torchrun's ranks or two local processes
from torch import nn

import dtprofile

LAYOUTS = ("fsdp", "hsdp", "replicate")


class Block(nn.Module):
    """A transformer-style MLP block: one FSDP unit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def build(layout: str, width: int = 256, blocks: int = 4, classes: int = 10) -> nn.Module:
    """The model, wrapped block by block and at the root."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, classes))
    if layout == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap

        kwargs: dict = {}
    else:
        wrap, kwargs = fully_shard, {}
        if layout == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            kwargs["mesh"] = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    for block in model[:-1]:
        wrap(block, **kwargs)
    wrap(model, **kwargs)
    return model


def train(layout: str, steps: int, logdir: str) -> None:
    torch.manual_seed(0)
    model = build(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = steps * 32 * dist.get_world_size()  # the sampler splits them: `steps` batches per rank
    dataset = torch.utils.data.TensorDataset(torch.randn(samples, 256), torch.randint(0, 10, (samples,)))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

    with dtprofile.profile(model, optimizer, logdir=logdir, every_n_steps=10) as prof:
        for x, y in prof.loader(loader):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(prof.report())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logdir", default="runs/custom-loop-fsdp")
    args = parser.parse_args()
    run_distributed(train, args.layout, args.steps, args.logdir)


if __name__ == "__main__":
    main()
