"""The Lightning callback: strategies, outputs, zero-code attach.

Multi-process runs go through ``tests/lightning_workers.py`` started with a hard timeout
(its whole process group is killed at the deadline), a free port, one thread per process
and at most 2 processes. Single-device runs happen in this process.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from distributed import free_port  # noqa: E402  (tests/ is on sys.path under pytest)

import dtprofile  # noqa: E402
from dtprofile.integrations import lightning as dl  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "lightning_workers.py"
sys.path.insert(0, str(HERE))
import lightning_workers as lw  # noqa: E402

SCENARIO_TIMEOUT_S = 240


# ---------------------------------------------------------------------- helpers
def run_scenario(name: str, outdir: Path, env: dict | None = None) -> dict:
    """Run a multi-process scenario; its rank-0 result. Never hangs: killed at the deadline."""
    outdir.mkdir(parents=True, exist_ok=True)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DTPROFILE")}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        full_env.pop(k, None)
    full_env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS), name, str(outdir)],
        env=full_env,
        cwd=str(outdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the ranks it starts die with it
    )
    try:
        out, _ = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"scenario {name} still running after {SCENARIO_TIMEOUT_S} s; killed\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers, if any
        except ProcessLookupError:
            pass
    result = outdir / "result.json"
    assert proc.returncode == 0 and result.exists(), f"scenario {name} failed (rc={proc.returncode}):\n{out[-6000:]}"
    return json.loads(result.read_text())


def events(log_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def check_outputs(log_dir: str, world_size: int) -> dict:
    """Events in the logger's directory with the dtprofile tags; the summary beside them."""
    files = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert len(files) == 1, f"expected the logger's one event file, got {files}"  # no second writer
    acc = events(log_dir)
    scalars = set(acc.Tags()["scalars"])
    for tag in ("dtprofile/time/step", "dtprofile/time/forward", "dtprofile/time/data_wait", "dtprofile/ratio/R_O"):
        assert tag in scalars, (tag, sorted(scalars))
    assert any(t.startswith("dtprofile/projection/alpha_paper") for t in scalars)
    assert any(t.startswith("dtprofile/projection/speedup") for t in scalars)
    assert "dtprofile/advice/text_summary" in acc.Tags()["tensors"]
    path = os.path.join(log_dir, "dtprofile_summary.json")
    summary = json.loads(Path(path).read_text())
    assert summary["world_size"] == world_size
    assert summary["data_wait_source"] == "loader"
    return summary


def fit_local(tmp_path: Path, callback: bool = True, module=lw.Net, cb_kw: dict | None = None, **trainer_kw):
    """A single-device CPU fit in this process (thread count and seed variables put back)."""
    threads = torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        return lw.fit(
            strategy="auto", devices=1, callback=callback, module=module, root=str(tmp_path), cb_kw=cb_kw, **trainer_kw
        )
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------- API and zero-code attach
def test_import_dtprofile_does_not_import_lightning():
    code = (
        "import sys, dtprofile; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', 'lightning_fabric')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_names():
    assert dtprofile.DTProfileCallback is dl.DTProfileCallback
    assert issubclass(dtprofile.DTProfileCallback, pl.Callback)
    assert "DTProfileCallback" in dtprofile.__all__


def test_batch_hooks_it_has_no_use_for_are_not_dispatched():
    """The Trainer skips a callback's hook that is not callable: the batch hooks the
    callback does not use are None on the instance; a subclass's own override stays, and
    its super() call reaches Lightning's hook."""
    from pytorch_lightning.trainer import call

    class Mine(dtprofile.DTProfileCallback):
        seen = 0

        def on_after_backward(self, trainer, pl_module):
            super().on_after_backward(trainer, pl_module)
            Mine.seen += 1

    plain, mine = dtprofile.DTProfileCallback(), Mine()
    assert plain.on_after_backward is None and plain.on_before_zero_grad is None
    assert callable(mine.on_after_backward) and mine.on_before_zero_grad is None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[plain, mine],
    )
    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_callback_hooks(trainer, "on_before_zero_grad", None)
    assert Mine.seen == 1


def test_batch_hooks_a_fit_does_not_need_are_not_dispatched(tmp_path):
    """During a fit in full precision with automatic optimization, the callback's
    ``on_before_optimizer_step`` (the precision plugin's ``_after_closure`` marks the
    update's start after it) and ``on_train_batch_end`` (every update announced runs
    inside ``optimizer.step``) are None on the instance; the class's are back after fit.
    Manual optimization keeps the batch's end (it closes the step there), and a
    subclass's override stays."""
    seen: dict = {}

    class Mine(dtprofile.DTProfileCallback):
        calls = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            Mine.calls += 1

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            Mine.starts += 1

        starts = 0

    class Look(pl.Callback):
        def __init__(self, cb):
            self.cb = cb

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("step", self.cb.on_before_optimizer_step)
            seen.setdefault("end", self.cb.on_train_batch_end)
            seen.setdefault("starts", []).append(self.cb.on_train_batch_start)

    plain = dtprofile.DTProfileCallback(warmup_steps=1)
    fit_local(tmp_path / "plain", callback=False, callbacks=[plain, Look(plain)], max_steps=6)
    assert seen["step"] is None and seen["end"] is None
    # The batch start's hook notes the first batch's size (below), then has nothing left to do.
    assert seen["starts"] == [None] * 6
    for name in ("on_before_optimizer_step", "on_train_batch_end", "on_train_batch_start"):
        assert callable(getattr(plain, name)) and name not in vars(plain)
    summary = plain.report().to_dict()
    assert summary["steps_total"] >= 4 and summary["per_step_ms"]["optimizer"] > 0
    assert summary["run"]["batch_bytes"] == 8 * (3 * 8 * 8 * 4 + 8)  # 8 images and labels: what a worker copies

    seen.clear()
    mine = Mine(warmup_steps=1)
    fit_local(tmp_path / "mine", callback=False, callbacks=[mine, Look(mine)], max_steps=6)
    assert callable(seen["step"]) and Mine.calls == 6 and seen["end"] is None
    assert all(callable(start) for start in seen["starts"]) and Mine.starts == 6  # a subclass's own stays

    seen.clear()
    mixed = dtprofile.DTProfileCallback(warmup_steps=1)
    fit_local(tmp_path / "mixed", callback=False, callbacks=[mixed, Look(mixed)], max_steps=6, precision="bf16-mixed")
    assert seen["step"] is None and callable(seen["end"])  # MixedPrecision steps the optimizer its own way

    # Manual optimization closes each step at the batch's end, even with the callback of
    # a fit that ended without putting its hooks back.
    seen.clear()
    plain.on_train_batch_end = None
    fit_local(tmp_path / "manual", callback=False, module=lw.ManualNet, callbacks=[plain, Look(plain)], max_steps=6)
    assert callable(seen["end"])
    assert plain.report().to_dict()["steps_total"] >= 4


