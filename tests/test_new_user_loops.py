"""What a new user's loops broke: one test per case, each failing without its fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import types
import warnings

import pytest
import torch
from distributed import run_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from workers import peer_dies_mid_run, profile_on_rank_0_only

import dtprofile
from dtprofile import cli
from dtprofile.options import Options


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model, opt, x, y):
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------- 1. prof.loader
def test_a_batch_fetched_by_a_function_between_forward_and_backward_is_data_wait():
    """nanoGPT's loop: ``get_batch()``, a function, called between forward and backward to
    fetch the next batch. Wrapped as ``prof.loader(iter(get_batch, None))``, that fetch (8
    ms here) is data wait, not compute."""
    import time

    model, opt = _model()

    def get_batch():
        time.sleep(0.008)
        return torch.randn(8, 16), torch.randn(8, 1)

    with dtprofile.profile(model, opt, warmup_steps=2, logdir=None) as prof:
        batches = prof.loader(iter(get_batch, None))
        x, y = next(batches)
        for _ in range(20):
            loss = nn.functional.mse_loss(model(x), y)
            x, y = next(batches)  # the next batch, fetched before backward
            loss.backward()
            opt.step()
            opt.zero_grad()
    per = prof.report().per_step_ms
    # All of the 8 ms sleep is data wait (counted as compute, the wait would be ~0). The
    # compute beside it, a 16-32-1 MLP's, is a fraction of a ms on an idle machine and
    # what the scheduler makes of it on a busy one (16 ms once): not compared.
    assert per["data_wait"] >= 7.0, per
    assert per["data_wait"] + per["compute"] <= per["step"] + 1e-6, per


def test_the_loader_is_iterated_again_each_epoch():
    """``loader = prof.loader(dl)`` once, three epochs: every epoch gets every batch."""
    model, opt = _model()
    dl = DataLoader(TensorDataset(torch.randn(40, 16), torch.randn(40, 1)), batch_size=4)
    with dtprofile.profile(model, opt, warmup_steps=1) as prof:
        loader = prof.loader(dl)
        per_epoch = []
        for _ in range(3):
            per_epoch.append(0)
            for x, y in loader:
                _step(model, opt, x, y)
                per_epoch[-1] += 1
    assert per_epoch == [10, 10, 10]
    assert prof.report().to_dict()["steps_total"] == 30
    assert prof.report().to_dict()["data_wait_source"] == "loader"


def test_the_loader_behaves_like_what_it_wraps():
    model, opt = _model()
    sampler = DistributedSampler(TensorDataset(torch.randn(20, 16)), num_replicas=1, rank=0)
    dl = DataLoader(sampler.dataset, batch_size=4, sampler=sampler)
    prof = dtprofile.profile(model, opt)
    loader = prof.loader(dl)
    assert len(loader) == len(dl) == 5
    assert loader.batch_size == 4 and loader.sampler is sampler and loader.dataset is dl.dataset
    loader.sampler.set_epoch(3)
    assert sampler.epoch == 3
    # A list is re-iterable and sized; a generator stays a one-shot generator.
    batches = prof.loader([1, 2, 3])
    assert len(batches) == 3 and list(batches) == list(batches) == [1, 2, 3]
    assert [next(batches), next(batches)] == [1, 2]  # a step-based loop's next() still works
    gen = prof.loader(b for b in [1, 2])
    assert isinstance(gen, types.GeneratorType) and list(gen) == [1, 2] and list(gen) == []

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream = prof.loader(DataLoader(Stream(), batch_size=None))
    assert not hasattr(stream, "__len__") or not callable(getattr(type(stream), "__len__", None))
    assert list(stream) == list(stream) == [0, 1, 2]


def test_an_epoch_cut_short_by_break_starts_over_next_time():
    model, opt = _model()
    data = [(torch.randn(4, 16), torch.randn(4, 1)) for _ in range(6)]
    with dtprofile.profile(model, opt, warmup_steps=0) as prof:
        loader = prof.loader(data)
        first = []
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                if i == 0:
                    first.append(x)
                _step(model, opt, x, y)
                if epoch == 0 and i == 2:
                    break
    assert torch.equal(first[0], first[1])  # the second epoch began at the first batch
    assert prof.report().to_dict()["steps_total"] == 3 + 6


# ---------------------------------------------------------------- 2. GradScaler's skips
def _scaled_run(iters, bad, set_to_none=True, profiled=True):
    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu")
    prof = dtprofile.profile(model, opt, warmup_steps=0, every_n_steps=1000)
    skipped = 0
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if profiled:
            prof.start()
        for i in range(iters):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y) * (float("inf") if bad(i) else 1.0)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            opt.zero_grad(set_to_none=set_to_none)
        summary = prof.stop().to_dict() if profiled else None
    return model, summary, skipped


@pytest.mark.parametrize(
    "iters, bad, set_to_none",
    [
        (40, lambda i: i < 15, True),  # skips before the first real update
        (120, lambda i: i < 87, True),
        (40, lambda i: i % 6 == 3, False),  # zero_grad(set_to_none=False): the gradients stay
        (40, lambda i: i < 5 or i % 7 == 0, False),
    ],
)
def test_every_update_the_scaler_skipped_is_its_own_step(iters, bad, set_to_none):
    _, s, skipped = _scaled_run(iters, bad, set_to_none)
    assert skipped == sum(bool(bad(i)) for i in range(iters))
    assert s["steps_total"] == iters
    assert s["steps_skipped_update"] == skipped
    assert s["steps_profiled"] == iters - skipped
    assert "varying_steps" not in [a["id"] for a in s["advice"]]


def test_watching_the_scaler_leaves_training_and_the_class_as_they_were():
    original = torch.amp.GradScaler.step
    m0, _, _ = _scaled_run(30, lambda i: i < 6, profiled=False)
    m1, _, _ = _scaled_run(30, lambda i: i < 6)
    for a, b in zip(m0.parameters(), m1.parameters(), strict=False):
        assert torch.equal(a, b)
    assert torch.amp.GradScaler.step is original  # unwrapped once the profile stopped


def test_a_scaler_step_wrapped_by_someone_else_while_profiling_keeps_working(monkeypatch):
    """Another library wraps GradScaler.step over dtprofile's wrapper: the profile's end
    leaves that chain working (no recursion), and a later profile still sees the skips."""
    from torch.amp.grad_scaler import GradScaler

    calls = []
    _scaled_run(5, lambda i: False)  # (a profile before: nothing of it is left)
    prof = dtprofile.profile(*_model(), warmup_steps=0)
    prof.start()
    theirs = GradScaler.step

    def wrapped(self, optimizer, *args, **kwargs):
        calls.append(1)
        return theirs(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(GradScaler, "step", wrapped)
    prof.stop()
    _, s, skipped = _scaled_run(20, lambda i: i < 4)
    assert s["steps_skipped_update"] == skipped == 4 and s["steps_total"] == 20
    assert len(calls) == 20  # their wrapper ran on every step, ours inside it


# ---------------------------------------------------------------- 3. one bandwidth rule
@pytest.mark.parametrize("text", ["10", "1e9", " 25 "])
def test_bandwidth_text_without_a_unit_is_refused_everywhere(text, capsys):
    with pytest.raises(ValueError, match="link_bandwidth must be") as info:
        Options(link_bandwidth=text)
    assert "\n" not in str(info.value) and "Gbps" in str(info.value) and "needs a unit" in str(info.value)
    from dtprofile.integrations.lightning import options_from_env

    with pytest.raises(ValueError, match="DTPROFILE_LINK_BANDWIDTH") as info:
        options_from_env({"DTPROFILE_LINK_BANDWIDTH": text})
    assert "\n" not in str(info.value) and "needs a unit" in str(info.value)
    assert cli.main(["project", "nowhere", "--bandwidth", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "needs a unit" in err[-1] and "--bandwidth" in err[-1]


def test_a_bare_number_is_bytes_per_second():
    assert Options(link_bandwidth=10).link_bandwidth_Bps == 10.0
    assert Options(link_bandwidth=1.25e9).link_bandwidth_Bps == 1.25e9
    assert Options(link_bandwidth="10Gbps").link_bandwidth_Bps == 1.25e9


# ---------------------------------------------------------------- 4. profile() on one rank
@pytest.mark.slow
def test_profile_on_rank_0_only_says_so_without_waiting_out_the_gather_timeout():
    cfg = dict(start_wait_s=3.0, timeout_s=60.0)
    res = run_ranks(profile_on_rank_0_only, 2, cfg, timeout_s=90)
    r0 = res[0]
    assert r0["start_s"] < cfg["start_wait_s"] + 2.0, r0  # not gather_timeout_s
    assert any("profile() must be called on every rank of the process group" in w for w in r0["warnings"]), r0
    assert not any("DistStoreError" in w or "wait timeout" in w for w in r0["warnings"]), r0
    assert r0["steps"] == 12 and r0["ranks"] == [0]
    assert res[0]["ranks_after"] == res[1]["ranks_after"] == [0, 1]  # a later profile on both gathers both
    assert not any("must be called on every rank" in w for w in res[1]["warnings"])


# ---------------------------------------------------------------- 5. a peer that dies
@pytest.mark.slow
@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_peer_that_dies_is_reported_as_the_peers_failure(how):
    # Step 10 is a gradient-noise sample: the failed reduction reached dtprofile's callback.
    res = run_ranks(peer_dies_mid_run, 2, {"how": how, "at": 10}, timeout_s=120, allow_missing=True)
    r0 = res[0]
    assert r0["error"], r0  # the training failed, as without dtprofile
    said = " | ".join(r0["warnings"])
    assert "internal error" not in said and "training continues" not in said, said
    assert "did not arrive" not in said, said
    assert all("failed or exited" in w for w in r0["warnings"] if "gather" in w), said


# ---------------------------------------------------------------- 6. a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root and mount(2) needed; skipped where the machine refuses)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


# TensorBoard's own writer thread dies of the full disk (its traceback is TensorBoard's).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_disk_filled_during_the_run_still_takes_the_summary(small_disk):
    logdir = small_disk / "run"
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt, logdir=str(logdir), warmup_steps=1, every_n_steps=2):
            for _ in range(6):
                _step(model, opt, torch.randn(4, 16), torch.randn(4, 1))
            fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
            with pytest.raises(OSError):  # the event files, or anything else, fill the disk
                while True:
                    os.write(fd, b"x" * 4096)
            os.close(fd)
            for _ in range(20):
                _step(model, opt, torch.randn(4, 16), torch.randn(4, 1))
    summary = json.loads((logdir / "dtprofile_summary.json").read_text())
    assert summary["steps_total"] == 26
    assert not any("could not write the summary" in str(w.message) for w in caught)
    assert not any(p.name.startswith(".dtprofile_summary.") for p in logdir.iterdir())  # reserve and temp gone
    assert all("internal error" not in str(w.message) for w in caught)  # a full disk is said as such


# ---------------------------------------------------------------- 7. compare of unrelated runs
def _sample_summary():
    with open(os.path.join(os.path.dirname(__file__), "data", "summary_2rank.json")) as fh:
        return json.load(fh)


def _write(path, summary):
    path.mkdir(parents=True)
    (path / "dtprofile_summary.json").write_text(json.dumps(summary))


def test_compare_warns_on_one_line_when_the_runs_are_different_jobs(tmp_path, capsys):
    base = _sample_summary()
    other = json.loads(json.dumps(base))
    other["grad_bytes"] = base["grad_bytes"] * 1000
    other["run"]["param_bytes"] *= 1000
    other["run"]["param_count"], base["run"]["param_count"] = 124_000_000, 124_000
    other["run"]["model_class"], base["run"]["model_class"] = "GPT2LMHeadModel", "MLP"
    _write(tmp_path / "a", base)
    _write(tmp_path / "b", other)
    _write(tmp_path / "c", base)
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out.splitlines()
    warning = [line for line in out if line.startswith("Warning:")]
    assert len(warning) == 1 and out.index(warning[0]) == 1
    for what in ("gradient bytes 1,000x apart", "parameter counts", "GPT2LMHeadModel"):
        assert what in warning[0]
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["different_jobs"] == []
    # A 16-bit against a 32-bit run of one model is one job.
    half = json.loads(json.dumps(base))
    half["grad_bytes"] = base["grad_bytes"] / 2
    from dtprofile.analysis.compare import job_differences

    assert job_differences(base, half) == []


def test_a_profiled_run_records_its_model_class_and_parameter_count():
    model, opt = _model()
    with dtprofile.profile(model, opt, warmup_steps=0) as prof:
        _step(model, opt, torch.randn(4, 16), torch.randn(4, 1))
    run = prof.report().to_dict()["run"]
    assert run["model_class"] == "Sequential"
    assert run["param_count"] == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- 8. the two-level model's link
def test_project_help_and_report_say_whose_link_the_bandwidth_is(capsys, tmp_path):
    assert cli.main(["project", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--bandwidth-per" in help_text and "shared by its GPUs" in help_text
    _write(tmp_path / "r", _sample_summary())
    steps = {}
    for per in ("node", "gpu"):
        assert (
            cli.main(
                [
                    "project",
                    str(tmp_path / "r"),
                    "--gpus",
                    "4,8,16",
                    "--nodes",
                    "4",
                    "--bandwidth",
                    "1Gbps",
                    "--bandwidth-per",
                    per,
                    "--json",
                ]
            )
            == 0
        )
        proj = json.loads(capsys.readouterr().out)
        assert proj["link_per"] == per
        steps[per] = proj["step_ms"]
    assert steps["node"] == sorted(steps["node"])  # more GPUs per node never cheaper
    assert steps["gpu"][2] < steps["node"][2]
    assert cli.main(["project", str(tmp_path / "r"), "--gpus", "8", "--nodes", "4", "--bandwidth", "1Gbps"]) == 0
    assert "per node (its GPUs share it)" in capsys.readouterr().out


# ---------------------------------------------------------------- optimizer wrappers
class _WrappingOptimizer(torch.optim.Optimizer):
    """Built as Accelerate's AcceleratedOptimizer is: a torch Optimizer subclass that does
    not run Optimizer.__init__ (so it has no step hooks of its own), drives ``optimizer``
    and steps it only on the micro-batch that updates."""

    def __init__(self, optimizer, accumulate=1):
        self.optimizer = optimizer
        self.accumulate, self.calls = accumulate, 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        if self.calls % self.accumulate == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.calls += 1
        if self.calls % self.accumulate == 0:
            self.optimizer.step(closure)


def test_an_optimizer_wrapper_is_profiled_through_the_optimizer_it_drives():
    """profile(model, wrapped) used to raise AttributeError ('_optimizer_step_pre_hooks')
    at start; now the wrapped optimizer's steps end the training steps, accumulation
    included (4 micro-batches, one update), and training is unchanged."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(48)]
    weights = []
    for profiled in (False, True):
        model, opt = _model()
        wrapped = _WrappingOptimizer(opt, accumulate=4)
        prof = dtprofile.profile(model, wrapped, warmup_steps=2, every_n_steps=1000) if profiled else None
        if prof is not None:
            prof.start()
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
            wrapped.step()
            wrapped.zero_grad()
        if prof is not None:
            s = prof.stop().to_dict()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=False))
    assert s["steps_total"] == 12 and s["steps_profiled"] == 10 and s["run"]["micro_batches"] == 4
    assert not s["parts_disabled"]


def test_an_optimizer_that_cannot_be_hooked_warns_once_and_training_runs():
    class Opaque(torch.optim.Optimizer):  # no __init__ of Optimizer's, nothing it wraps
        def __init__(self, params):
            self.inner = torch.optim.SGD(params, lr=0.01)
            self.param_groups = self.inner.param_groups

        def step(self, closure=None):
            self.inner.step()

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none=set_to_none)

    model, _ = _model()
    opt = Opaque(model.parameters())
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtprofile.profile(model, opt) as prof:
            for _ in range(5):
                _step(model, opt, x, y)
    said = [str(w.message) for w in caught if "cannot hook the step of Opaque" in str(w.message)]
    assert len(said) == 1 and "training continues" in said[0] and "internal error" not in said[0]
    s = prof.report().to_dict()
    assert "timing" in s["parts_disabled"] and "Opaque" in s["parts_disabled"]["timing"]
