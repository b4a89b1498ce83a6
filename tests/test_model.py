"""Tests of the performance model, the projection and the recommendations
(dtprofile.analysis): numbers worked by hand, properties, projections, recommendations."""

from __future__ import annotations

import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtprofile.analysis import projection
from dtprofile.analysis.perf_model import (
    alpha,
    bandwidth_needed,
    min_parameter_servers,
    paper_r_o,
    parameter_server_seconds,
    parse_bandwidth,
    projected_speedup,
    ring_allreduce_seconds,
    two_level_allreduce_seconds,
)
from dtprofile.analysis.phases import StepPhases, project_phases
from dtprofile.analysis.projection import ASSUMED_BANDWIDTH_Bps, project_summary
from dtprofile.analysis.recommendations import recommend
from dtprofile.analysis.sizing import GradientNoiseScale, dataloader_workers_needed, max_batch_size

approx = pytest.approx


def make_summary(**overrides) -> dict:
    """A well-formed summary (docs/summary.md), 2 ranks, weak scaling, measured comm."""
    summary = {
        "schema": "dtprofile.summary/1",
        "complete": True,
        "device": "cpu",
        "world_size": 2,
        "steps_profiled": 100,
        "per_step_ms": {
            "step": 100.0,
            "data_wait": 2.0,
            "forward": 30.0,
            "backward": 50.0,
            "optimizer": 5.0,
            "comm_total": 20.0,
            "comm_exposed": 5.0,
            "compute": 93.0,
            "overhead": 7.0,
        },
        "ranks": [],
        "ratios": {"R_O": 7.0 / 93.0, "data_fraction": 0.02, "comm_fraction": 0.05, "comm_overlap": 0.75},
        "grad_bytes": 10_000_000,
        "algbw_GBps": 0.5,
        "busbw_GBps": 0.5,
        "run": {
            "batch_size": 32,
            "micro_batches": 1,
            "num_workers": 0,
            "cpus_per_rank": 4.0,
            "param_bytes": 10_000_000,
            "trainable_param_bytes": 10_000_000,
            "has_conv": False,
            "cudnn_benchmark": None,
            "memory": None,
            "gradient_noise": None,
            "hardware": {},
            "telemetry": None,
        },
        "options": {
            "target_efficiency": 0.8,
            "link_bandwidth_Bps": None,
            "scaling": "weak",
            "project_gpus": [1, 2, 4, 8, 16, 32, 64],
        },
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key] = {**summary[key], **value}
        else:
            summary[key] = value
    return summary


# --------------------------------------------------------------------------- alpha


def test_alpha_and_speedup_by_hand():
    # R_O = 0.25, G = 4: (1.25)/(1 + 1) = 0.625; speedup 2.5.
    assert alpha(0.25, 4) == approx(0.625)
    assert projected_speedup(0.25, 4) == approx(2.5)
    assert alpha(1.0, 3) == approx(0.5)  # 2 / 4
    assert alpha(0.5, 1) == 1.0
    assert alpha(0, 1000) == 1.0
    assert projected_speedup(0.0, 8) == approx(8.0)


@pytest.mark.parametrize(
    "r_o, gpus, name",
    [
        (-0.1, 2, "r_o"),
        (0.1, 0, "gpus"),
        (0.1, 0.5, "gpus"),
        (float("nan"), 2, "r_o"),
        (True, 2, "r_o"),
        ("0.1", 2, "r_o"),
    ],
)
def test_alpha_rejects(r_o, gpus, name):
    with pytest.raises(ValueError, match=name):
        alpha(r_o, gpus)
    with pytest.raises(ValueError, match=name):
        projected_speedup(r_o, gpus)


r_os = st.floats(min_value=0.0, max_value=1e3, allow_nan=False)
gpu_counts = st.floats(min_value=1.0, max_value=1e5, allow_nan=False)


@given(r_os, gpu_counts)
def test_alpha_in_unit_interval(r_o, g):
    a = alpha(r_o, g)
    assert 0.0 < a <= 1.0


@given(r_os, gpu_counts, gpu_counts)
def test_alpha_decreasing_in_gpus(r_o, g1, g2):
    lo, hi = sorted((g1, g2))
    assert alpha(r_o, hi) <= alpha(r_o, lo) * (1 + 1e-12)


@given(r_os, r_os, gpu_counts)
def test_alpha_decreasing_in_overhead(r1, r2, g):
    lo, hi = sorted((r1, r2))
    assert alpha(hi, g) <= alpha(lo, g) * (1 + 1e-12)


@given(st.floats(min_value=1e-6, max_value=1e3), gpu_counts)
def test_speedup_bounded(r_o, g):
    assert projected_speedup(r_o, g) <= (1 + r_o) / r_o * (1 + 1e-9)
    assert projected_speedup(r_o, g) <= g * (1 + 1e-12)


# --------------------------------------------------------------------------- cost models


def test_ring_by_hand():
    # 2*(4-1)/4 = 1.5 x 1 GB at 1 GB/s = 1.5 s; latency 1 ms x 2*3 steps = 6 ms.
    assert ring_allreduce_seconds(1e9, 4, 1e9) == approx(1.5)
    assert ring_allreduce_seconds(1e9, 4, 1e9, latency=1e-3) == approx(1.506)
    assert ring_allreduce_seconds(1e9, 2, 2e9) == approx(0.5)
    assert ring_allreduce_seconds(1e9, 1, 1e9, latency=1.0) == 0.0
    with pytest.raises(ValueError, match="bus_bandwidth"):
        ring_allreduce_seconds(1e9, 4, 0)
    with pytest.raises(ValueError, match="nbytes"):
        ring_allreduce_seconds(-1, 4, 1e9)
    with pytest.raises(ValueError, match="gpus"):
        ring_allreduce_seconds(1, 0, 1e9)


def test_two_level_by_hand():
    # 8 GB, 2 nodes x 8 GPUs, 100 GB/s NVLink, 12.5 GB/s (100 Gbit/s) network link:
    # intra 2*7/8*8/100 = 0.14 s; a link per node carries all 8 GB: inter 2*1/2*8/12.5 = 0.64 s.
    assert two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9) == approx(0.78)
    # A NIC per GPU carries one shard each: inter 2*1/2*(8/8)/12.5 = 0.08 s.
    assert two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9, link_per="gpu") == approx(0.22)
    # Latency: 2*(7 + 1) hops.
    assert two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9, latency=1e-3, link_per="gpu") == approx(0.236)
    with pytest.raises(ValueError, match="link_per must be one of"):
        two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9, link_per="rack")