def test_options_are_validated_at_construction():
    with pytest.raises(ValueError, match="every_n_steps"):
        dtprofile.DTProfileCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="scaling"):
        dtprofile.DTProfileCallback(scaling="sideways")
    with pytest.raises(ValueError, match="link_bandwidth"):
        dtprofile.DTProfileCallback(link_bandwidth="fast")
    with pytest.raises(TypeError):
        dtprofile.DTProfileCallback(5)  # keyword-only, like dtprofile.profile's options


def test_options_from_env():
    env = {
        "DTPROFILE_LOGDIR": "/tmp/x",
        "DTPROFILE_EVERY_N_STEPS": "7",
        "DTPROFILE_WARMUP_STEPS": "3",
        "DTPROFILE_TARGET_EFFICIENCY": "0.9",
        "DTPROFILE_LINK_BANDWIDTH": "25Gbps",
        "DTPROFILE_SCALING": "strong",
        "DTPROFILE_PROJECT_GPUS": "1, 2,8",
        "DTPROFILE_PROBE_EVERY": "10",
        "DTPROFILE_GATHER_TIMEOUT_S": "5",
        "DTPROFILE_TELEMETRY_INTERVAL_S": "0",
    }
    kw = dl.options_from_env(env)
    assert kw == dict(
        logdir="/tmp/x",
        every_n_steps=7,
        warmup_steps=3,
        target_efficiency=0.9,
        link_bandwidth="25Gbps",
        scaling="strong",
        project_gpus=(1, 2, 8),
        probe_every=10,
        gather_timeout_s=5.0,
        telemetry_interval_s=0.0,
    )
    with pytest.raises(ValueError, match="DTPROFILE_TELEMETRY_INTERVAL_S='0.01': telemetry_interval_s"):
        dl.options_from_env({"DTPROFILE_TELEMETRY_INTERVAL_S": "0.01"})
    # A bare number would be bytes/s (25 meant as Gbit/s gave 2e-7 Gbit/s): a unit is required.
    with pytest.raises(ValueError, match="DTPROFILE_LINK_BANDWIDTH='25'.*needs a unit"):
        dl.options_from_env({"DTPROFILE_LINK_BANDWIDTH": "25"})
    assert dl.options_from_env({"DTPROFILE_WARMUP_STEPS": ""}) == {}
    for raw, value in (("auto", "auto"), (" AUTO", "auto"), ("0", 0), ("5", 5)):
        assert dl.options_from_env({"DTPROFILE_BUCKET_TIMING_EVERY": raw}) == {"bucket_timing_every": value}
    for var, bad in [
        ("DTPROFILE_EVERY_N_STEPS", "ten"),
        ("DTPROFILE_EVERY_N_STEPS", "0"),
        ("DTPROFILE_WARMUP_STEPS", "-1"),
        ("DTPROFILE_TARGET_EFFICIENCY", "1.5"),
        ("DTPROFILE_TARGET_EFFICIENCY", "high"),
        ("DTPROFILE_LINK_BANDWIDTH", "fast"),
        ("DTPROFILE_SCALING", "diagonal"),
        ("DTPROFILE_PROJECT_GPUS", "1,two"),
        ("DTPROFILE_PROJECT_GPUS", "0,2"),
        ("DTPROFILE_PROBE_EVERY", "x"),
        ("DTPROFILE_BUCKET_TIMING_EVERY", "sometimes"),
        ("DTPROFILE_BUCKET_TIMING_EVERY", "-2"),
    ]:
        with pytest.raises(ValueError, match=var):
            dl.options_from_env({var: bad})


def test_callbacks_factory(monkeypatch):
    monkeypatch.delenv("DTPROFILE", raising=False)
    assert dl.callbacks_factory() == []
    monkeypatch.setenv("DTPROFILE", "0")
    assert dl.callbacks_factory() == []
    monkeypatch.setenv("DTPROFILE", "1")
    monkeypatch.setenv("DTPROFILE_WARMUP_STEPS", "3")
    (cb,) = dl.callbacks_factory()
    assert isinstance(cb, dtprofile.DTProfileCallback) and cb._from_env
    assert cb.options.warmup_steps == 3
    monkeypatch.setenv("DTPROFILE_EVERY_N_STEPS", "soon")
    with pytest.raises(ValueError, match="DTPROFILE_EVERY_N_STEPS"):
        dl.callbacks_factory()
    monkeypatch.setenv("DTPROFILE", "maybe")
    with pytest.raises(ValueError, match="DTPROFILE"):
        dl.callbacks_factory()


