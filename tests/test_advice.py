"""Tests of the advice (dtprofile.analysis.advice) with synthetic summaries."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtprofile.analysis import projection
from dtprofile.analysis.advice import (
    SEVERITY_ORDER,
    Finding,
    advise,
    analyze,
    format_findings,
    registry,
    rules,
    thresholds,
)
from dtprofile.analysis.sizing import SHM_COPY_BYTES_PER_S, WORKER_HANDOFF_MS, WORKER_SEND_MS, _stretch, loader_plan
from dtprofile.render import format_report

REQUIRED_KEYS = {"id", "severity", "title", "evidence", "action", "expected_gain"}


def make_summary(**overrides) -> dict:
    """A healthy, compute-bound 2-rank CPU run; override what a test needs."""
    summary = {
        "schema": "dtprofile.summary/1",
        "complete": True,
        "device": "cpu",
        "backend": "gloo",
        "world_size": 2,
        "steps_profiled": 100,
        "steps_total": 105,
        "per_step_ms": {
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 30.0,
            "backward": 60.0,
            "optimizer": 5.0,
            "comm_total": 2.0,
            "comm_exposed": 0.5,
            "compute": 98.5,
            "overhead": 1.5,
        },
        "ranks": [
            {
                "rank": 0,
                "steps": 100,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 60.0,
                "optimizer": 5.0,
                "comm_total": 2.0,
                "comm_exposed": 0.6,
                "compute": 98.4,
                "overhead": 1.6,
            },
            {
                "rank": 1,
                "steps": 100,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.5,
                "backward": 61.0,
                "optimizer": 5.0,
                "comm_total": 2.0,
                "comm_exposed": 0.4,
                "compute": 98.6,
                "overhead": 1.4,
            },
        ],
        "ratios": {"R_O": 1.5 / 98.5, "data_fraction": 0.01, "comm_fraction": 0.005, "comm_overlap": 0.75},
        "grad_bytes": 10_000_000,
        "algbw_GBps": 5.0,
        "busbw_GBps": 10.0,
        "probe": None,
        "run": {
            "batch_size": 32,
            "micro_batches": 1,
            "num_workers": 2,
            "cpus_per_rank": 8.0,
            "param_bytes": 10_000_000,
            "trainable_param_bytes": 10_000_000,
            "optimizer_state_bytes": 0,
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
            "every_n_steps": 50,
            "warmup_steps": 5,
        },
        "projection": None,
        "recommendations": None,
        "advice": [],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key] = {**summary[key], **value}
        else:
            summary[key] = value
    return summary


def ids(findings):
    return [f["id"] for f in findings]


def by_id(findings, id_):
    found = [f for f in findings if f["id"] == id_]
    assert found, f"no {id_} in {ids(findings)}"
    return found[0]


def check_well_formed(findings):
    for f in findings:
        assert set(f) == REQUIRED_KEYS
        assert f["severity"] in SEVERITY_ORDER
        assert isinstance(f["title"], str) and "\n" not in f["title"]
        assert isinstance(f["evidence"], dict)
        assert isinstance(f["action"], str) and f["action"]
    ranks = [SEVERITY_ORDER.index(f["severity"]) for f in findings]
    assert ranks == sorted(ranks)
    json.dumps(findings)  # JSON-serialisable


def test_severity_order():
    assert SEVERITY_ORDER == ("high", "medium", "low", "info")


def test_compute_bound_is_healthy_without_false_alarms():
    out = analyze(make_summary())
    findings = out["advice"]
    check_well_formed(findings)
    assert findings[0]["id"] == "healthy"
    assert not [f for f in findings if f["severity"] != "info"]
    assert "straggler" not in ids(findings)
    assert "data_bound" not in ids(findings) and "comm_bound" not in ids(findings)
    healthy = by_id(findings, "healthy")
    assert "1.0%" in healthy["title"] and "0.5%" in healthy["title"]
    assert healthy["evidence"]["step_ms"] == 100.0
    assert out["recommendations"]["gpus"] == 64
    assert healthy["title"].startswith("Healthy: ") and healthy["action"] == "no change needed"
    # Communication unmeasured on several ranks (an untimed hook): no verdict on it.
    base = make_summary()
    per = dict(base["per_step_ms"], comm_total=None, comm_exposed=None)
    blind = dict(
        base,
        per_step_ms=per,
        comm_source=None,
        comm_unmeasured="the DDP model has a hook dtprofile cannot time",
        ratios=dict(base["ratios"], comm_fraction=None, comm_overlap=None),
    )
    f = by_id(analyze(blind)["advice"], "healthy")
    assert not f["title"].startswith("Healthy") and "not measured" in f["title"]
    assert f["action"].startswith("measure communication to judge it: the DDP model has a hook")


def test_data_bound_recommends_workers():
    s = make_summary(
        per_step_ms={"data_wait": 40.0, "compute": 59.5, "overhead": 40.5},
        ratios={"data_fraction": 0.4, "R_O": 40.5 / 59.5},
        run={"num_workers": 0},
    )
    findings = analyze(s)["advice"]
    check_well_formed(findings)
    f = by_id(findings, "data_bound")
    assert f["severity"] == "high"
    # t_load = 40 ms per batch, busy 60 ms: ceil(40/60) + 1 = 2 workers.
    assert "DataLoader(num_workers=2" in f["action"]
    assert f["evidence"]["data_wait_ms"] == 40.0
    assert f["expected_gain"].startswith("step 100.0 -> 61.0 ms")  # + WORKER_HANDOFF_MS
    assert findings[0]["id"] == "data_bound"
    assert "healthy" not in ids(findings)


def test_data_bound_from_the_gap_says_it_may_be_host_work():
    # Without prof.loader the wait is the gap before forward: the finding does not claim
    # it is the DataLoader, and says how to tell.
    s = make_summary(
        per_step_ms={"data_wait": 40.0, "compute": 59.5, "overhead": 40.5},
        ratios={"data_fraction": 0.4, "R_O": 40.5 / 59.5},
        run={"num_workers": 0},
        data_wait_source="gap",
    )
    f = by_id(advise(s), "data_bound")
    assert f["title"].startswith("Data-bound or host-bound: 40.0 ms")
    assert f["action"].startswith("tell loading from other host work: iterate prof.loader(")
    assert "DataLoader(num_workers=2" in f["action"] and "host work" in f["action"]
    assert f["evidence"]["data_wait_source"] == "gap"


def test_data_bound_at_cpu_limit():
    s = make_summary(
        per_step_ms={"data_wait": 40.0}, ratios={"data_fraction": 0.4}, run={"num_workers": 1, "cpus_per_rank": 1.0}
    )
    f = by_id(advise(s), "data_bound")
    assert "CPU" in f["action"] and "(num_workers=1, cpus_per_rank=1)" in f["action"]


def test_a_waiting_loader_gets_workers_beyond_the_cores_and_a_computing_one_does_not():
    # One worker, one core: a batch takes 1 x (60 + 40) = 100 ms to load; 3 workers hide it.
    waiting = make_summary(
        per_step_ms={"data_wait": 40.0},
        ratios={"data_fraction": 0.4},
        run={
            "num_workers": 1,
            "cpus_per_rank": 1.0,
            "cpu_time": {"worker_cpu_ms_per_batch": 2.0, "training_cpu_cores": 0.5},
        },
    )
    out = analyze(waiting)
    rec, f = out["recommendations"], by_id(out["advice"], "data_bound")
    assert rec["loader_kind"] == "io" and rec["loader_cpu_share"] == pytest.approx(0.02)
    # Training takes 50 ms of the core a batch: two workers keep up (CPU pace 53 ms < 61),
    # and the step is the training's 60 ms and its taking each batch over; on one core its
    # 50 ms of CPU also wait while a worker computes, 2 ms a batch per 61 ms (against 2
    # per 100 ms beside the one worker now).
    step = 60.0 + WORKER_HANDOFF_MS + 50.0 * (2.0 / 61.0 - 2.0 / 100.0)
    assert rec["num_workers"] == 2 and rec["num_workers_step_ms"] == pytest.approx(step)
    assert "DataLoader(num_workers=2" in f["action"] and "beyond the CPU cores" in f["action"]
    assert f["evidence"]["predicted_step_ms"] == pytest.approx(step)
    assert f["expected_gain"].startswith("step 100.0 -> 61.6 ms")
    # The same wait spent computing: one core, so one worker, and the finding says cores.
    computing = make_summary(
        per_step_ms={"data_wait": 40.0},
        ratios={"data_fraction": 0.4},
        run={
            "num_workers": 1,
            "cpus_per_rank": 1.0,
            "cpu_time": {"worker_cpu_ms_per_batch": 95.0, "training_cpu_cores": 0.05},
        },
    )
    out = analyze(computing)
    rec, f = out["recommendations"], by_id(out["advice"], "data_bound")
    assert rec["loader_kind"] == "cpu" and rec["num_workers"] == 1 and rec["num_workers_needed"] == 3
    assert rec["num_workers_step_ms"] == pytest.approx(100.0)  # (5 + 95) ms of CPU a batch on one core
    assert "more CPU cores" in f["action"] and "num_workers=1" in f["action"]


def test_a_computing_main_process_loader_gets_a_worker_per_core_training_leaves():
    # The main process loads 80 ms a step (78 of them CPU) beside 20 ms of training, which
    # keeps one of the 4 CPUs busy while it computes: 5 workers would hide the wait, 3 cores
    # are left, so 3 workers.
    s = make_summary(
        per_step_ms={"data_wait": 80.0, "step": 100.0},
        ratios={"data_fraction": 0.8},
        run={
            "num_workers": 0,
            "cpus_per_rank": 4.0,
            "cpu_time": {"fetch_cpu_ms": 78.0, "worker_cpu_ms_per_batch": None, "training_cpu_cores": 0.2},
        },
    )
    out = analyze(s)
    rec = out["recommendations"]
    assert rec["loader_kind"] == "cpu" and rec["num_workers_needed"] == 5 and rec["num_workers"] == 3
    # Each worker hands its batch on after loading it: a batch every (80 + send) / 3 ms.
    assert rec["num_workers_step_ms"] == pytest.approx((80.0 + WORKER_SEND_MS) / 3)
    assert rec["loader_cores_needed"] == pytest.approx(4.9)  # (20 + 78) / 20
    f = by_id(out["advice"], "data_bound")
    assert "DataLoader(num_workers=3" in f["action"] and "keep 4.9 cores busy" in f["action"]


def test_a_loader_that_computes_half_the_time_gets_a_worker_per_half_core_left():
    # 40 ms of loading a step, 20 of them CPU, beside 10 ms of training on one of 2 CPUs:
    # each worker keeps half a core busy, so the one core left runs two of them.
    s = make_summary(
        per_step_ms={"data_wait": 40.0, "step": 50.0},
        ratios={"data_fraction": 0.8},
        run={"num_workers": 0, "cpus_per_rank": 2.0, "cpu_time": {"fetch_cpu_ms": 20.0, "training_cpu_cores": 0.2}},
    )
    rec = analyze(s)["recommendations"]
    assert rec["loader_kind"] == "cpu" and rec["loader_cpu_share"] == pytest.approx(0.5)
    assert rec["num_workers"] == 2
    assert rec["num_workers_step_ms"] == pytest.approx((40.0 + WORKER_SEND_MS) / 2)


def test_a_workers_pace_counts_copying_its_batch_into_shared_memory():
    # The main process loads 40 ms of CPU a step beside 40 ms of training, one core left:
    # one worker, which also copies each 29 MB batch into shared memory to hand it over.
    run = {"num_workers": 0, "cpus_per_rank": 2.0, "cpu_time": {"fetch_cpu_ms": 40.0, "training_cpu_cores": 0.5}}
    small = make_summary(per_step_ms={"data_wait": 40.0, "step": 80.0}, ratios={"data_fraction": 0.5}, run=run)
    big = make_summary(
        per_step_ms={"data_wait": 40.0, "step": 80.0}, ratios={"data_fraction": 0.5}, run=dict(run, batch_bytes=29e6)
    )
    assert analyze(small)["recommendations"]["num_workers_step_ms"] == pytest.approx(40.0 + WORKER_SEND_MS)
    rec = analyze(big)["recommendations"]
    assert rec["num_workers"] == 1
    assert rec["num_workers_step_ms"] == pytest.approx(40.0 + WORKER_SEND_MS + 29e6 / SHM_COPY_BYTES_PER_S * 1e3)
    # Copy costs the run measured on its machine stand in for the rate.
    measured = make_summary(
        per_step_ms={"data_wait": 40.0, "step": 80.0},
        ratios={"data_fraction": 0.5},
        run=dict(run, batch_bytes=29e6, shm_copy_ms=20.0, shm_release_ms=8.0),
    )
    assert analyze(measured)["recommendations"]["num_workers_step_ms"] == pytest.approx(40.0 + WORKER_SEND_MS + 20.0)
    # With workers already, their copies are in the load the step shows.
    with_workers = make_summary(
        per_step_ms={"data_wait": 15.0, "step": 20.0},
        ratios={"data_fraction": 0.75},
        run={
            "num_workers": 2,
            "cpus_per_rank": 2.0,
            "batch_bytes": 29e6,
            "cpu_time": {"worker_cpu_ms_per_batch": 32.0, "training_cpu_cores": 0.25},
        },
    )
    assert analyze(with_workers)["recommendations"]["num_workers_step_ms"] == pytest.approx(20.0)


def test_the_training_frees_each_workers_batch_and_shares_the_cores_with_the_workers():
    # A waiting loader (60 ms a batch, 1 ms of CPU) beside 20 ms of training CPU on 2 cores,
    # 19 MB batches: a worker copies each into shared memory (10 ms), and the training
    # process frees it once done (3 ms), on top of taking it over.
    s = make_summary(
        per_step_ms={"data_wait": 60.0, "step": 80.0},
        ratios={"data_fraction": 0.75},
        run={
            "num_workers": 0,
            "cpus_per_rank": 2.0,
            "batch_bytes": 19e6,
            "shm_copy_ms": 10.0,
            "shm_release_ms": 3.0,
            "cpu_time": {"fetch_cpu_ms": 1.0, "training_cpu_cores": 0.25},
        },
    )
    rec = analyze(s)["recommendations"]
    # The training's pace, 20 + 1 + 3 = 24 ms, is the step from 3 workers on ((60 + 2 + 10) / 3),
    # one more for jitter; its 20 ms of CPU stretch while two workers or more want a core
    # (each 13 ms of CPU a batch: 1 loading, 2 sending, 10 copying; one batch in 4 paces).
    assert rec["loader_kind"] == "io" and rec["num_workers"] == 4
    assert rec["num_workers_step_ms"] == pytest.approx(24.0 + 20.0 * (_stretch(4, 13.0 / (4 * 24.0), 2.0) - 1.0))
    assert 24.5 < rec["num_workers_step_ms"] < 25.5
    # Under one CPU a rank, the measured step already holds the training's share of it:
    # the stretch counts from there. 10 ms of training CPU and 3 of each worker's (1
    # loading, 2 sending) a batch on half a core: the CPUs' pace, 28 ms, is the step.
    half = loader_plan(60.0, 80.0, 0, cpu_ms_per_batch=1.0, cpus_per_rank=0.5, training_cpu_cores=0.125)
    assert half.workers == 3 and half.predicted_step_ms == pytest.approx((10.0 + 3.0 + WORKER_HANDOFF_MS) / 0.5)
    # The stretch: none with one worker beside a free core; on one core, all a worker takes.
    assert _stretch(1, 0.9, 2.0) == 1.0 and _stretch(1, 0.25, 1.0) == pytest.approx(1.25)
    assert _stretch(3, 0.0, 2.0) == 1.0 and _stretch(3, 1.0, 2.0) == pytest.approx(2.0)


def test_workers_that_would_not_shorten_the_step_are_not_advised():
    # 30 ms of CPU loading beside 10 ms of training on one core: a worker only moves the
    # loading to the same core, and hands each 29 MB batch over on top.
    s = make_summary(
        per_step_ms={"data_wait": 30.0, "step": 40.0},
        ratios={"data_fraction": 0.75},
        run={
            "num_workers": 0,
            "cpus_per_rank": 1.0,
            "batch_bytes": 29e6,
            "cpu_time": {"fetch_cpu_ms": 30.0, "training_cpu_cores": 0.25},
        },
    )
    out = analyze(s)
    rec, f = out["recommendations"], by_id(out["advice"], "data_bound")
    assert rec["num_workers"] == 0 and rec["num_workers_step_ms"] == pytest.approx(40.0)
    assert "at the CPU limit (num_workers=0, cpus_per_rank=1)" in f["action"]
    # A gain under LOADER_MIN_GAIN is not advised either; one above it is.
    assert loader_plan(30.0, 40.0, cpu_ms_per_batch=30.0, cpus_per_rank=2.0, training_cpu_cores=0.25).workers == 1
    near = loader_plan(3.0, 40.0, cpu_ms_per_batch=3.0, cpus_per_rank=2.0, training_cpu_cores=0.9)
    assert near.workers == 0 and near.predicted_step_ms == 40.0  # 38 ms a step at best: 5% off


def test_a_loader_at_the_cpu_limit_keeps_the_workers_it_has():
    # Two computing workers (a batch every 20 ms, 32 ms of CPU each) beside 5 ms of
    # training on 2 CPUs: the cores are full, and one worker fewer would halve the supply.
    s = make_summary(
        per_step_ms={"data_wait": 15.0, "step": 20.0},
        ratios={"data_fraction": 0.75},
        run={
            "num_workers": 2,
            "cpus_per_rank": 2.0,
            "cpu_time": {"worker_cpu_ms_per_batch": 32.0, "training_cpu_cores": 0.25},
        },
    )
    out = analyze(s)
    rec, f = out["recommendations"], by_id(out["advice"], "data_bound")
    assert rec["loader_kind"] == "cpu" and rec["num_workers"] == 2
    assert rec["num_workers_step_ms"] == pytest.approx(20.0)  # the step it has
    assert "at the CPU limit (num_workers=2, cpus_per_rank=2)" in f["action"]


@pytest.mark.parametrize("device, pinned", [("cuda", True), ("cpu", False)])
def test_data_bound_pins_memory_only_for_a_gpu(device, pinned):
    s = make_summary(
        device=device,
        per_step_ms={"data_wait": 40.0},
        ratios={"data_fraction": 0.4},
        run={"num_workers": 0, "cpus_per_rank": 4.0},
    )
    f = by_id(advise(s), "data_bound")
    assert "DataLoader(num_workers=" in f["action"] and ("pin_memory=True" in f["action"]) == pinned


def test_data_bound_severity_bands():
    for wait, severity in ((6.0, "low"), (12.0, "medium"), (25.0, "high")):
        s = make_summary(per_step_ms={"data_wait": wait}, ratios={"data_fraction": wait / 100})
        assert by_id(advise(s), "data_bound")["severity"] == severity
    s = make_summary(per_step_ms={"data_wait": 4.0}, ratios={"data_fraction": 0.04})
    assert "data_bound" not in ids(advise(s))


def comm_heavy() -> dict:
    # 100 MB of gradients at 0.5 GB/s busbw (ring at 2: 2*1/2*1e8/5e8 = 200 ms);
    # measured: comm_total 200, exposed 150 of a 250 ms step.
    return make_summary(
        per_step_ms={
            "step": 250.0,
            "data_wait": 1.0,
            "forward": 30.0,
            "backward": 60.0,
            "optimizer": 5.0,
            "comm_total": 200.0,
            "comm_exposed": 150.0,
            "compute": 99.0,
            "overhead": 151.0,
        },
        ratios={"R_O": 151 / 99, "data_fraction": 0.004, "comm_fraction": 0.6, "comm_overlap": 0.25},
        grad_bytes=100_000_000,
        algbw_GBps=0.5,
        busbw_GBps=0.5,
        ranks=[],
        backend="nccl",
    )  # compressing hooks pay under NCCL, not under gloo


def test_comm_bound_and_network_bandwidth():
    out = analyze(comm_heavy())
    findings = out["advice"]
    check_well_formed(findings)
    f = by_id(findings, "comm_bound")
    assert f["severity"] == "high"
    assert f["evidence"]["comm_exposed_ms"] == 150.0
    assert "register_comm_hook" in f["action"]
    # Halving the bytes: comm 100, hideable 50 -> exposed 50; step 250 -> 150.
    assert f["expected_gain"].startswith("step 250.0 -> 150.0 ms")
    # A measured step the parts do not rebuild (10 ms more): the gain starts from it.
    heavy = comm_heavy()
    heavy["per_step_ms"]["step"] = 260.0
    f = by_id(analyze(heavy)["advice"], "comm_bound")
    assert f["expected_gain"].startswith("step 260.0 -> 160.0 ms")
    nb = by_id(findings, "network_bandwidth")
    assert nb["severity"] == "medium"
    assert "link bandwidth >= " in nb["action"] and "Gbit/s" in nb["action"]
    needed = out["recommendations"]["bandwidth_needed_Gbps"]
    assert nb["evidence"]["bandwidth_needed_Gbps"] == pytest.approx(needed)
    assert needed > 0.5 * 8  # more than the measured 4 Gbit/s
    # The figure quoted is rounded up: following it reaches the target.
    quoted = float(nb["action"].split("link bandwidth >= ")[1].split(" Gbit/s")[0])
    assert (
        needed <= quoted * (1 + 1e-9)
        and quoted <= needed * 1.1
        and f"{nb['action'].split(' >= ')[1].split(' ')[0]} Gbit/s reaches" in nb["title"]
    )
    assert nb["evidence"]["bandwidth_source"] == "measured"
    assert "healthy" not in ids(findings)
    # Most severe first.
    assert findings[0]["severity"] == "high"


def test_comm_bound_cpu_suggests_bigger_batch_capped_by_critical():
    s = comm_heavy()
    findings = advise(s)
    f = by_id(findings, "batch_headroom")
    size = f["evidence"]["suggested_batch_size"]
    assert size > 32 and f"batch_size={size}" in f["action"]
    # A critical batch of 256 global over 2 ranks caps the per-device batch at 128.
    s["run"]["gradient_noise"] = {"B_simple": 256.0, "grad_sq_norm": 1.0, "trace_sigma": 256.0, "samples": 20}
    f = by_id(advise(s), "batch_headroom")
    assert f["evidence"]["suggested_batch_size"] <= 128
    assert "critical" in f["title"]
    assert "in proportion to the batch" in f["expected_gain"]  # the model's assumption, said
    # The same estimate from 3 sampled steps is noise: it caps nothing.
    s["run"]["gradient_noise"]["samples"] = 3
    f = by_id(advise(s), "batch_headroom")
    assert f["evidence"]["suggested_batch_size"] == size and f["evidence"]["critical_batch_size"] is None
    s["run"]["gradient_noise"]["samples"] = 20
    # At the critical batch already: says a bigger batch costs samples, suggests keeping it.
    s["run"]["gradient_noise"]["B_simple"] = 64.0
    f = by_id(advise(s), "batch_headroom")
    assert f["severity"] == "info" and "cost more samples" in f["title"]


def test_straggler_named_even_when_steps_equal():
    # All steps equal (the all-reduce waits for the slow rank): rank 1 has the larger
    # backward, rank 0 the larger exposed communication (it waits for rank 1).
    s = make_summary(
        ranks=[
            {
                "rank": 0,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 40.0,
                "optimizer": 5.0,
                "comm_total": 30.0,
                "comm_exposed": 25.0,
                "compute": 74.0,
            },
            {
                "rank": 1,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 60.0,
                "optimizer": 5.0,
                "comm_total": 10.0,
                "comm_exposed": 5.0,
                "compute": 94.0,
            },
        ]
    )
    findings = advise(s)
    check_well_formed(findings)
    f = by_id(findings, "straggler")
    assert f["evidence"]["rank"] == 1
    assert f["evidence"]["slow_phase"] == "backward"
    assert "rank 1" in f["title"] and "backward" in f["title"]
    assert f["evidence"]["excess_ms"] == pytest.approx(20.0)
    assert f["severity"] == "high"  # 20% of the step
    assert f["title"].endswith("every rank waits for it in the all-reduce")
    # A sharded model waits in FSDP's collectives, not in an all-reduce.
    s = dict(s, comm_source="fsdp", run=dict(s["run"], fsdp={"units": 3, "all_gathers": 6, "reduce_scatters": 3}))
    assert by_id(advise(s), "straggler")["title"].endswith("every rank waits for it in FSDP's collectives")


@pytest.mark.parametrize(
    "run, says, never",
    [
        ({"num_workers": 2, "sample_shapes_vary": True}, "length bucketing", "look past the data"),
        ({"num_workers": 2, "sample_shapes_vary": False}, "shapes do not vary", "length bucketing"),
        ({"num_workers": 2}, "length bucketing if the samples' lengths vary", "look past the data"),
        ({}, "the same batch size and shapes drawn on every rank", "DistributedSampler"),
    ],
)
def test_straggler_balance_fits_the_loops_batches(run, says, never):
    """Length bucketing only where the samples' shapes vary (or nobody knows); a loop
    without a DataLoader draws its own batches and has no sampler."""
    s = make_summary(
        ranks=[
            {
                "rank": 0,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 40.0,
                "optimizer": 5.0,
                "comm_total": 30.0,
                "comm_exposed": 25.0,
                "compute": 74.0,
            },
            {
                "rank": 1,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 60.0,
                "optimizer": 5.0,
                "comm_total": 10.0,
                "comm_exposed": 5.0,
                "compute": 94.0,
            },
        ]
    )
    s["run"] = {k: v for k, v in s["run"].items() if k != "num_workers"} | run
    action = by_id(advise(s), "straggler")["action"]
    assert says in action and never not in action, action


def test_straggler_in_data_wait_with_three_ranks():
    ranks = [
        {
            "rank": i,
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 30.0,
            "backward": 50.0,
            "optimizer": 5.0,
            "comm_exposed": 20.0,
        }
        for i in range(3)
    ]
    ranks[2]["data_wait"], ranks[2]["comm_exposed"] = 16.0, 5.0
    f = by_id(advise(make_summary(ranks=ranks)), "straggler")
    assert f["evidence"]["rank"] == 2 and f["evidence"]["slow_phase"] == "data_wait"
    assert f["severity"] == "medium"


def test_straggler_not_triggered_by_noise():
    # 3% spread (well under 10%) on a 2-rank CPU run.
    s = make_summary(
        ranks=[
            {
                "rank": 0,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 60.0,
                "optimizer": 5.0,
                "comm_exposed": 4.0,
            },
            {
                "rank": 1,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 62.0,
                "optimizer": 5.0,
                "comm_exposed": 1.0,
            },
        ]
    )
    assert "straggler" not in ids(advise(s))
    # Sub-millisecond steps: 20% but only 0.1 ms -> not a straggler (1 ms floor).
    tiny = make_summary(
        ranks=[
            {"rank": 0, "step": 0.6, "comm_exposed": 0.1, "backward": 0.2},
            {"rank": 1, "step": 0.6, "comm_exposed": 0.0, "backward": 0.3},
        ]
    )
    assert "straggler" not in ids(advise(tiny))


def test_straggler_between_phases_is_unattributed():
    # Rank 1 sleeps 10 ms between forward and backward: no phase holds that time, so the
    # finding names none (backward's 0.2 ms is noise) and points at host work.
    s = make_summary(
        ranks=[
            {
                "rank": 0,
                "step": 30.0,
                "data_wait": 1.0,
                "forward": 5.0,
                "backward": 8.0,
                "optimizer": 1.0,
                "comm_exposed": 11.0,
            },
            {
                "rank": 1,
                "step": 30.0,
                "data_wait": 1.0,
                "forward": 5.0,
                "backward": 8.2,
                "optimizer": 1.0,
                "comm_exposed": 1.0,
            },
        ]
    )
    f = by_id(advise(s), "straggler")
    assert f["evidence"]["rank"] == 1 and f["evidence"]["slow_phase"] == "unattributed"
    assert "between its phases" in f["title"] and "host work" in f["action"]


def test_straggler_without_comm_uses_busy_time():
    s = make_summary(
        ranks=[
            {
                "rank": 0,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 30.0,
                "backward": 40.0,
                "optimizer": 5.0,
                "comm_exposed": None,
                "compute": 75.0,
            },
            {
                "rank": 1,
                "step": 100.0,
                "data_wait": 1.0,
                "forward": 45.0,
                "backward": 40.0,
                "optimizer": 5.0,
                "comm_exposed": None,
                "compute": 90.0,
            },
        ]
    )
    f = by_id(advise(s), "straggler")
    assert f["evidence"]["rank"] == 1 and f["evidence"]["slow_phase"] == "forward"


def test_telemetry_straggler():
    s = make_summary(
        device="cuda",
        run={
            "telemetry": {
                "ranks": [{"rank": 0, "throttle_reasons": []}, {"rank": 1, "throttle_reasons": ["hw_thermal_slowdown"]}]
            }
        },
    )
    f = by_id(advise(s), "straggler")
    assert f["evidence"]["throttled_ranks"] == [1]


def test_cuda_rules():
    s = make_summary(
        device="cuda",
        per_step_ms={"optimizer": 30.0, "forward": 20.0, "backward": 45.0},
        run={
            "has_conv": True,
            "cudnn_benchmark": False,
            "memory": {"peak_bytes": 10e9, "static_bytes": 2e9, "total_bytes": 80e9},
            "telemetry": {"gpu_util_percent": 35.0},
        },
    )
    out = analyze(s)
    findings = out["advice"]
    check_well_formed(findings)
    assert by_id(findings, "cudnn_benchmark")["action"] == (
        "torch.backends.cudnn.benchmark = True (input shapes fixed; with varying shapes it re-tunes per shape)"
    )
    assert "reduce-overhead" in by_id(findings, "launch_bound")["action"]
    opt = by_id(findings, "optimizer_serial")
    assert opt["evidence"]["share"] == pytest.approx(30 / 98.5)
    assert "ZeroRedundancyOptimizer" in opt["action"]
    assert out["recommendations"]["max_batch_size"] == 280
    # The run's own optimizer is named (SGD stays SGD), with what its constructor takes.
    for info, fused in (
        ({"class": "torch.optim.SGD", "fused": True, "foreach": True}, "torch.optim.SGD(..., fused=True)"),
        ({"class": "torch.optim.RMSprop", "fused": False, "foreach": True}, "torch.optim.RMSprop(..., foreach=True)"),
        ({"class": "mylib.Lion", "fused": False, "foreach": False}, "instead of mylib.Lion"),
    ):
        named = by_id(analyze(dict(s, run=dict(s["run"], optimizer=info)))["advice"], "optimizer_serial")
        assert fused in named["action"] and f"optimizer_class={info['class']})" in named["action"], named
        assert "AdamW" not in named["action"] or info["class"] == "mylib.Lion"
    # Already fused: not told to fuse it, only to shard it.
    info = {"class": "torch.optim.AdamW", "fused": True, "foreach": True, "fused_on": True, "foreach_on": False}
    named = by_id(analyze(dict(s, run=dict(s["run"], optimizer=info)))["advice"], "optimizer_serial")
    assert named["action"].startswith("torch.optim.AdamW is fused already; with several GPUs shard it")
    assert "fused=True" not in named["action"]
    # The ZeRO line runs as pasted (torch.distributed has no optim attribute until imported).
    assert "from torch.distributed.optim import ZeroRedundancyOptimizer; ZeroRedundancyOptimizer(" in named["action"]
    # ZeRO already: its local optimizer is the one to fuse; no ZeRO around ZeRO.
    info = {"class": "torch.optim.Adam", "fused": True, "foreach": True, "zero": True}
    named = by_id(analyze(dict(s, run=dict(s["run"], optimizer=info)))["advice"], "optimizer_serial")
    assert "(ZeroRedundancyOptimizer)" in named["title"] and "import ZeroRedundancyOptimizer" not in named["action"]
    assert named["action"] == "torch.optim.Adam(..., fused=True) (or foreach=True)"
    # FSDP: a sharded model already steps each rank's shard (no ZeRO to suggest); a
    # replicated one (FSDP's replicate) is told to shard.
    for counts, words, sharding in (
        ({"all_gathers": 9, "reduce_scatters": 5}, "on this rank's shard", False),
        ({"all_gathers": 0, "reduce_scatters": 0, "replica_all_reduces": 5}, "every replica repeats it", True),
    ):
        fsdp_run = dict(s["run"], fsdp=dict(units=5, replicas=2, **counts))
        opt = by_id(analyze(dict(s, comm_source="fsdp", run=fsdp_run))["advice"], "optimizer_serial")
        assert words in opt["title"] and "fused=True" in opt["action"], opt
        assert "ZeroRedundancyOptimizer" not in opt["action"]
        assert ("shard dimension" in opt["action"]) is sharding and (opt["expected_gain"] is not None) is sharding
    head = by_id(findings, "batch_headroom")
    assert head["evidence"]["suggested_batch_size"] == 280
    assert "batch_size=280" in head["action"]


def test_launch_bound_needs_cuda_and_no_overhead():
    tele = {"telemetry": {"gpu_util_percent": 20.0}}
    assert "launch_bound" not in ids(advise(make_summary(run=tele)))  # CPU
    s = make_summary(device="cuda", run=tele, per_step_ms={"data_wait": 30.0}, ratios={"data_fraction": 0.3})
    assert "launch_bound" not in ids(advise(s))  # data wait explains it


def test_gpu_count_and_assumed_bandwidth():
    # One device, 100 MB of gradients, nothing known about the link: assumed 10 GbE.
    s = make_summary(
        world_size=1,
        ranks=[],
        busbw_GBps=None,
        grad_bytes=100_000_000,
        per_step_ms={"comm_total": None, "comm_exposed": None},
    )
    out = analyze(s)
    assert out["projection"]["bandwidth_source"] == "assumed"
    g = by_id(out["advice"], "gpu_count")
    assert g["evidence"]["recommended_gpus"] == out["recommendations"]["gpus"] < 64
    assert "assumed" in g["title"] and "10 Gbit/s Ethernet" in g["title"]
    assert g["severity"] == "info"  # a forecast: the measured run itself is fine
    nb = by_id(out["advice"], "network_bandwidth")
    assert "assumed" in nb["title"]
    # An all-reduce job: the lemma is a what-if in the projection, never a finding.
    assert "parameter_servers" not in ids(out["advice"])
    assert out["recommendations"]["num_parameter_servers"] >= 1
    text = format_report(out)
    line = next(x for x in text.splitlines() if x.startswith("Parameter servers, were this job"))
    assert f">= {out['recommendations']['num_parameter_servers']} at " in line
    assert "num_parameter_servers" not in text.split("Recommendations:")[1]
    # A summary that says its job pushed gradients to servers gets the finding.
    s["run"] = {**s.get("run", {}), "gradient_exchange": "parameter_server"}
    ps = by_id(analyze(s)["advice"], "parameter_servers")
    assert ps["severity"] == "info"
    assert ps["evidence"]["num_parameter_servers"] == out["recommendations"]["num_parameter_servers"]
    # Nothing wrong with the run itself: still healthy.
    assert out["advice"][0]["id"] == "healthy"


def test_gpu_count_medium_when_over_scaled():
    s = comm_heavy()
    s["world_size"] = 4
    s["options"]["project_gpus"] = [1, 2, 4, 8]
    out = analyze(s)
    g = by_id(out["advice"], "gpu_count")
    assert out["recommendations"]["gpus"] < 4
    assert g["severity"] == "medium"
    # Below the target at its own size: a decision with the throughput of each option,
    # never "scale down" as the order.
    assert g["title"].startswith("Efficiency ") and "at the 4 GPUs used now, below the target" in g["title"]
    proj = out["projection"]
    speed = dict(zip(proj["gpus"], proj["speedup"], strict=False))
    assert g["action"].startswith(
        f"for throughput, world_size (torchrun --nnodes/--nproc_per_node) = 8: speedup {speed[8]:.1f}x"
    )
    assert speed[8] > speed[4] > speed[1]
    assert "only if the cost per sample matters more than time: at 1 GPU" in g["action"]
    assert g["evidence"]["options"]["more_gpus"]["gpus"] == 8
    assert g["evidence"]["options"]["fewer_gpus"]["speedup"] == pytest.approx(speed[out["recommendations"]["gpus"]])
    s["run"] = dict(s.get("run") or {}, framework="lightning")
    g = by_id(analyze(s)["advice"], "gpu_count")
    assert g["action"].startswith("for throughput, Trainer(devices=..., num_nodes=...) with devices x num_nodes = 8")


def test_the_runs_own_gpu_count_is_projected_so_the_advice_can_weigh_it():
    s = comm_heavy()
    s["world_size"] = 3
    s["options"]["project_gpus"] = [1, 2, 4, 8]
    out = analyze(s)
    assert out["projection"]["gpus"] == [1, 2, 3, 4, 8]
    g = by_id(out["advice"], "gpu_count")
    assert "at the 3 GPUs used now" in g["title"] and g["action"].startswith("for throughput, ")


def test_gpu_count_keeps_the_world_size_when_more_gpus_would_not_go_faster():
    s = comm_heavy()
    s["world_size"] = 4
    s["options"]["project_gpus"] = [1, 2, 4]
    out = analyze(s)
    g = by_id(out["advice"], "gpu_count")
    assert g["action"].startswith("for throughput, keep 4 GPUs")
    assert "more_gpus" not in g["evidence"]["options"] and "fewer_gpus" in g["evidence"]["options"]


def test_all_null_summary_does_not_raise():
    nulls = {
        "schema": "dtprofile.summary/1",
        "device": None,
        "world_size": None,
        "per_step_ms": {
            k: None
            for k in (
                "step",
                "data_wait",
                "forward",
                "backward",
                "optimizer",
                "comm_total",
                "comm_exposed",
                "compute",
                "overhead",
            )
        },
        "ranks": None,
        "ratios": None,
        "grad_bytes": None,
        "busbw_GBps": None,
        "run": None,
        "options": None,
    }
    out = analyze(nulls)
    check_well_formed(out["advice"])
    assert ids(out["advice"]) == ["insufficient_data"]
    assert analyze({})["advice"][0]["id"] == "insufficient_data"
    assert "insufficient_data" in format_findings(out["advice"])


def test_partial_nulls():
    # Comm unmeasured on 2 ranks, zero steps on a rank, world_size 1 variants.
    s = make_summary(
        per_step_ms={"comm_total": None, "comm_exposed": None},
        ratios={"comm_fraction": None, "comm_overlap": None},
        busbw_GBps=None,
        ranks=[{"rank": 0, "steps": 0, "step": None}, {"rank": 1}],
    )
    check_well_formed(analyze(s)["advice"])
    s = make_summary(world_size=1, ranks=[], run={"batch_size": None, "memory": None})
    check_well_formed(analyze(s)["advice"])


numbers = st.one_of(
    st.none(),
    st.floats(min_value=0.0, max_value=1e4),
    st.floats(min_value=0.0, max_value=1e-300),
    st.integers(0, 10**9),
)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "step",
                "data_wait",
                "forward",
                "backward",
                "optimizer",
                "comm_total",
                "comm_exposed",
                "compute",
                "overhead",
            ]
        ),
        numbers,
    ),
    st.dictionaries(st.sampled_from(["R_O", "data_fraction", "comm_fraction", "comm_overlap"]), numbers),
    st.sampled_from(["cpu", "cuda", None]),
    st.integers(1, 8),
    numbers,
    numbers,
)
def test_analyze_never_raises_on_nulls(per, ratios, device, world, grad_bytes, busbw):
    s = make_summary(
        device=device, world_size=world, grad_bytes=grad_bytes, busbw_GBps=busbw, per_step_ms=per, ratios=ratios
    )
    s["per_step_ms"] = {**{k: None for k in s["per_step_ms"]}, **per}
    out = analyze(s)
    check_well_formed(out["advice"])
    json.dumps(out, allow_nan=False)  # no nan / inf anywhere
    format_findings(out["advice"])


def test_analyze_returns_copy():
    s = make_summary()
    before = copy.deepcopy(s)
    out = analyze(s)
    assert s == before
    assert out is not s
    assert set(out["projection"]) >= {
        "scaling",
        "bandwidth_source",
        "bandwidth_GBps",
        "gpus",
        "alpha_paper",
        "speedup_paper",
        "step_ms",
        "speedup",
        "efficiency",
    }
    assert set(out["recommendations"]) >= {
        "gpus",
        "num_parameter_servers",
        "bandwidth_needed_Gbps",
        "max_batch_size",
        "num_workers",
        "critical_batch_size",
    }


def test_advise_computes_projection_when_missing():
    s = comm_heavy()
    assert ids(advise(s)) == ids(analyze(s)["advice"])


def test_format_findings_most_severe_first():
    findings = [
        {
            "id": "parameter_servers",
            "severity": "info",
            "title": "A",
            "evidence": {},
            "action": "x",
            "expected_gain": None,
        },
        {
            "id": "data_bound",
            "severity": "high",
            "title": "B",
            "evidence": {"x": 1.23456},
            "action": "DataLoader(num_workers=4)",
            "expected_gain": "step 2 -> 1 ms",
        },
        {
            "id": "cudnn_benchmark",
            "severity": "low",
            "title": "C",
            "evidence": {},
            "action": "y",
            "expected_gain": None,
        },
    ]
    text = format_findings(findings)
    lines = text.splitlines()
    assert lines[0].startswith("[HIGH]") and "data_bound: B" in lines[0]
    assert "action: DataLoader(num_workers=4)" in text
    assert "expected gain: step 2 -> 1 ms" in text
    assert "x=1.235" in text
    assert text.index("cudnn_benchmark") < text.index("parameter_servers")
    assert format_findings([]) == "No findings."


def test_thresholds_are_named_constants():
    assert thresholds.DATA_BOUND_FRACTION == 0.05
    assert thresholds.COMM_BOUND_FRACTION == 0.10
    assert (thresholds.WARNING_FRACTION, thresholds.CRITICAL_FRACTION) == (0.10, 0.20)
    assert thresholds.STRAGGLER_MIN_EXCESS_FRACTION == 0.10
    assert thresholds.STRAGGLER_MIN_EXCESS_MS == 1.0
    assert thresholds.LAUNCH_BOUND_UTIL_PERCENT == 50.0
    assert thresholds.OPTIMIZER_SERIAL_FRACTION == 0.20
    assert projection.ASSUMED_BANDWIDTH_Bps == 1.25e9


def test_comm_bound_suggests_bucket_views_only_when_ddp_copies_gradients():
    base = dict(
        per_step_ms={
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 20.0,
            "backward": 30.0,
            "optimizer": 5.0,
            "comm_total": 60.0,
            "comm_exposed": 40.0,
            "compute": 59.0,
            "overhead": 41.0,
        },
        ratios={"R_O": 41 / 59, "data_fraction": 0.01, "comm_fraction": 0.4, "comm_overlap": 1 / 3},
        backend="nccl",
    )
    copying = make_summary(**base, run={"ddp": {"gradient_as_bucket_view": False}})
    viewing = make_summary(**base, run={"ddp": {"gradient_as_bucket_view": True}})
    action = {f["id"]: f["action"] for f in analyze(copying)["advice"]}["comm_bound"]
    assert "gradient_as_bucket_view=True" in action and "timed_hook" in action
    action = {f["id"]: f["action"] for f in analyze(viewing)["advice"]}["comm_bound"]
    assert "gradient_as_bucket_view" not in action
    # Lightning: the strategy's arguments, not the DDP constructor's.
    lightning = make_summary(**base, run={"framework": "lightning", "ddp": {"gradient_as_bucket_view": False}})
    action = by_id(analyze(lightning)["advice"], "comm_bound")["action"]
    assert action.startswith("DDPStrategy(ddp_comm_hook=dtprofile.timed_hook(")
    assert "DDPStrategy(gradient_as_bucket_view=True)" in action and "register_comm_hook" not in action
    # Already compressing to 16 bits: not told to do it again, and no gain claimed for it.
    compressed = make_summary(
        **base,
        run={"ddp": {"gradient_as_bucket_view": True, "compressed_16bit": True, "comm_hook": "bf16_compress_hook"}},
    )
    f = by_id(analyze(compressed)["advice"], "comm_bound")
    assert "already cross in 16 bits (bf16_compress_hook)" in f["action"] and "PowerSGD" in f["action"]
    assert "bf16_compress_hook))" not in f["action"] and f["expected_gain"] is None


def test_comm_bound_suggests_no_compression_under_gloo_or_over_powersgd():
    """Under gloo a bf16 hook made the step 1.1-2.8x slower and PowerSGD stalled; with
    PowerSGD registered the rule went back to suggesting bf16, and DDP takes one hook."""
    gloo = dict(comm_heavy(), backend="gloo")
    f = by_id(analyze(gloo)["advice"], "comm_bound")
    assert "bf16_compress_hook" not in f["action"] and "no_sync()" in f["action"]
    assert f["expected_gain"] is None and f["evidence"]["backend"] == "gloo"
    psgd = comm_heavy()
    psgd["run"] = dict(psgd["run"], ddp={"comm_hook": "powerSGD_hook", "compressed_16bit": False})
    f = by_id(analyze(psgd)["advice"], "comm_bound")
    assert "already compressed (powerSGD_hook)" in f["action"] and "bf16" not in f["action"]


@pytest.mark.parametrize(
    "skipped, severity", [(0, None), (1, None), (2, None), (3, "low"), (10, "medium"), (40, "high")]
)
def test_skipped_updates(skipped, severity):
    # 200 steps after a 5-step warm-up; 2 skips are 1% exactly but under the minimum count.
    out = analyze(make_summary(steps_total=205, warmup_steps=5, steps_skipped_update=skipped))
    check_well_formed(out["advice"])
    found = [f for f in out["advice"] if f["id"] == "skipped_updates"]
    if severity is None:
        assert not found
        return
    assert found[0]["severity"] == severity
    assert found[0]["evidence"]["steps_skipped_update"] == skipped
    assert found[0]["evidence"]["share"] == pytest.approx(skipped / 200)
    assert "bf16" in found[0]["action"]
    # Persistent skips (5% and up) are the gradients' own: their causes come first, and
    # bf16 is not offered as the fix (it wrote NaN into 662,026 weights when followed).
    persistent = skipped / 200 >= 0.05
    assert found[0]["action"].startswith("the skips persist") == persistent
    assert ("would write the inf/NaN into the weights" in found[0]["action"]) == persistent
    assert "all-reduce" in found[0]["title"]  # two ranks
    assert found[0]["expected_gain"] == f"{200 / (200 - skipped):.2f}x useful updates per second"


def test_skipped_updates_absent_in_old_summaries():
    summary = make_summary()
    summary.pop("steps_skipped_update", None)
    assert "skipped_updates" not in ids(analyze(summary)["advice"])


@pytest.mark.parametrize(
    "b_simple, world, flagged", [(0.0, 2, True), (-2e-4, 4, True), (0.5, 2, False), (0.0, 1, False), (None, 2, False)]
)
def test_identical_data(b_simple, world, flagged):
    gns = (
        None if b_simple is None else {"B_simple": b_simple, "samples": 3, "grad_sq_norm": 1.0, "trace_sigma": b_simple}
    )
    out = analyze(make_summary(world_size=world, run={"gradient_noise": gns}))
    check_well_formed(out["advice"])
    found = [f for f in out["advice"] if f["id"] == "identical_data"]
    assert bool(found) == flagged
    if flagged:
        assert found[0]["severity"] == "high" and found[0]["expected_gain"] == f"{world}x distinct samples per step"
        assert out["advice"][0]["id"] == "identical_data"  # high, first rule


def test_every_advice_id_is_documented():
    import re
    from pathlib import Path

    registered = {r.id for r in rules()}
    assert {
        "data_bound",
        "comm_bound",
        "straggler",
        "skipped_updates",
        "identical_data",
        "healthy",
        "insufficient_data",
        "few_steps",
        "varying_steps",
        "rare_long_steps",
        "eval_forwards_in_steps",
    } <= registered
    documented = set(
        re.findall(r"^\| `([a-z_]+)` \|", (Path(__file__).parents[1] / "docs" / "advice.md").read_text(), re.M)
    )
    assert registered == documented


def test_one_registry_holds_every_rule_in_its_order():
    """Every finding comes from a registered rule; the order of ties is the rules' order."""
    assert [r.id for r in rules("gate")] == ["insufficient_data"]
    assert [r.id for r in rules("verdict")] == ["healthy"]
    assert [r.id for r in rules("check")] == [
        "identical_data",
        "data_bound",
        "tp_across_nodes",
        "tp_comm_exposed",
        "comm_bound",
        "dp_comm_exposed",
        "pipeline_bubble",
        "stage_imbalance",
        "pipeline_transfer",
        "straggler",
        "network_bandwidth",
        "gpu_count",
        "batch_headroom",
        "launch_bound",
        "optimizer_serial",
        "host_work",
        "accumulation_sync",
        "cpu_threads",
        "cudnn_benchmark",
        "skipped_updates",
        "parameter_servers",
        "varying_steps",
        "rare_long_steps",
        "eval_forwards_in_steps",
        "few_steps",
    ]
    assert registry.SEVERITY_ORDER is SEVERITY_ORDER


