"""FSDP2 (``fully_shard``) communication: the exposure arithmetic on a device timeline,
the instrumentation's wiring, and real 2-process gloo runs on the CPU."""

from __future__ import annotations

import types

import pytest
from distributed import run_ranks
from workers import fsdp_train

from dtprofile.capture.clocks import HostClock
from dtprofile.capture.fsdp import FSDPInstrumentation, TimedAllGather, TimedReduceScatter
from dtprofile.capture.records import CommInterval, PendingStep

S = 1e-3  # HostClock marks are seconds: these tests write them in ms * S


def _sharded_step(blocking: bool) -> PendingStep:
    """One step, 0-100 ms: forward 0-30, backward compute 30-80, synced at 90.

    Two all-gathers in forward (0-5, 5-15), reduce-scatters in backward (40-60, 70-88);
    the compute timeline waited for the gathers at 0-4 and 10-12.
    """
    step = PendingStep(start=0.0)
    step.forward.append([0.0, 30 * S])
    step.backward.append([30 * S, 80 * S, 90 * S])
    for kind, a, b, nbytes in (
        ("all_gather", 0, 5, 100),
        ("all_gather", 5, 15, 100),
        ("reduce_scatter", 40, 60, 100),
        ("reduce_scatter", 70, 88, 100),
    ):
        step.comm.append(
            CommInterval(
                start=a * S,
                end=b * S,
                nbytes=nbytes,
                bucket=False,
                kind=kind,
                blocking=blocking and kind == "reduce_scatter",
            )
        )
    step.comm_waits += [[0.0, 4 * S], [10 * S, 12 * S]]
    step.comm_measured = True
    step.optimizer = (92 * S, 100 * S)
    step.end = 100 * S
    return step


def test_device_timeline_exposes_only_the_waits_and_the_tail():
    """GPU semantics: collectives on FSDP's streams overlap compute; the step loses the
    compute stream's waits for the gathers (4 + 2 ms) and the tail after backward
    compute (80 -> 90 ms, FSDP waiting for the last reduce-scatter)."""
    record = _sharded_step(blocking=False).to_record(HostClock(), data_wait_from="gap")
    assert record.comm_exposed == pytest.approx(16.0)
    # Every collective and wait: 0-15, 40-60, 70-90.
    assert record.comm_total == pytest.approx(55.0)
    assert record.compute == pytest.approx(100.0 - 16.0)
    # Forward 0-30 waited 4 + 2 ms; backward compute 30-80 waited for nothing.
    assert record.forward == pytest.approx(30.0 - 6.0) and record.backward == pytest.approx(50.0)
    # Four collectives of 100 bytes: the all-reduce of the same traffic moves 200.
    assert record.grad_bytes == pytest.approx(200.0)


def test_blocking_collectives_are_exposed_in_full():
    """CPU semantics: a collective without async_op holds the training thread."""
    record = _sharded_step(blocking=True).to_record(HostClock(), data_wait_from="gap")
    # waits 0-4, 10-12; blocking reduce-scatters 40-60, 70-88; tail 80-90 -> 70-90
    assert record.comm_exposed == pytest.approx(4 + 2 + 20 + 20)
    assert record.comm_exposed <= record.comm_total
    # The reduce-scatters held backward compute (30-80) for 20 + 10 ms.
    assert record.backward == pytest.approx(50.0 - 30.0)


class _FakeComm:
    def __init__(self):
        self.calls = []

    def allocate(self, size, *, dtype, device):
        return ("allocated", size, dtype, device)

    def __call__(self, *args):
        self.calls.append(args)
        return None


class _FakeMeshInfo:
    shard_mesh_size = 2  # sharded over two ranks: its parameters are gathered


class _FakeGroup:
    mesh_info = _FakeMeshInfo()

    def __init__(self):
        self._all_gather_comm = _FakeComm()
        self._reduce_scatter_comm = _FakeComm()
        self.waits = 0

    def wait_for_unshard(self):
        self.waits += 1
        return "waited"