def test_entry_points_are_installed_and_loaded_by_the_trainer(monkeypatch, tmp_path):
    from importlib.metadata import entry_points

    for group in ("pytorch_lightning.callbacks_factory", "lightning.pytorch.callbacks_factory"):
        eps = [ep for ep in entry_points(group=group) if ep.name == "dtprofile"]
        assert eps, f"no dtprofile entry point in {group}: run pip install -e ."
        assert eps[0].load() is dl.callbacks_factory
    monkeypatch.setenv("DTPROFILE", "1")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    assert sum(isinstance(c, dtprofile.DTProfileCallback) for c in trainer.callbacks) == 1
    monkeypatch.delenv("DTPROFILE")
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=str(tmp_path), logger=False)
    assert not any(isinstance(c, dtprofile.DTProfileCallback) for c in trainer.callbacks)


def test_headline_alpha_at_recommended_gpus():
    summary = {
        "ratios": {"R_O": 0.25},
        "projection": {"gpus": [1, 2, 4], "alpha_paper": [1.0, 0.8333, 0.625]},
        "recommendations": {"gpus": 2},
    }
    h = dl.DTProfileCallback.headline(summary)
    assert h == {"dtprofile/R_O": 0.25, "dtprofile/alpha_at_target": 0.8333, "dtprofile/recommended_gpus": 2.0}
    summary["recommendations"] = {"gpus": None}  # no recommendation: the largest projected G
    assert dl.DTProfileCallback.headline(summary)["dtprofile/alpha_at_target"] == 0.625
    assert dl.DTProfileCallback.headline(None) == {}
    # Without the projection's list (an interval before the model ran), the paper's R_O
    # of a 2-rank run is R_O / 2: alpha(0.125, 4) = 1.125 / 1.5 = 0.75, not 0.625.
    two = {"ratios": {"R_O": 0.25}, "world_size": 2, "projection": {"gpus": [1, 4]}, "recommendations": {"gpus": None}}
    assert dl.DTProfileCallback.headline(two)["dtprofile/alpha_at_target"] == pytest.approx(0.75)


# ---------------------------------------------------------------------- single device, in process
def test_single_device_cpu(tmp_path):
    trainer, _, cb = fit_local(tmp_path)
    report = cb.report()
    s = report.to_dict()
    assert s["world_size"] == 1 and s["steps_total"] == 12 and s["steps_profiled"] == 10
    assert cb.options.every_n_steps == trainer.log_every_n_steps == 5  # the Trainer's interval by default
    per = s["per_step_ms"]
    for k in ("step", "forward", "backward", "optimizer", "data_wait"):
        assert per[k] is not None and per[k] > 0, (k, per)
    assert s["comm_source"] is None and per["comm_total"] is None  # nothing to communicate
    assert s["run"]["batch_size"] == 8
    summary = check_outputs(trainer.logger.log_dir, world_size=1)
    assert summary["steps_total"] == 12
    steps = [e.step for e in events(trainer.logger.log_dir).Scalars("dtprofile/time/step")]
    assert steps[:2] == [4, 9]  # where Lightning logs the same batch (batches stepped before it)
    for key in dl.METRIC_KEYS:
        assert key in trainer.callback_metrics, key
    assert float(trainer.callback_metrics["dtprofile/R_O"]) == pytest.approx(s["ratios"]["R_O"])
    # everything put back
    assert "start" not in vars(trainer.profiler) and "stop" not in vars(trainer.profiler)
    assert "training_step" not in vars(trainer.strategy)
    assert not trainer.lightning_module._forward_hooks and not trainer.lightning_module._forward_pre_hooks
    assert not trainer.optimizers[0]._optimizer_step_pre_hooks


class _SlowData(lw.Images):
    def __getitem__(self, i: int):
        time.sleep(0.002)  # 8 per batch: >= 16 ms of data wait per step
        return super().__getitem__(i)


class _SlowStep(lw.Net):
    def training_step(self, batch, batch_idx):
        time.sleep(0.010)  # inside training_step: forward
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        time.sleep(0.010)  # between backward and the update (gradient-norm logging, say): not optimizer

    def train_dataloader(self):
        return lw.DataLoader(_SlowData(), batch_size=8)


@pytest.fixture(params=["loop hooks", "profiler actions"])
def fetch_timing(request, monkeypatch):
    """Each way the callback times fetches: the epoch loop's fetch hooks and the
    strategy's transfer, or, on a Lightning without them, the Trainer's profiler actions."""
    from dtprofile.integrations import _lightning_patches as patches

    used: list[type] = []
    real = patches._FetchHooks.attach

    def attach(trainer, add_wait, on_fetch=None):
        hooks = real(trainer, add_wait, on_fetch) if request.param == "loop hooks" else None
        used.append(patches._FetchHooks if hooks is not None else patches._FetchTimer)
        return hooks

    monkeypatch.setattr(patches._FetchHooks, "attach", staticmethod(attach))
    yield request.param
    assert used == [patches._FetchHooks if request.param == "loop hooks" else patches._FetchTimer]


def test_phases_land_where_they_happen(tmp_path, fetch_timing):
    """Fetch time is data wait; training_step is forward; the optimizer phase is the update
    only (Lightning runs forward and backward inside optimizer.step's closure, then the
    on_before_optimizer_step hooks and clipping: other compute)."""
    _, _, cb = fit_local(tmp_path, module=_SlowStep, max_steps=10, cb_kw={"warmup_steps": 2}, gradient_clip_val=1.0)
    per = cb.report().to_dict()["per_step_ms"]
    assert per["data_wait"] >= 15.0, per
    assert per["forward"] >= 9.5, per
    assert per["optimizer"] < 9.0, per
    assert per["compute"] - per["forward"] - per["backward"] - per["optimizer"] >= 9.5, per
    assert per["step"] >= per["data_wait"] + per["forward"] * 0.9, per
    # 16 ms of sleep in each step's 36 ms and more of sleeps (the rest, a tiny model's
    # compute, grows on a busy machine).
    assert cb.report().to_dict()["ratios"]["data_fraction"] > 0.2


