"""Boundaries and paths a mutation audit found untested: each test fails when one
threshold, term or guard of the model, the advice or the summary is changed."""

from __future__ import annotations

import pytest
from test_advice import _summary_from_rows, by_id, comm_heavy, ids
from test_advice import make_summary as advice_summary
from test_model import make_summary

from dtprofile.analysis.advice import advise
from dtprofile.analysis.advice.wording import round_up
from dtprofile.analysis.perf_model import alpha, two_level_allreduce_seconds
from dtprofile.analysis.phases import phases_from_summary
from dtprofile.analysis.projection import project_summary
from dtprofile.analysis.recommendations import recommend

approx = pytest.approx


# ----------------------------------------------------------------- the performance model and projection


def test_phases_without_compute_take_exposed_comm_out_of_the_step():
    s = make_summary(per_step_ms={"compute": None, "forward": None, "backward": None})
    ph = phases_from_summary(s)
    # compute = 100 - 2 (data) - 5 (exposed) = 93; scalable = 93 - 5 (optimizer)
    assert ph.scalable_ms == approx(88.0) and ph.hideable_ms == approx(15.0)


def test_num_workers_leave_the_transfer_to_the_device_out():
    s = make_summary(per_step_ms={"data_wait": 60.0, "data_transfer": 50.0})
    rec = recommend(s, project_summary(s))
    # the loader's own wait is 10 ms of a 100 ms step: ceil(10 / 90) + 1
    assert rec["num_workers_needed"] == 2


def test_data_wait_of_exactly_five_percent_is_sized():  # "at least 5%"
    s = make_summary(per_step_ms={"data_wait": 5.0})
    assert recommend(s, project_summary(s))["num_workers_needed"] == 2  # ceil(5/95) + 1


def test_two_level_bandwidth_unreachable_inside_one_node():
    s = make_summary(
        world_size=1,
        busbw_GBps=None,
        grad_bytes=4_000_000_000,
        per_step_ms={"comm_total": None, "comm_exposed": None},
        run={"hardware": {"pcie_GBps": 1.0}},
    )
    p = project_summary(s, gpus=[1, 8], nodes=1)  # 8 GPUs in one node: 7 s of PCIe traffic
    rec = recommend(s, p)
    assert rec["bandwidth_needed_reachable"] is False and rec["bandwidth_needed_Gbps"] is None


def test_r_o_falls_back_to_overhead_over_compute():
    p = project_summary(make_summary(ratios=None), gpus=[1, 2])
    assert p["R_O"] == approx(7.0 / 93.0)


# ----------------------------------------------------------------- the advice

DATA = dict(
    per_step_ms={"data_wait": 40.0, "compute": 59.5, "overhead": 40.5},
    ratios={"data_fraction": 0.4, "R_O": 40.5 / 59.5},
)


def test_transfer_over_half_the_wait_is_named():  # TRANSFER_BOUND_SHARE = 0.5
    s = advice_summary(
        per_step_ms={**DATA["per_step_ms"], "data_transfer": 25.0}, ratios=DATA["ratios"], run={"num_workers": 0}
    )
    assert by_id(advise(s), "data_bound")["action"].startswith(
        "the wait is in the batch's transfer to the device (25.0 ms"
    )


def test_enough_cores_means_no_more_cores_asked_for():
    s = advice_summary(**DATA, run={"num_workers": 0})  # needs 2, 8 cores: gets 2
    assert "would hide it fully" not in by_id(advise(s), "data_bound")["action"]


def test_data_bound_gain_with_workers_and_micro_batches():
    # m = 2, w0 = 2: busy 30, wait 20 per batch, t_load = 2 * 50 = 100; capped at 3 workers.
    # The loader's CPU time unknown, it is taken as all CPU: the 3 CPUs' pace, with taking
    # each batch over, is (100 + 1) / 3 ms a batch, two per step.
    s = advice_summary(**DATA, run={"num_workers": 2, "cpus_per_rank": 3.0, "micro_batches": 2})
    f = by_id(advise(s), "data_bound")
    assert "num_workers=3" in f["action"]
    assert f["expected_gain"].startswith("step 100.0 -> 67.3 ms")