class _RecordingEngine:
    def __init__(self):
        self.events = []

    def collective_start(self, kind, nbytes, reduce=None):
        self.events.append(("start", kind, nbytes))
        self.reduce = reduce
        return kind

    def collective_end(self, interval, work, failed=False):
        self.events.append(("end", interval, work) + (("failed",) if failed else ()))

    def wait_start(self):
        self.events.append(("wait",))
        return ["span"]

    def wait_end(self, span):
        self.events.append(("waited",))


def test_instrumentation_wraps_fsdp_comm_objects_and_restores_them():
    import torch

    group, engine = _FakeGroup(), _RecordingEngine()
    ag, rs = group._all_gather_comm, group._reduce_scatter_comm
    handle = FSDPInstrumentation([group])
    handle.install(engine)
    assert isinstance(group._all_gather_comm, TimedAllGather) and group._all_gather_comm.inner is ag
    assert isinstance(group._reduce_scatter_comm, TimedReduceScatter)
    out, inp = torch.zeros(8), torch.zeros(4)
    assert group._all_gather_comm(out, inp, "pg", False) is None
    group._reduce_scatter_comm(inp, out, "pg", "sum")
    assert group.wait_for_unshard() == "waited" and group.waits == 1
    # bytes: the all-gather's output, the reduce-scatter's input (both the full tensor)
    assert engine.events == [
        ("start", "all_gather", 32),
        ("end", "all_gather", None),
        ("start", "reduce_scatter", 32),
        ("end", "reduce_scatter", None),
        ("wait",),
        ("waited",),
    ]
    assert ag.calls == [(out, inp, "pg", False)] and rs.calls == [(inp, out, "pg", "sum", False)]
    # The reduce-scatter hands its tensors over for the gradient noise sample.
    assert engine.reduce == (out, inp, "sum", "pg")
    # FSDP allocates its buffers through the comm object: still its own allocator.
    assert group._all_gather_comm.allocate((4,), dtype="f", device="d") == ("allocated", (4,), "f", "d")
    handle.remove()
    assert group._all_gather_comm is ag and group._reduce_scatter_comm is rs
    assert "wait_for_unshard" not in vars(group)
    handle.remove()  # twice is harmless
    assert group.wait_for_unshard() == "waited"
    # A profiler that never stopped left its wrappers: the next one replaces them.
    FSDPInstrumentation([group]).install(engine)
    later = FSDPInstrumentation([group])
    later.install(_RecordingEngine())
    assert (
        group._all_gather_comm.inner is ag
        and group.wait_for_unshard.__wrapped__ == _FakeGroup.wait_for_unshard.__get__(group)
    )
    later.remove()
    assert group._all_gather_comm is ag and "wait_for_unshard" not in vars(group)


def test_a_collective_that_raises_still_ends_its_interval():
    import torch

    class Failing(_FakeComm):
        def __call__(self, *args):
            raise RuntimeError("peer gone")

    group, engine = _FakeGroup(), _RecordingEngine()
    group._all_gather_comm = Failing()
    FSDPInstrumentation([group]).install(engine)
    with pytest.raises(RuntimeError, match="peer gone"):
        group._all_gather_comm(torch.zeros(2), torch.zeros(1), "pg")
    assert engine.events == [("start", "all_gather", 8), ("end", "all_gather", None, "failed")]


def test_instrumentation_passes_through_when_engine_is_gone():
    import torch

    group = _FakeGroup()
    handle = FSDPInstrumentation([group])
    handle.install(None)
    group._all_gather_comm(torch.zeros(2), torch.zeros(1), "pg")
    assert len(group._all_gather_comm.inner.calls) == 1


class _FakeDist:
    class ReduceOp:
        SUM, AVG = "sum", "avg"

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls.append((op, group, async_op))
        tensor.mul_(2)  # in place, as the real one

    def get_rank(self):
        return 0