def test_the_registry_refuses_a_second_rule_with_an_id_or_a_place_taken():
    with pytest.raises(ValueError, match="registered twice"):
        registry.rule("data_bound", order=12345)(lambda r: None)
    with pytest.raises(ValueError, match="order 200 of kind 'check' is 'data_bound'"):
        registry.rule("a_new_rule", order=200)(lambda r: None)
    with pytest.raises(ValueError, match="kind must be one of"):
        registry.rule("a_new_rule", order=12345, kind="sometimes")
    assert "a_new_rule" not in {r.id for r in rules()}


def test_a_registered_rule_runs_in_its_place(monkeypatch):
    """The recipe of the package's docstring: one function and its registration."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @registry.rule("optimizer_heavy", order=150)
    def optimizer_heavy(r):
        if r.optimizer is None or r.step is None or r.optimizer < 0.04 * r.step:
            return None
        return Finding("optimizer_heavy", "info", "the optimizer", {"optimizer_ms": r.optimizer}, "look")

    # healthy, the optimizer 5 of 100 ms; a parameter-server job, so that a later info rule fires
    found = ids(advise(make_summary(run={"gradient_exchange": "parameter_server"})))
    assert found.index("healthy") < found.index("optimizer_heavy") < found.index("parameter_servers")

    @registry.rule("misnamed", order=160)
    def misnamed(r):
        return Finding("not_misnamed", "info", "t", {}, "a")

    with pytest.raises(ValueError, match="returned a finding with id 'not_misnamed'"):
        advise(make_summary())


def test_every_threshold_is_defined_once_in_the_thresholds_module():
    """A number a rule compares with is a named constant of advice/thresholds.py, not a
    constant of the rule's own module."""
    import ast
    from pathlib import Path

    package = Path(registry.__file__).parent
    for path in package.glob("*.py"):
        if path.name == "thresholds.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                numbers = [
                    n
                    for n in ast.walk(node.value)
                    if isinstance(n, ast.Constant)
                    and isinstance(n.value, (int, float))
                    and not isinstance(n.value, bool)
                ]
                assert not numbers, f"{path.name}: {names} holds a number; thresholds belong in thresholds.py"


