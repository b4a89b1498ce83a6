"""Hugging Face runs for the tests, started by a real launcher (``accelerate launch`` or
torchrun) on 2 gloo ranks: ``<launcher> tests/hf_workers.py accelerate|trainer OUTDIR``.

Each rank runs several short trainings in one process (the imports and the process group
are the slow part) and writes what it saw to ``OUTDIR/<scenario>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

import dtprofile

torch.set_num_threads(1)
RANK = int(os.environ.get("RANK", "0"))


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class SlowItems(torch.utils.data.Dataset):
    """Random (x, y) pairs; ``delay_s`` spent on each item (a slow disk or decoder)."""

    def __init__(self, count: int, width: int, classes: int, seed: int, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, width, generator=g)
        self.y = torch.randint(0, classes, (count,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"x": self.x[i], "labels": self.y[i]}


class Classifier(nn.Module):
    """An MLP that returns the loss the way Transformers models do (``{"loss": ...}``)."""

    def __init__(self, width: int, hidden: int, classes: int, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(width if i == 0 else hidden, hidden), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


# Small: the step is mostly compute. Heavy: 2 x 8 MB of gradients for a 2-sample batch.
SMALL = dict(width=64, hidden=256, classes=8)
HEAVY = dict(width=64, hidden=1024, classes=8, depth=3)


def _summary_fields(summary: dict) -> dict:
    return {
        k: summary.get(k)
        for k in (
            "world_size",
            "steps_total",
            "steps_skipped_update",
            "comm_source",
            "grad_bytes",
            "per_step_ms",
            "ranks",
            "run",
        )
    } | {"advice_ids": [a["id"] for a in summary.get("advice") or []]}


# ----------------------------------------------------------------------------- Accelerate
def _accelerate_train(
    accelerator,
    outdir: str,
    name: str,
    *,
    profiled: bool,
    model_cfg: dict = SMALL,
    batch: int = 8,
    updates: int = 16,
    delay_s: float = 0.0,
    rank1_sleep_s: float = 0.0,
    inf_at: tuple[int, ...] = (),
    scaler: bool = False,
) -> dict:
    torch.manual_seed(0)
    model = Classifier(**model_cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accum = accelerator.gradient_accumulation_steps
    data = SlowItems(
        updates * accum * batch * accelerator.num_processes,
        model_cfg["width"],
        model_cfg["classes"],
        seed=1,
        delay_s=delay_s,
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    if scaler:  # the loss scaler of Accelerate's fp16 on a GPU, on the CPU
        accelerator.scaler = torch.amp.GradScaler("cpu")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    logdir = os.path.join(outdir, name)
    prof = dtprofile.profile(model, optimizer, logdir=logdir, warmup_steps=2, every_n_steps=8) if profiled else None
    batches = prof.loader(loader) if prof is not None else loader
    if prof is not None:
        prof.start()
    micro = 0
    for batch_ in batches:
        with accelerator.accumulate(model):
            loss = model(batch_["x"], batch_["labels"])["loss"]
            micro += 1
            if micro in inf_at:
                loss = loss * float("inf")  # the scaler skips this update
            if rank1_sleep_s and accelerator.process_index == 1 and accelerator.sync_gradients:
                time.sleep(rank1_sleep_s)  # rank 0 waits this long in the all-reduce
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            optimizer.zero_grad()
    result = {"weights": _weights(accelerator.unwrap_model(model)), "updates": updates}
    if prof is not None:
        result["summary"] = _summary_fields(prof.stop().to_dict())
        result["summary_written"] = os.path.isfile(os.path.join(logdir, "dtprofile_summary.json"))
    accelerator.scaler = None
    return result


def accelerate_scenarios(outdir: str, full: bool) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    out: dict = {"num_processes": accelerator.num_processes}
    plain = _accelerate_train(accelerator, outdir, "plain", profiled=False, rank1_sleep_s=0.015)
    synced = _accelerate_train(accelerator, outdir, "synced", profiled=True, rank1_sleep_s=0.015)
    out["identical"] = bool(torch.equal(plain["weights"], synced["weights"]))
    out["synced"] = {k: v for k, v in synced.items() if k != "weights"}
    if full:
        out["slow_data"] = _accelerate_train(
            accelerator, outdir, "slow_data", profiled=True, batch=4, delay_s=0.004, updates=12
        )["summary"]
        out["comm_heavy"] = _accelerate_train(
            accelerator, outdir, "comm_heavy", profiled=True, batch=2, model_cfg=HEAVY, updates=12
        )["summary"]
        out["skips"] = _accelerate_train(accelerator, outdir, "skips", profiled=True, scaler=True, inf_at=(9, 10, 21))[
            "summary"
        ]
    return out


# ----------------------------------------------------------------------------- Trainer
def _trainer_train(
    outdir: str,
    name: str,
    *,
    profiled: bool,
    model_cfg: dict = SMALL,
    batch: int = 8,
    steps: int = 20,
    delay_s: float = 0.0,
    eval_delay_s: float = 0.0,
    resume: str | None = None,
    save_steps: int | None = None,
) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class LogRecorder(TrainerCallback):
        """A reporter after dtprofile's callback: what the Trainer's other reporters get."""

        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    torch.manual_seed(0)
    model = Classifier(**model_cfg)
    train = SlowItems(4096, model_cfg["width"], model_cfg["classes"], seed=1, delay_s=delay_s)
    evaluation = SlowItems(16, model_cfg["width"], model_cfg["classes"], seed=3, delay_s=eval_delay_s)
    args = TrainingArguments(
        output_dir=os.path.join(outdir, name),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        learning_rate=0.05,
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,  # (DDP then searches for unused parameters: the default)
    )
    recorder = LogRecorder()
    callback = dtprofile.DTProfileTrainerCallback(warmup_steps=2, every_n_steps=4) if profiled else None
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        callbacks=[c for c in (callback, recorder) if c is not None],
    )
    trainer.train(resume_from_checkpoint=resume)
    result: dict = {"weights": _weights(trainer.model), "global_step": trainer.state.global_step}
    if callback is not None:
        result["summary"] = _summary_fields(callback.report().to_dict())
        result["logdir"] = callback.logdir
        result["headline_logs"] = [
            {k: v for k, v in logs.items() if k.startswith("dtprofile/")} for logs in recorder.logs
        ]
        result["first_callback"] = type(trainer.callback_handler.callbacks[0]).__name__
        from dtprofile.capture.records import FIELDS

        steps = callback.engine.steps.run.rows()[:, FIELDS.index("step")]
        result["step_max_ms"] = float(steps[steps == steps].max())  # the longest step profiled
    return result


def trainer_scenarios(outdir: str, full: bool) -> dict:
    out: dict = {}
    plain = _trainer_train(outdir, "plain", profiled=False, eval_delay_s=0.03)
    synced = _trainer_train(outdir, "synced", profiled=True, eval_delay_s=0.03, save_steps=10)
    out["identical"] = bool(torch.equal(plain["weights"], synced["weights"]))
    out["synced"] = {k: v for k, v in synced.items() if k != "weights"}
    if full:
        resumed = _trainer_train(
            outdir, "synced", profiled=True, resume=os.path.join(outdir, "synced", "checkpoint-10")
        )
        out["resumed"] = {k: v for k, v in resumed.items() if k != "weights"}
        out["slow_data"] = _trainer_train(outdir, "slow_data", profiled=True, batch=4, delay_s=0.004, steps=12)[
            "summary"
        ]
        out["comm_heavy"] = _trainer_train(outdir, "comm_heavy", profiled=True, batch=2, model_cfg=HEAVY, steps=12)[
            "summary"
        ]
    return out


def main() -> None:
    scenario, outdir = sys.argv[1], sys.argv[2]
    full = "--full" in sys.argv[3:]
    run = {"accelerate": accelerate_scenarios, "trainer": trainer_scenarios}[scenario]
    result = run(outdir, full)
    with open(os.path.join(outdir, f"{scenario}-rank{RANK}.json"), "w") as fh:
        json.dump(result, fh, default=str)


if __name__ == "__main__":
    main()
