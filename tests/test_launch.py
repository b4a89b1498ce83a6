"""Profiled jobs launched as users launch them, ending as users' jobs end.

Every other multi-process test starts its ranks from a fork server whose children leave
with ``os._exit``: nothing there runs interpreter teardown (atexit, the process group's
and dtprofile's objects freed at exit). Here the ranks come from the launchers users
type (torchrun, ``torch.multiprocessing.spawn``, Lightning's ``ddp_spawn``, ``dtprofile
demo``), run the scripts in ``tests/launch_scripts/`` (or an example, unchanged), and end
through normal interpreter teardown. Each test asserts every rank's exit code (torchrun's
own is nonzero when any rank's is; the other launchers' parents record each one), each
rank's own record that it finished with its dtprofile figures, and output free of
"terminate called" (an abort at teardown) and tracebacks.

gloo on 127.0.0.1 only, a free port each time, one thread per rank, every job in a
process group of its own that is killed at a hard deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port  # (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
TIMEOUT_S = 180  # a job's hard deadline; each takes 10-30 s on 2 idle cores
ABORTS = ("terminate called", "Traceback", "core dumped", "Fatal Python error")


def _loopback() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def run_job(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run one job to its end; its whole process group is killed at the deadline."""
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DTPROFILE")
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
        )
    }
    full.update(
        MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::DeprecationWarning"
    )
    if _loopback():
        full["GLOO_SOCKET_IFNAME"] = _loopback()
    full.update(env or {})
    proc = subprocess.Popen(
        args,
        cwd=str(cwd),
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own group: its ranks die with it
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args[1:4]}... still running after {TIMEOUT_S} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def torchrun(script: Path, *script_args: str) -> list[str]:
    """torchrun's command line (its own entry point, of this Python) for 2 local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *script_args,
    ]


def check_ended_cleanly(job: subprocess.CompletedProcess) -> None:
    """Exit code 0 (the launcher's: torchrun's and the others' are nonzero when a rank's is)
    and no abort or traceback in the output."""
    out = job.stdout
    assert job.returncode == 0, f"exit code {job.returncode}:\n{out[-6000:]}"
    for sign in ABORTS:
        assert sign not in out, f"{sign!r} in the output:\n{out[-6000:]}"


def rank_records(outdir: Path, world: int = 2) -> list[dict]:
    """Each rank's record, written by the rank itself at the end of its script."""
    records = []
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} left no record: it did not reach the end of its script"
        record = json.loads(path.read_text())
        assert record["rank"] == rank and record["world_size"] == world and record["status"] == "finished", record
        records.append(record)
    assert len({r["pid"] for r in records}) == world  # one process per rank
    return records


def check_figures(records: list[dict], steps: int) -> None:
    """Every rank's own final report: every step, both ranks, measured communication."""
    for r in records:
        s = r["summary"]
        assert s["steps_total"] == steps and s["world_size"] == 2, r
        assert s["comm_source"] == "ddp_probe" and s["step_ms"] > 0, r


# ---------------------------------------------------------------------- torchrun
def test_torchrun_ddp_loop(tmp_path):
    """A plain DDP loop under the README's context manager, launched with torchrun."""
    job = run_job(torchrun(SCRIPTS / "ddp_loop.py", str(tmp_path)), tmp_path)
    check_ended_cleanly(job)
    records = rank_records(tmp_path)
    check_figures(records, steps=24)
    for r in records:  # the gathered figures: both ranks' steps, the same on each
        assert r["summary"]["ranks_steps"] == records[0]["summary"]["ranks_steps"]
        assert len(r["summary"]["ranks_steps"]) == 2 and min(r["summary"]["ranks_steps"]) > 0
    summary = json.loads((tmp_path / "logs" / "dtprofile_summary.json").read_text())  # rank 0 wrote it
    assert summary["steps_total"] == 24 and summary["complete"] is True


def test_torchrun_example(tmp_path):
    """examples/custom_loop_ddp.py, unchanged, under torchrun, as the README launches it."""
    logdir = tmp_path / "logs"
    job = run_job(
        torchrun(
            SCRIPTS / "run_example.py",
            str(tmp_path),
            str(REPO / "examples" / "custom_loop_ddp.py"),
            "--steps",
            "16",
            "--logdir",
            str(logdir),
        ),
        tmp_path,
    )
    check_ended_cleanly(job)
    records = rank_records(tmp_path)
    assert [r["profiles"] for r in records] == [1, 1]
    check_figures(records, steps=16)
    summary = json.loads((logdir / "dtprofile_summary.json").read_text())
    assert summary["steps_total"] == 16 and summary["world_size"] == 2 and summary["complete"] is True
    assert "R_O = T_O / T_C" in job.stdout  # rank 0 printed the report