def test_dist_proxy_times_only_registered_groups():
    """The proxy put in an FSDP module's ``dist`` times the named collectives on the
    process groups it was given and passes every other call and attribute through."""
    import torch

    from dtprofile.capture.fsdp import FSDP1_REDUCTIONS, FSDP2_COLLECTIVES, _TimedDist

    class Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    fake, engine, replicas, other = _FakeDist(), _RecordingEngine(), Group(2), Group(2)
    proxy = _TimedDist(fake, FSDP2_COLLECTIVES)
    proxy.recorders[id(replicas)] = (replicas, engine)
    grad = torch.ones(4)
    assert proxy.all_reduce(grad, op="avg", group=replicas) is None
    assert engine.events == [("start", "replica_all_reduce", 16), ("end", "replica_all_reduce", None)]
    # The input is handed over for the noise sample (in place: input and output alike).
    assert engine.reduce[0] is grad and engine.reduce[1] is grad and engine.reduce[2:] == ("avg", replicas)
    proxy.all_reduce(grad, group=other)  # not registered: untimed
    assert len(engine.events) == 2 and fake.calls == [("avg", replicas, False), (None, other, False)]
    assert grad.tolist() == [4.0] * 4 and proxy.get_rank() == 0
    alone = Group(1)  # a replicate group of one rank: timed, but nothing on the wire
    proxy.recorders[id(alone)] = (alone, engine)
    proxy.all_reduce(grad, op="avg", group=alone)
    assert engine.events[-2:] == [("start", "replica_all_reduce", 0), ("end", "replica_all_reduce", None)]
    # FSDP1's reduce-scatter: the input's bytes (the full gradient), no noise sample.
    fake.reduce_scatter_single = lambda out, inp, group=None: fake.calls.append(("rs", group))
    fsdp1 = _TimedDist(fake, FSDP1_REDUCTIONS)
    fsdp1.recorders[id(replicas)] = (replicas, engine)
    fsdp1.reduce_scatter_single(torch.zeros(2), torch.zeros(4), group=replicas)
    assert engine.events[-2:] == [("start", "reduce_scatter", 16), ("end", "reduce_scatter", None)]
    assert engine.reduce is None and fake.calls[-1] == ("rs", replicas)


def test_hsdp_noise_sample_pairs_the_scatter_input_with_the_replica_all_reduce_output():
    """HSDP: the reduce-scatter's output is only the shard group's mean until the
    all-reduce across replicas: the sample takes |g|^2 of the scatter's input and of the
    all-reduce's output, scaled by both reductions (SUM: 1 / each group's size)."""
    import torch
    import torch.distributed as dist

    from dtprofile.engine import Engine
    from dtprofile.options import Options

    class Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    engine = Engine(Options(), clock=HostClock())
    grad, shard = torch.full((4,), 2.0), torch.full((2,), 3.0)
    rs = CommInterval(start=0.0, nbytes=16, bucket=False, kind="reduce_scatter")
    engine.noise.sample_shard_input(rs, grad, shard, dist.ReduceOp.SUM, Group(2))
    engine.comm.collective_end(rs, None)
    assert rs.global_sq.value() == pytest.approx(18.0 / 4)  # (|shard| / 2)^2, before the all-reduce
    ar = CommInterval(start=0.0, nbytes=8, bucket=False, kind="replica_all_reduce")
    engine.noise.sample_shard_input(ar, shard, shard, dist.ReduceOp.SUM, Group(3))
    shard.mul_(3)  # the all-reduce across three replicas (SUM)
    engine.comm.collective_end(ar, None)
    assert rs.local_sq is None and rs.global_sq is None  # the pair moved to the all-reduce
    assert ar.local_sq.value() == pytest.approx(16.0)
    assert ar.global_sq.value() == pytest.approx(162.0 / 36)  # (|(9, 9)| / (2 * 3))^2
    # FSDP's replicate (nothing sharded): the all-reduce's input is the whole gradient.
    alone = CommInterval(start=0.0, nbytes=16, bucket=False, kind="replica_all_reduce")
    engine.noise.sample_shard_input(alone, grad, grad, dist.ReduceOp.AVG, Group(2))
    engine.comm.collective_end(alone, None)
    assert alone.local_sq.value() == pytest.approx(16.0) and alone.global_sq.value() == pytest.approx(16.0)