def test_a_link_per_node_never_gets_cheaper_with_more_gpus_per_node():
    """4 nodes on a 1 Gbit/s link each: 4, 8 and 16 GPUs. Given to every GPU in full, the
    link made 16 GPUs' step cheaper than 4's; shared by a node's GPUs, it never does."""
    s = make_summary(
        world_size=1,
        busbw_GBps=None,
        grad_bytes=4e6,
        per_step_ms={"comm_total": None, "comm_exposed": None, "step": 10.0},
    )
    node = project_summary(s, gpus=[4, 8, 16], nodes=4, bandwidth="1Gbps")
    assert node["link_per"] == "node" and node["gpus_per_node"] == [1, 2, 4]
    assert node["step_ms"][0] <= node["step_ms"][1] <= node["step_ms"][2]
    gpu = project_summary(s, gpus=[4, 8, 16], nodes=4, bandwidth="1Gbps", link_per="gpu")
    assert gpu["step_ms"][2] < gpu["step_ms"][0]  # rail-optimised: each GPU's own NIC
    assert node["comm_ms"][0] == approx(gpu["comm_ms"][0])  # one GPU per node: the same link
    # The run's option decides when the call does not.
    s["options"]["link_bandwidth_per"] = "gpu"
    assert project_summary(s, gpus=[16], nodes=4, bandwidth="1Gbps")["link_per"] == "gpu"


@given(
    st.floats(min_value=0, max_value=1e10),
    st.integers(1, 64),
    st.floats(min_value=1e6, max_value=1e12),
    st.floats(min_value=1e6, max_value=1e12),
)
def test_two_level_reduces_to_ring(nbytes, g, b1, b2):
    assert two_level_allreduce_seconds(nbytes, 1, g, b1, b2) == approx(ring_allreduce_seconds(nbytes, g, b1))
    assert two_level_allreduce_seconds(nbytes, g, 1, b1, b2) == approx(ring_allreduce_seconds(nbytes, g, b2))


def test_parameter_server_by_hand():
    # 100 MB, 8 workers, 4 servers at 1 GB/s: 2*0.1*8/4 = 0.4 s.
    assert parameter_server_seconds(1e8, 8, 4, 1e9) == approx(0.4)
    # 16 servers: 0.1 s server side, worker side 2*0.1/1 = 0.2 s dominates.
    assert parameter_server_seconds(1e8, 8, 16, 1e9) == approx(0.1)
    assert parameter_server_seconds(1e8, 8, 16, 1e9, worker_bandwidth=1e9) == approx(0.2)
    with pytest.raises(ValueError, match="num_servers"):
        parameter_server_seconds(1e8, 8, 0, 1e9)


def test_min_parameter_servers_lemma():
    # Paper's setting: 180 MB, 8 GPUs, 1 Gbps servers, 250 ms compute:
    # 2*180e6*8/(1.25e8*0.25) = 92.16 -> 93.
    assert min_parameter_servers(180e6, 8, 1.25e8, 0.25) == 93
    # Exact integer stays put: 2*1e8*4/(1e9*0.2) = 4.
    assert min_parameter_servers(1e8, 4, 1e9, 0.2) == 4
    assert min_parameter_servers(1e8, 4, 1e9, 0.2, imbalance=1.5) == 6
    assert min_parameter_servers(0, 4, 1e9, 0.2) == 1
    # With that many servers, communication fits under compute.
    n = min_parameter_servers(180e6, 8, 1.25e8, 0.25)
    assert parameter_server_seconds(180e6, 8, n, 1.25e8) <= 0.25
    assert parameter_server_seconds(180e6, 8, n - 1, 1.25e8) > 0.25
    with pytest.raises(ValueError, match="imbalance"):
        min_parameter_servers(1e8, 4, 1e9, 0.2, imbalance=0.5)
    with pytest.raises(ValueError, match="compute_seconds"):
        min_parameter_servers(1e8, 4, 1e9, 0.0)


def test_bandwidth_needed_by_hand():
    # Weak scaling, no hiding: efficiency = T/(T + comm) >= 0.8 -> comm <= T/4.
    # 180 MB over 8 GPUs with T = 0.25 s: 2*7/8*180e6 / 0.0625 = 5.04e9 B/s.
    b = bandwidth_needed(180e6, 8, 0.25, 0.8)
    assert b == approx(5.04e9)
    assert 0.25 / (0.25 + ring_allreduce_seconds(180e6, 8, b)) == approx(0.8)
    # Hideable comm raises the budget: 0.0625 + 0.0625 -> half the bandwidth.
    assert bandwidth_needed(180e6, 8, 0.25, 0.8, hideable_seconds=0.0625) == approx(2.52e9)
    # Other overhead counts in the step: base 0.3, budget 0.075.
    assert bandwidth_needed(180e6, 8, 0.25, 0.8, other_overhead_seconds=0.05) == approx(3.15e8 / 0.075)
    # Latency eats the budget; unreachable -> inf.
    assert bandwidth_needed(180e6, 8, 0.25, 0.8, latency=0.01) == math.inf
    assert bandwidth_needed(180e6, 8, 0.25, 1.0) == math.inf
    assert bandwidth_needed(180e6, 1, 0.25, 0.8) == 0.0
    # Strong scaling: ideal = step(1)/G.
    assert bandwidth_needed(1e9, 2, 0.5, 0.8, ideal_seconds=0.5) == approx(1e9 / 0.125)
    with pytest.raises(ValueError, match="target_efficiency"):
        bandwidth_needed(1e9, 2, 0.5, 1.5)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25Gbps", 25e9 / 8),
        ("100 GB/s", 100e9),
        ("400Gb/s", 400e9 / 8),
        ("1gbit", 1e9 / 8),
        ("10 Gbit/s", 10e9 / 8),
        ("12.5GBps", 12.5e9),
        ("1 Tbps", 1e12 / 8),
        ("100 Mbps", 100e6 / 8),
        ("100mbps", 100e6 / 8),
        ("1000 kB/s", 1e6),
        ("2GB", 2e9),
        ("800 b/s", 100.0),
        ("1 GBIT", 1e9 / 8),
        (" 3.2 GB/s ", 3.2e9),
        (1.25e9, 1.25e9),
        (5, 5.0),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == approx(expected)