# ---------------------------------------------------------------------- torch.multiprocessing.spawn
@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The DDP loop's ranks from ``torch.multiprocessing.spawn``; each also records its
    threads and descriptors before the profiler starts and after it stops (``--release``)."""
    outdir = tmp_path_factory.mktemp("spawn")
    job = run_job([sys.executable, str(SCRIPTS / "ddp_loop.py"), str(outdir), "--spawn", "--release"], outdir)
    return job, outdir


def test_mp_spawn_ddp_loop(spawned):
    job, outdir = spawned
    check_ended_cleanly(job)
    assert json.loads((outdir / "spawn.json").read_text())["exitcodes"] == [0, 0]  # each rank's, after teardown
    records = rank_records(outdir)
    check_figures(records, steps=24)
    for r in records:
        assert [run["steps_total"] for run in r["runs"]] == [24, 24]  # two profiled runs, one after the other
    for run in ("run0", "run1"):
        assert json.loads((outdir / "logs" / run / "dtprofile_summary.json").read_text())["steps_total"] == 24


def _matplotlib_font(target: str) -> bool:
    return "matplotlib" in target and target.endswith((".ttf", ".otf", ".afm"))


def test_stop_releases_threads_and_descriptors(spawned):
    """After stop(), what dtprofile opened is gone: its threads (Python's and native) and
    its descriptors, on both ranks, after each of two runs.

    Each rank snapshots itself (tests/launch_scripts/ddp_loop.py) after its process group,
    DDP model, loader and one un-profiled step exist (what torch makes lazily at a first
    step is not dtprofile's), then two steps before each run's end, then after each stop.
    Compared:

    - Python threads (``threading.enumerate()``), by name and ident: the same set.
    - Native threads (``/proc/self/task``): the same set. The snapshot after stop waits
      (at most 3 s) for the count to come back, because a thread that ``join()`` saw end
      (the TensorBoard writer's, joined as rank 0's writer closes) may still be an OS
      thread for a moment; one never told to end stays past the wait.
    - Descriptors (``/proc/self/fd``, and where each points): the same, except that rank
      0's images (drawn once at stop) leave matplotlib's font files open: matplotlib keeps
      each font it loaded in a process-wide cache. They are allowed, and must be the same
      after the second run as after the first (the cache does not grow per run).

    The snapshot near each run's end shows what the comparison is about: the gather's
    thread (and no socket of dtprofile's: the gather goes through the job's store), and on
    rank 0 dtprofile's worker thread.
    """
    job, outdir = spawned
    check_ended_cleanly(job)
    for r in rank_records(outdir):
        before = r["before"]
        fonts_after_first = None
        for number, run in enumerate(r["runs"]):
            where = f"rank {r['rank']}, run {number}"
            during, after = run["during"], run["after"]
            # While profiling: the gather's thread exists (so the checks below can see what
            # dtprofile starts), and no socket: the gather goes through the job's store,
            # over the connection each rank already had (a side gloo group opened N-1).
            started = set(during["tasks"]) - set(before["tasks"])
            assert started, (where, "no native thread of the gather's", during["tasks"])
            assert any(t.split(":")[0] == "dtprofile-gather" for t in during["threads"]), (where, during)
            opened = set(during["fds"].values()) - set(before["fds"].values())
            assert not any(t.startswith("socket:") for t in opened), (where, opened)
            if r["rank"] == 0:
                assert any(t.split(":")[0].startswith("dtprofile") for t in during["threads"]), (where, during)
            # After stop: all of it gone.
            assert after["threads"] == before["threads"], (where, before["threads"], after["threads"])
            assert after["tasks"] == before["tasks"], (where, before["tasks"], after["tasks"])
            left = {fd: t for fd, t in after["fds"].items() if before["fds"].get(fd) != t}
            closed = {fd: t for fd, t in before["fds"].items() if after["fds"].get(fd) != t}
            assert not closed, (where, "descriptors the job had before were closed", closed)
            assert all(_matplotlib_font(t) for t in left.values()), (where, "left open", left)
            fonts = sorted(left.values())
            if fonts_after_first is None:
                fonts_after_first = fonts
            assert fonts == fonts_after_first, (where, "matplotlib's fonts grew", fonts_after_first, fonts)
            if r["rank"] != 0:
                assert not left, (where, left)  # rank 1 draws nothing


# ---------------------------------------------------------------------- Lightning ddp_spawn
def test_lightning_ddp_spawn(tmp_path):
    """PyTorch Lightning's ``strategy="ddp_spawn"``, 2 CPU processes, the callback."""
    pytest.importorskip("pytorch_lightning")
    job = run_job(
        [sys.executable, str(SCRIPTS / "lightning_spawn.py"), str(tmp_path)],
        tmp_path,
        env={"MASTER_PORT": str(free_port())},
    )
    check_ended_cleanly(job)
    launcher = json.loads((tmp_path / "launcher.json").read_text())
    assert launcher["exitcodes"] == [0, 0], launcher  # each spawned rank's, after its teardown
    assert launcher["summary"] == {"steps_total": 12, "world_size": 2}  # rank 0's report, handed back
    records = rank_records(tmp_path)
    check_figures(records, steps=12)
    for r in records:
        assert r["global_step"] == 12 and r["summary"]["complete"] is True, r
    (summary,) = tmp_path.glob("lightning_logs/*/dtprofile_summary.json")
    assert json.loads(summary.read_text())["steps_total"] == 12


# ---------------------------------------------------------------------- dtprofile demo
def test_demo(tmp_path):
    """``dtprofile demo`` as a user types it: its 2 spawned ranks end through teardown and
    the demo exits 0 only when every rank's exit code was 0 (dtprofile/demo.py)."""
    console_script = Path(sys.executable).with_name("dtprofile")
    command = [str(console_script)] if console_script.is_file() else [sys.executable, "-m", "dtprofile"]
    logdir = tmp_path / "demo"
    job = run_job([*command, "demo", "--logdir", str(logdir), "--steps", "20", "--timeout", "150"], tmp_path)
    check_ended_cleanly(job)
    assert "R_O = T_O / T_C" in job.stdout and "tensorboard --logdir" in job.stdout
    summary = json.loads((logdir / "dtprofile_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps_total"] == 20 and summary["complete"] is True
    # Both ranks reached stop(): the final gather carried each one's steps.
    assert [row["rank"] for row in summary["ranks"]] == [0, 1]
    assert all(row["steps"] > 0 for row in summary["ranks"]), summary["ranks"]
    assert summary["per_step_ms"]["data_wait"] > 0  # the demo's slow dataset, measured