def test_the_old_module_path_re_exports_the_advice():
    with warnings.catch_warnings():  # (deprecated: tests/test_public_surface.py)
        warnings.simplefilter("ignore", DeprecationWarning)
        import dtprofile.advice as old
    from dtprofile import _values
    from dtprofile.analysis import advice as new
    from dtprofile.analysis.advice import wording

    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name, None) or getattr(old, name) is getattr(thresholds, name)
    assert old.FEW_STEPS == thresholds.FEW_STEPS and old.TRANSFER_BOUND_SHARE == thresholds.TRANSFER_BOUND_SHARE
    assert (old._num, old._get, old._median, old._round_up) == (
        _values.finite,
        _values.get,
        _values.median,
        wording.round_up,
    )


def test_accumulation_sync():
    base = dict(
        per_step_ms={
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 20.0,
            "backward": 40.0,
            "optimizer": 5.0,
            "comm_total": 30.0,
            "comm_exposed": 10.0,
            "compute": 89.0,
            "overhead": 11.0,
        }
    )
    naive = analyze(make_summary(**base, run={"micro_batches": 4, "sync_passes": 4}))
    f = by_id(naive["advice"], "accumulation_sync")
    # DDP decides in the forward whether backward syncs: a backward alone under no_sync()
    # still all-reduced (4 of 4 micro-batches after following the old wording).
    assert "with ddp.no_sync(): loss = loss_fn(ddp(x), y); loss.backward()" in f["action"]
    # A parameter server takes the gradients once per step, not once per micro-batch.
    once = analyze(make_summary(**base, run={"micro_batches": 4, "sync_passes": 1}))
    assert (naive["recommendations"]["num_parameter_servers"], once["recommendations"]["num_parameter_servers"]) == (
        1,
        2,
    )
    # 3 of 4 all-reduces are wasted: up to 22.5 ms of a 100 ms step (the high band, >= 20%).
    assert f["severity"] == "high"
    assert f["expected_gain"].startswith("75% less gradient traffic") and "100.0 -> 77.5 ms" in f["expected_gain"]
    # (3 passes over 2 micro-batches: several losses per batch, e.g. a GAN, not accumulation.)
    for run in (
        {"micro_batches": 4, "sync_passes": 1},
        {"micro_batches": 1, "sync_passes": 1},
        {"sync_passes": None},
        {"micro_batches": 2, "sync_passes": 3},
    ):
        assert "accumulation_sync" not in ids(analyze(make_summary(**base, run=run))["advice"])
    # FSDP2 names the collective its passes repeat: reduce-scatters, or all-reduces for replicate.
    for counts, verb in (
        ({"reduce_scatters": 12, "replica_all_reduces": 0}, "reduce-scatters"),
        ({"reduce_scatters": 0, "replica_all_reduces": 12}, "all-reduces"),
    ):
        run = {"micro_batches": 4, "sync_passes": 4, "fsdp": dict(units=3, all_gathers=0, replicas=2, **counts)}
        f = by_id(analyze(make_summary(**base, comm_source="fsdp", run=run))["advice"], "accumulation_sync")
        assert f["title"].startswith(f"Gradient accumulation {verb} on 4 of 4")
        assert f"so only it {verb} (FSDP2)" in f["action"] and "set_requires_gradient_sync(False)" in f["action"]
        assert "set_requires_all_reduce" not in f["action"]  # no HSDP: nothing in between
    # FSDP1: its own no_sync() on the root.
    run = {"micro_batches": 4, "sync_passes": 4, "fsdp": dict(api="FSDP1", units=3, all_gathers=6, reduce_scatters=12)}
    f = by_id(analyze(make_summary(**base, comm_source="fsdp", run=run))["advice"], "accumulation_sync")
    assert "model.no_sync()" in f["action"] and "only the last backward reduce-scatters" in f["action"], f["action"]
    # HSDP (reduce-scatters and all-reduces across replicas): the middle way is named too.
    run = {
        "micro_batches": 4,
        "sync_passes": 4,
        "fsdp": dict(units=3, all_gathers=6, replicas=2, reduce_scatters=12, replica_all_reduces=12),
    }
    f = by_id(analyze(make_summary(**base, comm_source="fsdp", run=run))["advice"], "accumulation_sync")
    assert "set_requires_gradient_sync(False)" in f["action"] and "set_requires_all_reduce(False)" in f["action"]
    # Lightning's ModelParallelStrategy: the call goes in training_step.
    run = {
        "framework": "lightning",
        "micro_batches": 4,
        "sync_passes": 4,
        "fsdp": dict(units=3, all_gathers=6, replicas=1, reduce_scatters=12),
    }
    f = by_id(analyze(make_summary(**base, comm_source="fsdp", run=run))["advice"], "accumulation_sync")
    assert f["action"].startswith("in training_step, before backward, on the module you gave fully_shard last")
    assert (
        ".set_requires_gradient_sync((batch_idx + 1) % self.trainer.accumulate_grad_batches == 0 or "
        "self.trainer.is_last_batch)" in f["action"]
    )


