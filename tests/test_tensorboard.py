"""The TensorBoard sink, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: E402
from tensorboard.plugins.custom_scalar import layout_pb2  # noqa: E402

from dtprofile import render  # noqa: E402
from dtprofile.sinks import (
    plots,  # noqa: E402
    tags,  # noqa: E402
)
from dtprofile.sinks import tensorboard as tb  # noqa: E402
from dtprofile.sinks.tensorboard import TensorBoardSink  # noqa: E402

DATA = Path(__file__).parent / "data" / "summary_2rank.json"


@pytest.fixture
def summary() -> dict:
    return json.loads(DATA.read_text())


def read(logdir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(logdir), size_guidance={k: 0 for k in ea.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    return acc


def text_of(acc: ea.EventAccumulator, tag: str = "dtprofile/advice/text_summary") -> list:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def layouts(acc: ea.EventAccumulator) -> list:
    out = []
    for e in acc.Tensors("custom_scalars__config__"):
        lay = layout_pb2.Layout()
        lay.ParseFromString(e.tensor_proto.string_val[0])
        out.append(lay)
    return out


def test_scalars_text_layout_and_images(tmp_path, summary):
    sink = TensorBoardSink(logdir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # the writer is created lazily
    later = copy.deepcopy(summary)
    later["per_step_ms"]["step"] = 99.0
    later["per_step_ms"]["comm_interference"] = 2.0  # a probe run's part of the overhead
    later["per_step_ms"]["comm_peer_wait"] = 1.5  # several ranks: waiting for a slower one
    later["per_step_ms"]["data_transfer"] = 0.5  # Lightning: the batch transfer hooks
    later["per_step_ms"]["comm_buffers"] = 0.2  # DDP with BatchNorm: the buffer broadcast
    sink.log(summary, 50)
    sink.log(later, 100)
    sink.close(later, 125)

    acc = read(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    expected = {f"dtprofile/time/{k}" for k in tb.TIME_KEYS}
    expected |= {f"dtprofile/ratio/{k}" for k in tb.RATIO_KEYS}
    expected |= {
        f"dtprofile/projection/{k}_G{g}"
        for k in ("speedup", "efficiency", "alpha_paper", "speedup_paper", "step_ms")
        for g in summary["projection"]["gpus"]
    }
    expected |= {"dtprofile/comm/grad_MB", "dtprofile/comm/algbw_GBps", "dtprofile/comm/busbw_GBps"}
    expected |= {
        f"dtprofile/rank/{m}/rank{r}"
        for r in (0, 1)
        for m in ("step_ms", "compute_ms", "data_wait_ms", "comm_exposed_ms")
    }
    expected |= {"dtprofile/rank/step_ms/min", "dtprofile/rank/step_ms/max"}
    assert expected <= scalars
    assert all(t.startswith("dtprofile/") for t in scalars)
    # telemetry is {"available": false, ...}: nothing under dtprofile/gpu
    assert not [t for t in scalars if t.startswith("dtprofile/gpu/")]

    steps = acc.Scalars("dtprofile/time/step")
    assert [(e.step, e.value) for e in steps] == [(50, 95.0), (100, 99.0), (125, 99.0)]
    assert acc.Scalars("dtprofile/ratio/R_O")[0].value == pytest.approx(summary["ratios"]["R_O"])
    assert acc.Scalars("dtprofile/projection/speedup_G8")[0].value == pytest.approx(summary["projection"]["speedup"][3])
    assert acc.Scalars("dtprofile/projection/efficiency_G8")[0].value == pytest.approx(
        summary["projection"]["efficiency"][3]
    )
    assert acc.Scalars("dtprofile/comm/grad_MB")[0].value == pytest.approx(50.331648)
    assert acc.Scalars("dtprofile/rank/compute_ms/rank1")[0].value == pytest.approx(61.9)

    # the advice: one text per log interval, Markdown tables, most severe finding first
    texts = text_of(acc)
    assert [s for s, _ in texts] == [50, 100, 125]
    md = texts[-1][1]
    assert "| part | ms | share of step |" in md
    assert "#### Projection" in md and "| GPUs |" in md
    pos = [md.index(f"`{i}`") for i in ("comm_bound", "small_minibatch", "gpu_count_knee")]
    assert pos == sorted(pos)
    assert "fp16_compress_hook" in md  # the action is there

    # the custom-scalars layout, written once
    assert "custom_scalars__config__" in acc.PluginTagToContent("custom_scalars")
    (lay,) = layouts(acc)
    titles = [c.title for c in lay.category]
    assert titles[:4] == [
        "dtprofile: time per step (ms)",
        "dtprofile: ratios",
        "dtprofile: communication",
        "dtprofile: per rank (ms)",
    ]
    projected = [t for t in titles if t.startswith("dtprofile: projected at ")]
    assert projected == [f"dtprofile: projected at {g} GPUs" for g in summary["projection"]["gpus"]]
    charts = {(c.title, ch.title): ch for c in lay.category for ch in c.chart}
    assert list(charts["dtprofile: time per step (ms)", "step (= compute + overhead)"].multiline.tag) == [
        "dtprofile/time/step$"
    ]
    margin = charts["dtprofile: per rank (ms)", "step: median rank, band from the fastest to the slowest"]
    series = margin.margin.series[0]
    assert (series.value, series.lower, series.upper) == (
        "dtprofile/time/step",
        "dtprofile/rank/step_ms/min",
        "dtprofile/rank/step_ms/max",
    )
    # One labelled quantity a chart: each Multiline regex matches exactly one written tag
    # (TensorBoard uses re.match), or none for a part this run did not have.
    import re

    matched = 0
    for key, ch in charts.items():
        for rx in ch.multiline.tag:
            hits = [t for t in scalars if re.match(rx, t)]
            assert len(hits) <= 1, (key, rx, hits)
            matched += len(hits)
    assert matched >= 20

    # images: at the first log and at close (image_every=10)
    assert set(acc.Tags()["images"]) == {"dtprofile/plot/speedup", "dtprofile/plot/breakdown"}
    assert [e.step for e in acc.Images("dtprofile/plot/speedup")] == [50, 125]
    img = acc.Images("dtprofile/plot/breakdown")[-1]
    assert img.width > 300 and img.height > 200 and img.encoded_image_string[:4] == b"\x89PNG"


def test_close_at_the_last_step_writes_text_not_scalars_again(tmp_path, summary):
    final = copy.deepcopy(summary)
    final["per_step_ms"]["step"] = 90.0
    final["steps_profiled"] = 999
    sink = TensorBoardSink(logdir=str(tmp_path))
    sink.log(summary, 100)
    sink.close(final, 100)
    acc = read(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("dtprofile/time/step")] == [(100, 95.0)]
    texts = text_of(acc)
    assert len(texts) == 2 and "999 steps profiled" in texts[-1][1]
    assert len(acc.Images("dtprofile/plot/speedup")) == 2


def test_nulls_are_skipped_not_zero(tmp_path, summary):
    summary["per_step_ms"]["forward"] = None
    summary["ratios"]["comm_overlap"] = None
    summary["projection"]["speedup"][2] = None
    summary["algbw_GBps"] = None
    with_nan = copy.deepcopy(summary)
    with_nan["per_step_ms"]["backward"] = float("nan")
    sink = TensorBoardSink(logdir=str(tmp_path), image_every=0)
    sink.log(with_nan, 10)
    sink.close()
    scalars = set(read(tmp_path).Tags()["scalars"])
    for tag in (
        "dtprofile/time/forward",
        "dtprofile/time/backward",
        "dtprofile/ratio/comm_overlap",
        "dtprofile/projection/speedup_G4",
        "dtprofile/comm/algbw_GBps",
    ):
        assert tag not in scalars
    assert "dtprofile/projection/speedup_G8" in scalars


def test_given_writer_is_flushed_not_closed_and_layout_once(tmp_path, summary):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    a = TensorBoardSink(writer=w, image_every=0)
    a.log(summary, 1)
    a.log(summary, 2)
    a.close(summary, 3)
    b = TensorBoardSink(writer=w, image_every=0)  # e.g. a second fit on the same logger
    b.log(summary, 4)
    b.close()
    assert w.all_writers is not None  # still open: the owner closes it
    w.add_scalar("user/loss", 1.0, 5)
    w.close()
    acc = read(tmp_path)
    assert len(acc.Tensors("custom_scalars__config__")) == 1
    assert "user/loss" in acc.Tags()["scalars"]
    assert [s for s, _ in text_of(acc)] == [1, 2, 3, 4]


def test_gpu_telemetry_per_rank(tmp_path, summary):
    summary["run"]["telemetry"] = {
        "ranks": [
            {"rank": 0, "util_pct": 91.0, "memory": {"used_MB": 1200, "total_MB": 80000}, "name": "H100"},
            {"rank": 1, "util_pct": 40.5, "memory": {"used_MB": 1100, "total_MB": 80000}},
        ],
        "power_W": 310.0,
    }
    sink = TensorBoardSink(logdir=str(tmp_path), image_every=0)
    sink.log(summary, 7)
    sink.close()
    acc = read(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    assert {
        "dtprofile/gpu/util_pct/rank0",
        "dtprofile/gpu/util_pct/rank1",
        "dtprofile/gpu/memory_used_MB/rank1",
        "dtprofile/gpu/power_W",
    } <= scalars
    assert acc.Scalars("dtprofile/gpu/util_pct/rank1")[0].value == pytest.approx(40.5)
    (lay,) = layouts(acc)
    gpu = [c for c in lay.category if c.title == "dtprofile: GPU"]
    assert gpu and {ch.title for ch in gpu[0].chart} >= {"util_pct/rank0", "util_pct/rank1", "power_W"}


@pytest.mark.parametrize(
    "telemetry",
    [
        None,
        {"available": False, "reason": "no NVML"},
        {"0": {"util_pct": 5}},
        [{"util_pct": 5}],
        "weird",
    ],
)
def test_telemetry_shapes(telemetry):
    out = tags._telemetry_scalars(telemetry)
    if (
        isinstance(telemetry, (dict, list))
        and telemetry
        and not (isinstance(telemetry, dict) and telemetry.get("available") is False)
    ):
        assert out == {"dtprofile/gpu/util_pct/rank0": 5.0}
    else:
        assert out == {}


def test_without_matplotlib_images_are_skipped_with_one_info(tmp_path, summary, monkeypatch, caplog):
    monkeypatch.setattr(plots, "available", lambda: False)
    caplog.set_level(logging.INFO, logger="dtprofile.tensorboard")
    sink = TensorBoardSink(logdir=str(tmp_path), image_every=1)
    for step in (1, 2, 3):
        sink.log(summary, step)
    sink.close(summary, 4)
    assert sum("matplotlib" in r.getMessage() for r in caplog.records) == 1
    acc = read(tmp_path)
    assert acc.Tags()["images"] == []
    assert "dtprofile/time/step" in acc.Tags()["scalars"]


def test_bounded_history_and_no_output(tmp_path, summary, capsys):
    del summary["steps_total"]
    sink = TensorBoardSink(logdir=str(tmp_path), history=5, image_every=0)
    for i in range(8):
        sink.log(summary, 10 * i)
    sink.close(summary)  # step defaults to the latest seen
    assert len(sink.history) == 5
    assert [s for s, _ in sink.history] == [30, 40, 50, 60, 70]
    sink.close(summary)  # idempotent
    sink.log(summary, 99)  # after close: ignored, no exception
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_empty_and_foreign_summaries_do_not_raise(tmp_path):
    sink = TensorBoardSink(logdir=str(tmp_path), image_every=1)
    sink.log({"schema": "dtprofile.summary/1", "per_step_ms": {}, "ratios": {}}, 1)
    sink.log({"per_step_ms": {"step": None}, "projection": {"gpus": []}, "ranks": "x", "advice": "nope"}, 2)
    sink.log("not a dict", 3)  # type: ignore[arg-type]
    sink.close()
    texts = text_of(read(tmp_path))
    assert "No steady-state steps measured yet" in texts[0][1]


def test_needs_writer_or_logdir():
    with pytest.raises(ValueError):
        TensorBoardSink()


# ----------------------------------------------------------------------- plots


def test_plots_are_hwc_uint8(summary):
    pytest.importorskip("matplotlib")
    img = plots.render_speedup(summary)
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    assert img.shape[0] > 200 and img.shape[1] > 300
    assert img.std() > 0  # not a blank canvas
    hist = [(10 * i, summary["per_step_ms"]) for i in range(20)]
    for h in (hist, hist[:1], []):
        b = plots.render_breakdown(h)
        assert b.dtype == np.uint8 and b.shape[2] == 3
    assert plots.render_speedup({}).shape[2] == 3  # a message panel, not an error


def test_breakdown_parts_add_up_to_the_step(summary):
    per = summary["per_step_ms"]  # forward+backward+optimizer (73) > compute (62)
    parts = plots._parts(per)
    assert sum(parts.values()) == pytest.approx(per["step"])
    assert parts["data_wait"] == 1.0 and parts["comm_exposed"] == 32.0
    assert parts["forward"] + parts["backward"] + parts["optimizer"] == pytest.approx(62.0)
    # phases short of compute: the rest is "other"; no phases: compute unsplit
    short = {
        "step": 100.0,
        "forward": 10.0,
        "backward": 20.0,
        "optimizer": 5.0,
        "compute": 80.0,
        "data_wait": 15.0,
        "comm_exposed": 5.0,
        "overhead": 20.0,
    }
    p = plots._parts(short)
    assert p["other"] == pytest.approx(45.0) and sum(p.values()) == pytest.approx(100.0)
    p = plots._parts({"step": 50.0, "compute": 40.0, "overhead": 10.0, "data_wait": 10.0})
    assert p["compute"] == 40.0 and sum(p.values()) == pytest.approx(50.0)


def test_lightning_logger_experiment(tmp_path, summary):
    """The Lightning callback passes ``trainer.logger.experiment``; the logger itself works too."""
    loggers = pytest.importorskip("pytorch_lightning.loggers")
    logger = loggers.TensorBoardLogger(str(tmp_path), name="lit", version=0)
    sink = TensorBoardSink(writer=logger.experiment, image_every=0)
    sink.log(summary, 5)
    sink.close(summary, 6)
    TensorBoardSink(writer=logger, image_every=0).close(summary, 7)
    logger.log_metrics({"train_loss": 0.5}, step=7)  # the logger's writer is still open
    logger.finalize("success")
    acc = read(logger.log_dir)
    assert {"dtprofile/time/step", "train_loss"} <= set(acc.Tags()["scalars"])
    assert [s for s, _ in text_of(acc)] == [5, 6, 7]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # TensorBoard's vendored bleach
def test_advice_renders_in_tensorboards_markdown(summary):
    from tensorboard import plugin_util

    html = plugin_util.markdown_to_safe_html(render.advice_markdown(summary, 125))
    assert html.count("<table>") == 2  # breakdown and projection
    assert html.count("<ol>") == 1 and html.count("<ul>") == 3  # findings with details
    # Asterisks in a title or an action are text, not emphasis (the parameter-server lemma).
    lemma = copy.deepcopy(summary)
    lemma["advice"][0]["title"] = "needs >= 4 servers (lemma N_ps >= 2*S*G/(B_ps*T_C))"
    lemma["advice"][0]["action"] = "a*b*c"
    html = plugin_util.markdown_to_safe_html(render.advice_markdown(lemma, 125))
    assert "2*S*G/(B_ps*T_C))</strong>" in html and "action: a*b*c" in html and "<em>" not in html


def test_engine_start_imports_the_writer_before_training(tmp_path):
    """The sink's own SummaryWriter is imported at start, on the training thread and
    before any step: the first interval's background write used to do it mid-step
    (a 269 ms step, 204 ms of it in the optimizer, in a Lightning run without a logger)."""
    import subprocess
    import sys

    code = (
        "import sys, os, torch, dtprofile\n"
        "assert 'torch.utils.tensorboard' not in sys.modules\n"
        "net = torch.nn.Linear(4, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "prof = dtprofile.profile(net, opt, logdir=sys.argv[1]); prof.start()\n"
        "assert 'torch.utils.tensorboard' in sys.modules\n"
        "assert not [f for f in os.listdir(sys.argv[1]) if f.startswith('events')]  # no file before a log\n"
        "prof.stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
