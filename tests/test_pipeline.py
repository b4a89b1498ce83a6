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
    assert "pipeline_bubble" in ids and "comm_bound" not in ids and "data_bound" not in ids
    bubble = next(f for f in s["advice"] if f["id"] == "pipeline_bubble")
    # The lead finding, unless the host work each microbatch brings (a busy machine's) makes
    # every change of the schedule cost more than it saves: then low, and it says so.
    assert ids[0] == "pipeline_bubble" or (bubble["severity"] == "low" and "would not pay" in bubble["action"])
    # More microbatches where the projection gains from them (the host work each brings counted).
    assert re.search(r"n_microbatches=(8|16) \(from 4\)|more microbatches would not pay", bubble["action"])
    assert "ScheduleInterleaved1F1B" in bubble["action"]
    # G counts replicas of 2 GPUs (the stages): one measured.
    assert s["projection"]["measured_gpus"] == 1 and s["projection"]["mesh"]["gpus_per_replica"] == 2
    # The model holds the measured step at the run's own counts (what its what-ifs start from).
    own = pipe["projection"]["step_ms_by_microbatches"][pipe["projection"]["microbatches"].index(4)]
    assert own == pytest.approx(per["step"], rel=0.1)
    _assert_timeline(pipe, stages=2, microbatches=4)


def _assert_timeline(pipe: dict, stages: int, microbatches: int, chunks: int = 1) -> None:
    """One step's timeline: a row a stage, its passes in the order a schedule runs them."""
    timeline = pipe["timeline"]
    assert timeline["step"] is not None and timeline["step"] % 4 == 0  # (a step every stage sampled)
    assert [row["stage"] for row in timeline["stages"]] == list(range(stages))
    for row in timeline["stages"]:
        kinds = [e[0] for e in row["events"]]
        assert kinds.count("F") == kinds.count("B") == microbatches * chunks, kinds
        assert kinds[-1] == "U" and all(a <= b for _, a, b in row["events"])
        starts = [a for _, a, _ in row["events"]]
        assert starts == sorted(starts) and starts[-1] <= row["step_ms"]
    # The first stage forwards first; the last one waits for its first activation.
    assert timeline["stages"][0]["events"][0][0] == "F"
    assert timeline["stages"][-1]["events"][0][0] == "R"


