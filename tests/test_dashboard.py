"""TensorBoard itself, started on localhost against a profiled run's logs, shows the
advice in its text dashboard (and, where Chromium exists, renders it in a browser)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from distributed import free_port
from torch import nn

import dtprofile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A data-bound run: a loader that sleeps, so the advice has something to say."""
    path = tmp_path_factory.mktemp("tb")
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def slow_batches():
        for _ in range(24):
            time.sleep(0.01)
            yield torch.randn(4, 8), torch.randn(4, 2)

    with dtprofile.profile(model, opt, logdir=str(path), warmup_steps=2, every_n_steps=10) as prof:
        for x, y in prof.loader(slow_batches()):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return path


@pytest.fixture(scope="module")
def server(logdir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/data/plugins_listing", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("tensorboard exited at start")
                time.sleep(0.5)
        else:
            pytest.fail("tensorboard did not start within 60 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _get(url: str):
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def test_text_dashboard_serves_the_rendered_advice(server):
    tags = _get(server + "/data/plugin/text/tags")
    run = next(r for r, t in tags.items() if "dtprofile/advice/text_summary" in t)
    entries = _get(f"{server}/data/plugin/text/text?run={run}&tag=dtprofile%2Fadvice%2Ftext_summary")
    latest = entries[-1]["text"]  # TensorBoard's own Markdown rendering, as the dashboard shows it
    assert "<table>" in latest and "data_bound" in latest and "num_workers" in latest
    assert entries[-1]["step"] == 24


def test_scalars_and_layout_are_served(server):
    tags = _get(server + "/data/plugin/scalars/tags")
    run_tags = next(iter(tags.values()))
    assert {"dtprofile/time/step", "dtprofile/ratio/R_O", "dtprofile/time/data_wait"} <= set(run_tags)
    layout = _get(server + "/data/plugin/custom_scalars/layout")
    assert any("dtprofile" in cat.get("title", "") or cat.get("chart") for cat in layout.get("category", []))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed")
def test_headless_chromium_renders_the_text_dashboard(server, tmp_path):
    shot = tmp_path / "text.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,1000",
        "--virtual-time-budget=15000",
        f"--screenshot={shot}",
        server + "/#text",
    ]
    subprocess.run(cmd, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert shot.exists() and shot.stat().st_size > 20_000  # a rendered page, not a blank one
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, tables and TensorBoard's header
