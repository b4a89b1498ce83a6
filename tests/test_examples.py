"""The examples the README and docs/ point to run as documented and leave their outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_custom_loop_example(tmp_path):
    out = _run([str(REPO / "examples" / "custom_loop_ddp.py"), "--steps", "20", "--logdir", str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "dtprofile_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["comm_source"] == "ddp_probe"
    assert summary["steps_total"] == 20
    assert "R_O = T_O / T_C" in out and "Projection" in out


def test_lightning_example(tmp_path):
    out = _run([str(REPO / "examples" / "lightning_ddp.py"), "--steps", "20", "--root", str(tmp_path)], tmp_path)
    [path] = list(tmp_path.rglob("dtprofile_summary.json"))
    summary = json.loads(path.read_text())
    assert summary["world_size"] == 2 and summary["steps_total"] == 20
    assert "tensorboard --logdir" in out


@pytest.mark.parametrize("layout, collective", [("fsdp", "reduce_scatters"), ("hsdp", "replica_all_reduces")])
def test_custom_loop_fsdp_example(tmp_path, layout, collective):
    out = _run(
        [
            str(REPO / "examples" / "custom_loop_fsdp.py"),
            "--layout",
            layout,
            "--steps",
            "20",
            "--logdir",
            str(tmp_path),
        ],
        tmp_path,
    )
    summary = json.loads((tmp_path / "dtprofile_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["comm_source"] == "fsdp" and summary["steps_total"] == 20
    assert summary["run"]["fsdp"]["units"] == 5 and summary["run"]["fsdp"][collective] == 5
    assert summary["per_step_ms"]["comm_total"] > 0
    assert "R_O = T_O / T_C" in out and "FSDP's" in out


def test_accelerate_example(tmp_path):
    pytest.importorskip("accelerate")
    # By itself: it starts its two ranks with torchrun.
    out = _run([str(REPO / "examples" / "accelerate_loop.py"), "--steps", "16", "--logdir", str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "dtprofile_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["comm_source"] == "ddp_probe"
    assert summary["steps_total"] == 16 and summary["run"]["micro_batches"] == 2
    assert summary["run"]["framework"] == "accelerate" and "R_O = T_O / T_C" in out


def test_hf_trainer_example_under_accelerate_launch(tmp_path):
    pytest.importorskip("transformers")
    from distributed import free_port

    out = _run(
        [
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
            str(free_port()),
            str(REPO / "examples" / "hf_trainer.py"),
            "--steps",
            "16",
            "--output-dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    [path] = list((tmp_path / "runs").glob("*/dtprofile_summary.json"))  # beside the Trainer's events
    assert list(path.parent.glob("events.out.tfevents.*"))
    summary = json.loads(path.read_text())
    # The Trainer's DDP searches for unused parameters and keeps its own all-reduce; DDP's
    # reducer reduces the probe steps.
    assert summary["world_size"] == 2 and summary["comm_source"] == "ddp_probe"
    assert summary["run"]["ddp"]["find_unused_parameters"] and summary["run"]["ddp"]["comm_hook"] is None
    assert summary["steps_total"] == 16 and summary["run"]["framework"] == "transformers"
    assert "R_O = T_O / T_C" in out and "tensorboard --logdir" in out