@pytest.mark.slow
def test_a_slower_stage_is_named_with_the_time_to_move_off_it():
    s = _launch(dict(stage_ms=[[4.0, 8.0], [8.0, 16.0]], steps=10))[0]["summary"]
    imbalance = next(f for f in s["advice"] if f["id"] == "stage_imbalance")
    # Stage 1 computes twice stage 0's: 4/3 of the median (the two's mean).
    assert imbalance["evidence"]["slowest_stage_rank"] == 1
    assert imbalance["evidence"]["imbalance"] == pytest.approx(4 / 3, rel=0.15)
    assert "from rank 1's stage to rank 0's" in imbalance["action"]
    assert imbalance["evidence"]["balanced_step_ms"] < s["per_step_ms"]["step"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, cfg",
    [
        (4, dict(dp=2, schedule="1f1b", stage_ms=[[4.0, 8.0], [6.0, 12.0]])),  # 2 pipelines of 2 stages
        (2, dict(virtual=2, schedule="interleaved")),  # 2 ranks, 2 stages each
    ],
    ids=["dp2xpp2", "interleaved"],
)
def test_pipelines_side_by_side_and_interleaved_stages(world, cfg):
    from distributed import run_ranks
    from pp_workers import pp_train

    profiled = run_ranks(pp_train, world, dict(cfg, steps=14), timeout_s=240)
    plain = run_ranks(pp_train, world, dict(cfg, steps=14, profile=False), timeout_s=240)
    assert [r["weights"] for r in profiled] == [p["weights"] for p in plain]
    assert all(r["wrappers_left"] == [] for r in profiled)
    s = profiled[0]["summary"]
    pipe = s["pipeline"]
    assert [r["pipeline_stage"] for r in s["ranks"]] == [r % 2 for r in range(world)]
    # Each rank's waits for its neighbours, apart from any other communication it waited for.
    assert all(0 < r["pipeline_wait"] <= 1.1 * r["comm_exposed"] + 1.0 for r in s["ranks"]), s["ranks"]
    ids = [f["id"] for f in s["advice"]]
    assert "straggler" not in ids and "comm_bound" not in ids and "data_bound" not in ids
    if cfg.get("dp"):
        # Each stage's figures: the median over its two replicas, which the report names.
        assert pipe["replicas"] == 2 and [f["ranks"] for f in pipe["stage_figures"]] == [[0, 2], [1, 3]]
        imbalance = next(f for f in s["advice"] if f["id"] == "stage_imbalance")
        assert imbalance["evidence"]["slowest_stage_index"] == 1
        assert imbalance["evidence"]["imbalance"] == pytest.approx(1.2, rel=0.15)  # (18 ms of 30 over the mean)
        assert "from stage 1 (ranks 1, 3) to stage 0 (ranks 0, 2)" in imbalance["action"]
        _assert_timeline(pipe, stages=2, microbatches=4)
    else:
        # 4 stages over 2 ranks: the bubble (p - 1)/(m v + p - 1) = 1/9 with v = 2.
        assert pipe["stages"] == 2 and pipe["stages_per_rank"] == 2 and pipe["num_stages"] == 4
        assert pipe["bubble_fraction_theory"] == pytest.approx(1 / 9)
        assert 0.03 <= pipe["bubble_fraction"] <= 0.3, pipe["bubble_fraction"]
        _assert_timeline(pipe, stages=2, microbatches=4, chunks=2)


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
    assert bubble_theory("ScheduleInterleaved1F1B", 4, 4) == pytest.approx(3 / 7)  # (v = 1)
    assert bubble_theory("ScheduleInterleaved1F1B", 4, 4, virtual=2) == pytest.approx(3 / 11)
    assert bubble_theory("ScheduleZBVZeroBubble", 4, 4) is None  # (not this formula's)
    view = pipeline_view(_summary())
    assert view["fixed_ms"] == pytest.approx(92.0 - 72.0 * 5 / 4)
    assert step_at(view) == pytest.approx(92.0)
    assert step_at(view, microbatches=8) == pytest.approx(72.0 * 9 / 8 + 2.0)
    assert step_at(view, stages=4) == pytest.approx(36.0 * 7 / 4 + 2.0)  # (the layers over 4 stages)
    proj = pipeline_projection(view)
    assert proj["step_ms_by_microbatches"] == sorted(proj["step_ms_by_microbatches"], reverse=True)
    assert pipeline_view({"pipeline": {"stages": 1, "microbatches": 4}}) is None