def test_weights_identical_with_and_without_callback(tmp_path):
    _, m0, _ = fit_local(tmp_path / "a", callback=False)
    _, m1, _ = fit_local(tmp_path / "b", callback=True)
    w0, w1 = m0.state_dict(), m1.state_dict()
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k


def test_accumulate_grad_batches_counts_optimizer_steps(tmp_path):
    trainer, _, cb = fit_local(tmp_path, accumulate_grad_batches=2)
    s = cb.report().to_dict()
    assert trainer.global_step == 12
    assert s["steps_total"] == 12  # optimizer steps, not micro-batches
    assert s["run"]["micro_batches"] == 2


def test_manual_optimization(tmp_path):
    trainer, _, cb = fit_local(tmp_path, module=lw.ManualNet)
    s = cb.report().to_dict()
    assert s["steps_total"] == trainer.global_step == 12
    per = s["per_step_ms"]
    assert per["forward"] > 0 and per["backward"] > 0 and per["optimizer"] > 0, per


class _GAN(lw.Net):
    """Manual optimization, two optimizers: D steps every batch, G every second batch."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False
        self.gen = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x, y = batch
        logits = self(x)
        d_loss = torch.nn.functional.cross_entropy(logits, y)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        if batch_idx % 2 == 1:
            g_loss = self.gen(self(x).detach()).pow(2).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

    def configure_optimizers(self):
        d_params = [p for n, p in self.named_parameters() if not n.startswith("gen.")]
        return torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(d_params, lr=0.05)


def test_manual_optimization_with_two_optimizers_is_a_step_per_batch(tmp_path):
    # The generator's optimizer comes first in trainer.optimizers but steps every second
    # batch only: each batch in which any optimizer stepped is one step.
    trainer, _, cb = fit_local(tmp_path, module=_GAN, max_steps=36)  # global_step counts both optimizers
    s = cb.report().to_dict()
    batches = trainer.fit_loop.epoch_loop._batches_that_stepped
    assert batches == 24 and s["steps_total"] == batches
    assert s["run"]["micro_batches"] == 1
    assert s["per_step_ms"]["optimizer"] > 0


class _Validated(lw.Net):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.02)  # 2 batches: 40 ms of validation after every training batch
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def val_dataloader(self):
        return lw.DataLoader(lw.Images(32), batch_size=8)


def test_validation_inside_fit_is_left_out_of_the_step(tmp_path):
    _, _, cb = fit_local(tmp_path, module=_Validated, val_check_interval=1, limit_val_batches=2)
    per = cb.report().to_dict()["per_step_ms"]
    # The 40 ms of validation after every batch (2 x 20 ms of sleep) is not training; a
    # step is a few ms (more on a busy machine).
    assert per["step"] < 0.75 * 40.0, per
    assert per["compute"] < 0.75 * 40.0 and per["data_wait"] < 0.75 * 40.0, per


class _SlowSave(pl.callbacks.Checkpoint):
    """Saves at each validation's end, as ModelCheckpoint(monitor=...) does: Lightning runs a
    Checkpoint's hooks after every other callback's, so after dtprofile's."""

    def on_validation_end(self, trainer, pl_module):
        time.sleep(0.03)

    def on_train_epoch_end(self, trainer, pl_module):
        time.sleep(0.03)


class _EpochEnd(lw.Net):
    lr = 0.05  # for the learning rate finder

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return lw.DataLoader(lw.Images(16), batch_size=8)  # 2 batches an epoch

    def on_train_epoch_end(self):
        time.sleep(0.03)


def test_checkpoints_and_epoch_ends_are_left_out_of_the_step(tmp_path):
    """A save after each validation (every step here) or at an epoch's end, 30 ms each: before,
    the validation's save was compute of the next step (43 ms steps instead of 13). A step
    that held one would be 30 ms longer than the sleep; these steps take a few ms (more on
    a busy machine)."""
    saving = fit_local(
        tmp_path / "b",
        module=_Validated,
        val_check_interval=1,
        limit_val_batches=1,
        callbacks=[_SlowSave()],
        enable_checkpointing=True,
    )[2]
    saved = saving.report().to_dict()["per_step_ms"]["step"]
    assert saved < 0.75 * 30.0, saved
    epochs = fit_local(
        tmp_path / "c",
        module=_EpochEnd,
        callbacks=[_SlowSave()],  # every other step ends
        enable_checkpointing=True,
    )[2]  # an epoch: 60 ms
    assert epochs.report().to_dict()["per_step_ms"]["step"] < 0.75 * 30.0


class _TransferHooks(lw.Net):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        time.sleep(0.01)
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        time.sleep(0.01)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_batch_transfer_hooks_are_data_wait_that_workers_do_not_shorten(tmp_path, fetch_timing):
    """on_before_batch_transfer (10 ms) was compute, transfer_batch_to_device (10 ms) data wait
    with advice to add loader workers, which cannot run either hook."""
    _, _, cb = fit_local(tmp_path, module=_TransferHooks, cb_kw={"warmup_steps": 2})
    s = cb.report().to_dict()
    per = s["per_step_ms"]
    assert per["data_transfer"] >= 19.0 and per["data_wait"] >= per["data_transfer"], per
    (finding,) = [f for f in s["advice"] if f["id"] == "data_bound"]
    assert "transfer_batch_to_device" in finding["action"] and "num_workers=" not in finding["action"]
    assert finding["evidence"]["data_transfer_ms"] == pytest.approx(per["data_transfer"])
    assert s["recommendations"]["num_workers"] in (None, 0)
    assert "transfer to the device" in str(cb.report())