@pytest.mark.parametrize(
    "threads, cpus, device, severity",
    [
        (8, 4.0, "cpu", "medium"),
        (1, 16.0, "cpu", "low"),
        (4, 4.0, "cpu", None),
        (1, 2.0, "cpu", None),
        (8, 4.0, "cuda", None),
    ],
)
def test_cpu_threads(threads, cpus, device, severity):
    out = analyze(make_summary(device=device, run={"torch_threads": threads, "cpus_per_rank": cpus}))
    found = [f for f in out["advice"] if f["id"] == "cpu_threads"]
    assert (found[0]["severity"] if found else None) == severity
    if found:
        assert f"torch.set_num_threads({int(cpus)})" in found[0]["action"]
    if severity == "medium":  # two ranks here; one process has no ranks to blame
        assert "the ranks oversubscribe" in found[0]["title"]
        one = analyze(
            make_summary(device=device, world_size=1, ranks=[], run={"torch_threads": threads, "cpus_per_rank": cpus})
        )
        assert "the threads oversubscribe" in by_id(one["advice"], "cpu_threads")["title"]


def _straggler_rows() -> list[dict]:
    """Two ranks as a 2-rank gloo run measured them with rank 1's loader 30 ms slower:
    rank 0 sits in the all-reduce while rank 1 loads."""
    from dtprofile.summary import rank_row

    def row(rank, data_wait, comm_total, comm_exposed):
        step = 32.0
        medians = {
            "step": step,
            "data_wait": data_wait,
            "forward": 0.4,
            "backward": 0.6,
            "optimizer": 0.3,
            "comm_total": comm_total,
            "comm_exposed": comm_exposed,
            "compute": step - data_wait - comm_exposed,
            "overhead": data_wait + comm_exposed,
            "grad_bytes": 37904.0,
        }
        return rank_row(rank, 30, medians, 0, {})

    return [row(0, 0.2, 31.5, 31.0), row(1, 30.3, 1.2, 0.6)]