def test_the_stages_of_pipelines_side_by_side_and_of_other_schedules():
    # 2 pipelines of 2 stages (rank = replica * 2 + stage): a stage's figures are its
    # replicas' median; a replica slower than its stage's other is the straggler, not a stage.
    summary = _summary(stage_ms=((24.0, 48.0), (24.0, 48.0), (24.0, 48.0), (24.0, 48.0)), waits=(18.0,) * 4)
    summary["pipeline"].update(stages=2, group_size=2)
    for row in summary["ranks"]:
        row["pipeline_stage"] = row["rank"] % 2
    view = pipeline_view(summary)
    assert view["replicas"] == 2 and [f["ranks"] for f in view["stage_figures"]] == [[0, 2], [1, 3]]
    # A rank that reported its waits for its neighbours apart (pipeline_wait): the bubble is
    # those, not its other exposed communication (the data-parallel all-reduce).
    apart = {**summary, "ranks": [dict(r, comm_exposed=30.0, pipeline_wait=18.0) for r in summary["ranks"]]}
    assert [f["wait_ms"] for f in pipeline_view(apart)["stage_figures"]] == [18.0, 18.0]
    assert view["bubble_fraction_theory"] == pytest.approx(0.2) and step_at(view) == pytest.approx(92.0)
    slow = analyze(dict(summary, ranks=[dict(r, step=92.0) for r in summary["ranks"]]))
    assert "straggler" not in {f["id"] for f in slow["advice"]}
    summary["ranks"][3].update(forward=40.0, backward=80.0, comm_exposed=2.0)
    found = {f["id"]: f for f in analyze(summary)["advice"]}
    assert found["straggler"]["evidence"]["rank"] == 3
    assert "pipeline stage 1's other replicas' median" in found["straggler"]["title"]
    # Interleaved, 2 stages a rank: the bubble (p - 1)/(m v + p - 1), its slots half as long.
    inter = _summary(schedule="ScheduleInterleaved1F1B")
    inter["pipeline"].update(stages=4, group_size=2)
    view = pipeline_view(inter)
    assert view["stages"] == 2 and view["stages_per_rank"] == 2
    assert view["bubble_fraction_theory"] == pytest.approx(1 / 9)
    assert step_at(view, virtual=1) - step_at(view) == pytest.approx(72.0 / 4 - 72.0 / 8)
    # A zero-bubble schedule: the bubble's slots read off the measured waits (k), no theory.
    zb = pipeline_view(_summary(schedule="ScheduleZBVZeroBubble", waits=(6.0, 6.0)))
    assert zb["bubble_fraction_theory"] is None and zb["bubble_model"] == "measured"
    assert zb["bubble_slots"] == pytest.approx(6.0 / 18.0)  # (one slot: 72 ms over 4 microbatches)
    assert step_at(zb) == pytest.approx(92.0)
    assert step_at(zb, microbatches=8) == pytest.approx(92.0 - 72.0 / 3 * (1 / 4 - 1 / 8))
    assert pipeline_projection(zb)["bubble_model"] == "measured"


def test_one_step_as_the_stages_ran_it_in_the_report_and_the_tab(tmp_path):
    import json

    from dtprofile.dashboard.views import run_view
    from dtprofile.render.markdown import advice_markdown
    from dtprofile.render.terminal import format_report

    events = [
        [["F", 0.0, 10.0], ["F", 10.0, 20.0], ["R", 20.0, 40.0], ["B", 40.0, 60.0], ["B", 60.0, 80.0]],
        [["R", 0.0, 10.0], ["F", 10.0, 20.0], ["B", 20.0, 40.0], ["S", 40.0, 41.0], ["F", 41.0, 51.0]],
    ]
    events[0].append(["U", 80.0, 82.0])
    events[1].append(["B", 51.0, 71.0])
    summary = analyze(_summary())
    summary["pipeline"]["timeline"] = {
        "step": 8,
        "step_ms": 82.0,
        "stages": [{"stage": i, "rank": i, "step_ms": 82.0, "events": e} for i, e in enumerate(events)],
    }
    text = format_report(summary)
    rows = [line for line in text.splitlines() if line.startswith("  stage ")]
    assert rows[0].startswith("  stage 0 (rank 0) |FFFFFFFF") and rows[0].endswith("u|")
    # (64 columns of 1.28 ms: where a column holds a wait and a pass, the pass shows)
    assert rows[1].startswith("  stage 1 (rank 1) |.......FFFFFFFFBBBB")
    assert "step 8, 82.00 ms" in text
    assert "```" in advice_markdown(summary) and "stage 1 (rank 1) |" in advice_markdown(summary)
    summary.update(schema="dtprofile.summary/1", complete=True)
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "dtprofile_summary.json").write_text(json.dumps(summary))
    timeline = run_view(str(tmp_path), "pp")["pipeline"]["timeline"]
    assert timeline["caption"] == "step 8, 82.0 ms" and [r["label"] for r in timeline["stages"]] == [
        "stage 0 (rank 0)",
        "stage 1 (rank 1)",
    ]
    assert timeline["stages"][1]["events"][3] == ["S", 40.0, 41.0]