def test_finder_trial_steps_mid_fit_are_not_the_runs(tmp_path):
    """A LearningRateFinder run from on_train_epoch_start (Lightning's fine-tuning pattern) runs
    20 trial steps with the Trainer's callbacks swapped out: before, they were 20 more steps."""

    class MidFitFinder(pl.callbacks.LearningRateFinder):
        def on_fit_start(self, *args, **kwargs):
            return

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.lr_find(trainer, pl_module)

    finder = MidFitFinder(num_training_steps=20, min_lr=1e-4, max_lr=1e-2)
    trainer, _, cb = fit_local(tmp_path, module=_EpochEnd, callbacks=[finder], max_steps=12)
    s = cb.report().to_dict()
    assert s["steps_total"] == trainer.global_step == 12
    assert not cb.engine.suspended and "run" not in trainer.fit_loop.__dict__
    # Nor did the trial steps' fetches end the epoch end's exclusion (30 ms of
    # on_train_epoch_end): no step holds it, or the trials (929.7 ms once).
    # A step holding either stands 30 ms and more above the others (a step is a few ms).
    steps = cb.engine.steps.run._data[: len(cb.engine.steps.run), 0]
    assert steps.max() < np.median(steps) + 25.0, steps


def test_fast_dev_run_writes_nothing(tmp_path):
    _, _, cb = fit_local(tmp_path, fast_dev_run=3)
    assert cb.report().to_dict()["steps_total"] == 3
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_tensorboard_steps_follow_lightnings_after_a_resume(tmp_path):
    """dtprofile's scalars use the step Lightning's loggers use, so a resumed fit continues
    the curves instead of starting again at 0 beside them."""
    first, _, _ = fit_local(tmp_path / "a", max_steps=6)
    ckpt = tmp_path / "six.ckpt"
    first.save_checkpoint(str(ckpt))
    pl.seed_everything(0)
    cb = dtprofile.DTProfileCallback(**lw.CB)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[cb],
        default_root_dir=str(tmp_path / "b"),
        **{**lw.FAST, "max_steps": 18},
    )
    trainer.fit(lw.Net(), ckpt_path=str(ckpt))
    steps = [e.step for e in events(trainer.logger.log_dir).Scalars("dtprofile/time/step")]
    assert steps and min(steps) >= 6 and max(steps) == 18, steps


def test_bf16_mixed_precision(tmp_path):
    trainer, _, cb = fit_local(tmp_path, precision="bf16-mixed")
    s = cb.report().to_dict()
    assert s["steps_total"] == 12
    assert s["per_step_ms"]["forward"] > 0 and s["per_step_ms"]["backward"] > 0


class _OverflowingNet(lw.Net):
    """Every 5th loss is inf: fp16 mixed precision's GradScaler skips that update."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx % 5 == 3 else loss


def test_fp16_grad_scaler_skipped_updates(tmp_path):
    from pytorch_lightning.plugins.precision import MixedPrecision

    def fit(sub, callback):
        # Lightning turns precision="16-mixed" into bf16 on the CPU; the plugin keeps fp16 and its scaler.
        return fit_local(
            tmp_path / sub, callback=callback, module=_OverflowingNet, plugins=[MixedPrecision("16-mixed", "cpu")]
        )

    trainer, m1, cb = fit("a", True)
    _, m0, _ = fit("b", False)
    assert trainer.global_step == 12
    s = cb.report().to_dict()
    assert s["steps_total"] == 12
    assert s["steps_skipped_update"] == 2  # batches 3 and 8 (batch 3 is after the 2 warm-up steps)
    assert s["steps_profiled"] == 12 - 2 - 2
    assert s["run"]["micro_batches"] == 1
    assert s["per_step_ms"]["optimizer"] > 0
    assert events(trainer.logger.log_dir).Scalars("dtprofile/steps/skipped_update")[-1].value == 2
    for k, v in m0.state_dict().items():
        assert torch.equal(v, m1.state_dict()[k]), k


class _SkippingNet(lw.Net):
    """Every 5th batch is skipped the Lightning way: training_step returns None."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 5 == 3 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["16-mixed", "32"])
@pytest.mark.parametrize("backward_timed", [True, False])
def test_batches_skipped_by_returning_none_are_not_inf_skips(tmp_path, monkeypatch, precision, backward_timed):
    """No backward ran: not "updated nothing: inf/NaN gradients" (skipped_updates said 29%
    under a GradScaler), nor a step averaged in with no backward (full precision). Also
    on steps that do not time backward (no hook on the outputs): Lightning announces
    each backward it runs."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    import dtprofile.capture.schedule

    cb_kw = None
    if not backward_timed:  # backward timed on the first step after warm-up, then once per 5-step interval
        monkeypatch.setattr(dtprofile.capture.schedule, "BACKWARD_TIMING_FIRST", 1)
        cb_kw = dict(backward_timing_every=1000)
    plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else []
    trainer, _, cb = fit_local(tmp_path, module=_SkippingNet, plugins=plugins, cb_kw=cb_kw)
    s = cb.report().to_dict()
    assert s["backward_timed_steps"] == (8 if backward_timed else 2)
    assert s["steps_skipped_update"] == 0
    assert s["steps_without_backward"] == 2  # batches 3 and 8 (after the 2 warm-up steps)
    assert s["steps_profiled"] == 12 - 2 - 2
    assert "skipped_updates" not in {f["id"] for f in s["advice"]}


class _OwnBackward(lw.Net):
    """Backward on a loss the returned one is a detached copy of (a backward() override):
    no hook on training_step's output sees it, but Lightning announces it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._objective = torch.nn.functional.cross_entropy(self(x), y)
        return self._objective.detach().requires_grad_()

    def backward(self, loss, *args, **kwargs):
        self._objective.backward()


def test_a_backward_the_output_hooks_cannot_see_is_not_a_skipped_batch(tmp_path):
    """Before, every step of such a run went to steps_without_backward: nothing profiled."""
    trainer, _, cb = fit_local(tmp_path, module=_OwnBackward)
    s = cb.report().to_dict()
    assert s["steps_without_backward"] == 0 and s["steps_profiled"] == 12 - 2


