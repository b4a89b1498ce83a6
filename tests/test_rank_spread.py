"""A summary, a report, the scalars and the tab at a thousand ranks: distributions, the
slowest rank and node named, sizes bounded (synthetic rows through the same code path as
a real run's; the times and sizes as functions of N: benchmarks/summary_size.py)."""

from __future__ import annotations

import json

import pytest

from dtprofile.analysis.rank_spread import MAX_NODES_LISTED, rank_spread
from dtprofile.analysis.uncertainty import MAX_INTERVAL_RANKS
from dtprofile.options import Options
from dtprofile.render.terminal import format_report
from dtprofile.sinks.tags import scalars_from_summary
from dtprofile.summary import build_summary

META = {
    "device": "cuda",
    "device_name": "test",
    "backend": "nccl",
    "steps_total": 40,
    "data_wait_source": "loader",
    "comm_source": "dtprofile",
    "timing": "cuda_event",
}


def _summary_size():
    """benchmarks/summary_size.py as a module: its synthetic ranks' rows are this file's too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "summary_size.py"
    spec = importlib.util.spec_from_file_location("summary_size", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY_SIZE = _summary_size()


def synthetic_rows(world: int, slow_node: int | None = None) -> list[dict]:
    """``world`` ranks' rows: 40 ms of compute, 3 ms of communication, 2 ms of data wait a step
    with a little noise, 8 ranks a node; the ranks of ``slow_node`` 20% slower."""
    return SUMMARY_SIZE.rows_for(world, -1 if slow_node is None else slow_node)


@pytest.fixture(scope="module")
def big():
    world = 1024
    meta = dict(META, world_size=world, run={"batch_size": 16, "micro_batches": 1, "ranks_per_host": 8})
    return build_summary(synthetic_rows(world, slow_node=77), meta, Options())


def test_a_thousand_ranks_read_as_a_distribution_with_the_slowest_rank_and_node_named(big):
    spread = big["rank_spread"]
    assert spread["ranks"] == 1024 and spread["step"]["p10"] <= spread["step"]["median"] <= spread["step"]["p90"]
    assert spread["step"]["max_rank"] // 8 == 77  # (one of the slow node's ranks)
    nodes = spread["nodes"]
    assert nodes["count"] == 128 and nodes["slowest"]["node"] == 77 and nodes["slowest"]["ranks"] == [616, 623]
    assert nodes["slowest"]["excess_ms"] == pytest.approx(8.0, rel=0.2)  # (20% of 40 ms)
    assert len(nodes["listed"]) == MAX_NODES_LISTED
    # The straggler is one of the slow node's ranks, and the node is named as the thing to look at.
    straggler = next(f for f in big["advice"] if f["id"] == "straggler")
    assert straggler["evidence"]["rank"] // 8 == 77 and straggler["evidence"]["node"]["node"] == 77
    assert nodes["source"] == "hosts" and nodes["slowest"]["host"] == SUMMARY_SIZE.host_of(616)
    assert f"its host {SUMMARY_SIZE.host_of(616)} (node 77, ranks 616-623) is the slowest node" in straggler["title"]
    assert all(r["host"] == SUMMARY_SIZE.host_of(r["rank"]) for r in big["ranks"])


def test_the_intervals_draw_from_a_bounded_number_of_ranks(big):
    assert big["uncertainty"]["ranks_drawn"] == MAX_INTERVAL_RANKS
    low, high = big["uncertainty"]["per_step_ms"]["step"]
    assert low <= big["per_step_ms"]["step"] <= high


def test_the_report_the_scalars_and_the_tab_stay_bounded(big, tmp_path):
    from dtprofile.dashboard.views import run_view

    report = format_report(big)
    assert "Ranks: 1024 ranks: step median" in report and "(node 77, ranks 616-623)" in report
    assert f"128 hosts of about 8 ranks: the slowest, host {SUMMARY_SIZE.host_of(616)}" in report
    assert len(report.splitlines()) < 80
    tags = scalars_from_summary(big)
    assert not [t for t in tags if "/rank/step_ms/rank" in t]  # (no tag a rank past 16 ranks)
    assert {"dtprofile/rank/step_ms/p90", "dtprofile/rank/step_ms/max"} <= set(tags)
    assert len(tags) < 200
    big = dict(big, schema="dtprofile.summary/1", complete=True)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "dtprofile_summary.json").write_text(json.dumps(big))
    step = run_view(str(tmp_path), "big")["step"]
    assert step["ranks_total"] == 1024 and len(step["ranks"]) == 16
    assert max(r["step_ms"] for r in step["ranks"]) == pytest.approx(big["rank_spread"]["step"]["max"])
    assert any("node 77" in line for line in step["spread"])


def test_a_small_run_keeps_its_ranks_one_by_one():
    meta = dict(META, world_size=4, run={"batch_size": 16, "micro_batches": 1})
    small = build_summary(synthetic_rows(4), meta, Options(), intervals=False)
    assert small["rank_spread"]["nodes"] is None and "Ranks:" not in format_report(small)
    assert "dtprofile/rank/step_ms/rank3" in scalars_from_summary(small)
    assert rank_spread([{"rank": 0, "step": 1.0}]) is None


def test_the_size_benchmark_runs_and_names_the_slow_node(capsys):
    assert SUMMARY_SIZE.main(["--ranks", "64"]) == 0  # (1: the slow node was not named)
    out = capsys.readouterr().out
    assert "| 64    |" in out and "slow node named" in out


def test_nodes_are_hosts_where_known_else_local_world_size():
    """Hosts decide the nodes (a slow node's ranks need not be contiguous: it is named by
    its host, its ranks listed); without hosts, or with one host for all (nodes emulated on
    one machine), LOCAL_WORLD_SIZE's blocks, as before."""
    busy = {"a": 40.0, "b": 40.0, "c": 48.0}
    placement = ["a", "c", "b", "a", "c", "b", "a", "c", "b"]  # (round-robin: node c holds 1, 4, 7)
    ranks = [{"rank": r, "host": h, "step": busy[h] + 3.0, "comm_exposed": 3.0} for r, h in enumerate(placement)]
    nodes = rank_spread(ranks, ranks_per_host=3)["nodes"]
    assert nodes["source"] == "hosts" and nodes["count"] == 3 and nodes["ranks_per_node"] == 3
    slow = nodes["slowest"]
    assert (slow["host"], slow["node"], slow["members"], slow["excess_ms"]) == ("c", 1, [1, 4, 7], 8.0)
    assert [n["host"] for n in nodes["listed"]][0] == "c"
    from dtprofile.analysis.rank_spread import in_node, node_label

    assert node_label(slow) == "host c (node 1, ranks 1, 4, 7)" and in_node(slow, 4) and not in_node(slow, 5)

    blocks = rank_spread([{k: v for k, v in e.items() if k != "host"} for e in ranks], ranks_per_host=3)["nodes"]
    assert blocks["source"] == "local_world_size" and blocks["slowest"]["ranks"] in ([0, 2], [3, 5], [6, 8])
    one_host = rank_spread([dict(e, host="same") for e in ranks], ranks_per_host=3)["nodes"]
    assert one_host["source"] == "local_world_size" and one_host["count"] == 3
    assert rank_spread([dict(e, host="same") for e in ranks])["nodes"] is None


