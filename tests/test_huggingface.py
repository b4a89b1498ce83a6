"""Hugging Face Accelerate and the Transformers Trainer, profiled on 2 gloo ranks started
by the real launchers (``accelerate launch`` and torchrun); see tests/hf_workers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from distributed import free_port

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "hf_workers.py"


def _launch(launcher: str, scenario: str, outdir: Path, full: bool) -> list[dict]:
    """``scenario`` of tests/hf_workers.py on 2 local ranks; each rank's result."""
    port = str(free_port())
    if launcher == "accelerate":
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
        ]
    command += [str(WORKERS), scenario, str(outdir)] + (["--full"] if full else [])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(command, cwd=outdir, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads((outdir / f"{scenario}-rank{r}.json").read_text()) for r in range(2)]


def _check_synced(result: dict, updates: int) -> dict:
    """The profiled run of a 2-rank, 2-micro-batch training with rank 1 sleeping 15 ms
    before each update's backward (Accelerate) or none (Trainer)."""
    assert result["identical"], "dtprofile changed the trained weights"
    s = result["synced"]["summary"]
    assert s["world_size"] == 2 and s["comm_source"] == "ddp_probe"
    assert s["steps_total"] == updates and s["run"]["micro_batches"] == 2  # one step per optimizer update
    assert s["per_step_ms"]["comm_total"] > 0 and s["grad_bytes"] > 0
    assert s["run"]["batch_bytes"] == 8 * (64 * 4 + 8)  # 8 samples of 64 float32 and an int64 label
    return s


# --------------------------------------------------------------------------- Accelerate
@pytest.mark.slow
def test_accelerate_under_accelerate_launch(tmp_path):
    """Prepared objects as they are: identical weights, accumulation as one step, the
    exposed wait against a known straggler, data_bound, comm_bound and fp16 skips."""
    results = _launch("accelerate", "accelerate", tmp_path, full=True)
    assert [r["num_processes"] for r in results] == [2, 2]
    for r in results:
        s = _check_synced(r, updates=16)
        assert s["run"]["framework"] == "accelerate"
    rank0 = results[0]
    assert rank0["synced"]["summary_written"]
    ranks = rank0["synced"]["summary"]["ranks"]
    # Rank 0 waits in the all-reduce for rank 1's 15 ms as well as for the wire; rank 1
    # waits for the wire only (a few ms, more on a busy machine).
    assert ranks[0]["comm_exposed"] - ranks[1]["comm_exposed"] == pytest.approx(15.0, rel=0.5), ranks
    assert ranks[1]["comm_exposed"] < 15.0, ranks
    assert "data_bound" in rank0["slow_data"]["advice_ids"], rank0["slow_data"]["advice_ids"]
    assert "comm_bound" in rank0["comm_heavy"]["advice_ids"], rank0["comm_heavy"]["advice_ids"]
    skips = rank0["skips"]
    assert skips["steps_total"] == 16 and skips["steps_skipped_update"] == 2  # micro-batches 9+10 and 21


@pytest.mark.slow
def test_accelerate_under_torchrun(tmp_path):
    for r in _launch("torchrun", "accelerate", tmp_path, full=False):
        _check_synced(r, updates=16)