@pytest.mark.parametrize(
    "bad",
    [
        "-5Gbps",
        "0Gbps",
        "0",
        0,
        -1.0,
        float("nan"),
        float("inf"),
        "nan",
        "fast",
        "25G",
        "10",
        "1e9",
        "25 GiB/s",
        "",
        True,
        False,
        None,
        [1],
        "1e400 GB/s",
        "Gbps",
    ],
)
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ValueError, match="link_bandwidth") as info:
        parse_bandwidth(bad, "link_bandwidth")
    assert "Gbps" in str(info.value)  # names the accepted forms
    with pytest.raises(ValueError, match="bandwidth must be"):
        parse_bandwidth(bad)


# --------------------------------------------------------------------------- the refined projection


@given(
    st.floats(min_value=1.0, max_value=1e4),
    st.floats(min_value=0.0, max_value=1e4),
    st.floats(min_value=0.0, max_value=1e4),
    st.integers(1, 1024),
)
def test_refined_equals_paper_under_paper_assumptions(t_c, data, comm, g):
    # Strong scaling, measured on one device, no optimizer / serial part, constant T_O
    # (data wait not scaling, communication constant, nothing hidden).
    phases = StepPhases(scalable_ms=t_c, backward_ms=t_c / 2, data_wait_ms=data)
    p = project_phases(phases, [1, g], lambda _g: comm, "strong", data_wait_scales=False)
    r_o = (data + comm) / t_c
    assert p["speedup"][1] == approx(projected_speedup(r_o, g), rel=1e-9)
    assert p["efficiency"][1] == approx(alpha(r_o, g), rel=1e-9)
    assert p["step_ms"][1] == approx(t_c / g + data + comm)


def test_paper_equivalence_through_summary():
    # World size 1, strong scaling, optimizer 0, no data wait, communication free:
    # T_O = 0 -> R_O = 0 -> alpha = 1 everywhere and the refined model agrees.
    s = make_summary(
        world_size=1,
        per_step_ms={
            "step": 80.0,
            "data_wait": 0.0,
            "forward": 30.0,
            "backward": 50.0,
            "optimizer": 0.0,
            "comm_total": None,
            "comm_exposed": None,
            "compute": 80.0,
            "overhead": 0.0,
        },
        ratios={"R_O": 0.0},
        busbw_GBps=None,
    )
    p = project_summary(s, scaling="strong", bandwidth=1e30)
    assert p["speedup"] == approx(p["speedup_paper"], rel=1e-6)
    assert p["efficiency"] == approx(p["alpha_paper"], rel=1e-6)


def test_projection_reproduces_measured_step_weak():
    s = make_summary()
    p = project_summary(s)
    assert p["bandwidth_source"] == "measured"
    assert p["bandwidth_GBps"] == approx(0.5)
    i = p["gpus"].index(2)
    # busbw was derived from comm_total: the model returns the measured comm and step.
    assert p["comm_ms"][i] == approx(20.0)
    assert p["comm_exposed_ms"][i] == approx(5.0)
    assert p["step_ms"][i] == approx(100.0)
    # G = 1: no communication; 2 + 80 + 5 + other (93 - 85 = 8) = 95.
    assert p["comm_ms"][0] == 0.0
    assert p["step_ms"][0] == approx(95.0)
    assert p["efficiency"][0] == approx(1.0)
    assert p["speedup"][i] == approx(2 * 95.0 / 100.0)
    # Lists aligned with gpus.
    for key in ("alpha_paper", "speedup_paper", "step_ms", "speedup", "efficiency"):
        assert len(p[key]) == len(p["gpus"])
    # The paper's T_C is the global batch's compute on one device: 2 ranks x 93 ms.
    assert p["R_O_paper"] == approx(7 / 93 / 2)
    assert p["alpha_paper"][i] == approx(alpha(7 / 186, 2))
    # At the measured G it agrees with the refined model's efficiency (0.95) within 2%.
    assert p["alpha_paper"][i] == approx(p["efficiency"][i], rel=0.02)


def test_projection_keeps_ddps_buffer_broadcast_at_every_g_above_one():
    """4 ms of the 9 ms exposed are DDP's buffer broadcast (not in the bandwidth's time):
    the model rebuilds the measured step at G = 2, keeps the broadcast at larger G and
    has none at G = 1."""
    s = make_summary(
        per_step_ms={"step": 104.0, "comm_total": 24.0, "comm_exposed": 9.0, "comm_buffers": 4.0, "overhead": 11.0}
    )
    p = project_summary(s, gpus=[1, 2, 8])
    assert p["step_ms"][0] == approx(95.0) and p["comm_ms"][0] == 0.0
    assert p["step_ms"][1] == approx(104.0) and p["comm_ms"][1] == approx(24.0)
    plain = project_summary(make_summary(), gpus=[8])
    assert p["comm_ms"][2] == approx(plain["comm_ms"][0] + 4.0)
    # A what-if bandwidth leaves the broadcast out of the all-reduce's fixed part.
    link = make_summary(per_step_ms=s["per_step_ms"], options={"link_bandwidth_Bps": 1e9})
    assert project_summary(link, gpus=[2], bandwidth=1e9)["fixed_comm_ms"] == approx(
        project_summary(make_summary(options={"link_bandwidth_Bps": 1e9}), gpus=[2], bandwidth=1e9)["fixed_comm_ms"]
    )


def test_one_device_runs_its_passes_as_the_probes_that_took_turns():
    """On a shared host, one device's step is the summary's compute_alone_ms plus the data
    wait, however far the probes' passes (90 ms here) are from the average step's (80)."""
    s = make_summary(
        probe={
            "steps": 4,
            "alone_steps": 2,
            "passes_ms": 90.0,
            "passes_alone_ms": 45.0,
            "sharing_slowdown": 1.0,
            "compute_alone_ms": 93.0 - 0.5 * 90.0,
        }
    )
    p = project_summary(s, gpus=[1, 2])
    assert p["step_ms"][0] == approx(48.0 + 2.0)
    # Above one device the compute stays as measured beside the other ranks.
    assert p["step_ms"][1] == approx(100.0)


def test_projection_weak_by_hand_at_8():
    s = make_summary()
    p = project_summary(s, gpus=[1, 8])
    # ring at 8: 2*7/8 * 1e7 B / 5e8 B/s = 35 ms; hidden 15 -> exposed 20; step 95 + 20.
    assert p["comm_ms"][1] == approx(35.0)
    assert p["step_ms"][1] == approx(115.0)
    assert p["efficiency"][1] == approx(95.0 / 115.0)


