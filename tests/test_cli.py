"""The ``dtprofile`` command line: report, project, demo; exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dtprofile
from dtprofile import cli
from dtprofile.cli import main

DATA = Path(__file__).parent / "data" / "summary_2rank.json"
REPO = Path(__file__).resolve().parents[1]
SCHEMA = "dtprofile.summary/1"


@pytest.fixture
def summary() -> dict:
    return json.loads(DATA.read_text())


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "logs" / "exp1"
    d.mkdir(parents=True)
    shutil.copy(DATA, d / "dtprofile_summary.json")
    return tmp_path / "logs"


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *needles):
    assert rc == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


# ----------------------------------------------------------------------- report


def test_report_text(capsys, run_dir):
    rc, out, err = run(capsys, "report", str(run_dir))
    assert rc == 0, err
    assert "95" in out  # the step time
    assert "comm_bound" in out and "small_minibatch" in out
    assert out.index("comm_bound") < out.index("small_minibatch")  # most severe first
    assert "Projection" in out and "64" in out


def test_report_json_one_run(capsys, run_dir, summary):
    rc, out, err = run(capsys, "report", str(run_dir), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["schema"] == SCHEMA
    assert data == summary


def test_report_json_several_runs_maps_paths(capsys, run_dir):
    other = run_dir / "exp2" / "nested"
    other.mkdir(parents=True)
    shutil.copy(DATA, other / "dtprofile_summary.json")
    rc, out, err = run(capsys, "report", str(run_dir), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert sorted(data) == ["exp1", os.path.join("exp2", "nested")]
    assert all(v["schema"] == SCHEMA for v in data.values())
    rc, out, _ = run(capsys, "report", str(run_dir))
    assert rc == 0 and "== exp1 ==" in out and f"== {os.path.join('exp2', 'nested')} ==" in out


def test_report_markdown(capsys, run_dir, summary):
    from dtprofile.render import advice_markdown

    rc, out, err = run(capsys, "report", str(run_dir), "--markdown")
    assert rc == 0, err
    assert out == advice_markdown(summary).rstrip() + "\n"
    assert_one_line_error(*run(capsys, "report", str(run_dir), "--markdown", "--json"), "not allowed with")


def test_report_accepts_the_summary_file(capsys, run_dir):
    rc, out, _ = run(capsys, "report", str(run_dir / "exp1" / "dtprofile_summary.json"), "--json")
    assert rc == 0 and json.loads(out)["schema"] == SCHEMA


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda d: None, "no dtprofile run found"),  # empty dir
        (lambda d: (d / "dtprofile_summary.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "dtprofile_summary.json").write_text('{"schema": "other/1"}'), "not a dtprofile summary"),
        (lambda d: (d / "dtprofile_summary.json").write_text("[1, 2]"), "not a dtprofile summary"),
        (
            lambda d: (d / "dtprofile_summary.json").write_text('{"schema": "dtprofile.summary/2"}'),
            'summary schema "dtprofile.summary/2"',
        ),
        (lambda d: (d / "dtprofile_summary.json").write_bytes(b"\xff\xfe\x00"), "not valid JSON"),
    ],
)
def test_report_errors_are_one_line(capsys, tmp_path, setup, needle):
    setup(tmp_path)
    for extra in ([], ["--json"]):
        assert_one_line_error(*run(capsys, "report", str(tmp_path), *extra), needle)


def test_truncated_json_error_reads_well(capsys, tmp_path, summary):
    text = json.dumps(summary, indent=2)
    cut = text.index('"device"')
    (tmp_path / "dtprofile_summary.json").write_text(text[: cut + 4])  # ends inside a string
    rc, out, err = run(capsys, "report", str(tmp_path))
    line = text[:cut].count("\n") + 1
    assert_one_line_error(rc, out, err, "not valid JSON", f"(Unterminated string starting at: line {line} column")
    assert "at at" not in err


def test_report_missing_path(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "report", str(tmp_path / "nope")), "no such file or directory")


def test_report_good_and_bad_runs(capsys, run_dir):
    bad = run_dir / "broken"
    bad.mkdir()
    (bad / "dtprofile_summary.json").write_text('{"schema": "dtprofile.summary/1", ')
    rc, out, err = run(capsys, "report", str(run_dir), "--json")
    assert rc == 2  # the good run is printed, the bad one is reported and fails the status
    assert json.loads(out)["schema"] == SCHEMA
    assert err.count("\n") == 1 and "broken" in err and "Traceback" not in err


def _write_events(logdir: Path, summary: dict, steps=(50, 100)) -> None:
    from dtprofile.sinks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(logdir=str(logdir), image_every=0)
    for s in steps:
        sink.log(summary, s)
    sink.close()


def test_report_rebuilds_from_event_files(capsys, tmp_path, summary):
    _write_events(tmp_path / "live", summary)
    rc, out, err = run(capsys, "report", str(tmp_path), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["schema"] == SCHEMA and data["complete"] is False
    assert data["source"] == "tensorboard_events"
    assert data["steps_total"] == 100
    assert data["per_step_ms"]["step"] == pytest.approx(95.0)
    assert data["ratios"]["R_O"] == pytest.approx(summary["ratios"]["R_O"])
    assert data["world_size"] == 2 and data["ranks"][1]["compute"] == pytest.approx(61.9)
    assert data["grad_bytes"] == pytest.approx(summary["grad_bytes"], rel=1e-6)  # float32
    assert data["projection"]["gpus"] == summary["projection"]["gpus"]
    assert data["projection"]["speedup"] == pytest.approx(summary["projection"]["speedup"])
    rc, out, _ = run(capsys, "report", str(tmp_path))
    assert rc == 0
    assert "rebuilt from TensorBoard event files" in out
    assert "Last advice written to TensorBoard" in out and "comm_bound" in out
    # The scalars do not say how they were measured: no guessed notes (gap, unmeasured).
    assert "data wait = gap" not in out and "communication unmeasured" not in out
    # Nor do they hold the advice record: compare says so instead of calling it all new.
    (tmp_path / "after").mkdir()
    (tmp_path / "after" / "dtprofile_summary.json").write_text(json.dumps(summary))
    rc, out, err = run(capsys, "compare", str(tmp_path / "live"), str(tmp_path / "after"))
    assert rc == 0, err
    assert "Advice not compared" in out and "New advice" not in out


def test_summary_wins_over_event_files_of_the_same_run(capsys, run_dir, summary):
    _write_events(run_dir / "exp1", summary)  # same directory as the summary
    rc, out, _ = run(capsys, "report", str(run_dir), "--json")
    assert rc == 0 and json.loads(out) == summary


def test_event_file_path_uses_the_summary_beside_it(capsys, run_dir, summary):
    _write_events(run_dir / "exp1", summary)
    (event_file,) = (run_dir / "exp1").glob("*tfevents*")
    rc, out, err = run(capsys, "report", str(event_file), "--json")
    assert rc == 0 and json.loads(out) == summary, err
    rc, out, err = run(capsys, "report", str(event_file))
    assert rc == 0, err
    assert "rebuilt from TensorBoard" not in out and "run incomplete" not in out
    (run_dir / "exp1" / "dtprofile_summary.json").unlink()  # no summary: rebuilt, and said so
    rc, out, err = run(capsys, "report", str(event_file))
    assert rc == 0 and "rebuilt from TensorBoard event files" in out, err


def test_event_files_without_dtprofile_scalars_are_not_a_run(capsys, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as w:
        w.add_scalar("loss", 1.0, 1)
    assert_one_line_error(*run(capsys, "report", str(tmp_path)), "no dtprofile run found")


# ----------------------------------------------------------------------- project


def test_project_json(capsys, run_dir):
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "8,16,64", "--json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["gpus"] == [8, 16, 64]
    for key in ("alpha_paper", "speedup_paper", "step_ms", "speedup", "efficiency"):
        assert len(p[key]) == 3
    assert p["scaling"] == "weak"


def test_project_options_reach_the_model(capsys, run_dir):
    rc, out, err = run(
        capsys,
        "project",
        str(run_dir),
        "--gpus",
        "4,8",
        "--bandwidth",
        "100Gbps",
        "--scaling",
        "strong",
        "--nodes",
        "2",
        "--json",
    )
    assert rc == 0, err
    p = json.loads(out)
    assert p["scaling"] == "strong"
    assert p["bandwidth_source"] == "user"
    assert p["bandwidth_GBps"] == pytest.approx(12.5)


def test_project_text_table(capsys, run_dir):
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "8,16,64")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Projection (weak scaling")
    assert lines[1].split()[:3] == ["GPUs", "step", "ms"]
    assert [ln.split()[0] for ln in lines[3:6]] == ["8", "16", "64"]


def test_project_model_ps_gives_the_lemma_at_each_g(capsys, run_dir):
    """--model ps: the servers the paper's lemma needs at each G, rising with G (weak
    scaling keeps T_C), in the table and in the JSON; without it, no such section."""
    rc, out, err = run(
        capsys, "project", str(run_dir), "--gpus", "2,8,64", "--bandwidth", "10Gbps", "--model", "ps", "--json"
    )
    assert rc == 0, err
    plan = json.loads(out)["parameter_servers"]
    assert [p["gpus"] for p in plan] == [2, 8, 64]
    servers = [p["num_parameter_servers"] for p in plan]
    assert servers == sorted(servers) and servers[-1] > servers[0] >= 1
    assert all(p["bandwidth_Gbps"] == pytest.approx(10.0) for p in plan)
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "2,8,64", "--bandwidth", "10Gbps", "--model", "ps")
    assert rc == 0, err
    table = out.split("Parameter servers, were the job")[1].splitlines()[1:]
    assert table[0].split()[:2] == ["GPUs", "servers"]
    assert [(ln.split()[0], int(ln.split()[1])) for ln in table[2:5]] == list(
        zip(["2", "8", "64"], servers, strict=False)
    )
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "2,8")
    assert rc == 0 and "Parameter servers" not in out, err
    assert_one_line_error(*run(capsys, "project", str(run_dir), "--model", "server"), "--model")


def test_project_with_nodes_spreads_exactly_g_and_names_both_links(capsys, run_dir):
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "8,16", "--nodes", "3", "--json")
    assert rc == 0, err
    p = json.loads(out)
    assert [n * g for n, g in zip(p["nodes_used"], p["gpus_per_node"], strict=False)] == [8, 16]
    rc, out, err = run(capsys, "project", str(run_dir), "--gpus", "8,16", "--nodes", "3")
    assert rc == 0, err
    lines = out.splitlines()
    # The caption says which model ran and that the intra-node link is an assumption.
    assert "two-level all-reduce over at most 3 nodes" in lines[0]
    assert "inter-node bandwidth" in lines[0] and "source: measured" in lines[0]
    assert "intra-node bandwidth 25.0 GB/s, source: assumed" in lines[0], lines[0]
    assert "nodes × GPUs" in lines[1]
    assert [ln.split()[:4] for ln in lines[3:5]] == [["8", "2", "×", "4"], ["16", "2", "×", "8"]]
    assert "nodes × GPUs" not in run(capsys, "project", str(run_dir), "--gpus", "8")[1]


def test_project_calls_project_summary_with_the_options(capsys, run_dir, monkeypatch):
    seen = {}

    def fake(summary, *, gpus, scaling, bandwidth, nodes, link_per, batch, tp, gpus_per_node):
        seen.update(gpus=gpus, scaling=scaling, bandwidth=bandwidth, nodes=nodes, link_per=link_per, batch=batch)
        seen.update(tp=tp, gpus_per_node=gpus_per_node)
        return {
            "scaling": scaling,
            "bandwidth_source": "user",
            "bandwidth_GBps": 1.0,
            "gpus": gpus,
            "alpha_paper": [0.5] * len(gpus),
            "speedup_paper": [1.0] * len(gpus),
            "step_ms": [10.0] * len(gpus),
            "speedup": [1.0] * len(gpus),
            "efficiency": [0.5] * len(gpus),
        }

    monkeypatch.setattr(cli, "_project_fn", lambda: fake)
    rc, out, _ = run(
        capsys,
        "project",
        str(run_dir),
        "--gpus",
        "16,8,8",
        "--bandwidth",
        "12.5GB/s",
        "--nodes",
        "4",
        "--bandwidth-per",
        "gpu",
        "--batch",
        "64",
        "--mesh",
        "dp=32,tp=4",
        "--gpus-per-node",
        "8",
    )
    assert rc == 0
    assert seen == {
        "gpus": [8, 16, 32],  # (--mesh's dp among them)
        "scaling": "weak",
        "bandwidth": 12.5e9,
        "nodes": 4,
        "link_per": "gpu",
        "batch": 64,
        "tp": 4,
        "gpus_per_node": 8,
    }
    assert "50.0%" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--gpus", "abc"], "--gpus"),
        (["--gpus", "0,8"], "--gpus"),
        (["--gpus", ""], "--gpus"),
        (["--scaling", "foo"], "--scaling"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "10"], "needs a unit"),
        (["--bandwidth", "0Gbps"], "--bandwidth"),
        (["--bandwidth", "-5Gbps"], "must be a positive number"),  # not "expected one argument"
        (["--bandwidth=-5Gbps"], "must be a positive number"),
        (["--bandwidth", "-.5GB/s"], "must be a positive number"),
        (["--nodes", "0"], "--nodes"),
        (["--nodes", "x"], "--nodes"),
        (["--batch", "0"], "--batch"),
    ],
)
def test_project_bad_options(capsys, run_dir, argv, needle):
    assert_one_line_error(*run(capsys, "project", str(run_dir), *argv), needle)


def test_project_errors(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "project", str(tmp_path), "--gpus", "8"), "no dtprofile run found")
    (tmp_path / "dtprofile_summary.json").write_text("nope")
    assert_one_line_error(*run(capsys, "project", str(tmp_path)), "not valid JSON")


# ----------------------------------------------------------------------- main


def test_help_and_usage(capsys):
    for argv in ([], ["report"], ["project"], ["compare"], ["demo"]):
        rc, out, err = run(capsys, *argv, "--help")
        assert rc == 0 and "usage: dtprofile" in out and err == ""
    rc, out, err = run(capsys)  # no command: the help, status 2
    assert rc == 2 and "report" in err and "project" in err and "compare" in err and "demo" in err
    assert_one_line_error(*run(capsys, "frobnicate"), "invalid choice")
    assert_one_line_error(*run(capsys, "report"), "LOGDIR")
    rc, out, _ = run(capsys, "--version")
    import dtprofile

    # The code's version, whatever an (editable) install's metadata recorded.
    assert rc == 0 and out.strip() == f"dtprofile {dtprofile.__version__}"


def test_verbose_before_or_after_the_command(capsys, run_dir):
    parser = cli.build_parser()
    for argv, verbose in (
        (["-v", "report", "X"], True),
        (["report", "X", "-v"], True),
        (["report", "--verbose", "X"], True),
        (["report", "X"], False),
        (["project", "X", "-v"], True),
        (["compare", "A", "B", "-v"], True),
        (["demo", "-v"], True),
    ):
        assert parser.parse_args(argv).verbose is verbose, argv
    for command in ("report", "project", "compare", "demo"):
        rc, out, _ = run(capsys, command, "--help")
        assert rc == 0 and "-v, --verbose" in out, command
    rc, out, err = run(capsys, "report", str(run_dir), "-v")
    assert rc == 0 and "Projection" in out, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--warmup-steps", "-3"], "--warmup-steps"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--every-n-steps", "x"], "--every-n-steps"),
        (["demo", "--world-size", "100000"], "--world-size must be between 1 and"),
    ],
)
def test_demo_rejects_bad_options_before_starting(capsys, argv, needle):
    assert_one_line_error(*run(capsys, *argv), needle)


def test_demo_logdir_that_is_a_file_is_a_usage_error(capsys, tmp_path):
    from dtprofile import demo

    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    assert_one_line_error(
        *run(capsys, "demo", "--logdir", str(taken), "--steps", "1"), "--logdir", "must be a directory", str(taken)
    )
    with pytest.raises(ValueError, match="logdir must be a directory"):
        demo.run(logdir=str(taken), world_size=1, steps=1)
    assert taken.read_text() == "not a directory"


def test_unexpected_errors_are_one_line(capsys, run_dir, monkeypatch):
    def boom(_summary):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cli, "format_report", boom)
    rc, out, err = run(capsys, "report", str(run_dir))
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "RuntimeError: kaboom" in err and "Traceback" not in err


def test_python_dash_m(run_dir):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "dtprofile", "report", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["schema"] == SCHEMA
    p = subprocess.run(
        [sys.executable, "-m", "dtprofile", "project", str(run_dir), "--scaling", "foo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1


def test_a_terminal_that_is_not_utf8_gets_the_report(run_dir):
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    for argv in (["report", str(run_dir)], ["report", str(run_dir), "--markdown"], ["project", str(run_dir)]):
        p = subprocess.run([sys.executable, "-m", "dtprofile", *argv], capture_output=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        p.stdout.decode("ascii")  # "?" where a character has no ASCII form
        assert b"Projection" in p.stdout or b"|" in p.stdout


def test_report_json_turns_nan_from_an_edited_file_into_null(capsys, run_dir):
    path = run_dir / "exp1" / "dtprofile_summary.json"
    path.write_text(path.read_text().replace('"R_O": ', '"R_O": NaN, "was": ', 1))
    rc, out, err = run(capsys, "report", str(run_dir), "--json")
    assert rc == 0, err
    assert json.loads(out)["ratios"]["R_O"] is None


# ----------------------------------------------------------------------- demo


def test_demo_in_process(capsys, tmp_path):
    logdir = tmp_path / "demo1"
    rc, out, err = run(
        capsys,
        "demo",
        "--world-size",
        "1",
        "--steps",
        "12",
        "--every-n-steps",
        "6",
        "--warmup-steps",
        "2",
        "--logdir",
        str(logdir),
    )
    assert rc == 0, err
    assert "step   12/12" in out
    assert "Open the dashboard: tensorboard --logdir" in out
    data = json.loads((logdir / "dtprofile_summary.json").read_text())
    assert data["schema"] == SCHEMA and data["world_size"] == 1


def test_demo_with_an_empty_logdir_writes_no_files(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "demo", "--world-size", "1", "--steps", "8", "--warmup-steps", "2", "--logdir", "")
    assert rc == 0, err
    assert "step    8/8" in out and "Open the dashboard" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_demo_two_ranks(tmp_path):
    """The default main job, end to end: 2 spawned ranks on gloo, then report it."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logdir = tmp_path / "demo2"
    p = subprocess.run(
        [sys.executable, "-m", "dtprofile", "demo", "--logdir", str(logdir), "--steps", "40", "--timeout", "150"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step   40/40" in p.stdout
    assert p.stdout.rstrip().endswith("Open the dashboard: tensorboard --logdir demo2")
    summary = json.loads((logdir / "dtprofile_summary.json").read_text())
    assert summary["schema"] == SCHEMA and summary["world_size"] == 2
    assert summary["backend"] == "gloo"
    # the deliberate bottleneck is found: data wait is most of the step
    assert summary["ratios"]["data_fraction"] > 0.3
    assert any(a.get("id") == "data_bound" for a in summary["advice"])
    assert "data_bound" in p.stdout  # rank 0 printed the report

    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={k: 0 for k in ea.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    tags = acc.Tags()
    assert "dtprofile/time/step" in tags["scalars"]
    assert "dtprofile/rank/step_ms/rank1" in tags["scalars"]
    assert "dtprofile/advice/text_summary" in tags["tensors"]
    assert "custom_scalars__config__" in tags["tensors"]
    assert "dtprofile/plot/speedup" in tags["images"]
    assert "dtprofile/plot/breakdown" in tags["images"]

    p = subprocess.run(
        [sys.executable, "-m", "dtprofile", "report", str(logdir)], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0 and "data_bound" in p.stdout


# ----------------------------------------------------------------------- compare


def _write(path: Path, summary: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "dtprofile_summary.json").write_text(json.dumps(summary))
    return path


def test_compare_weak_scaling_checks_the_projection(capsys, tmp_path, summary):
    from dtprofile.analysis.projection import project_summary

    base = _write(tmp_path / "g2", summary)
    cand_summary = json.loads(json.dumps(summary))
    cand_summary.update(world_size=4, advice=[{"id": "comm_bound"}, {"id": "network_bandwidth"}])
    cand_summary["per_step_ms"]["step"] = 120.0
    cand = _write(tmp_path / "g4", cand_summary)
    rc, out, err = run(capsys, "compare", str(base), str(cand), "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["per_step_ms"]["step"] == {
        "baseline": 95.0,
        "candidate": 120.0,
        "delta_ms": 25.0,
        "delta_fraction": pytest.approx(25 / 95),
    }
    # 32 samples per rank: 2 ranks in 95 ms against 4 ranks in 120 ms.
    assert res["throughput"]["speedup"] == pytest.approx((4 / 120) / (2 / 95))
    check = res["projection_check"]
    predicted_step = project_summary(summary, gpus=[2, 4], scaling="weak")["step_ms"][1]
    assert check["scaling"] == "weak" and check["predicted_step_ms"] == pytest.approx(predicted_step)
    assert check["predicted_speedup"] == pytest.approx(95 / predicted_step * 2)
    assert check["error"] == pytest.approx(check["predicted_speedup"] / res["throughput"]["speedup"] - 1)
    assert res["advice"] == {
        "resolved": ["small_minibatch", "gpu_count_knee"],
        "new": ["network_bandwidth"],
        "remaining": ["comm_bound"],
    }
    rc, text, _ = run(capsys, "compare", str(base), str(cand))
    assert rc == 0
    for needle in (
        "Throughput: 1.58x",
        "Projection check (2 -> 4 ranks), weak scaling",
        "Advice resolved: small_minibatch",
    ):
        assert needle in text, text


def test_compare_says_when_the_definitions_changed_between_versions(capsys, tmp_path, summary):
    old = json.loads(json.dumps(summary))
    old["dtprofile_version"] = "0.1.0"
    new = dict(json.loads(json.dumps(summary)), dtprofile_version="0.2.0")
    base, cand = _write(tmp_path / "old", old), _write(tmp_path / "new", new)
    rc, out, _ = run(capsys, "compare", str(base), str(cand), "--json")
    assert rc == 0 and "trimmed means" in json.loads(out)["dtprofile_version"]["note"]
    rc, text, _ = run(capsys, "compare", str(base), str(cand))
    assert "Note: made by dtprofile 0.1.0 and 0.2.0" in text
    rc, out, _ = run(capsys, "compare", str(cand), str(cand), "--json")
    assert "note" not in json.loads(out)["dtprofile_version"]
    later = _write(tmp_path / "later", dict(new, dtprofile_version="0.3.0"))
    rc, out, _ = run(capsys, "compare", str(base), str(later), "--json")
    note = json.loads(out)["dtprofile_version"]["note"]
    assert "trimmed means" in note and "averages the same steps" in note  # 0.2's and 0.3's changes
    newest = _write(tmp_path / "newest", dict(new, dtprofile_version="0.4.0"))
    rc, out, _ = run(capsys, "compare", str(later), str(newest), "--json")
    note = json.loads(out)["dtprofile_version"]["note"]
    assert "buffer broadcast" in note and "trimmed means" not in note  # 0.4's alone
    v5 = _write(tmp_path / "v5", dict(new, dtprofile_version="0.5.0"))
    rc, out, _ = run(capsys, "compare", str(newest), str(v5), "--json")
    note = json.loads(out)["dtprofile_version"]["note"]
    assert "alpha_paper" in note and "buffer broadcast" not in note  # 0.5's alone
    v6 = _write(tmp_path / "v6", dict(new, dtprofile_version="0.6.0"))
    rc, out, _ = run(capsys, "compare", str(v5), str(v6), "--json")
    note = json.loads(out)["dtprofile_version"]["note"]
    assert "loss scaler" in note and "link_per" in note and "alpha_paper" not in note  # 0.6's alone


def test_compare_strong_scaling_and_when_no_check_applies(tmp_path, summary):
    from dtprofile.analysis.compare import compare_summaries

    strong = json.loads(json.dumps(summary))
    strong["world_size"] = 4
    strong["run"]["batch_size"] = 16  # the same global batch over twice the ranks
    check = compare_summaries(summary, strong)["projection_check"]
    assert check["scaling"] == "strong" and "skipped" not in check
    both = json.loads(json.dumps(strong))
    both["run"]["batch_size"] = 24
    assert "neither weak nor strong" in compare_summaries(summary, both)["projection_check"]["skipped"]
    assert compare_summaries(summary, summary)["projection_check"] is None  # same GPU count
    assert compare_summaries(summary, summary)["throughput"]["speedup"] == pytest.approx(1.0)


def test_compare_without_a_batch_size_calls_it_a_step_time_ratio(capsys, tmp_path, summary):
    unknown = json.loads(json.dumps(summary))
    unknown["run"]["batch_size"] = None  # as in a run rebuilt from TensorBoard event files
    unknown["per_step_ms"]["step"] = 190.0
    base, cand = _write(tmp_path / "known", summary), _write(tmp_path / "unknown", unknown)
    rc, out, err = run(capsys, "compare", str(base), str(cand), "--json")
    assert rc == 0, err
    thr = json.loads(out)["throughput"]
    assert thr["speedup"] == pytest.approx(0.5) and thr["basis"] == "step_time"
    rc, text, _ = run(capsys, "compare", str(base), str(cand))
    line = next(ln for ln in text.splitlines() if ln.startswith("Throughput"))
    assert line == ("Throughput: 0.500x (step-time ratio: batch size unknown, the same samples per step assumed)"), line
    rc, out, _ = run(capsys, "compare", str(base), str(base), "--json")
    assert json.loads(out)["throughput"]["basis"] == "samples_per_s"


def test_compare_needs_one_run_on_each_side(capsys, run_dir, tmp_path):
    shutil.copytree(run_dir / "exp1", run_dir / "exp2")
    rc, out, err = run(capsys, "compare", str(run_dir), str(run_dir / "exp1"))
    assert_one_line_error(rc, out, err, "BASELINE", "2 runs found", "point at one")
    rc, out, err = run(capsys, "compare", str(run_dir / "exp1"), str(tmp_path / "missing"))
    assert_one_line_error(rc, out, err, "no such file")


def test_compare_two_real_runs_before_and_after_fixing_data_wait(capsys, tmp_path):
    """A loop that waits 30 ms for each batch, then the same loop without the wait."""
    import time

    import torch
    from torch import nn

    import dtprofile

    def profiled_run(logdir: Path, wait_s: float) -> None:
        torch.manual_seed(0)
        # Compute of a few ms, so the fixed run is not data-bound on the loop's own overhead.
        model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        data = [(torch.randn(64, 256), torch.randn(64, 1)) for _ in range(20)]

        def batches():
            for batch in data:
                if wait_s:
                    time.sleep(wait_s)
                yield batch

        with dtprofile.profile(model, opt, logdir=str(logdir), warmup_steps=2) as prof:
            for x, y in prof.loader(batches()):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()

    # One thread: with more, a loaded machine's oversubscribed OpenMP threads made the
    # few-ms compute swing by 10x between the two runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        profiled_run(tmp_path / "before", 0.03)
        profiled_run(tmp_path / "after", 0.0)
    finally:
        torch.set_num_threads(threads)
    rc, out, err = run(capsys, "compare", str(tmp_path / "before"), str(tmp_path / "after"), "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["per_step_ms"]["data_wait"]["delta_ms"] < -27.0
    assert res["throughput"]["speedup"] > 1.5
    assert "data_bound" in res["advice"]["resolved"]


def test_compare_summaries_refuses_what_is_not_a_summary(summary):
    from dtprofile.analysis.compare import compare_summaries

    with pytest.raises(TypeError, match="baseline must be a dtprofile summary .* got NoneType"):
        compare_summaries(None, summary)
    with pytest.raises(TypeError, match="candidate must be a dtprofile summary .* got str"):
        compare_summaries(summary, "run/dtprofile_summary.json")
    with pytest.raises(TypeError, match="summary must be a dict"):
        dtprofile.Report.from_dict(None)
