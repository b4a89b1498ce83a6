"""A Hugging Face Accelerate training loop, profiled by dtprofile.

A tiny Transformer encoder built from a config, random tokens, no downloads. Run it on
two processes with Accelerate's launcher (on CPUs too: gloo), or torchrun::

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py
    torchrun --nproc-per-node 2 examples/accelerate_loop.py

or by itself (it then starts two local processes with torchrun on a free port)::

    python examples/accelerate_loop.py [--steps 40] [--accumulate 2] [--logdir runs/accelerate-loop]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _torchrun import relaunch  # (beside this script: starts torchrun when run by itself)
from torch import nn

import dtprofile

CONFIG = {"vocab": 512, "width": 64, "heads": 4, "layers": 2, "seq": 32, "classes": 8}


class TinyEncoder(nn.Module):
    """Token classification over a small Transformer encoder."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(config["vocab"], config["width"])
        layer = nn.TransformerEncoderLayer(config["width"], config["heads"], 4 * config["width"], batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config["layers"])
        self.head = nn.Linear(config["width"], config["classes"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def train(steps: int, accumulate: int, logdir: str) -> None:
    from accelerate import Accelerator

    torch.set_num_threads(1)
    # On a machine without GPUs, cpu=True makes Accelerate run the processes as one gloo
    # job (without it, each CPU process trains alone).
    accelerator = Accelerator(gradient_accumulation_steps=accumulate, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = TinyEncoder(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = 16
    samples = steps * accumulate * batch * accelerator.num_processes  # `steps` updates on every rank
    tokens = torch.randint(0, CONFIG["vocab"], (samples, CONFIG["seq"]))
    labels = torch.randint(0, CONFIG["classes"], (samples,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # The prepared objects as they are: the AcceleratedOptimizer's updates end the steps,
    # an accumulation's micro-batches are one step.
    with dtprofile.profile(model, optimizer, logdir=logdir, every_n_steps=20) as prof:
        for x, y in prof.loader(loader):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    if accelerator.is_main_process:
        print(prof.report())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer updates")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--logdir", default="runs/accelerate-loop")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not launched: start two ranks
        sys.exit(relaunch(__file__, sys.argv[1:]))
    train(args.steps, args.accumulate, args.logdir)


if __name__ == "__main__":
    main()