def test_projection_strong_by_hand():
    s = make_summary()
    p = project_summary(s, gpus=[1, 2, 4], scaling="strong")
    assert p["scaling"] == "strong"
    # G'=1: batch factor 2: 2*(30+50) + 2*2 + 5 + 8 = 177, no comm.
    assert p["step_ms"][0] == approx(177.0)
    # G'=2 (measured): 100.
    assert p["step_ms"][1] == approx(100.0)
    # G'=4: factor 0.5: 40 + 1 + 5 + 8 = 54; comm 2*3/4*1e7/5e8 = 30 ms; hideable
    # min(15, 25) = 15 -> exposed 15; step 69.
    assert p["step_ms"][2] == approx(69.0)
    assert p["speedup"][2] == approx(177.0 / 69.0)
    assert p["efficiency"][2] == approx(177.0 / 69.0 / 4)


def test_weak_vs_strong_differ_and_strong_scales_worse():
    s = make_summary()
    weak = project_summary(s, gpus=[1, 64], scaling="weak")
    strong = project_summary(s, gpus=[1, 64], scaling="strong")
    assert strong["efficiency"][1] < weak["efficiency"][1]


def test_hideable_bounded_by_backward_in_strong():
    # hidden 15 ms but backward at G'=64 is 50 * 2/64 = 1.5625 ms: only that hides.
    s = make_summary()
    p = project_summary(s, gpus=[64], scaling="strong")
    assert p["hideable_ms"][0] == approx(50.0 * 2 / 64)


def test_bandwidth_what_if():
    s = make_summary()
    base = project_summary(s, gpus=[1, 8])
    fast = project_summary(s, gpus=[1, 8], bandwidth="40Gbps")  # 5 GB/s, 10x measured
    assert fast["bandwidth_source"] == "user"
    assert fast["bandwidth_GBps"] == approx(5.0)
    # comm 35 -> 3.5 ms, fully hidden (15 ms hideable): step back to 95.
    assert fast["comm_ms"][1] == approx(3.5)
    assert fast["step_ms"][1] == approx(95.0)
    assert fast["step_ms"][1] < base["step_ms"][1]
    assert fast["step_ms"][0] == base["step_ms"][0]  # G=1 unaffected
    slow = project_summary(s, gpus=[8], bandwidth=2.5e8)  # half: comm 70, exposed 55
    assert slow["step_ms"][0] == approx(150.0)
    with pytest.raises(ValueError, match="bandwidth"):
        project_summary(s, bandwidth="fast")


def test_bandwidth_sources():
    s = make_summary(world_size=1, busbw_GBps=None, per_step_ms={"comm_total": None, "comm_exposed": None})
    assert project_summary(s)["bandwidth_source"] == "assumed"
    assert project_summary(s)["bandwidth_GBps"] == approx(ASSUMED_BANDWIDTH_Bps / 1e9)
    s["run"]["hardware"] = {"nic_Gbps": 100}
    p = project_summary(s)
    assert (p["bandwidth_source"], p["bandwidth_GBps"]) == ("nic", approx(12.5))
    s["run"]["hardware"]["pcie_GBps"] = 25
    assert project_summary(s)["bandwidth_source"] == "nvml"
    s["run"]["hardware"]["nvlink_GBps"] = 300
    assert project_summary(s)["bandwidth_GBps"] == approx(300)
    s["options"]["link_bandwidth_Bps"] = 3e9
    p = project_summary(s)
    assert (p["bandwidth_source"], p["bandwidth_GBps"]) == ("user", approx(3.0))
    # Measured wins over the option when world_size >= 2 ...
    s2 = make_summary(options={"link_bandwidth_Bps": 3e9})
    assert project_summary(s2)["bandwidth_source"] == "measured"
    # ... and the explicit what-if wins over measured.
    assert project_summary(s2, bandwidth=3e9)["bandwidth_source"] == "user"


def test_world_size_one_has_no_measured_bandwidth_and_no_comm_at_one():
    s = make_summary(world_size=1, busbw_GBps=0.5, per_step_ms={"comm_total": None, "comm_exposed": None, "step": 95.0})
    p = project_summary(s, gpus=[1, 2])
    assert p["bandwidth_source"] == "assumed"  # busbw ignored at world_size 1
    assert p["step_ms"][0] == approx(95.0)
    # Nothing known hidden: all 2*1/2*1e7/1.25e9 = 8 ms exposed.
    assert p["step_ms"][1] == approx(103.0)


def test_two_level_projection():
    s = make_summary(
        world_size=1,
        busbw_GBps=None,
        per_step_ms={"comm_total": None, "comm_exposed": None, "step": 95.0},
        run={"hardware": {"nvlink_GBps": 100.0, "nic_Gbps": 100.0}},
    )
    p = project_summary(s, gpus=[1, 8, 16], nodes=2)
    assert p["model"] == "two_level"
    assert p["bandwidth_source"] == "nic"  # inter-node link
    assert p["intra_bandwidth_GBps"] == approx(100.0)
    assert p["gpus_per_node"] == [1, 4, 8]
    assert p["nodes_used"] == [1, 2, 2]
    expected = two_level_allreduce_seconds(1e7, 2, 8, 100e9, 12.5e9) * 1e3
    assert p["comm_ms"][2] == approx(expected)
    assert p["comm_ms"][0] == 0.0


def test_two_level_projection_places_exactly_g_gpus():
    # 8 and 16 GPUs over at most 3 nodes: 2 nodes of 4 and of 8, never 3 x 3 = 9 or 3 x 6.
    s = make_summary(
        world_size=1, busbw_GBps=None, per_step_ms={"comm_total": None, "comm_exposed": None, "step": 95.0}
    )
    p = project_summary(s, gpus=[1, 2, 4, 7, 8, 16, 24], nodes=3)
    assert p["nodes_used"] == [1, 2, 2, 1, 2, 2, 3]
    assert p["gpus_per_node"] == [1, 1, 2, 7, 4, 8, 8]
    assert [n * g for n, g in zip(p["nodes_used"], p["gpus_per_node"], strict=False)] == p["gpus"]
    expected = two_level_allreduce_seconds(1e7, 2, 4, 25e9, 1.25e9) * 1e3
    assert p["comm_ms"][4] == approx(expected)
    # No NVLink or PCIe figure: the intra-node link is assumed, and the projection says so.
    assert p["intra_bandwidth_source"] == "assumed"
    assert p["intra_bandwidth_GBps"] == approx(projection.DEFAULT_INTRA_NODE_BANDWIDTH_Bps / 1e9)


