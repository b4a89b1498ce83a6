"""Pipeline parallelism (torch.distributed.pipelining): the stages, the bubble, the advice.

Two stages on gloo, each a rank, their device time emulated (tests/pp_workers.py): 4
microbatches of 4 ms forward and 8 ms backward a stage, so the schedule's compute is 48 ms
a step and its bubble (p - 1)/(m + p - 1) = 20% of the step with equal stages."""

from __future__ import annotations

import re

import pytest

from dtprofile.analysis.advice import analyze
from dtprofile.analysis.pipeline_plan import bubble_theory, pipeline_projection, pipeline_view, step_at


def _launch(cfg: dict) -> list[dict]:
    from distributed import run_ranks
    from pp_workers import pp_train

    return run_ranks(pp_train, 2, cfg, timeout_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, target", [("gpipe", "module"), ("1f1b", "schedule")])
def test_a_two_stage_pipeline_reports_its_stages_and_its_bubble(schedule, target):
    profiled = _launch(dict(schedule=schedule, target=target, steps=12))
    plain = _launch(dict(schedule=schedule, steps=12, profile=False))
    for r, p in zip(profiled, plain, strict=True):
        assert r["weights"] == p["weights"]  # (a digest of the stage's weights: bitwise)
        assert r["wrappers_left"] == []
    s = profiled[0]["summary"]
    assert s["comm_source"] == "pipeline" and s["comm_unmeasured"] is None
    pipe = s["pipeline"]
    assert pipe["schedule"] == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
    assert pipe["stages"] == 2 and pipe["microbatches"] == 4 and pipe["stage_indices"] == [0]
    assert pipe["bubble_fraction_theory"] == pytest.approx(0.2)
    # The waits for the neighbour are exposed communication, not data wait or compute
    # (bounds a busy machine cannot cross: the emulated sleeps hold).
    assert 0.1 <= pipe["bubble_fraction"] <= 0.45, pipe
    per = s["per_step_ms"]
    assert per["data_wait"] < 0.25 * per["comm_exposed"]
    for stage in pipe["stage_figures"]:
        assert 14.0 <= stage["forward_ms"] <= 40.0 and 30.0 <= stage["backward_ms"] <= 80.0, stage
    ids = [f["id"] for f in s["advice"]]
    assert ids[0] == "pipeline_bubble" and "comm_bound" not in ids and "data_bound" not in ids
    bubble = s["advice"][0]
    # More microbatches where the projection gains from them (the host work each brings counted).
    assert re.search(r"n_microbatches=(8|16) \(from 4\)|more microbatches would not pay", bubble["action"])
    assert "ScheduleInterleaved1F1B" in bubble["action"]
    # G counts replicas of 2 GPUs (the stages): one measured.
    assert s["projection"]["measured_gpus"] == 1 and s["projection"]["mesh"]["gpus_per_replica"] == 2
    # The model holds the measured step at the run's own counts (what its what-ifs start from).
    own = pipe["projection"]["step_ms_by_microbatches"][pipe["projection"]["microbatches"].index(4)]
    assert own == pytest.approx(per["step"], rel=0.1)


@pytest.mark.slow
def test_a_slower_stage_is_named_with_the_time_to_move_off_it():
    s = _launch(dict(stage_ms=[[4.0, 8.0], [8.0, 16.0]], steps=10))[0]["summary"]
    imbalance = next(f for f in s["advice"] if f["id"] == "stage_imbalance")
    # Stage 1 computes twice stage 0's: 4/3 of the median (the two's mean).
    assert imbalance["evidence"]["slowest_stage_rank"] == 1
    assert imbalance["evidence"]["imbalance"] == pytest.approx(4 / 3, rel=0.15)
    assert "from rank 1's stage to rank 0's" in imbalance["action"]
    assert imbalance["evidence"]["balanced_step_ms"] < s["per_step_ms"]["step"]


def _summary(stage_ms=((24.0, 48.0), (24.0, 48.0)), waits=(18.0, 18.0), step=92.0, m=4, schedule="ScheduleGPipe"):
    ranks = [
        {"rank": i, "step": step, "forward": f, "backward": b, "comm_exposed": w}
        for i, ((f, b), w) in enumerate(zip(stage_ms, waits, strict=True))
    ]
    return {
        "world_size": len(ranks),
        "pipeline": {"schedule": schedule, "stages": len(ranks), "microbatches": m},
        "per_step_ms": {"step": step, "forward": 24.0, "backward": 48.0, "compute": 74.0, "comm_exposed": 18.0},
        "ranks": ranks,
        "run": {"batch_size": 8},
    }


def test_the_bubble_in_theory_and_the_step_at_other_counts():
    assert bubble_theory("ScheduleGPipe", 2, 4) == pytest.approx(0.2)
    assert bubble_theory("Schedule1F1B", 4, 4) == pytest.approx(3 / 7)
    assert bubble_theory("ScheduleInterleaved1F1B", 4, 4) is None  # (not this formula's)
    view = pipeline_view(_summary())
    assert view["fixed_ms"] == pytest.approx(92.0 - 72.0 * 5 / 4)
    assert step_at(view) == pytest.approx(92.0)
    assert step_at(view, microbatches=8) == pytest.approx(72.0 * 9 / 8 + 2.0)
    assert step_at(view, stages=4) == pytest.approx(36.0 * 7 / 4 + 2.0)  # (the layers over 4 stages)
    proj = pipeline_projection(view)
    assert proj["step_ms_by_microbatches"] == sorted(proj["step_ms_by_microbatches"], reverse=True)
    assert pipeline_view({"pipeline": {"stages": 1, "microbatches": 4}}) is None


def test_pipeline_advice_on_known_figures():
    even = {f["id"]: f for f in analyze(_summary())["advice"]}
    assert even["pipeline_bubble"]["severity"] == "medium" and "stage_imbalance" not in even
    assert "batch_headroom" not in even and "comm_bound" not in even
    uneven = {f["id"]: f for f in analyze(_summary(stage_ms=((24.0, 48.0), (36.0, 72.0))))["advice"]}
    assert uneven["stage_imbalance"]["evidence"]["move_ms"] == pytest.approx(108.0 - 90.0)
    low = {f["id"] for f in analyze(_summary(waits=(4.0, 4.0)))["advice"]}
    assert "pipeline_bubble" not in low


def test_the_report_and_its_markdown_show_the_pipeline():
    from dtprofile.render.markdown import advice_markdown
    from dtprofile.render.terminal import format_report

    summary = analyze(_summary())
    text = format_report(summary)
    assert "Pipeline: ScheduleGPipe, 2 stages, 4 microbatches" in text and "20.0% in theory" in text
    assert "rank 1: forward 24.0 ms + backward 48.0 ms, waits 18.0 ms" in text
    assert "8 microbatches" in text and "G = data-parallel replicas of 2 GPUs (2 pipeline stages" in text
    assert "Pipeline: ScheduleGPipe" in advice_markdown(summary)


def test_the_tab_shows_each_stage_and_the_bubble(tmp_path):
    import json

    from dtprofile.dashboard.views import run_view

    summary = analyze(_summary(stage_ms=((24.0, 48.0), (36.0, 72.0))))
    summary.update(schema="dtprofile.summary/1", complete=True)
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "dtprofile_summary.json").write_text(json.dumps(summary))
    view = run_view(str(tmp_path), "pp")
    pipe = view["pipeline"]
    assert pipe["lines"][0].startswith("ScheduleGPipe, 2 stages, 4 microbatches")
    assert [s["rank"] for s in pipe["stages"]] == [0, 1] and pipe["stages"][1]["backward_ms"] == 72.0
    assert view["scaling"]["axis"] == "replicas (of 2 GPUs)"
