"""The texts of a summary: terminal report, Markdown, their shared parts and numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtprofile import Report, advice, render

DATA = Path(__file__).parent / "data" / "summary_2rank.json"


@pytest.fixture
def summary() -> dict:
    return json.loads(DATA.read_text())


def test_markdown_escapes_pipes_and_orders_severity(summary):
    summary["advice"] = [
        {"id": "a", "severity": "low", "title": "x | y", "evidence": "e", "action": "do"},
        {"id": "b", "severity": "critical", "title": "worst", "evidence": {"n": 3}},
        {"id": "c", "severity": "weird", "title": "unknown severity"},
    ]
    md = render.advice_markdown(summary, 3)
    assert "x \\| y" in md
    assert md.index("`b`") < md.index("`a`")
    assert "n = 3" in md


@pytest.mark.parametrize(
    "counts, words",
    [
        ({"all_gathers": 9, "reduce_scatters": 5, "replica_all_reduces": 0}, "FSDP's all-gathers and reduce-scatters"),
        (
            {"all_gathers": 9, "reduce_scatters": 5, "replica_all_reduces": 5},
            "FSDP's all-gathers, reduce-scatters and all-reduces across replicas",
        ),
        ({"all_gathers": 0, "reduce_scatters": 0, "replica_all_reduces": 5}, "FSDP's all-reduces across replicas"),
    ],
)
def test_sharded_measurement_note_names_the_collectives_the_step_issued(counts, words):
    notes = render.measurement_notes({"world_size": 2, "comm_source": "fsdp", "run": {"fsdp": dict(units=5, **counts)}})
    assert any(n.startswith(f"communication = {words} and the waits for them") for n in notes), notes


@pytest.mark.parametrize(
    "hook, why", [(None, "bucket_timing_every=0"), ("fp16_compress_hook", "your hook fp16_compress_hook")]
)
def test_the_wait_only_note_says_why_there_is_no_total(hook, why):
    notes = render.measurement_notes(
        {"world_size": 2, "comm_source": "ddp_exposed", "run": {"ddp": {"comm_hook": hook}}}
    )
    [note] = [n for n in notes if n.startswith("communication = the wait after backward only")]
    assert why in note and "no total, overlap or bandwidth" in note
    assert ("timed_hook" in note) == (hook is not None)


def test_caption_of_a_run_shorter_than_its_warmup():
    # 3 steps with warmup_steps=5: it skipped 3, not 5.
    caption = render.run_caption({"world_size": 1, "steps_profiled": 0, "warmup_steps": 5, "steps_total": 3})
    assert "0 steps profiled, 3 warm-up skipped" in caption
    assert "40 steps profiled, 5 warm-up skipped" in render.run_caption(
        {"world_size": 1, "steps_profiled": 40, "warmup_steps": 5, "steps_total": 45}
    )


def test_breakdown_shows_the_wait_for_a_slower_rank_only_when_there_is_one(summary):
    per = summary["per_step_ms"]
    labels = [
        label.strip() for label, _, _ in render.breakdown_rows(dict(summary, per_step_ms=dict(per, comm_peer_wait=0.0)))
    ]
    assert "waiting for a slower rank" not in labels
    rows = render.breakdown_rows(dict(summary, per_step_ms=dict(per, comm_peer_wait=15.0)))
    (row,) = [r for r in rows if r[0].strip() == "waiting for a slower rank"]
    assert row[1] == 15.0 and row[2] == pytest.approx(15.0 / per["step"])


def test_breakdown_names_compute_outside_the_phases(summary):
    per = dict(summary["per_step_ms"], step=100.0, compute=60.0, forward=10.0, backward=30.0, optimizer=5.0)
    (row,) = [r for r in render.breakdown_rows(dict(summary, per_step_ms=per)) if r[0].strip().startswith("other")]
    assert row[1] == pytest.approx(15.0) and row[2] == pytest.approx(0.15)
    # Phases that account for compute (or exceed it, a backward slowed by overlap): no row.
    for backward in (44.8, 50.0):
        per = dict(per, backward=backward)
        labels = [r[0].strip() for r in render.breakdown_rows(dict(summary, per_step_ms=per))]
        assert not any(label.startswith("other") for label in labels)


def test_format_report_own_formatter(summary):
    text = render.format_report(summary)
    assert "2 × cpu" in text and "gloo" in text
    assert "R_O = T_O / T_C = 0.532" in text
    assert text.index("HIGH: Gradient all-reduce") < text.index("MEDIUM:") < text.index("INFO:")
    assert "action: Raise the interconnect bandwidth" in text
    assert "GPUs" in text and "paper α" in text
    assert "Recommendations: gpus = 1" in text


def test_report_leaves_out_recommendations_with_nothing_to_recommend(summary):
    empty = dict(
        summary,
        recommendations={
            "gpus": None,
            "num_parameter_servers": None,
            "bandwidth_needed_Gbps": None,
            "num_workers": None,
            "target_efficiency": 0.8,
            "bandwidth_needed_at_gpus": 64,
            "bandwidth_needed_reachable": None,
            "num_parameter_servers_at_gpus": None,
        },
    )
    assert "Recommendations" not in render.format_report(empty)
    assert "Recommendations" not in render.advice_markdown(empty)
    some = dict(empty, recommendations=dict(empty["recommendations"], gpus=8))
    line = render.format_report(some).splitlines()[-1]
    assert line == "Recommendations: gpus = 8, target_efficiency = 0.8", line


def test_report_shows_as_markdown_in_notebooks(summary):
    md = Report(summary)._repr_markdown_()
    assert md == render.advice_markdown(summary)
    assert "| " in md and "comm_bound" in md


def test_findings_follow_the_advice_severity_order():
    """advice.SEVERITY_ORDER decides; other tools' severities take their place on it."""
    names = ["ok", "info", "weird", "low", "warning", "medium", "high", "critical"]
    found = render.sorted_findings([{"id": n, "severity": n.upper()} for n in names])
    assert [f["id"] for f in found] == ["critical", "high", "warning", "medium", "weird", "low", "info", "ok"]
    assert [
        f["id"] for f in render.sorted_findings([{"id": s, "severity": s} for s in reversed(advice.SEVERITY_ORDER)])
    ] == list(advice.SEVERITY_ORDER)


def test_str_of_a_report_is_the_terminal_report(summary):
    assert str(Report(summary)) == render.format_report(summary)


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "-"),
        (0, "0"),
        (7, "7"),
        (0.5, "0.500"),
        (99.5, "99.5"),
        (123.4, "123"),
        (0.000123, "0.000123"),
        (float("nan"), "-"),
        (float("inf"), "-"),
        ("12", "12.0"),
        ("abc", "abc"),
        (True, "-"),
    ],
)
def test_fmt(value, text):
    assert render.fmt(value) == text