def _summary_from_rows(rows: list[dict], comm_source: str = "dtprofile") -> dict:
    from dtprofile.options import Options
    from dtprofile.summary import build_summary

    meta = {
        "world_size": len(rows),
        "device": "cpu",
        "device_name": "cpu",
        "backend": "gloo",
        "steps_total": 35,
        "data_wait_source": "loader",
        "comm_source": comm_source,
        "timing": "perf_counter",
        "run": make_summary()["run"],
    }
    return build_summary(rows, meta, Options(warmup_steps=5))


def test_cluster_overhead_is_the_sum_of_its_medians():
    """Three ranks, each adding up: the median of each part comes from a different rank, and
    the median of the overheads (12.0 here) is not the sum of the parts' medians (10.0)."""
    from dtprofile.summary import rank_row

    def row(rank, data_wait, comm_exposed):
        step = 20.0 + data_wait + comm_exposed
        averages = {
            "step": step,
            "data_wait": data_wait,
            "forward": 4.0,
            "backward": 12.0,
            "optimizer": 1.0,
            "comm_total": comm_exposed + 5.0,
            "comm_exposed": comm_exposed,
            "compute": 20.0,
            "overhead": data_wait + comm_exposed,
            "grad_bytes": 1e6,
        }
        return rank_row(rank, 30, averages, 0, {})

    summary = _summary_from_rows([row(0, 1.0, 11.0), row(1, 11.0, 1.0), row(2, 5.0, 5.0)])
    per = summary["per_step_ms"]
    # Ranks 0 and 2 wait in the all-reduce for rank 1's loading (10 and 4 ms).
    assert (per["data_wait"], per["comm_exposed"], per["comm_peer_wait"]) == (5.0, 1.0, 4.0)
    assert per["overhead"] == pytest.approx(10.0)
    assert per["step"] == pytest.approx(per["compute"] + per["overhead"])
    assert summary["ratios"]["R_O"] == pytest.approx(10.0 / 22.0)