# --------------------------------------------------------------------------- Trainer
@pytest.mark.slow
def test_trainer_under_torchrun(tmp_path):
    """The Trainer's own DDP model, evaluation left out of the steps, the events beside
    the Trainer's, the headline in its logs, a resumed run, data_bound and comm_bound."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = _launch("torchrun", "trainer", tmp_path, full=True)
    for r in results:
        s = _check_synced(r, updates=20)
        assert s["run"]["framework"] == "transformers"
        # The Trainer's DDP searches for unused parameters (its default for a model of its
        # own): DDP's reducer reduces the probe steps, with DDP's own all-reduce.
        assert s["run"]["ddp"]["find_unused_parameters"] and s["run"]["ddp"]["comm_hook"] is None
        assert r["synced"]["first_callback"] == "DTProfileTrainerCallback"
        # Evaluation every 5 steps holds 240 ms of loading per rank (8 items of 30 ms of
        # sleep): no profiled step holds it (a step here takes a few ms, tens on a busy machine).
        assert r["synced"]["step_max_ms"] < 0.75 * 240.0, (r["synced"]["step_max_ms"], s["per_step_ms"])
    rank0, rank1 = (r["synced"] for r in results)
    assert rank1["logdir"] is None and not any(rank1["headline_logs"])
    logdir = Path(rank0["logdir"])
    assert logdir.parent == tmp_path / "synced" / "runs"  # the Trainer's own runs/<time>_<host>
    assert (logdir / "dtprofile_summary.json").is_file()
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "dtprofile/time/step" in tags  # one run in TensorBoard: both writers'
    # The headline reached the reporter after dtprofile's (and so TensorBoard's callback).
    headline = [h for h in rank0["headline_logs"] if h]
    assert headline and set(headline[0]) == {"dtprofile/R_O", "dtprofile/alpha_at_target", "dtprofile/recommended_gpus"}
    assert "train/dtprofile/R_O" in tags

    results0 = results[0]
    resumed = results0["resumed"]
    assert resumed["global_step"] == 20 and resumed["summary"]["steps_total"] == 10
    resumed_events = EventAccumulator(resumed["logdir"])
    resumed_events.Reload()
    assert min(e.step for e in resumed_events.Scalars("dtprofile/time/step")) > 10  # the Trainer's step axis
    assert "data_bound" in results0["slow_data"]["advice_ids"], results0["slow_data"]["advice_ids"]
    assert "comm_bound" in results0["comm_heavy"]["advice_ids"], results0["comm_heavy"]["advice_ids"]


# --------------------------------------------------------------------------- in one process
def test_import_dtprofile_imports_neither_hugging_face_package():
    code = (
        "import sys, dtprofile; bad = [m for m in ('accelerate', 'transformers') if m in sys.modules]; "
        "print(bad); assert not bad; assert 'DTProfileTrainerCallback' in dtprofile.__all__"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_trainer_callback_takes_the_options_and_names_a_wrong_one():
    import dtprofile

    callback = dtprofile.DTProfileTrainerCallback(warmup_steps=3, target_efficiency=0.7)
    assert callback.options.warmup_steps == 3 and callback.options.target_efficiency == 0.7
    with pytest.raises(TypeError, match="DTProfileTrainerCallback.*'warmup'"):
        dtprofile.DTProfileTrainerCallback(warmup=3)
    with pytest.raises(ValueError, match="target_efficiency"):
        dtprofile.DTProfileTrainerCallback(target_efficiency=2.0)
    with pytest.raises(RuntimeError, match="before trainer.train"):
        callback.report()


def test_trainer_logdir_follows_the_trainers_tensorboard_directory(tmp_path, monkeypatch):
    from dtprofile.integrations.transformers import _trainer_logdir

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    # Transformers 5 without a TensorBoard callback: its default, runs/<time>_<host> under output_dir.
    default = Path(_trainer_logdir(None, args))
    assert default.parent == tmp_path / "out" / "runs"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    assert _trainer_logdir(None, args) == str(tmp_path / "tb")
    # The Trainer's TensorBoardCallback, once it made its writer: that writer's directory.
    TensorBoardCallback = type("TensorBoardCallback", (), {})
    tb = TensorBoardCallback()
    tb.tb_writer = SimpleNamespace(log_dir=str(tmp_path / "writer"))
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[object(), tb]))
    assert _trainer_logdir(trainer, args) == str(tmp_path / "writer")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    # Transformers 4: args.logging_dir.
    assert _trainer_logdir(None, SimpleNamespace(output_dir="o", logging_dir=str(tmp_path / "old"))) == str(
        tmp_path / "old"
    )


def test_trainer_callback_without_its_trainer_warns_and_measures_what_it_can(tmp_path):
    """Events called by something other than a Trainer (a wrapper, a test harness): the
    unwrapped model and the optimizer are profiled, the data wait is reported unmeasured
    with the reason, and nothing is raised into the loop."""
    import torch

    import dtprofile

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = dtprofile.DTProfileTrainerCallback(warmup_steps=1, logdir=str(tmp_path))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    args = SimpleNamespace(output_dir=str(tmp_path), device=torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match="data wait unmeasured.*found no Trainer"):
        callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
    for step in range(6):
        callback.on_step_begin(args, state, None)
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        state.global_step = step + 1
        callback.on_step_end(args, state, None)
    callback.on_train_end(args, state, None)
    summary = callback.report().to_dict()
    assert summary["steps_total"] == 6 and summary["per_step_ms"]["forward"] > 0
    assert "data" in summary["parts_disabled"] and summary["run"]["framework"] == "transformers"
    assert (tmp_path / "dtprofile_summary.json").is_file()


def test_fetch_timer_times_each_fetch_and_pauses_when_an_epoch_runs_out():
    from dtprofile.integrations.transformers import _FetchTimer, _training_logs

    class Trainer:
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches = []
            for _ in range(num_batches):
                try:
                    batches.append(next(epoch_iterator))
                except StopIteration:
                    break
            return batches, None

    waits, cpu_read, calls = [], [], []

    def add(s, transfer, cpu):
        waits.append(s)
        cpu_read.append(cpu is not None)

    noted, compared = [], []
    data = SimpleNamespace(add=add, batch_bytes=None, sample_shapes_vary=None)
    data.note_batch = lambda batch: (noted.append(batch), setattr(data, "batch_bytes", 8))
    data.compare_batch = compared.append
    engine = SimpleNamespace(active=True, data=data)
    trainer = Trainer()
    timer = _FetchTimer(
        trainer, lambda: engine, on_fetch=lambda: calls.append("resume"), on_empty=lambda: calls.append("pause")
    )
    epoch = iter(range(3))
    assert trainer.get_batch_samples(epoch, 2, None)[0] == [0, 1]
    assert trainer.get_batch_samples(epoch, 2, None)[0] == [2]
    assert trainer.get_batch_samples(epoch, 2, None)[0] == []  # an epoch that ran out
    assert len(waits) == 3 and all(w >= 0 for w in waits)  # one wait per batch fetched
    assert calls == ["resume", "resume", "resume", "pause"]
    assert noted == [0]  # the first batch's bytes, once
    # The CPU clock is read on one fetch in FETCH_CPU_EVERY of the run, not of each call.
    from dtprofile.capture.data_wait import FETCH_CPU_EVERY

    epoch = iter(range(100))
    for _ in range(10):
        trainer.get_batch_samples(epoch, 2, None)
    assert cpu_read == [i % FETCH_CPU_EVERY == 0 for i in range(23)]
    # A later batch's shapes are compared on one fetch in FETCH_CPU_EVERY (fixed or varying lengths).
    fetched = [0, 1, 2] + list(range(20))  # (the first noted, not compared)
    assert compared == [b for n, b in enumerate(fetched, start=1) if n > 1 and n % FETCH_CPU_EVERY == 1] == [5, 13]
    timer.restore()
    assert "get_batch_samples" not in vars(trainer)
    # The headline goes with the training figures, whatever an evaluation's prefix.
    assert _training_logs({"loss": 1.0, "learning_rate": 1e-3}) and _training_logs({"train_runtime": 3.0})
    assert not _training_logs({"val_loss": 1.0, "val_runtime": 0.1}) and not _training_logs({"eval_loss": 1.0})