def test_seed_alexnet_example_cannot_scale_on_1gbps():
    # ~180 MB of parameters, 1 Gbps Ethernet, AlexNet-ish 250 ms compute per step.
    s = make_summary(
        world_size=1,
        grad_bytes=180_000_000,
        busbw_GBps=None,
        per_step_ms={
            "step": 250.0,
            "data_wait": 0.0,
            "forward": 80.0,
            "backward": 160.0,
            "optimizer": 10.0,
            "comm_total": None,
            "comm_exposed": None,
            "compute": 250.0,
            "overhead": 0.0,
        },
        ratios={"R_O": 0.0},
    )
    p = project_summary(s, gpus=[1, 2, 4, 8], bandwidth="1Gbps")
    # ring at 8: 2*7/8*180e6/1.25e8 = 2.52 s vs 0.25 s compute.
    assert p["comm_ms"][3] == approx(2520.0)
    assert p["efficiency"][3] == approx(250.0 / 2770.0)
    assert p["efficiency"][3] < 0.1
    rec = recommend(s, p)
    assert rec["gpus"] == 1
    # The paper's lemma for a parameter-server deployment at 8 GPUs on 1 Gbps servers:
    # 2*180e6*8/(1.25e8*0.25) = 92.16 -> 93 servers.
    assert rec["num_parameter_servers_at_gpus"] == 8
    assert rec["num_parameter_servers"] == 93
    assert rec["bandwidth_needed_at_gpus"] == 8
    # 2*7/8*180e6 B / 62.5 ms = 5.04 GB/s = 40.3 Gbit/s.
    assert rec["bandwidth_needed_Gbps"] == approx(40.32)
    assert rec["bandwidth_needed_Gbps"] > 30  # far beyond 1 Gbps
    # With that bandwidth the target is met.
    better = project_summary(s, gpus=[1, 8], bandwidth=rec["bandwidth_needed_Gbps"] * 1e9 / 8)
    assert better["efficiency"][1] == approx(0.8)


def test_projection_nulls():
    empty = {"per_step_ms": {k: None for k in ("step", "data_wait", "forward")}, "options": {}, "run": None}
    p = project_summary(empty)
    assert p["step_ms"] == [None] * 7
    assert p["alpha_paper"] == [None] * 7
    # Step known but no bytes: G=1 known, G>1 unknown.
    s = make_summary(grad_bytes=None, run={"trainable_param_bytes": None, "param_bytes": 0})
    p = project_summary(s, gpus=[1, 2])
    assert p["step_ms"][0] == approx(95.0)
    assert p["step_ms"][1] is None and p["efficiency"][1] is None


def test_projection_validates_arguments():
    s = make_summary()
    with pytest.raises(ValueError, match="scaling"):
        project_summary(s, scaling="diagonal")
    with pytest.raises(ValueError, match="gpus"):
        project_summary(s, gpus=[0, 2])


# --------------------------------------------------------------------------- recommendations


def test_recommend_by_hand():
    s = make_summary()
    p = project_summary(s, gpus=[1, 2, 4, 8, 16, 32, 64])
    rec = recommend(s, p)
    effs = dict(zip(p["gpus"], p["efficiency"], strict=False))
    assert rec["gpus"] == max(g for g, e in effs.items() if e >= 0.8)
    assert rec["target_efficiency"] == 0.8
    assert rec["bandwidth_needed_at_gpus"] == 64
    # At 64 (weak): base 95, hideable 15, budget 15 + 95/0.8 - 95 = 38.75 ms;
    # 2*63/64*1e7 B / 38.75 ms.
    needed_Bps = 2 * 63 / 64 * 1e7 / 0.03875
    assert rec["bandwidth_needed_Gbps"] == approx(needed_Bps * 8 / 1e9)
    check = project_summary(s, gpus=[1, 64], bandwidth=needed_Bps)
    assert check["efficiency"][1] == approx(0.8)
    # Lemma at the recommended G with the measured bandwidth and compute 93 ms.
    assert rec["num_parameter_servers"] == min_parameter_servers(1e7, rec["gpus"], 5e8, 0.093)
    assert rec["max_batch_size"] is None  # CPU
    assert rec["num_workers"] == 0  # data wait 2% is hidden already: keep the setting
    assert rec["critical_batch_size"] is None


def test_recommend_strong_bandwidth_needed_meets_target():
    s = make_summary()
    p = project_summary(s, gpus=[1, 4], scaling="strong")
    rec = recommend(s, p)
    assert rec["bandwidth_needed_reachable"] is True
    check = project_summary(s, gpus=[1, 4], scaling="strong", bandwidth=rec["bandwidth_needed_Gbps"] * 1e9 / 8)
    assert check["efficiency"][1] == approx(0.8)


def test_recommend_strong_unreachable_at_8():
    # Strong scaling to 8: step(1) = 177 ms, ideal 22.1 ms; the serial part alone
    # (fwd+bwd 20 + data 0.5 + optimizer 5 + other 8 = 33.5 ms) misses 22.1/0.8 = 27.7.
    s = make_summary()
    p = project_summary(s, gpus=[1, 8], scaling="strong")
    rec = recommend(s, p)
    assert rec["bandwidth_needed_reachable"] is False
    assert rec["bandwidth_needed_Gbps"] is None
    assert bandwidth_needed(1e7, 8, 0.0335, 0.8, ideal_seconds=0.177 / 8) == math.inf


def test_recommend_two_level_bandwidth_needed_meets_target():
    s = make_summary(
        world_size=1,
        busbw_GBps=None,
        per_step_ms={"comm_total": None, "comm_exposed": None, "step": 95.0},
        grad_bytes=400_000_000,
        run={"hardware": {"nvlink_GBps": 100.0}},
    )
    p = project_summary(s, gpus=[1, 16], nodes=2)
    rec = recommend(s, p)
    assert rec["bandwidth_needed_Gbps"] is not None
    check = project_summary(s, gpus=[1, 16], nodes=2, bandwidth=rec["bandwidth_needed_Gbps"] * 1e9 / 8)
    assert check["efficiency"][1] == approx(0.8)


def test_recommend_names_no_gpu_count_for_a_bandwidth_it_did_not_find():
    # Nothing measured (a 1-step run): no bandwidth figure, so no G it would be "at".
    s = make_summary(
        per_step_ms={k: None for k in ("step", "data_wait", "forward", "backward", "optimizer", "compute", "overhead")}
    )
    rec = recommend(s, project_summary(s))
    assert rec["bandwidth_needed_Gbps"] is None and rec["bandwidth_needed_reachable"] is None
    assert rec["bandwidth_needed_at_gpus"] is None


