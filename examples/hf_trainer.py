"""A Hugging Face Transformers ``Trainer`` run, profiled by dtprofile.

A tiny GPT-2 built from a config, random tokens, no downloads; evaluation every few
steps (left out of the profiled steps). Run it on two processes with torchrun or
Accelerate's launcher::

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py

or by itself (it then starts two local processes with torchrun on a free port)::

    python examples/hf_trainer.py [--steps 40] [--accumulate 2] [--output-dir runs/hf-trainer]

The Trainer writes its TensorBoard events under ``<output-dir>/runs/<time>_<host>``;
dtprofile writes its own, and ``dtprofile_summary.json``, beside them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _torchrun import relaunch  # (beside this script: starts torchrun when run by itself)

import dtprofile


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, their own labels (causal language modelling)."""

    def __init__(self, count: int, length: int, vocab: int, seed: int) -> None:
        self.tokens = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def train(steps: int, accumulate: int, output_dir: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    callback = dtprofile.DTProfileTrainerCallback(every_n_steps=20)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(4096, 32, 512, seed=1),
        eval_dataset=RandomTokens(64, 32, 512, seed=2),
        callbacks=[callback],
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print(callback.report())
        print(f"\ntensorboard --logdir {os.path.join(output_dir, 'runs')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer updates (max_steps)")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--output-dir", default="runs/hf-trainer")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not launched: start two ranks
        sys.exit(relaunch(__file__, sys.argv[1:]))
    train(args.steps, args.accumulate, args.output_dir)


if __name__ == "__main__":
    main()