def test_uneven_data_wait_needs_twice_the_others():
    def ranks(slow):
        return [{"rank": 0, "step": 100.0, "data_wait": 20.0}, {"rank": 1, "step": 100.0, "data_wait": slow}]

    s = advice_summary(**DATA, ranks=ranks(30.0))
    assert "slowest_rank" not in by_id(advise(s), "data_bound")["evidence"]
    s = advice_summary(**DATA, ranks=ranks(50.0))
    assert by_id(advise(s), "data_bound")["evidence"]["slowest_rank"] == 1


def test_round_up_never_rounds_down():
    assert [round_up(v) for v in (0.1484, 3.304, 17.2)] == ["0.15", "3.4", "18"]


def test_buffer_broadcast_named_from_a_quarter_of_the_wait():
    s = advice_summary(
        per_step_ms={
            "step": 100.0,
            "comm_total": 30.0,
            "comm_exposed": 25.0,
            "comm_buffers": 10.0,
            "compute": 74.0,
            "overhead": 26.0,
        },
        ratios={"comm_fraction": 0.25, "comm_overlap": 1 - 25 / 30},
    )
    assert "broadcast_buffers=False" in by_id(advise(s), "comm_bound")["action"]


def test_comm_bound_between_ten_and_twenty_percent_is_medium():
    s = advice_summary(
        per_step_ms={"comm_total": 20.0, "comm_exposed": 15.0, "compute": 84.0, "overhead": 16.0},
        ratios={"comm_fraction": 0.15},
    )
    assert by_id(advise(s), "comm_bound")["severity"] == "medium"


def test_memory_headroom_needs_twice_the_batch():
    assert "batch_headroom" not in ids(advise(advice_summary(device="cuda", recommendations={"max_batch_size": 48})))
    f = by_id(advise(advice_summary(device="cuda", recommendations={"max_batch_size": 64})), "batch_headroom")
    assert f["evidence"]["suggested_batch_size"] == 64


def test_comm_bound_batch_growth_capped_by_memory():
    s = comm_heavy()
    s.update(device="cuda", recommendations={"max_batch_size": 40})
    assert by_id(advise(s), "batch_headroom")["evidence"]["suggested_batch_size"] == 40


def test_batch_headroom_is_low_when_overhead_is_high():
    s = advice_summary(device="cuda", recommendations={"max_batch_size": 128}, ratios={"R_O": 0.15})
    assert by_id(advise(s), "batch_headroom")["severity"] == "low"


def test_straggler_excess_under_five_percent_of_the_step_is_noise():
    ranks = [{"rank": 0, "step": 100.0, "comm_exposed": 92.0}, {"rank": 1, "step": 100.0, "comm_exposed": 96.0}]
    assert "straggler" not in ids(advise(advice_summary(ranks=ranks)))  # 4 ms excess, 4% of the step


def test_few_cpus_are_not_underused():
    s = advice_summary(run={"torch_threads": 1, "cpus_per_rank": 3.0})
    assert "cpu_threads" not in ids(advise(s))


def test_host_work_from_ten_percent():
    s = advice_summary(per_step_ms={"compute": 98.5, "forward": 25.0, "backward": 56.5, "optimizer": 5.0})
    assert by_id(advise(s), "host_work")["evidence"]["share"] == approx(0.12)


# ----------------------------------------------------------------- report.py


def _rows(world, comm_total=20.0, comm_exposed=5.0):
    from dtprofile.summary import rank_row

    avg = {
        "step": 100.0,
        "data_wait": 2.0,
        "forward": 30.0,
        "backward": 50.0,
        "optimizer": 5.0,
        "comm_total": comm_total,
        "comm_exposed": comm_exposed,
        "compute": 93.0,
        "overhead": 7.0,
        "grad_bytes": 1e7,
    }
    return [rank_row(r, 30, avg, 0, {}) for r in range(world)]


def test_busbw_is_algbw_times_2_g_minus_1_over_g():
    s = _summary_from_rows(_rows(4))
    assert s["algbw_GBps"] == approx(0.5)  # 1e7 B in 20 ms
    assert s["busbw_GBps"] == approx(0.5 * 2 * 3 / 4)