def test_pipeline_advice_on_known_figures():
    even = {f["id"]: f for f in analyze(_summary())["advice"]}
    assert even["pipeline_bubble"]["severity"] == "medium" and "stage_imbalance" not in even
    assert "batch_headroom" not in even and "comm_bound" not in even
    uneven = {f["id"]: f for f in analyze(_summary(stage_ms=((24.0, 48.0), (36.0, 72.0))))["advice"]}
    assert uneven["stage_imbalance"]["evidence"]["move_ms"] == pytest.approx(108.0 - 90.0)
    low = {f["id"] for f in analyze(_summary(waits=(4.0, 4.0)))["advice"]}
    assert "pipeline_bubble" not in low
    # Waits no change of the schedule shortens (10 ms of host work a microbatch: more of them,
    # or interleaving, cost more than they save): low, and the slower stage named as the cause.
    busy = _summary(stage_ms=((24.0, 48.0), (36.0, 72.0)), waits=(40.0, 4.0), step=160.0)
    for row in busy["ranks"]:
        row["compute"] = row["forward"] + row["backward"] + 40.0
    found = {f["id"]: f for f in analyze(busy)["advice"]}
    assert found["pipeline_bubble"]["severity"] == "low" and found["stage_imbalance"]["severity"] == "medium"
    assert found["pipeline_bubble"]["title"].endswith("mostly for the slower stage: see stage_imbalance")
    assert "more microbatches would not pay" in found["pipeline_bubble"]["action"]
    # Each finding as severe as what its change would gain: a stage 4x the other's leads.
    lopsided = analyze(_summary(stage_ms=((12.0, 24.0), (48.0, 96.0)), waits=(110.0, 6.0), step=160.0))["advice"]
    assert [(f["id"], f["severity"]) for f in lopsided] == [("stage_imbalance", "high"), ("pipeline_bubble", "medium")]
    # What the stages send: 16 MB a step (rank 0's launches, both ways) with 12 ms of send
    # waits. Over the assumed link (10 Gbit/s: 12.8 ms), the bytes explain the waits.
    sending = _summary()
    sending["pipeline"].update(bytes=16e6, send_wait_ms=12.0)
    transfer = {f["id"]: f for f in analyze(sending)["advice"]}["pipeline_transfer"]
    assert transfer["evidence"]["transfer_ms"] == pytest.approx(12.0) and transfer["evidence"][
        "wire_ms"
    ] == pytest.approx(12.8)
    assert "2.00 MB each way a microbatch" in transfer["title"] and "13.0% of the step" in transfer["title"]
    assert "bf16" in transfer["action"]
    # Send waits the bytes cannot explain are a send waiting for its receiver: not transfers.
    sending["pipeline"].update(bytes=16e3, send_wait_ms=30.0)
    assert "pipeline_transfer" not in {f["id"] for f in analyze(sending)["advice"]}
    # Over a link set by the user the bytes alone decide: 8 MB at 1 GB/s, 8 ms, under 10%;
    # at 0.5 GB/s, 16 ms (17% of the step), whatever the send waits.
    sending["pipeline"].update(bytes=8e6, send_wait_ms=0.0)
    sending["options"] = {"link_bandwidth_Bps": 1e9}
    assert "pipeline_transfer" not in {f["id"] for f in analyze(sending)["advice"]}
    sending["options"] = {"link_bandwidth_Bps": 0.5e9}
    wire = {f["id"]: f for f in analyze(sending)["advice"]}["pipeline_transfer"]
    assert wire["evidence"]["wire_ms"] == pytest.approx(16.0)


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