def test_other_loggers_get_the_same_scalars(tmp_path):
    import csv

    from pytorch_lightning.loggers import CSVLogger

    trainer, _, cb = fit_local(tmp_path, logger=CSVLogger(str(tmp_path / "csv")))
    rows = list(csv.DictReader(open(os.path.join(trainer.logger.log_dir, "metrics.csv"))))
    logged = [r for r in rows if r.get("dtprofile/time/step")]
    assert [int(r["step"]) for r in logged][:2] == [4, 9]  # each log interval, at the step TensorBoard has it
    last = logged[-1]
    s = cb.report().to_dict()
    assert float(last["dtprofile/time/step"]) == pytest.approx(s["per_step_ms"]["step"])
    assert float(last["dtprofile/R_O"]) == pytest.approx(s["ratios"]["R_O"])
    assert "dtprofile/projection/speedup_G8" in last


def test_without_tensorboard_logger_writes_to_default_root(tmp_path):
    trainer, _, cb = fit_local(tmp_path, logger=False)
    out = tmp_path / "dtprofile_logs"
    check_outputs(str(out), world_size=1)


def test_explicit_logdir(tmp_path):
    trainer, _, cb = fit_local(tmp_path / "root", cb_kw={"logdir": str(tmp_path / "mine")})
    check_outputs(str(tmp_path / "mine"), world_size=1)
    assert not os.path.exists(os.path.join(trainer.logger.log_dir, "dtprofile_summary.json"))