@pytest.mark.slow
def test_fsdp2_run_on_two_ranks():
    """Per-layer fully_shard over gloo: every collective timed, all of it exposed (gloo
    collectives hold the training thread), weights unchanged by the profiler, and
    evaluation forwards under no_grad kept out of the step."""
    cfg = dict(steps=16, warmup=3, evaluate=True)
    res = run_ranks(fsdp_train, 2, cfg)
    plain = run_ranks(fsdp_train, 2, dict(cfg, profile=False))
    assert [r["checksum"] for r in res] == [r["checksum"] for r in plain]
    s = res[0]["summary"]
    assert s["comm_source"] == "fsdp" and s["comm_unmeasured"] is None and not s["parts_disabled"]
    fsdp = s["run"]["fsdp"]
    # 4 resharded layers + the root (its last Linear): 5 gathers in forward, 4 again in
    # backward (the root keeps its parameters), one reduce-scatter per unit.
    assert fsdp["units"] == 5 and fsdp["all_gathers"] == 9 and fsdp["reduce_scatters"] == 5
    assert fsdp["api"] == "FSDP2"
    # The reduce-scatter input is the full (padded) gradient: every parameter's bytes.
    assert fsdp["reduce_scatter_bytes"] == pytest.approx(res[0]["param_bytes"], rel=0.01)
    assert s["grad_bytes"] == (fsdp["all_gather_bytes"] + fsdp["reduce_scatter_bytes"]) // 2
    # The model's size is the whole model; what this rank holds is its shard.
    assert s["run"]["param_bytes"] == res[0]["param_bytes"]
    assert s["run"]["local_param_bytes"] == pytest.approx(s["run"]["param_bytes"] / 2, rel=0.01)
    per = s["per_step_ms"]
    for r in res:  # the collectives' own wall time, timed around dist.* in each process
        # Both average the same steps: those kept by step time.
        wall = r["training_collectives_ms"]
        row = s["ranks"][res.index(r)]
        # (bounds a loaded machine cannot cross: the accuracy itself is benchmarks/fidelity.py's)
        assert 0.5 * wall <= row["comm_total"] <= 2.0 * wall + 1.0, (row, wall)
    assert per["comm_exposed"] == pytest.approx(per["comm_total"], rel=0.05)
    assert per["compute"] == pytest.approx(per["step"] - per["overhead"])
    # The phases are compute: the projection at the measured size gives the measured step.
    assert per["forward"] + per["backward"] + per["optimizer"] <= per["compute"] * 1.1 + 0.5
    at_two = s["projection"]["step_ms"][s["projection"]["gpus"].index(2)]
    assert at_two == pytest.approx(per["step"], rel=0.15), (at_two, per)
    assert s["run"]["sync_passes"] == 1
    # The noise scale from each rank's gradient and the shards of the reduced one, one
    # sample per log interval (steps 0, 5, 10, 15), combined across ranks in the gathers.
    gns = s["run"]["gradient_noise"]
    assert gns["samples"] == 4 and gns["B_simple"] > 1.0, gns
    assert res[1]["summary"]["run"]["gradient_noise"] == gns
    assert "identical_data" not in {f["id"] for f in s["advice"]}
    comm = next(f for f in s["advice"] if f["id"] == "comm_bound")
    assert "all-gathers and reduce-scatters" in comm["title"]
    assert "MixedPrecisionPolicy" in comm["action"] and "reshard_after_forward=False" in comm["action"]