def test_waiting_for_a_straggler_is_not_the_network():
    """A rank waiting in the all-reduce for a slower one is not communication: before,
    this run said comm_bound HIGH, a 0.019 Gbit/s "measured" link and 82 parameter servers."""
    s = _summary_from_rows(_straggler_rows())
    per = s["per_step_ms"]
    assert per["comm_peer_wait"] == pytest.approx(30.4 / 2)  # median of [30.4, 0]
    assert per["comm_exposed"] == pytest.approx(0.6) and per["comm_total"] == pytest.approx((1.1 + 1.2) / 2)
    assert [r["comm_peer_wait"] for r in s["ranks"]] == [pytest.approx(30.4), 0.0]
    assert [r["comm_exposed"] for r in s["ranks"]] == [31.0, 0.6]  # each rank keeps what it measured
    assert per["overhead"] == pytest.approx((31.2 + 30.9) / 2)  # the wait is still overhead (T_O)
    assert s["algbw_GBps"] == pytest.approx(37904 / ((1.1 + 1.2) / 2e3) / 1e9)
    ids = {f["id"] for f in s["advice"]}
    assert "straggler" in ids
    assert not ids & {"comm_bound", "network_bandwidth"}, ids
    assert by_id(s["advice"], "straggler")["evidence"]["rank"] == 1
    # The data wait's median over 2 ranks (15.2 ms) is a wait neither had: it names whose.
    data = by_id(s["advice"], "data_bound")
    assert data["title"].endswith("; rank 1 waits 30.3 ms, the other ranks 0.2 ms (median)")
    assert data["evidence"]["slowest_rank"] == 1
    # The parameter-server lemma reads the network's bandwidth, not the wait's.
    assert s["recommendations"]["num_parameter_servers_bandwidth_Gbps"] == pytest.approx(s["busbw_GBps"] * 8)