def test_max_batch_size_by_hand():
    # per sample (10 - 2)/32 GB = 0.25 GB; (72 - 2)/0.25 = 280.
    assert max_batch_size(10e9, 2e9, 80e9, 32) == 280
    assert max_batch_size(2e9, 2e9, 80e9, 32) is None
    s = make_summary(device="cuda", run={"memory": {"peak_bytes": 10e9, "static_bytes": 2e9, "total_bytes": 80e9}})
    assert recommend(s, project_summary(s))["max_batch_size"] == 280
    s["device"] = "cpu"
    assert recommend(s, project_summary(s))["max_batch_size"] is None


def test_num_workers_by_hand():
    # Main-process loading 30 ms per 20 ms of compute: 2 workers + 1 margin.
    assert dataloader_workers_needed(30.0, 50.0, 0) == 3
    # Two workers, still 10 ms waiting per 20 ms busy: t_load = 2*30 = 60 ms -> 3 + 1.
    assert dataloader_workers_needed(10.0, 30.0, 2) == 4
    # Two micro-batches per step: per batch 15 ms wait, 10 ms busy -> ceil(1.5) + 1.
    assert dataloader_workers_needed(30.0, 50.0, 0, micro_batches=2) == 3
    s = make_summary(per_step_ms={"data_wait": 60.0, "step": 100.0}, ratios={"data_fraction": 0.6})
    rec = recommend(s, project_summary(s))
    assert rec["num_workers_needed"] == 3  # ceil(60/40) + 1
    assert rec["num_workers"] == 3
    s["run"]["cpus_per_rank"] = 2.5
    assert recommend(s, project_summary(s))["num_workers"] == 2  # capped by floor(2.5)
    s["run"]["cpus_per_rank"] = 0.5
    # Half a CPU, and a loader taken as all CPU: no worker would shorten the step.
    rec = recommend(s, project_summary(s))
    assert rec["num_workers"] == 0 and rec["num_workers_step_ms"] == 100.0


def test_critical_batch_size():
    s = make_summary(
        run={"gradient_noise": {"B_simple": 512.0, "grad_sq_norm": 1.0, "trace_sigma": 512.0, "samples": 10}}
    )
    assert recommend(s, project_summary(s))["critical_batch_size"] == 512.0


def test_recommend_all_null():
    rec = recommend({}, project_summary({}))
    assert all(
        rec[k] is None
        for k in (
            "gpus",
            "num_parameter_servers",
            "bandwidth_needed_Gbps",
            "max_batch_size",
            "num_workers",
            "critical_batch_size",
        )
    )


# --------------------------------------------------------------------------- gradient noise


def test_gradient_noise_scale_by_hand():
    gns = GradientNoiseScale()
    assert gns.value is None
    assert gns.to_dict() == {"B_simple": None, "grad_sq_norm": None, "trace_sigma": None, "samples": 0}
    # b = 32, B = 64, |G_b|^2 = 2, |G_B|^2 = 1.5: |G|^2 = (96 - 64)/32 = 1,
    # S = 0.5 / (1/32 - 1/64) = 32.
    gns.update(2.0, 1.5, 32, 64)
    assert gns.grad_sq_norm == approx(1.0)
    assert gns.trace_sigma == approx(32.0)
    assert gns.value == approx(32.0)
    assert gns.to_dict()["samples"] == 1


def test_gradient_noise_scale_ema_before_ratio():
    gns = GradientNoiseScale(beta=0.5)
    gns.update(2.0, 1.5, 32, 64)  # |G|^2 = 1, S = 32
    gns.update(4.0, 2.0, 32, 64)  # |G|^2 = (128 - 128)/32 = 0, S = 2/(1/64) = 128
    # Bias-corrected EMAs: weights 1/3, 2/3 (0.25 and 0.5 over 0.75).
    assert gns.grad_sq_norm == approx(1 / 3)
    assert gns.trace_sigma == approx(32 / 3 + 128 * 2 / 3)
    assert gns.value == approx((32 / 3 + 256 / 3) / (1 / 3))  # ratio of EMAs, 288


def test_gradient_noise_scale_edge_cases():
    gns = GradientNoiseScale()
    gns.update(3.0, 1.5, 32, 64)  # |G|^2 = 0 -> None
    assert gns.value is None
    gns2 = GradientNoiseScale()
    gns2.update(float("nan"), 1.0, 32, 64)  # skipped (AMP overflow)
    assert gns2.samples == 0
    with pytest.raises(ValueError, match="global_batch"):
        gns2.update(1.0, 1.0, 32, 32)
    with pytest.raises(ValueError, match="beta"):
        GradientNoiseScale(beta=1.0)


@settings(max_examples=50)
@given(
    st.floats(min_value=0.1, max_value=100.0),
    st.floats(min_value=1.0, max_value=1e4),
    st.integers(1, 64),
    st.integers(2, 16),
)
def test_gradient_noise_scale_recovers_noise_model(grad_sq, trace, b, g):
    # Noise-free expectations: E|G_b|^2 = |G|^2 + tr(Sigma)/b.
    big_b = b * g
    gns = GradientNoiseScale()
    for _ in range(5):
        gns.update(grad_sq + trace / b, grad_sq + trace / big_b, b, big_b)
    assert gns.value == approx(trace / grad_sq, rel=1e-6)


def test_what_if_bandwidth_keeps_the_fixed_part_of_measured_comm():
    # 10 MB over a 1 Gbit/s link (125e6 B/s), G=2: the wire explains 2*1/2*10e6/125e6 = 80 ms;
    # the run measured 100 ms, so 20 ms do not depend on bandwidth (F).
    summary = make_summary(per_step_ms={"comm_total": 100.0}, options={"link_bandwidth_Bps": 125e6})
    what_if = project_summary(summary, gpus=[2], bandwidth="2Gbps")
    assert what_if["fixed_comm_ms"] == approx(20.0)
    # At 2 Gbit/s: 40 ms of wire + the 20 ms fixed part.
    assert what_if["comm_ms"][0] == approx(60.0)
    # The measured bandwidth itself (no what-if) already contains F: nothing is added.
    assert project_summary(summary, gpus=[2])["fixed_comm_ms"] == 0.0
    # Without knowing the run's link rate, F cannot be separated from the wire time.
    plain = make_summary(per_step_ms={"comm_total": 100.0})
    assert project_summary(plain, gpus=[2], bandwidth="2Gbps")["fixed_comm_ms"] == 0.0