@pytest.mark.slow
def test_replica_all_reduce_of_hsdp_and_replicate_is_timed():
    """HSDP (two replicas of one shard) and FSDP's replicate all-reduce each unit's
    gradient across replicas with a plain dist.all_reduce: dtprofile times it through
    the proxy it puts in FSDP's collectives module, leaves the weights as they are, and
    reads the same gradient noise scale as from the sharded model's reduce-scatters."""
    runs = {
        layout: run_ranks(fsdp_train, 2, dict(steps=16, warmup=3, layout=layout))
        for layout in ("hsdp", "replicate", "fsdp", "hsdp_1x2")
    }
    plain = run_ranks(fsdp_train, 2, dict(steps=16, warmup=3, layout="hsdp", profile=False))
    assert [r["checksum"] for r in runs["hsdp"]] == [r["checksum"] for r in plain]
    for layout in ("hsdp", "replicate"):
        res = runs[layout]
        s = res[0]["summary"]
        assert s["comm_source"] == "fsdp" and not s["parts_disabled"], layout
        assert all(r["fsdp_dist_restored"] for r in res)
        # Nothing sharded: no gathers or scatters; each unit's whole gradient all-reduced.
        fsdp = s["run"]["fsdp"]
        assert fsdp["replicas"] == 2 and fsdp["replica_all_reduces"] == 5, fsdp
        assert fsdp["all_gathers"] == 0 and fsdp["reduce_scatters"] == 0
        assert fsdp["replica_all_reduce_bytes"] == pytest.approx(res[0]["param_bytes"], rel=0.01)
        assert s["grad_bytes"] == fsdp["replica_all_reduce_bytes"]  # an all-reduce counts in full
        assert s["run"]["sync_passes"] == 1
        for rank, r in enumerate(res):  # the all-reduces' wall time, timed around dist.all_reduce
            row, wall = s["ranks"][rank], r["training_collectives_ms"]
            assert r["all_reduce_ms"] > 0 and r["all_gather_ms"] == r["reduce_scatter_ms"] == 0
            assert 0.85 * wall <= row["comm_total"] <= 1.25 * wall + 1.0, (layout, row, wall)
        per = s["per_step_ms"]
        at_two = s["projection"]["step_ms"][s["projection"]["gpus"].index(2)]
        assert at_two == pytest.approx(per["step"], rel=0.15), (layout, at_two, per)
        comm = next(f for f in s["advice"] if f["id"] == "comm_bound")
        assert "FSDP's all-reduces across replicas" in comm["title"], comm["title"]
    # Same seeds, same batches: the same gradients whichever way they were reduced.
    noise = {layout: res[0]["summary"]["run"]["gradient_noise"] for layout, res in runs.items()}
    assert noise["fsdp"]["samples"] == noise["hsdp"]["samples"] == noise["replicate"]["samples"] == 4
    assert noise["fsdp"]["B_simple"] > 1.0
    for layout in ("hsdp", "replicate"):
        assert noise[layout]["B_simple"] == pytest.approx(noise["fsdp"]["B_simple"], rel=1e-3), noise
        assert noise[layout]["grad_sq_norm"] == pytest.approx(noise["fsdp"]["grad_sq_norm"], rel=1e-3), noise
    # A 1 x 2 mesh: sharded over both ranks, then an all-reduce across a replicate group of
    # one, which moves nothing: not timed, not counted, not advised on; the run reads as
    # the sharded model it is. (The reduce-scatter -> all-reduce chain of real HSDP, 4+
    # ranks, is tested on a fake:
    # test_hsdp_noise_sample_pairs_the_scatter_input_with_the_replica_all_reduce_output.)
    chained = runs["hsdp_1x2"][0]["summary"]
    fsdp = chained["run"]["fsdp"]
    assert fsdp["reduce_scatters"] == 5 and fsdp["replica_all_reduces"] == 0 and fsdp["replica_all_reduce_bytes"] == 0
    assert fsdp["replicas"] == 1 and chained["grad_bytes"] == runs["fsdp"][0]["summary"]["grad_bytes"]
    assert "across replicas" not in next(f for f in chained["advice"] if f["id"] == "comm_bound")["title"]
    assert noise["hsdp_1x2"]["samples"] == 4
    assert noise["hsdp_1x2"]["B_simple"] == pytest.approx(noise["fsdp"]["B_simple"], rel=1e-6), noise