def test_a_straggler_wait_is_not_taken_out_of_the_probe_steps_communication_alone():
    """Without a hook the total is the probe steps' all-reduce, timed after the ranks met:
    no wait for a slower rank is in it, so none is taken out of it or of the bandwidth
    (rank 0's total is its exposed wait, 31 ms, until the wait is taken out: 1.1 ms)."""
    from dtprofile.summary import rank_row

    def row(rank, data_wait, probe_comm, comm_exposed):
        step = 32.0
        averages = {
            "step": step,
            "data_wait": data_wait,
            "forward": 0.4,
            "backward": 0.6,
            "optimizer": 0.3,
            "comm_total": None,
            "comm_exposed": comm_exposed,
            "comm_timed_steps": 0,
            "compute": step - data_wait - comm_exposed,
            "overhead": data_wait + comm_exposed,
            "grad_bytes": 37904.0,
        }
        probe = {"step": 1.3 + probe_comm, "compute": 1.3, "comm_total": probe_comm}
        return rank_row(rank, 30, averages, 4, probe)

    rows = [row(0, 0.2, 1.1, 31.0), row(1, 30.3, 1.2, 0.6)]
    assert rows[0]["comm_total"] == 31.0 and rows[1]["comm_total"] == 1.2  # never below the exposed wait
    assert rows[0]["comm_timed_steps"] == 4
    s = _summary_from_rows(rows, comm_source="ddp_probe")
    per = s["per_step_ms"]
    assert per["comm_peer_wait"] == pytest.approx(30.4 / 2)
    assert per["comm_total"] == pytest.approx((1.1 + 1.2) / 2)  # not (0.6 + 1.2) / 2
    assert s["algbw_GBps"] == pytest.approx(37904 / ((1.1 + 1.2) / 2e3) / 1e9)
    assert s["comm_timed_steps"] == 4
    # Total and exposed from different steps: no share hidden is claimed.
    assert s["ratios"]["comm_overlap"] is None and "% hidden" not in format_report(s)
    assert _summary_from_rows(rows, comm_source="dtprofile")["ratios"]["comm_overlap"] is not None


def test_balanced_ranks_keep_their_communication():
    """Noise between ranks (under max(1 ms, 5% of the step)) is not a wait for a peer."""
    rows = _straggler_rows()
    for r, exposed in zip(rows, (20.0, 20.9), strict=False):
        r.update(comm_total=25.0, comm_exposed=exposed, data_wait=0.2, overhead=0.2 + exposed)
    s = _summary_from_rows(rows)
    assert s["per_step_ms"]["comm_peer_wait"] == 0.0
    assert s["per_step_ms"]["comm_exposed"] == pytest.approx(20.45) and s["per_step_ms"]["comm_total"] == 25.0
    assert "comm_bound" in {f["id"] for f in s["advice"]}
    one = _summary_from_rows(rows[:1])
    assert one["per_step_ms"]["comm_peer_wait"] is None and "comm_peer_wait" not in one["ranks"][0]


def test_host_work_between_the_phases_is_named():
    """An 8 ms sleep in the loop, measured with prof.loader: T_C 19.0 ms of phases worth
    8.9, and the verdict was 'Healthy'."""
    per = {
        "step": 19.5,
        "data_wait": 0.5,
        "forward": 3.0,
        "backward": 5.0,
        "optimizer": 0.9,
        "comm_total": 1.0,
        "comm_exposed": 0.0,
        "compute": 19.0,
        "overhead": 0.5,
    }
    s = make_summary(
        per_step_ms=per,
        ratios={"R_O": 0.5 / 19.0, "data_fraction": 0.5 / 19.5, "comm_fraction": 0.0, "comm_overlap": 1.0},
    )
    found = advise(s)
    f = by_id(found, "host_work")
    assert f["severity"] == "high" and f["evidence"]["other_ms"] == pytest.approx(10.1)
    assert ".item()" in f["action"] and f["expected_gain"].startswith("step 19.5 -> 9.4 ms")
    assert "healthy" not in {x["id"] for x in found}
    lightning = make_summary(per_step_ms=per, run={"framework": "lightning"})
    assert "log_every_n_steps" in by_id(advise(lightning), "host_work")["action"]
    assert "host_work" not in {x["id"] for x in advise(make_summary())}  # 4 of 250 ms