def test_what_if_at_the_runs_own_link_projects_what_the_measurement_does():
    """The fixed part of the all-reduce scales like the ring's traffic, not per hop: a
    what-if at the link the run used reproduces the measured projection at every G, and
    a faster link never projects slower (it did: 7.1 s at G = 64 for 1 Gbit/s, 6.4 s for
    10 Gbit/s, against 0.98 s without a what-if)."""
    # 2 ranks, 50 MB, 420 ms all-reduce on a 1 Gbit/s link: the wire explains 400 ms.
    s = make_summary(
        grad_bytes=50_000_000,
        busbw_GBps=50e6 / 0.42 / 1e9,
        per_step_ms={"comm_total": 420.0},
        options={"link_bandwidth_Bps": 125e6},
    )
    gpus = [2, 8, 64]
    measured = project_summary(s, gpus=gpus)
    same = project_summary(s, gpus=gpus, bandwidth="1Gbps")
    faster = project_summary(s, gpus=gpus, bandwidth="10Gbps")
    assert same["fixed_comm_ms"] == approx(20.0)
    assert same["comm_ms"] == approx(measured["comm_ms"])
    # G = 64: 2*63/64 of the 50 MB on the wire (787.5 ms at 1 Gbit/s) + 20 ms * (63/64)/(1/2).
    assert same["comm_ms"][2] == approx(787.5 + 39.375)
    assert all(f < m for f, m in zip(faster["comm_ms"], measured["comm_ms"], strict=False))
    # The bandwidth needed at G = 8 leaves room for that fixed part: plugged back in, it
    # reaches the target exactly.
    at8 = project_summary(s, gpus=[1, 8], bandwidth="1Gbps")
    need = recommend(s, at8)["bandwidth_needed_Gbps"]
    check = project_summary(s, gpus=[1, 8], bandwidth=f"{need}Gbps")
    assert check["fixed_comm_ms"] == approx(20.0)
    assert check["efficiency"][1] == approx(0.8)


def test_bandwidth_needed_subtracts_the_fixed_part():
    # 2*7/8*180e6 B in 62.5 ms of budget: 5.04 GB/s; 12.5 ms fixed leaves 50 ms: 6.3 GB/s.
    assert bandwidth_needed(180e6, 8, 0.25, 0.8) == approx(5.04e9)
    assert bandwidth_needed(180e6, 8, 0.25, 0.8, fixed_seconds=0.0125) == approx(6.3e9)
    assert bandwidth_needed(180e6, 8, 0.25, 0.8, fixed_seconds=0.0625) == math.inf


def test_paper_r_o_takes_the_global_batch_on_one_device():
    """8 ranks, 80 ms compute, 20 ms exposed (R_O 0.25 per rank): the paper's alpha at
    the measured G is (1 + 0.25/8)/(1 + 0.25) = 0.825, not alpha(0.25, 8) = 0.417."""
    assert paper_r_o(0.25, 8) == approx(0.03125)
    assert paper_r_o(0.25, 1) == 0.25
    with pytest.raises(ValueError, match="measured_gpus"):
        paper_r_o(0.25, 0)
    s = make_summary(
        world_size=8,
        per_step_ms={
            "step": 100.0,
            "data_wait": 0.0,
            "forward": 30.0,
            "backward": 45.0,
            "optimizer": 5.0,
            "comm_total": 20.0,
            "comm_exposed": 20.0,
            "compute": 80.0,
            "overhead": 20.0,
        },
        ratios={"R_O": 0.25},
    )
    p = project_summary(s, gpus=[1, 8])
    assert p["R_O"] == 0.25 and p["R_O_paper"] == approx(0.03125)
    assert p["alpha_paper"] == approx([1.0, 0.825])
    assert p["speedup_paper"][1] == approx(8 * 0.825)
    one = project_summary(make_summary(world_size=1, ratios={"R_O": 0.25}), gpus=[4])
    assert one["alpha_paper"] == approx([0.625])


def test_parameter_servers_use_the_network_not_nvlink():
    """A one-GPU run whose NVML reports 450 GB/s of NVLink and a 1 Gbit/s NIC: servers are
    reached over the NIC (738 of them for 180 MB at 64 GPUs), not NVLink (1)."""
    s = make_summary(
        world_size=1,
        grad_bytes=180_000_000,
        busbw_GBps=None,
        per_step_ms={
            "step": 250.0,
            "data_wait": 0.0,
            "forward": 80.0,
            "backward": 160.0,
            "optimizer": 10.0,
            "comm_total": None,
            "comm_exposed": None,
            "compute": 250.0,
            "overhead": 0.0,
        },
        ratios={"R_O": 0.0},
        run={"hardware": {"nvlink_GBps": 450.0, "nic_Gbps": 1.0}},
    )
    p = project_summary(s)
    assert p["bandwidth_source"] == "nvml"  # the ring inside a node still uses NVLink
    rec = recommend(s, p)
    assert rec["num_parameter_servers_bandwidth_source"] == "nic"
    assert rec["num_parameter_servers_bandwidth_Gbps"] == approx(1.0)
    g = rec["num_parameter_servers_at_gpus"]
    compute_s = p["compute_ms"][p["gpus"].index(g)] / 1e3
    assert rec["num_parameter_servers"] == min_parameter_servers(180e6, g, 1.25e8, compute_s)
    assert rec["num_parameter_servers"] > 100


def test_parameter_servers_flag_a_tensor_too_large_for_one_server():
    """Servers hold whole tensors: a 100 MB embedding of a 180 MB model, 8 GPUs on
    1 Gbit/s, 250 ms of compute: one server's budget is 1.25e8*0.25/16 = 1.95 MB, so the
    embedding alone needs 51x it; a model of small tensors splits evenly."""
    base = dict(
        world_size=1,
        grad_bytes=180_000_000,
        busbw_GBps=None,
        ratios={"R_O": 0.0},
        per_step_ms={
            "step": 250.0,
            "data_wait": 0.0,
            "forward": 80.0,
            "backward": 160.0,
            "optimizer": 10.0,
            "comm_total": None,
            "comm_exposed": None,
            "compute": 250.0,
            "overhead": 0.0,
        },
    )
    big = make_summary(run={"largest_trainable_param_bytes": 100_000_000, "trainable_param_bytes": 180_000_000}, **base)
    rec = recommend(big, project_summary(big, gpus=[1, 8], bandwidth="1Gbps"))
    assert rec["num_parameter_servers"] == 93
    assert rec["num_parameter_servers_largest_tensor_share"] == approx(100e6 / (1.25e8 * 0.25 / 16))
    assert rec["num_parameter_servers_imbalance"] == approx(100e6 * 93 / 180e6)
    small = make_summary(run={"largest_trainable_param_bytes": 1_000_000, "trainable_param_bytes": 180_000_000}, **base)
    rec = recommend(small, project_summary(small, gpus=[1, 8], bandwidth="1Gbps"))
    assert rec["num_parameter_servers_largest_tensor_share"] < 1
    assert rec["num_parameter_servers_imbalance"] == 1.0
    # Gradients crossing in bf16 (grad_bytes halved): the tensor is halved on the wire too.
    bf16 = make_summary(
        run={"largest_trainable_param_bytes": 100_000_000, "trainable_param_bytes": 180_000_000},
        **dict(base, grad_bytes=90_000_000),
    )
    rec = recommend(bf16, project_summary(bf16, gpus=[1, 8], bandwidth="1Gbps"))
    assert rec["num_parameter_servers_largest_tensor_share"] == approx(50e6 / (1.25e8 * 0.25 / 16))
    # A summary without the tensors' sizes (before 0.5) claims nothing about them.
    old = make_summary(**base)
    old["run"].pop("trainable_param_bytes")
    old["run"]["param_bytes"] = None
    assert (
        recommend(old, project_summary(old, gpus=[1, 8], bandwidth="1Gbps"))[
            "num_parameter_servers_largest_tensor_share"
        ]
        is None
    )