@pytest.mark.slow
def test_fsdp1_collectives_are_timed():
    """FSDP1 (FullyShardedDataParallel around each layer and the root, on the CPU): its
    all-gathers and reduce-scatters, plain dist calls in FSDP's modules, are timed
    through the same proxy; the weights are as without the profiler."""
    res = run_ranks(fsdp_train, 2, dict(steps=16, warmup=3, layout="fsdp1"))
    plain = run_ranks(fsdp_train, 2, dict(steps=16, warmup=3, layout="fsdp1", profile=False))
    assert [r["checksum"] for r in res] == [r["checksum"] for r in plain]
    assert all(r["fsdp_dist_restored"] for r in res)
    s = res[0]["summary"]
    assert s["comm_source"] == "fsdp" and s["comm_unmeasured"] is None and not s["parts_disabled"]
    fsdp = s["run"]["fsdp"]
    # 5 units; 4 layers regather in backward (FULL_SHARD frees them after forward).
    assert fsdp["units"] == 5 and fsdp["all_gathers"] == 9 and fsdp["reduce_scatters"] == 5, fsdp
    assert s["grad_bytes"] == (fsdp["all_gather_bytes"] + fsdp["reduce_scatter_bytes"]) // 2
    for rank, r in enumerate(res):
        row, wall = s["ranks"][rank], r["training_collectives_ms"]
        # (bounds a loaded machine cannot cross: the accuracy itself is benchmarks/fidelity.py's)
        assert 0.5 * wall <= row["comm_total"] <= 2.0 * wall + 1.0, (row, wall)
    per = s["per_step_ms"]
    assert 0 < per["comm_exposed"] <= per["comm_total"] < per["step"]
    comm = next(f for f in s["advice"] if f["id"] == "comm_bound")
    assert fsdp["api"] == "FSDP1" and "all-gathers and reduce-scatters" in comm["title"]
    # FSDP1's own knobs, not fully_shard's.
    assert "mixed_precision=MixedPrecision(" in comm["action"] and "SHARD_GRAD_OP" in comm["action"]
    assert "fully_shard" not in comm["action"]
    # NO_SHARD: FSDP1 as DDP, each unit's gradient all-reduced (FSDP1's own dist call).
    sharded = s
    res = run_ranks(fsdp_train, 2, dict(steps=12, warmup=3, layout="fsdp1_no_shard"))
    s = res[0]["summary"]
    # The model's size is the whole model however it is sharded; a FULL_SHARD rank holds half.
    assert sharded["run"]["param_bytes"] == s["run"]["param_bytes"] == res[0]["param_bytes"]
    assert sharded["run"]["local_param_bytes"] == pytest.approx(s["run"]["param_bytes"] / 2, rel=0.01)
    # use_orig_params=True: the original parameters are views of the shard; the size is
    # still the whole model's.
    orig = run_ranks(fsdp_train, 2, dict(steps=6, warmup=2, layout="fsdp1", use_orig_params=True))[0]["summary"]
    assert orig["run"]["param_bytes"] == s["run"]["param_bytes"]
    assert orig["run"]["local_param_bytes"] == sharded["run"]["local_param_bytes"]
    fsdp = s["run"]["fsdp"]
    assert fsdp["replica_all_reduces"] == 5 and fsdp["all_gathers"] == fsdp["reduce_scatters"] == 0, fsdp
    assert fsdp["replicas"] == 2 and s["grad_bytes"] == fsdp["replica_all_reduce_bytes"] == res[0]["param_bytes"]
    for rank, r in enumerate(res):
        row, wall = s["ranks"][rank], r["training_collectives_ms"]
        # (bounds a loaded machine cannot cross: the accuracy itself is benchmarks/fidelity.py's)
        assert 0.5 * wall <= row["comm_total"] <= 2.0 * wall + 1.0, (row, wall)


@pytest.mark.slow
def test_fsdp2_async_unshard_is_timed_through_its_future_and_wait():
    """With the all-gathers issued async (gloo on its own thread), their end comes from
    the work's future and the step's exposure from FSDP's wait for them."""
    res = run_ranks(fsdp_train, 2, dict(steps=12, warmup=3, async_unshard=True, reshard_after_forward=False))
    s = res[0]["summary"]
    assert s["run"]["fsdp"]["all_gathers"] == 5  # nothing regathered in backward
    per = s["per_step_ms"]
    assert 0 < per["comm_exposed"] <= per["comm_total"]
    wall = res[0]["reduce_scatter_ms"]  # the blocking part alone
    assert per["comm_exposed"] >= 0.9 * wall
    comm = next((f for f in s["advice"] if f["id"] == "comm_bound"), None)
    assert comm is None or "reshard_after_forward" not in comm["action"]