def test_comm_overlap_is_the_hidden_share():
    assert _summary_from_rows(_rows(2))["ratios"]["comm_overlap"] == approx(0.75)  # 15 of 20 ms hidden


def test_serial_work_is_not_blamed_on_the_link():
    # Strong scaling to 64: the optimizer and host time cap efficiency (~0.25) while the
    # exposed all-reduce stays ~4% of the step: no bandwidth finding.
    s = advice_summary(options={"scaling": "strong"})
    assert "network_bandwidth" not in ids(advise(s))


def test_steps_profiled_is_the_fewest_any_rank_measured():
    rows = _rows(2)
    rows[1]["steps"] = 20
    assert _summary_from_rows(rows)["steps_profiled"] == 20


# ----------------------------------------------------------------- the what-if and the fallback summary


def _what_if_summary():
    # 2 ranks, 50 MB, 420 ms all-reduce on a 1 Gbit/s link: 20 ms fixed; NVLink inside nodes.
    return make_summary(
        grad_bytes=50_000_000,
        busbw_GBps=50e6 / 0.42 / 1e9,
        per_step_ms={"comm_total": 420.0},
        options={"link_bandwidth_Bps": 125e6},
        run={"hardware": {"nvlink_GBps": 100.0}},
    )


def test_two_level_what_if_keeps_the_fixed_part():
    p = project_summary(_what_if_summary(), gpus=[1, 16], nodes=2, bandwidth="1Gbps")
    assert p["fixed_comm_ms"] == approx(20.0)
    wire = 1e3 * two_level_allreduce_seconds(50e6, 2, 8, 100e9, 125e6)
    assert p["comm_ms"][1] == approx(wire + 20.0 * (15 / 16) / (1 / 2))


def test_two_level_bandwidth_needed_leaves_room_for_the_fixed_part():
    s = _what_if_summary()
    need = recommend(s, project_summary(s, gpus=[1, 16], nodes=2, bandwidth="1Gbps"))["bandwidth_needed_Gbps"]
    check = project_summary(s, gpus=[1, 16], nodes=2, bandwidth=f"{need}Gbps")
    assert check["efficiency"][1] == approx(0.8)


def test_two_level_projection_keeps_ddps_buffer_broadcast():
    hw = {"hardware": {"nic_Gbps": 10, "nvlink_GBps": 100}}
    plain = project_summary(make_summary(run=hw), gpus=[1, 16], nodes=2)
    bn = project_summary(make_summary(run=hw, per_step_ms={"comm_buffers": 4.0}), gpus=[1, 16], nodes=2)
    assert bn["comm_ms"][0] == 0.0 and bn["comm_ms"][1] == approx(plain["comm_ms"][1] + 4.0)


def test_bandwidth_needed_leaves_room_for_the_buffer_broadcast():
    s = make_summary(per_step_ms={"comm_buffers": 4.0})
    need = recommend(s, project_summary(s, gpus=[1, 8]))["bandwidth_needed_Gbps"]
    check = project_summary(s, gpus=[1, 8], bandwidth=need * 1e9 / 8)
    assert check["efficiency"][1] == approx(0.8)


def test_unanalysed_summary_uses_the_papers_r_o():  # engine's fallback when analysis fails
    from dtprofile.options import Options
    from dtprofile.summary import build_summary, rank_row

    avg = {
        "step": 100.0,
        "data_wait": 2.0,
        "forward": 30.0,
        "backward": 50.0,
        "optimizer": 5.0,
        "comm_total": 20.0,
        "comm_exposed": 5.0,
        "compute": 93.0,
        "overhead": 7.0,
        "grad_bytes": 1e7,
    }
    rows = [rank_row(r, 30, avg, 0, {}) for r in range(4)]
    meta = {
        "world_size": 4,
        "device": "cpu",
        "device_name": "cpu",
        "backend": "gloo",
        "steps_total": 35,
        "data_wait_source": "loader",
        "comm_source": "dtprofile",
        "timing": "perf_counter",
        "run": make_summary()["run"],
    }
    s = build_summary(rows, meta, Options(warmup_steps=5, project_gpus=(8,)), analyze=False)
    assert s["projection"]["alpha_paper"] == [approx(alpha(7 / 93 / 4, 8))]