def test_a_summary_with_hosts_stays_bounded_at_4096_ranks():
    """Each rank's host adds its name to its entry (0.35 kB a rank in all, 0.30 without),
    and nothing else grows with the ranks: the spread names a handful of nodes."""
    world = 4096
    meta = dict(META, world_size=world, run={"batch_size": 16, "micro_batches": 1, "ranks_per_host": 8})
    summary = build_summary(SUMMARY_SIZE.rows_for(world, 300), meta, Options(), intervals=False)
    assert len(json.dumps(summary)) < world * 400, len(json.dumps(summary))
    assert len(json.dumps(summary["rank_spread"])) < 3_000
    assert summary["rank_spread"]["nodes"]["slowest"]["host"] == SUMMARY_SIZE.host_of(300 * 8)


def test_nodes_holding_different_pipeline_stages_are_compared_for_what_they_do():
    # 4 nodes of 2 ranks, the pipeline's 2 stages across them: the nodes of the heavier
    # stage are busier by design, not slow (stage_imbalance speaks of that).
    ranks = [
        {
            "rank": r,
            "host": f"h{r // 2}",
            "step": 100.0,
            "comm_exposed": 50.0 if r < 4 else 25.0,
            "pipeline_stage": r // 4,
        }
        for r in range(8)
    ]
    assert rank_spread(ranks)["nodes"]["slowest"]["excess_ms"] == pytest.approx(0.0)
    ranks[1]["comm_exposed"] = 40.0  # (a rank of the lighter stage 10 ms busier than its peers)
    slowest = rank_spread(ranks)["nodes"]["slowest"]
    assert slowest["host"] == "h0" and slowest["excess_ms"] == pytest.approx(5.0)