@pytest.mark.slow
def test_fsdp2_accumulation_that_reduces_every_micro_batch_is_named():
    """Three micro-batches: without set_requires_gradient_sync(False) every backward
    reduce-scatters (3 passes, 15 reduce-scatters); with it, only the last (1 pass)."""
    naive = run_ranks(fsdp_train, 2, dict(steps=8, warmup=2, accumulate=3))[0]["summary"]
    fixed = run_ranks(fsdp_train, 2, dict(steps=8, warmup=2, accumulate=3, no_sync_accumulation=True))[0]["summary"]
    assert naive["run"]["micro_batches"] == 3 and naive["run"]["sync_passes"] == 3
    assert naive["run"]["fsdp"]["reduce_scatters"] == 15
    finding = next(f for f in naive["advice"] if f["id"] == "accumulation_sync")
    assert "reduce-scatters" in finding["title"] and "set_requires_gradient_sync(False)" in finding["action"]
    assert fixed["run"]["sync_passes"] == 1 and fixed["run"]["fsdp"]["reduce_scatters"] == 5
    assert "accumulation_sync" not in {f["id"] for f in fixed["advice"]}
    # The sharded .grad stays None between unsynced micro-batches: not a skipped update.
    for s in (naive, fixed):
        assert s["steps_total"] == 8 and s["steps_skipped_update"] == 0, (s["steps_total"], s["steps_skipped_update"])
        assert "skipped_updates" not in {f["id"] for f in s["advice"]}
    # HSDP (2 x 1 mesh: nothing to scatter): every micro-batch all-reduces across the
    # replicas, unless set_requires_all_reduce(False) holds it back to the last.
    hsdp = run_ranks(fsdp_train, 2, dict(steps=8, warmup=2, accumulate=3, layout="hsdp"))[0]["summary"]
    assert hsdp["run"]["sync_passes"] == 3 and hsdp["run"]["fsdp"]["replica_all_reduces"] == 15
    assert next(f for f in hsdp["advice"] if f["id"] == "accumulation_sync")["title"].startswith(
        "Gradient accumulation all-reduces on 3 of 3"
    )
    last = run_ranks(fsdp_train, 2, dict(steps=8, warmup=2, accumulate=3, layout="hsdp", all_reduce_on_last=True))
    assert last[0]["summary"]["run"]["sync_passes"] == 1
    assert last[0]["summary"]["run"]["fsdp"]["replica_all_reduces"] == 5
    assert last[0]["summary"]["steps_total"] == 8 and last[0]["summary"]["steps_skipped_update"] == 0
    assert [r["checksum"] for r in last] == [
        r["checksum"]
        for r in run_ranks(
            fsdp_train, 2, dict(steps=8, warmup=2, accumulate=3, layout="hsdp", all_reduce_on_last=True, profile=False)
        )
    ]


@pytest.mark.slow
def test_fsdp2_ranks_training_on_the_same_batches_are_named():
    """Every rank the same batches: the reduced gradient equals each rank's, so the
    noise scale is zero (the check that the shards are summed on the right scale)."""
    for layout in ("fsdp", "hsdp"):  # reduce-scattered shards; all-reduced across replicas
        s = run_ranks(fsdp_train, 2, dict(steps=11, warmup=3, same_data=True, layout=layout))[0]["summary"]
        gns = s["run"]["gradient_noise"]
        assert gns["samples"] == 3 and gns["B_simple"] == pytest.approx(0.0, abs=1e-3), (layout, gns)
        assert gns["grad_sq_norm"] > 0.1
        finding = next(f for f in s["advice"] if f["id"] == "identical_data")
        assert finding["severity"] == "high" and "DistributedSampler" in finding["action"]