# --------------------------------------------------------------------------- the old module path


def test_the_old_module_path_re_exports_the_analysis():
    """dtprofile.model keeps every name it offered for a release, as the same objects."""
    with warnings.catch_warnings():  # (deprecated: tests/test_public_surface.py)
        warnings.simplefilter("ignore", DeprecationWarning)
        import dtprofile.model as old
    from dtprofile import _values
    from dtprofile.analysis import perf_model, phases, recommendations, sizing, summary_readers

    new = {}
    for module in (perf_model, phases, projection, recommendations, sizing):
        new.update({name: getattr(module, name) for name in module.__all__})
    assert old.__all__ and all(getattr(old, name) is new[name] for name in old.__all__)
    assert old.BANDWIDTH_UNIT_FORMS is perf_model.BANDWIDTH_UNIT_FORMS
    assert old.critical_batch_size is sizing.critical_batch_size and old.GNS_MIN_SAMPLES == 10
    assert (old._num, old._get, old._is_number) == (_values.finite, _values.get, _values.is_number)
    assert (old._r_o, old._world_size) == (summary_readers.overhead_ratio, summary_readers.world_size)


def test_the_old_compare_path_re_exports_the_comparison():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import dtprofile.compare as old
    from dtprofile.analysis import compare

    assert old.__all__ and all(getattr(old, name) is getattr(compare, name) for name in old.__all__)
    assert old.MEANING_CHANGES is compare.MEANING_CHANGES


def test_projection_what_if_batch_scales_forward_backward_and_data_wait():
    s = {
        "world_size": 1,
        "grad_bytes": 1e6,
        "run": {"batch_size": 32},
        "per_step_ms": {
            "step": 100.0,
            "compute": 80.0,
            "forward": 30.0,
            "backward": 40.0,
            "optimizer": 10.0,
            "data_wait": 20.0,
            "overhead": 20.0,
        },
    }
    as_run = project_summary(s, gpus=[1])
    doubled = project_summary(s, gpus=[1], batch=64)
    assert doubled["batch_size"] == 64
    # forward + backward + data wait (90 ms) twice over; the optimizer step (10 ms) as it was.
    assert doubled["step_ms"][0] - as_run["step_ms"][0] == pytest.approx(90.0)
    with pytest.raises(ValueError, match="^batch"):
        project_summary({**s, "run": {}}, gpus=[1], batch=64)
    with pytest.raises(ValueError, match="batch"):
        project_summary(s, gpus=[1], batch=0)


def test_a_run_over_nodes_projects_over_nodes_like_its_own():
    """16 ranks, 8 a node (LOCAL_WORLD_SIZE), 1e7 bytes, busbw 0.5 GB/s measured, NVLink
    100 GB/s: the two-level model over nodes of 8 by default, its inter-node link fitted so
    that the run's own count gets the measured all-reduce (ring at busbw: 37.5 ms), and 32
    ranks 4 nodes of 8 from there. An explicit nodes still wins."""
    s = make_summary(world_size=16, run={"ranks_per_host": 8, "hardware": {"nvlink_GBps": 100.0}})
    p = project_summary(s, gpus=[8, 16, 32])
    assert p["model"] == "two_level" and p["nodes_source"] == "local_world_size" and p["nodes"] is None
    assert p["measured_nodes"] == {"nodes": 2, "ranks_per_node": 8, "source": "local_world_size"}
    assert (p["nodes_used"], p["gpus_per_node"]) == ([1, 2, 4], [8, 8, 8])
    intra_s = 2 * 7 / 8 * 1e7 / 100e9  # 0.175 ms
    inter_Bps = 2 * 1 / 2 * 1e7 / (2 * 15 / 16 * 1e7 / 0.5e9 - intra_s)  # the link that gives 37.5 ms at 2 x 8
    assert p["bandwidth_fitted_to_nodes"] and p["bandwidth_GBps"] == approx(inter_Bps / 1e9)
    assert p["comm_ms"][1] == approx(37.5)
    assert p["comm_ms"][2] == approx(1e3 * (intra_s + 2 * 3 / 4 * 1e7 / inter_Bps))
    assert p["comm_ms"][0] == approx(1e3 * intra_s)
    user = project_summary(s, gpus=[8, 16, 32], nodes=3)
    assert user["nodes_source"] == "user" and user["gpus_per_node"] == [4, 8, 16]
    assert "bandwidth_fitted_to_nodes" not in user


def test_the_nodes_come_from_the_hosts_where_known_and_one_node_stays_a_ring():
    hosts = {"source": "hosts", "count": 4, "ranks_per_node": 2}
    s = make_summary(world_size=8, rank_spread={"nodes": hosts}, run={"ranks_per_host": 8})
    p = project_summary(s, gpus=[4, 8, 16], gpus_per_node=4)  # (an explicit size a node wins)
    assert p["nodes_source"] == "hosts" and p["measured_nodes"]["nodes"] == 4
    assert (p["nodes_used"], p["gpus_per_node"]) == ([1, 2, 4], [4, 4, 4])
    one = project_summary(make_summary(world_size=8, run={"ranks_per_host": 8}), gpus=[8, 16])
    assert one["model"] == "ring" and one["nodes_source"] is None and one["measured_nodes"] is None
