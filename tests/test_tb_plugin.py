"""The dtprofile tab: its routes through TensorBoard's own WSGI application, on real
profiled runs (the built-in demo at 1 and 2 ranks) and on a malformed one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _demo(logdir: Path, world: int) -> None:
    out = subprocess.run([sys.executable, "-m", "dtprofile", "demo", "--logdir", str(logdir), "--world-size",
                          str(world), "--steps", "30", "--every-n-steps", "10", "--warmup-steps", "2"],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Two runs of one job (the demo on 1 and 2 ranks) and a run whose summary was cut short."""
    root = tmp_path_factory.mktemp("tab")
    _demo(root / "two_ranks", 2)
    _demo(root / "one_rank", 1)
    broken = root / "broken"
    broken.mkdir()
    (broken / "dtprofile_summary.json").write_text('{"schema": 1, "per_step_ms": {"step": 4')
    return root


@pytest.fixture(scope="module")
def client(logdir):
    from tensorboard import default, program
    from tensorboard.backend import application
    from werkzeug.test import Client

    tb = program.TensorBoard(plugins=default.get_plugins())
    tb.configure(argv=["", "--logdir", str(logdir), "--load_fast", "false", "--reload_interval", "0"])
    provider, multiplexer = tb._make_data_provider()
    app = application.TensorBoardWSGIApp(tb.flags, tb.plugin_loaders, provider, tb.assets_zip_provider, multiplexer)
    return Client(app)


def _get(client, path: str, status: int = 200) -> dict:
    response = client.get(path)
    assert response.status_code == status, (path, response.status_code, response.get_data(as_text=True)[:500])
    return json.loads(response.get_data(as_text=True))


def test_the_tab_is_listed_and_active(client):
    listing = _get(client, "/data/plugins_listing")
    assert listing["dtprofile"]["enabled"] is True
    assert listing["dtprofile"]["tab_name"] == "dtprofile"
    assert listing["dtprofile"]["loading_mechanism"]["module_path"] == "/data/plugin/dtprofile/index.js"
    js = client.get("/data/plugin/dtprofile/index.js")
    assert js.status_code == 200 and "export async function render" in js.get_data(as_text=True)
    assert "http" not in js.get_data(as_text=True).replace("http://www.w3.org/2000/svg", "")  # nothing from a CDN


def test_runs_lists_each_run_and_names_the_malformed_one(client):
    index = _get(client, "/data/plugin/dtprofile/runs")
    assert [r["run"] for r in index["runs"]] == ["one_rank", "two_ranks"]
    assert any("broken" in e for e in index["errors"])
    answer = _get(client, "/data/plugin/dtprofile/run?run=broken", 400)
    assert "broken" in answer["error"] and "Traceback" not in answer["error"]
    assert "not found" in _get(client, "/data/plugin/dtprofile/run?run=nowhere", 400)["error"]
    assert "missing" in _get(client, "/data/plugin/dtprofile/run", 400)["error"]


def test_run_view_leads_with_the_verdict_and_splits_the_step(client):
    view = _get(client, "/data/plugin/dtprofile/run?run=two_ranks")
    verdict = view["verdict"]
    # The demo's slow dataset: the data wait is the verdict, with its numbers and action.
    assert verdict["id"] == "data_bound" and verdict["severity"] in ("high", "critical", "medium")
    assert "num_workers" in verdict["action"] and verdict["evidence"]
    assert all(f["id"] != "data_bound" for f in view["findings"])
    step = view["step"]
    parts = {p["key"]: p["ms"] for p in step["parts"]}
    assert {"data_wait", "forward", "backward", "optimizer"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(step["step_ms"], rel=0.02)  # the parts make the step
    assert [r["rank"] for r in step["ranks"]] == [0, 1]
    assert view["comm"]["total_ms"] > 0 and view["comm"]["grad_MB"] > 0
    scaling = view["scaling"]
    assert scaling["gpus"][0] == 1 and len(scaling["refined"]) == len(scaling["gpus"]) == len(scaling["alpha"])
    assert scaling["linear"] == [float(g) for g in scaling["gpus"]]
    assert 0 < scaling["target_efficiency"] < 1
    # The same job on 1 rank under the same log directory: measured points at G=1 and this run's G=2.
    assert [(p["run"], p["gpus"]) for p in scaling["measured"]] == [("one_rank", 1), ("two_ranks", 2)]
    assert scaling["measured"][0]["speedup"] == pytest.approx(1.0)
    over = view["over_time"]
    # Every interval the sink wrote (a busy one may be skipped: the newest summary wins), to the end.
    assert len(over["steps"]) >= 2 and over["steps"][-1] == 30 and over["steps"] == sorted(over["steps"])
    assert set(over["series"]) >= {"data_wait", "forward", "backward", "other"}
    assert all(len(v) == len(over["steps"]) for v in over["series"].values())


def test_what_if_projects_with_the_code_of_dtprofile_project(client, logdir):
    from dtprofile.analysis.projection import project_summary
    from dtprofile.summary import load_summary

    answer = _get(client, "/data/plugin/dtprofile/project?run=two_ranks&gpus=1,2,8,64&bandwidth=1Gbit&scaling=strong")
    expected = project_summary(load_summary(str(logdir / "two_ranks" / "dtprofile_summary.json")),
                               gpus=[1, 2, 8, 64], bandwidth="1Gbit", scaling="strong")
    assert answer["scaling"]["gpus"] == [1, 2, 8, 64]
    assert answer["scaling"]["refined"] == pytest.approx(expected["speedup"])
    assert answer["projection"]["bandwidth_source"] == "user"
    bigger = _get(client, "/data/plugin/dtprofile/project?run=two_ranks&gpus=8&batch=64")["projection"]
    same = _get(client, "/data/plugin/dtprofile/project?run=two_ranks&gpus=8")["projection"]
    assert bigger["step_ms"][0] > same["step_ms"][0]  # a bigger per-device batch: a longer step
    for query, name in [("gpus=0,2", "gpus"), ("gpus=a", "gpus"), ("bandwidth=fast", "bandwidth"),
                        ("nodes=-1", "nodes"), ("scaling=sideways", "scaling"), ("batch=0", "batch")]:
        error = _get(client, f"/data/plugin/dtprofile/project?run=two_ranks&{query}", 400)["error"]
        assert error.startswith(name), (query, error)


def test_compare_puts_two_runs_side_by_side(client):
    c = _get(client, "/data/plugin/dtprofile/compare?baseline=one_rank&candidate=two_ranks")
    assert c["baseline"] == "one_rank" and c["per_step_ms"]["step"]["candidate"] > 0
    assert "remaining" in c["advice"]
    assert "both" in _get(client, "/data/plugin/dtprofile/compare?baseline=one_rank", 400)["error"]