class _Boom(lw.Net):
    def training_step(self, batch, batch_idx):
        if self.global_step == 8:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_exception_leaves_an_incomplete_report(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        fit_local(tmp_path, module=_Boom, logger=False)
    summary = json.loads((tmp_path / "dtprofile_logs" / "dtprofile_summary.json").read_text())
    assert summary["complete"] is False
    assert summary["steps_total"] == 8


def test_env_callback_steps_aside_for_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("DTPROFILE", "1")
    trainer, _, cb = fit_local(tmp_path)
    found = [c for c in trainer.callbacks if isinstance(c, dtprofile.DTProfileCallback)]
    assert len(found) == 2
    assert cb.engine is not None and cb.report().to_dict()["steps_total"] == 12
    assert [c for c in found if c is not cb][0].engine is None


# ---------------------------------------------------------------------- multi-process (2 CPU ranks)
@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return run_scenario("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
def test_ddp_outputs_and_identical_weights(ddp_results):
    r = ddp_results["profiled"]
    assert r["weights_equal"], r["max_weight_diff"]
    s = r["summary"]
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["steps_total"] == 12
    assert s["comm_source"] == "ddp_probe"  # DDP's own all-reduce; totals from the probe steps
    per = s["per_step_ms"]
    assert per["comm_total"] > 0 and per["comm_exposed"] is not None and s["grad_bytes"] > 0
    assert len(s["ranks"]) == 2
    summary = check_outputs(r["log_dir"], world_size=2)
    assert summary["steps_total"] == 12
    for key in dl.METRIC_KEYS:
        assert key in r["metrics"], key
    # The CSV logger has every interval TensorBoard has, at the same steps: those whose
    # gathers completed in stop() too (before, the CSV lacked the last one).
    import csv

    rows = list(csv.DictReader(open(os.path.join(r["csv_log_dir"], "metrics.csv"))))
    csv_steps = sorted({int(row["step"]) for row in rows if row.get("dtprofile/time/step")})
    tb_steps = sorted({e.step for e in events(r["log_dir"]).Scalars("dtprofile/time/step")})
    assert csv_steps == tb_steps, (csv_steps, tb_steps)


@pytest.mark.slow
def test_ddp_accumulate_grad_batches(ddp_results):
    r = ddp_results["accum"]
    s = r["summary"]
    assert r["global_step"] == 12 and s["steps_total"] == 12 and s["run"]["micro_batches"] == 2
    assert s["per_step_ms"]["comm_total"] > 0  # only the synchronising micro-batch communicates
    check_outputs(r["log_dir"], world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["manual", "bf16", "iterable", "unused"])
def test_ddp_variants(ddp_results, case):
    r = ddp_results[case]
    s = r["summary"]
    assert s["world_size"] == 2 and s["steps_total"] == r["global_step"]
    per = s["per_step_ms"]
    assert per["forward"] > 0 and per["backward"] > 0 and per["comm_total"] > 0, per
    assert per["data_wait"] > 0
    if case == "manual":  # backward inside DDP's forward (training_step): every step still synced
        assert r["weights_equal"]
    if case == "unused":  # DDP searches for unused parameters: its reducer reduces the probe steps
        assert r["weights_equal"] and s["comm_source"] == "ddp_probe"
    check_outputs(r["log_dir"], world_size=2)


@pytest.mark.slow
def test_ddp_spawn(tmp_path_factory):
    root = tmp_path_factory.mktemp("spawn")
    r = run_scenario("spawn", root)["spawn"]
    s = r["summary"]  # cb.report() in the launching process: rank 0's report, handed back
    assert s["world_size"] == 2 and s["steps_total"] == 12 and s["comm_source"] == "ddp_probe"
    for key in dl.METRIC_KEYS:
        assert key in r["metrics"], key  # carried back by Lightning with callback_metrics
    (path,) = glob.glob(str(root / "spawn" / "lightning_logs" / "*" / "dtprofile_summary.json"))
    check_outputs(os.path.dirname(path), world_size=2)


def test_two_callbacks_leave_no_wrapper_behind(tmp_path):
    """Each callback wraps the strategy's training_step and the profiler's start/stop; the
    first to finish must not leave its wrapper under the second's (they piled up per fit)."""
    second = dtprofile.DTProfileCallback(**lw.CB)
    trainer, _, cb = fit_local(tmp_path, callbacks=[second])
    assert "training_step" not in trainer.strategy.__dict__
    assert "start" not in trainer.profiler.__dict__ and "stop" not in trainer.profiler.__dict__
    assert "_after_closure" not in vars(trainer.strategy.precision_plugin) and "run" not in vars(trainer.fit_loop)
    assert cb.report().to_dict()["steps_total"] == 12


def test_the_fetch_timer_times_fetches_and_keeps_a_working_profilers_calls():
    """Lightning's default profiler does nothing, so the fetch timer leaves its calls out;
    a profiler that records (SimpleProfiler, the user's own) still gets every action."""
    from pytorch_lightning.profilers import PassThroughProfiler

    from dtprofile.integrations._lightning_patches import _does_nothing, _FetchTimer

    class Recording(PassThroughProfiler):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def start(self, action_name: str) -> None:
            self.calls.append(("start", action_name))

        def stop(self, action_name: str) -> None:
            self.calls.append(("stop", action_name))

    names = (
        "[Callback]Clock.on_train_batch_end",
        "[_TrainingEpochLoop].train_dataloader_next",
        "[LightningModule]Net.on_before_batch_transfer",
        "[Strategy]SingleDeviceStrategy.batch_to_device",
        "[LightningModule]Net.training_step",
    )
    recording, idle = Recording(), PassThroughProfiler()
    assert _does_nothing(idle) and not _does_nothing(recording)
    for profiler in (recording, idle):
        waits: list[tuple[float, bool]] = []
        cpu_read: list[bool] = []

        def add_wait(s: float, transfer: bool, cpu: float | None = None) -> None:
            waits.append((s, transfer))
            if not transfer:
                cpu_read.append(cpu is not None)

        timer = _FetchTimer(profiler, add_wait)
        for _ in range(2):
            for name in names:
                profiler.start(name)
                time.sleep(0.003)
                profiler.stop(name)
        # Per batch: the fetch, then the transfer with the hook before it (from the fetch's end).
        assert [transfer for _, transfer in waits] == [False, True] * 2
        assert all(0.003 <= s < 0.5 for s, _ in waits[0::2]) and all(0.006 <= s < 0.5 for s, _ in waits[1::2])
        assert timer.fetches == 2 and cpu_read == [True, False]  # (the CPU clock: one fetch in FETCH_CPU_EVERY)
        timer.restore()
        assert "start" not in vars(profiler) and "stop" not in vars(profiler)
    assert recording.calls == [(kind, name) for name in names for kind in ("start", "stop")] * 2


def test_the_fetch_hooks_time_training_fetches_and_their_transfers_only():
    """The epoch loop's fetch hooks and the strategy's transfer: a fetch, then its batch's
    transfer (from the fetch's end); a transfer after the batch started (evaluation's) is
    not data wait. A fetcher already holding the loop's hooks gets the patched ones, and
    everything goes back at restore."""
    from types import SimpleNamespace

    from dtprofile.capture.data_wait import FETCH_CPU_EVERY
    from dtprofile.integrations._lightning_patches import _FetchHooks

    calls: list[str] = []

    class Loop:
        def _on_before_fetch(self) -> None:
            calls.append("start")

        def _on_after_fetch(self) -> None:
            calls.append("stop")

    class Strategy:
        def batch_to_device(self, batch, dataloader_idx=0):
            time.sleep(0.003)
            return batch * 2

    loop, strategy = Loop(), Strategy()
    fetcher = SimpleNamespace(_start_profiler=loop._on_before_fetch, _stop_profiler=loop._on_after_fetch)
    loop.trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop, _data_fetcher=fetcher), strategy=strategy)
    waits: list[tuple[float, bool, float | None]] = []
    resumed: list[int] = []
    hooks = _FetchHooks.attach(
        loop.trainer, lambda s, transfer, cpu=None: waits.append((s, transfer, cpu)), on_fetch=lambda: resumed.append(1)
    )
    assert hooks is not None
    for _ in range(2):
        fetcher._start_profiler()
        time.sleep(0.003)
        fetcher._stop_profiler()
        assert strategy.batch_to_device(21, dataloader_idx=0) == 42
        hooks.batch_started()
        strategy.batch_to_device(1)  # an evaluation batch's: not counted
    assert [transfer for _, transfer, _ in waits] == [False, True] * 2
    assert all(0.003 <= s < 0.5 for s, _, _ in waits)
    # The first fetch of every FETCH_CPU_EVERY reads the thread's CPU clock as well.
    fetch_cpu = [cpu for _, transfer, cpu in waits if not transfer]
    assert [cpu is not None for cpu in fetch_cpu] == [i % FETCH_CPU_EVERY == 0 for i in range(2)]
    assert all(0.0 <= cpu < 0.5 for cpu in fetch_cpu if cpu is not None)
    assert calls == ["start", "stop"] * 2 and len(resumed) == 2 and hooks.fetches == 2
    hooks.restore()
    assert not {"_on_before_fetch", "_on_after_fetch"} & set(vars(loop)) and "batch_to_device" not in vars(strategy)
    fetcher._start_profiler(), fetcher._stop_profiler(), strategy.batch_to_device(1)  # pass through now
    assert len(waits) == 4 and calls[-2:] == ["start", "stop"]
    # A Lightning whose loop has no such hooks: the profiler's actions are timed instead.
    assert (
        _FetchHooks.attach(
            SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=object()), strategy=strategy), lambda *a: None
        )
        is None
    )