@pytest.mark.parametrize("clock_kind", ["device", "host"])
def test_a_synchronous_collective_blocks_only_on_a_host_clock(clock_kind):
    """On CUDA a collective without async_op still runs on FSDP's stream (the compute
    stream's wait is timed apart); on the CPU it held the training thread throughout."""
    from dtprofile.capture.clocks import FakeEventClock
    from dtprofile.engine import Engine
    from dtprofile.options import Options

    clock = FakeEventClock() if clock_kind == "device" else HostClock()
    engine = Engine(Options(), clock=clock)
    engine.start()
    engine.passes.forward_open = True  # inside a training forward
    interval = engine.comm.collective_start("all_gather", 64)
    engine.comm.collective_end(interval, None)
    span = engine.comm.wait_start()
    engine.comm.wait_end(span)
    engine.passes.forward_open = False
    assert interval.end is not None and interval.blocking is (clock_kind == "host")
    assert engine.steps.current.comm == [interval] and engine.steps.current.comm_waits == [span]
    # Outside a training pass (evaluation under no_grad) nothing is recorded.
    assert engine.comm.collective_start("all_gather", 64) is None and engine.comm.wait_start() is None
    engine.stop()


def test_a_sharded_run_without_timed_collectives_says_so():
    """FSDP2 steps that issued nothing dtprofile timed (a custom all-reduce hook, changed
    FSDP internals) are reported as unmeasured with the reason, not as free of
    communication."""
    from dtprofile.engine import Engine
    from dtprofile.options import Options

    engine = Engine(Options(), clock=HostClock())
    engine.comm.world_size, engine.comm.comm_source = 2, "fsdp"
    assert engine.comm.unmeasured_reason() is None  # no step yet: nothing to say
    engine.steps.steps_seen = 3
    assert "FSDP ran steps without a collective dtprofile could time" in engine.comm.unmeasured_reason()
    for api in ("FSDP2", "FSDP1"):  # named as the model's FSDP
        engine.comm.fsdp = types.SimpleNamespace(api=api)
        assert f"{api} ran steps without a collective dtprofile could time" in engine.comm.unmeasured_reason()
    engine.comm.fsdp_config = {"units": 2, "all_gathers": 2}
    assert engine.comm.unmeasured_reason() is None


def test_an_fsdp2_without_comm_objects_is_reported_not_failed(monkeypatch):
    """Older FSDP2 called its collectives directly: nothing to wrap. The run says why its
    communication is unmeasured, changes nothing on the groups and disables no part."""
    import torch

    import dtprofile.capture.fsdp as fsdp_module
    from dtprofile.engine import Engine
    from dtprofile.options import Options

    class OldGroup:
        def wait_for_unshard(self):
            return None

    group = OldGroup()
    assert "_all_gather_comm / _reduce_scatter_comm" in fsdp_module.unsupported_reason([group])
    assert fsdp_module.unsupported_reason([_FakeGroup()]) is None
    monkeypatch.setattr(fsdp_module, "fsdp_param_groups", lambda module: [group])
    engine = Engine(Options(), clock=HostClock())
    engine.comm.world_size = 2
    engine.attach_fsdp(torch.nn.Linear(2, 2))
    assert engine.comm.fsdp is None and engine.comm.comm_source is None and "wait_for_unshard" not in vars(group)
    assert engine.parts["comm"].enabled
    assert "has no _all_gather_comm" in engine.comm.unmeasured_reason()


@pytest.mark.slow
@pytest.mark.parametrize("fsdp1", [False, True])
def test_a_second_profiler_on_the_same_fsdp_model_takes_over_from_the_first(fsdp1):
    from workers import fsdp_two_profilers

    r = run_ranks(fsdp_two_profilers, 2, dict(fsdp1=fsdp1), timeout_s=120)[0]
    (_, second), reasons = r["comm_total"], r["comm_unmeasured"]
    assert r["complete"] == [False, True] and r["steps_total"] == [0, 6], r
    assert second is not None and second > 0 and reasons[1] is None, r
    assert any("still running" in w for w in r["warnings"])