def test_a_gap_of_framework_dispatch_is_not_data_bound():
    """A 0.3 ms step's 36 us gap (hooks, zero_grad) is 12% of it, but not data."""
    s = make_summary(
        data_wait_source="gap", per_step_ms={"step": 0.307, "data_wait": 0.036}, ratios={"data_fraction": 0.036 / 0.307}
    )
    found = advise(s)
    assert "data_bound" not in {f["id"] for f in found}
    assert "gap before forward 36 us (< 100 us)" in by_id(found, "healthy")["title"]
    s = make_summary(
        data_wait_source="loader",
        per_step_ms={"step": 0.307, "data_wait": 0.036},
        ratios={"data_fraction": 0.036 / 0.307},
    )
    assert "data_bound" in {f["id"] for f in advise(s)}  # measured in next(): it is data


def test_a_wait_taken_out_of_the_network_always_has_a_straggler_finding():
    """The peer-wait thresholds are the straggler rule's: rank 0 waiting 6 ms of a 100 ms
    step (under 10% of its busy time) was taken out of comm_exposed with no finding."""
    rows = _straggler_rows()
    for wait in (6.0, 30.0):
        rows[0].update(step=100.0, comm_exposed=5.0 + wait, data_wait=0.2, overhead=5.2 + wait)
        rows[1].update(step=100.0, comm_exposed=5.0, data_wait=0.2 + wait, overhead=5.2 + wait)
        s = _summary_from_rows(rows)
        ids = {f["id"] for f in s["advice"]}
        assert (s["per_step_ms"]["comm_peer_wait"] > 0) == ("straggler" in ids), (wait, s["per_step_ms"], ids)
    assert "straggler" in ids  # 30 ms: both


def test_findings_from_a_handful_of_steps_say_so():
    few = advise(make_summary(steps_profiled=1, steps_total=6))  # 5 warm-up steps
    f = by_id(few, "few_steps")
    assert f["severity"] == "info" and "Only 1 steady-state step measured" in f["title"]
    assert "few_steps" not in {
        x["id"] for x in advise(make_summary(steps_profiled=thresholds.FEW_STEPS, steps_total=15))
    }
    # An interval of 5 steps in a long run is not a short run.
    interval = make_summary(steps_profiled=5, steps_total=40)
    assert "few_steps" not in {x["id"] for x in advise(interval)}


def test_steps_of_several_sizes_are_noted():
    s = make_summary()
    s["run"] = dict(s["run"], micro_batches=4, micro_batches_seen=[1, 2, 4], framework="lightning")
    f = by_id(advise(s), "varying_steps")
    assert f["severity"] == "info" and "1, 2 and 4 micro-batches" in f["title"]
    assert "GradientAccumulationScheduler" in f["title"] and "most common (4)" in f["title"]
    assert "varying_steps" not in ids(advise(make_summary()))


def test_comm_bound_led_by_ddps_buffer_broadcast_says_broadcast_buffers_false():
    s = make_summary(
        per_step_ms={
            "step": 100.0,
            "comm_total": 30.0,
            "comm_exposed": 25.0,
            "comm_buffers": 20.0,
            "compute": 74.0,
            "overhead": 26.0,
        },
        ratios={"comm_fraction": 0.25, "comm_overlap": 1 - 25 / 30},
    )
    s["run"] = dict(s["run"], ddp={"buffer_broadcast_bytes": 8_000_000})
    f = by_id(advise(s), "comm_bound")
    assert "20.0 ms of it DDP's buffer broadcast before forward" in f["title"]
    assert f["action"].startswith("DistributedDataParallel(model, broadcast_buffers=False)")
    assert f["evidence"]["comm_buffers_ms"] == 20.0
    # A small broadcast does not lead.
    small = copy.deepcopy(s)
    small["per_step_ms"]["comm_buffers"] = 1.0
    assert "buffer broadcast" not in by_id(advise(small), "comm_bound")["title"]


def test_optimizer_serial_for_lbfgs_does_not_offer_sharding():
    s = make_summary(per_step_ms={"optimizer": 40.0, "forward": 20.0, "backward": 30.0})
    s["run"] = dict(s["run"], optimizer={"class": "LBFGS", "fused": False, "foreach": False})
    f = by_id(advise(s), "optimizer_serial")
    assert "max_iter" in f["action"] and "cannot be sharded" in f["action"]
    s["run"]["optimizer"] = {"class": "SGD", "fused": True, "foreach": True, "fused_on": False, "foreach_on": True}
    assert "(or foreach=True)" not in by_id(advise(s), "optimizer_serial")["action"]


def test_optimizer_serial_title_fits_the_world_size():
    heavy = {"optimizer": 30.0, "forward": 20.0, "backward": 45.0}
    one = make_summary(
        world_size=1, backend=None, ranks=None, per_step_ms=heavy, comm_source=None, busbw_GBps=None, algbw_GBps=None
    )
    title = by_id(advise(one), "optimizer_serial")["title"]
    # One process, no DDP: nothing repeats it yet; more GPUs would.
    assert "DDP repeats it on every rank" not in title
    assert title.endswith("under DDP every rank would repeat it, so it would not shrink with more GPUs"), title
    title = by_id(advise(make_summary(per_step_ms=heavy)), "optimizer_serial")["title"]
    assert title.endswith("every one of the 2 ranks repeats it, so it does not shrink with more GPUs"), title


def test_parameter_servers_advice_says_to_split_a_tensor_too_large_for_one_server():
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
        run={
            "largest_trainable_param_bytes": 100_000_000,
            "param_bytes": 180_000_000,
            "trainable_param_bytes": 180_000_000,
            "gradient_exchange": "parameter_server",
            "hardware": {"nvlink_GBps": 450.0, "nic_Gbps": 1.0},
        },
    )
    out = analyze(s)
    ps = by_id(out["advice"], "parameter_servers")
    assert ps["evidence"]["bandwidth_source"] == "nic"
    assert ps["evidence"]["server_bandwidth_Gbps"] == pytest.approx(1.0)
    assert "1 Gbit/s each" in ps["title"]
    assert ps["evidence"]["largest_tensor_share"] > 1
    assert "split the largest parameter tensor" in ps["action"]
    even = copy.deepcopy(s)
    even["run"]["largest_trainable_param_bytes"] = 1000
    ps = by_id(analyze(even)["advice"], "parameter_servers")
    assert ps["evidence"]["largest_tensor_share"] < 1 and "split" not in ps["action"]
    assert "no tensor is too large" in ps["action"]
    unknown = copy.deepcopy(s)
    del unknown["run"]["largest_trainable_param_bytes"]  # a summary from before 0.5
    ps = by_id(analyze(unknown)["advice"], "parameter_servers")
    assert "no tensor is too large" not in ps["action"] and "split unevenly" in ps["action"]


def test_comm_bound_on_a_model_compiled_inside_ddp_says_to_compile_outside():
    """DDP(torch.compile(model)): backward is one graph, every bucket is ready at its end
    (a user measured exposed communication 3.9-6 ms against 1.1 ms compiled outside)."""
    import torch
    from torch import nn

    from dtprofile._torch_internals import compiled_module as _compiled_module

    assert _compiled_module(torch.compile(nn.Linear(2, 2)))  # the wrapper (nothing compiles yet)
    in_place = nn.Linear(2, 2)
    in_place.compile()
    assert _compiled_module(in_place) and not _compiled_module(nn.Linear(2, 2)) and not _compiled_module(None)
    base = dict(
        per_step_ms={
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 20.0,
            "backward": 30.0,
            "optimizer": 5.0,
            "comm_total": 60.0,
            "comm_exposed": 40.0,
            "compute": 59.0,
            "overhead": 41.0,
        },
        ratios={"R_O": 41 / 59, "data_fraction": 0.01, "comm_fraction": 0.4, "comm_overlap": 1 / 3},
        backend="nccl",
    )
    inside = by_id(analyze(make_summary(**base, run={"ddp": {"compiled_inside": True}}))["advice"], "comm_bound")
    assert inside["action"].startswith("torch.compile(DDP(model)) rather than DDP(torch.compile(model))")
    assert inside["evidence"]["compiled_inside_ddp"] is True
    outside = by_id(analyze(make_summary(**base, run={"ddp": {"compiled_inside": False}}))["advice"], "comm_bound")
    assert "torch.compile(DDP" not in outside["action"]


def test_rare_long_steps_are_named_when_the_trim_hides_their_time():
    """PPO: a rollout every 32 updates is one step in 33, always trimmed: 19% of the run
    was in no figure, and the advice said healthy with nothing else."""
    hidden = make_summary(
        steps_profiled=200,
        step_ms_all_steps=36.2,
        per_step_ms={
            "step": 29.2,
            "data_wait": 0.1,
            "forward": 9.0,
            "backward": 15.0,
            "optimizer": 4.0,
            "comm_total": None,
            "comm_exposed": None,
            "compute": 29.1,
            "overhead": 0.1,
        },
        ratios={"R_O": 0.1 / 29.1, "data_fraction": 0.1 / 29.2, "comm_fraction": None, "comm_overlap": None},
        world_size=1,
    )
    f = by_id(advise(hidden), "rare_long_steps")
    assert f["severity"] == "info" and f["evidence"]["share"] == pytest.approx((36.2 - 29.2) / 36.2)
    assert "36.2 ms a step in all, the averages 29.2 ms; 19.3%" in f["title"] and "rollout" in f["action"]
    even = dict(hidden, step_ms_all_steps=29.9)  # 2.3%: jitter the trim removes anyway
    assert "rare_long_steps" not in ids(advise(even))
    few = dict(hidden, steps_profiled=9)
    assert "rare_long_steps" not in ids(advise(few))
    assert "rare_long_steps" not in ids(advise({k: v for k, v in hidden.items() if k != "step_ms_all_steps"}))