def test_a_second_fit_writes_its_intervals_into_one_event_file(tmp_path):
    """Lightning closes its SummaryWriter after a fit; in the next fit the training thread
    and dtprofile's writer thread reopened it at once, each in an event file of its own
    (the first interval alone in a third file). dtprofile reopens it at start."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class OpenAtStart(pl.Callback):
        """After dtprofile's on_train_start: is the writer's event file open?"""

        seen: list = []

        def on_train_start(self, trainer, pl_module):
            self.seen.append(trainer.logger.experiment.file_writer is not None)

    cb = dtprofile.DTProfileCallback(**lw.CB)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[cb, OpenAtStart()],
        default_root_dir=str(tmp_path),
        **{**lw.FAST, "max_steps": 10},
    )
    model = lw.Net()
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 20
    trainer.fit(model)
    assert OpenAtStart.seen == [True, True]  # reopened before either thread writes
    with_dtprofile = []
    for path in sorted(glob.glob(os.path.join(trainer.logger.log_dir, "events.out.tfevents*"))):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if "dtprofile/time/step" in acc.Tags()["scalars"]:
            with_dtprofile.append([e.step for e in acc.Scalars("dtprofile/time/step")])
    assert len(with_dtprofile) == 2, with_dtprofile  # one per fit
    assert min(with_dtprofile[1]) > max(with_dtprofile[0])


def test_callback_reused_after_ddp_spawn_reports_the_newest_fit(tmp_path):
    """The launching process never runs a hook: each ddp_spawn fit hands rank 0's report
    over in the same file. A second fit's must replace the first's, not be ignored."""
    from dtprofile.summary import write_summary

    cb = dtprofile.DTProfileCallback()
    first = {"schema": "dtprofile.summary/1", "steps_total": 12, "per_step_ms": {"step": 10.0}}
    write_summary(first, cb._handoff)
    assert cb.report().to_dict()["steps_total"] == 12 and not os.path.exists(cb._handoff)
    write_summary(dict(first, steps_total=30), cb._handoff)  # the second fit's rank 0
    assert cb.report().to_dict()["steps_total"] == 30
    assert cb.report().to_dict()["steps_total"] == 30  # and kept once read


@pytest.mark.slow
def test_user_comm_hook_through_the_strategy(tmp_path_factory):
    r = run_scenario("hooks", tmp_path_factory.mktemp("hooks"))
    unwrapped = r["unwrapped"]
    # Only the wait after backward: the total unmeasured, never zero.
    assert unwrapped["summary"]["comm_source"] == "ddp_exposed"
    assert unwrapped["summary"]["per_step_ms"]["comm_total"] is None
    assert unwrapped["summary"]["per_step_ms"]["comm_exposed"] > 0
    assert unwrapped["warnings"], "expected a warning saying how to wrap the hook"
    wrapped = r["wrapped"]
    assert wrapped["summary"]["comm_source"] == "user"
    assert wrapped["summary"]["per_step_ms"]["comm_total"] > 0
    assert wrapped["hook_engine_cleared"]
    # Lightning registers DDPStrategy(ddp_comm_hook=...) on CUDA only: on CPU DDP's default
    # all-reduce runs, and that is what gets timed.
    assert r["stock"]["summary"]["comm_source"] == "ddp_probe"
    for case in ("unwrapped", "wrapped", "stock"):
        check_outputs(r[case]["log_dir"], world_size=2)


@pytest.mark.slow
def test_zero_code_attach_with_env(tmp_path_factory):
    r = run_scenario("env", tmp_path_factory.mktemp("env"), env={"DTPROFILE": "1", "DTPROFILE_WARMUP_STEPS": "2"})
    env = r["env"]
    assert env["env_callbacks"] == 1 and env["active_callbacks"] == 1
    s = env["summary"]
    # 10 steps after warm-up: 3 probe steps (probe_every="auto": the 2nd, 5th and 10th), 7 in the averages.
    assert s["world_size"] == 2 and s["steps_total"] == 12 and s["steps_profiled"] == 7
    assert s["probe"]["steps"] == 3 and s["compute_source"] == "probe"
    assert s["options"]["every_n_steps"] == 5  # the Trainer's log_every_n_steps
    summary = check_outputs(env["log_dir"], world_size=2)
    assert summary["steps_total"] == 12
    for key in dl.METRIC_KEYS:
        assert key in env["metrics"], key
    both = r["both"]  # DTPROFILE=1 and a callback in the code: one profiles
    assert both["env_callbacks"] == 2 and both["active_callbacks"] == 1 and both["code_callback_active"]
    check_outputs(both["log_dir"], world_size=2)


@pytest.mark.slow
def test_ddp_exception_leaves_an_incomplete_report_without_waiting(tmp_path_factory):
    r = run_scenario("crash", tmp_path_factory.mktemp("crash"))["crash"]
    assert r["error"] == "crash at step 8"
    summary = json.loads(Path(r["summary_path"]).read_text())
    assert summary["complete"] is False and summary["world_size"] == 2 and summary["steps_total"] == 8
    assert r["seconds"] < 90  # not the 120 s gather timeout on top of the run


@pytest.mark.slow
def test_fsdp2_through_model_parallel_strategy(tmp_path_factory):
    """ModelParallelStrategy with fully_shard in configure_model: the callback finds the
    sharded units under the LightningModule and times their collectives; weights are the
    same as without it."""
    r = run_scenario("fsdp", tmp_path_factory.mktemp("fsdp"))["fsdp"]
    s = r["summary"]
    assert r["weights_equal"] and r["global_step"] == 12 and s["steps_total"] == 12
    assert s["comm_source"] == "fsdp" and s["comm_unmeasured"] is None and not s["parts_disabled"]
    # features and head are the units; each gathers in forward and again in backward.
    assert s["run"]["fsdp"]["units"] == 2 and s["run"]["fsdp"]["reduce_scatters"] == 2
    assert s["run"]["fsdp"]["all_gathers"] == 4
    per = s["per_step_ms"]
    assert per["comm_total"] > 0 and 0 < per["comm_exposed"] <= per["comm_total"]
