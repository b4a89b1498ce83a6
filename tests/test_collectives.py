"""Tensor parallelism's collectives (dtprofile.capture.collectives): the mesh, and every
DTensor collective timed per mesh dimension, kind and phase.

The fast tests drive the timer's hot path with stand-in ops (no process group); the
slow ones train real DTensor models on gloo ranks (tests/tp_workers.py): a TP MLP, a
sequence-parallel block, and FSDP2 x TP on a 2 x 2 mesh. Their timing checks are loose:
the ranks share 2 cores, so a collective's span holds the other rank's compute.
"""

from __future__ import annotations

import json
import statistics
import warnings

import pytest
import torch
from torch._ops import OpOverloadPacket

import dtprofile.capture.collectives as col
from dtprofile.capture.clocks import FakeEventClock
from dtprofile.capture.collectives import CollectiveTimer, MeshDim, MeshInfo, figures_rows, find_mesh

IN = 64


# ---------------------------------------------------------------------------- fast: no process group
def _mesh_info() -> MeshInfo:
    return MeshInfo(
        device_type="cpu",
        shape=[2, 2],
        dim_names=["dp", "tp"],
        dims=[MeshDim(0, "dp", 2, "fsdp", "1", [0, 2]), MeshDim(1, "tp", 2, "tp", "3", [0, 1])],
        parameters=4,
        fsdp=True,
    )


def _stand_ins(timer: CollectiveTimer, kind: str = "all_reduce", blocking: bool = False):
    """A launch packet whose "collective" returns a fresh tensor, and the wait packet."""
    launch = col._TimedPacket(torch.ops.aten.neg, timer, (kind, col._first, blocking))
    launch._dtprofile_call = lambda t, op, group: t.neg()
    wait = col._TimedWait(torch.ops.aten.clone, timer, None)
    wait._dtprofile_call = lambda t: t
    return launch, wait


def _timer(**kwargs) -> CollectiveTimer:
    timer = CollectiveTimer(_mesh_info(), **kwargs)
    timer.installed = True  # (its hot path only: nothing put in torch.ops)
    return timer


def test_find_mesh_is_none_without_dtensor_parameters():
    assert find_mesh(torch.nn.Linear(2, 2)) is None
    assert find_mesh(object()) is None


def test_mesh_info_is_json_and_names_its_dimensions():
    info = _mesh_info()
    d = json.loads(json.dumps(info.to_dict()))
    assert d["dim_names"] == ["dp", "tp"] and [x["role"] for x in d["dims"]] == ["fsdp", "tp"]
    assert info.roles == {"dp": "fsdp", "tp": "tp"}
    assert info.dim("tp").group_name == "3" and info.dim(0).name == "dp" and info.dim("pp") is None
    assert MeshDim(2, None, 4, "dp", "9", []).label == "dim2"


def test_a_collective_and_its_wait_fold_into_the_steps_counters():
    timer = _timer(phase_of=lambda: "forward")
    launch, wait = _stand_ins(timer)
    x = torch.ones(8, IN)
    launch(x, "sum", "3")  # outside a step: passes straight through
    assert not timer._pending
    timer.begin_step()
    for _ in range(3):
        out = launch(x, "sum", "3")  # the tp dimension's group name
        assert torch.equal(wait(out), -x)
    launch(x, "sum", "1")  # never waited for: counted, not timed
    figures = timer.end_step()
    tp = figures["by_dim"]["tp"]["all_reduce"]["forward"]
    assert tp["count"] == 3 and tp["bytes"] == 3 * 8 * IN * 4
    assert 0 <= tp["waited_ms"] <= tp["total_ms"] < 1000
    assert figures["untimed"]["dp"]["all_reduce"]["forward"] == {"count": 1, "bytes": 8 * IN * 4}
    assert figures["unwaited"] == 1 and figures["step"] == 0
    rows = list(figures_rows(figures))
    assert rows == [{"dim": "tp", "kind": "all_reduce", "phase": "forward", **tp}]
    json.dumps(figures)
    timer.begin_step()  # the next step starts from zero
    assert timer.end_step()["by_dim"] == {}


def test_groups_outside_the_mesh_are_labelled_and_bounded(monkeypatch):
    monkeypatch.setattr(col, "MAX_OTHER_GROUPS", 2)
    timer = _timer(phase_of=lambda: "other")
    launch, wait = _stand_ins(timer, kind="broadcast", blocking=True)
    timer.begin_step()
    for name in ("a", "b", "c", "d"):
        launch(torch.ones(2), 0, name)
    labels = set(timer.end_step()["by_dim"])
    assert labels == {"group:a", "group:b", "other"}


def test_default_phase_is_backward_inside_autograds_backward():
    timer = _timer()
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("in Function.forward", timer._default_phase()))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", timer._default_phase()))
            return g * 2

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    with torch.no_grad():
        seen.append(("no_grad", timer._default_phase()))
    seen.append(("grad", timer._default_phase()))
    # (a Redistribute runs grad-disabled inside Function.forward: the model's forward hooks tell it)
    assert seen == [
        ("in Function.forward", "other"),
        ("backward", "backward"),
        ("no_grad", "other"),
        ("grad", "forward"),
    ]
    model = torch.nn.Linear(2, 2)
    watched = CollectiveTimer(phase_of=None, model=model)
    watched.installed = True
    watched._watch = col._ForwardWatch(model)

    def inside(module, args, output):
        seen.append(("model forward", watched._default_phase()))
        with torch.no_grad():
            seen.append(("no_grad inside forward", watched._default_phase()))

    model.register_forward_hook(inside, prepend=True)  # (inside the forward: before the watch closes it)
    model(torch.ones(1, 2))
    with torch.no_grad():
        model(torch.ones(1, 2))  # evaluation
    watched._watch.remove()
    assert seen[-4:] == [
        ("model forward", "forward"),
        ("no_grad inside forward", "forward"),
        ("model forward", "other"),
        ("no_grad inside forward", "other"),
    ]


def test_a_device_clock_is_read_at_a_later_poll_never_at_once():
    clock = FakeEventClock()
    timer = _timer(clock=clock, phase_of=lambda: "backward")
    launch, wait = _stand_ins(timer, kind="reduce_scatter")
    timer.begin_step()
    out = launch(torch.ones(4, IN), "sum", "3")
    clock.advance(2.0)
    wait(out)  # (the wait's start and end marks: both at 2.0 ms)
    clock.advance(1.0)
    assert timer.end_step() is None and timer.poll() == []  # the device has not got there
    clock.complete_all()
    (figures,) = timer.poll()
    rs = figures["by_dim"]["tp"]["reduce_scatter"]["backward"]
    assert rs["count"] == 1 and rs["total_ms"] == pytest.approx(2.0) and rs["waited_ms"] == pytest.approx(0.0)
    assert clock.released == 4  # the launch's start and end, the wait's start and end: each released once
    assert timer.poll() == []
    # Steps come out in order: one without collectives waits behind one not yet read.
    timer.begin_step()
    wait(launch(torch.ones(4, IN), "sum", "3"))
    assert timer.end_step() is None
    timer.begin_step()
    assert timer.end_step() is None
    clock.complete_all()
    assert [f["step"] for f in timer.poll()] == [1, 2]


def test_past_the_records_limit_a_device_clock_counts_without_times(monkeypatch):
    monkeypatch.setattr(col, "MAX_RECORDS_PER_STEP", 1)
    clock = FakeEventClock()
    timer = _timer(clock=clock, phase_of=lambda: "forward")
    launch, wait = _stand_ins(timer)
    timer.begin_step()
    for _ in range(3):
        wait(launch(torch.ones(4), "sum", "3"))
    assert timer.end_step() is None
    clock.complete_all()
    (figures,) = timer.poll()
    assert figures["by_dim"]["tp"]["all_reduce"]["forward"]["count"] == 1
    assert figures["untimed"]["tp"]["all_reduce"]["forward"]["count"] == 2
    assert clock.released == 12  # (per collective: the launch's start and end, the wait's)


def test_coalesced_collectives_complete_at_their_last_wait():
    timer = _timer(phase_of=lambda: "backward")
    launch = col._TimedPacket(torch.ops.aten.neg, timer, ("all_reduce", col._first_list, False))
    launch._dtprofile_call = lambda ts, op, group: [t.neg() for t in ts]
    _, wait = _stand_ins(timer)
    timer.begin_step()
    outs = launch([torch.ones(3), torch.ones(5)], "sum", "3")
    wait(outs[0])
    assert timer._pending  # one output still to wait for
    wait(outs[1])
    ar = timer.end_step()["by_dim"]["tp"]["all_reduce"]["backward"]
    assert ar["count"] == 1 and ar["bytes"] == 8 * 4


def test_an_internal_error_warns_once_disables_and_never_reaches_training():
    calls = []

    def broken_phase():
        calls.append(1)
        raise ValueError("boom")

    timer = _timer(phase_of=broken_phase)
    launch, wait = _stand_ins(timer)
    timer.begin_step()
    x = torch.ones(4)
    with pytest.warns(RuntimeWarning, match="collective timing disabled.*boom"):
        out = launch(x, "sum", "3")
    assert torch.equal(out, -x)  # the collective's result, as without the timer
    assert not timer.enabled and not timer.measuring and "ValueError" in timer.error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(wait(launch(x, "sum", "3")), -x)  # passes straight through, silently
        assert timer.end_step() is None
        timer.begin_step()
        assert not timer.measuring and len(calls) == 1
    # The collective's own error is the training's: it propagates, the timer stays on.
    timer = _timer(phase_of=lambda: "forward")
    launch, _ = _stand_ins(timer)
    launch._dtprofile_call = lambda *a: (_ for _ in ()).throw(RuntimeError("peer died"))
    timer.begin_step()
    with pytest.raises(RuntimeError, match="peer died"):
        launch(x, "sum", "3")
    assert timer.enabled


def test_c10d_calls_on_the_meshs_groups_are_timed_their_async_end_in_the_futures_callback():
    dp_group, stranger = object(), object()
    info = _mesh_info()
    info.dims[0].group = dp_group
    timer = CollectiveTimer(info, phase_of=lambda: "backward", c10d=True)
    timer.installed = True
    futures = []

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        if not async_op:
            return None
        futures.append(torch.futures.Future())
        return type("Work", (), {"get_future": lambda self: futures[-1]})()

    timed = col._TimedFunction(reduce_scatter_tensor, timer, "reduce_scatter", col._c10d_bytes_second)
    out, full = torch.empty(4), torch.empty(8)
    timer.begin_step()
    timed(out, full, group=stranger)  # not the mesh's: passes straight through
    timed(out, full, None, dp_group)  # blocking: waited for throughout
    work = timed(out, full, group=dp_group, async_op=True)
    assert work is not None and len(futures) == 1
    futures[0].set_result(None)  # (gloo: on its own thread)
    rs = timer.end_step()["by_dim"]["dp"]["reduce_scatter"]["backward"]
    assert rs["count"] == 2 and rs["bytes"] == 2 * 8 * 4
    assert rs["waited_ms"] <= rs["total_ms"]


def _patchable_state() -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    state = {}
    for ns in ("_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
        namespace = getattr(torch.ops, ns)
        state.update({f"{ns}.{k}": v for k, v in vars(namespace).items()})
    for name in col._C10D_FUNCTIONS:
        for module in (dist, c10d):
            state[f"{module.__name__}.{name}"] = getattr(module, name, None)
    return state


def test_install_and_remove_put_back_exactly_what_was_there():
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401

    before = _patchable_state()
    original = torch.ops._c10d_functional.all_reduce
    timer = CollectiveTimer(_mesh_info(), c10d=True)
    assert timer.install() and col.installed_timer() is timer
    try:
        packet = torch.ops._c10d_functional.all_reduce
        assert type(packet) is col._TimedPacket and isinstance(packet, OpOverloadPacket)
        assert packet == original and original == packet and hash(packet) == hash(original)
        assert packet.default is original.default and {packet: 1}[original] == 1
        assert type(torch.ops._c10d_functional.wait_tensor) is col._TimedWait
        assert isinstance(dist.all_gather_single, col._TimedFunction)
        with pytest.warns(UserWarning, match="already timing"):
            assert not CollectiveTimer(_mesh_info()).install()
    finally:
        timer.remove()
    timer.remove()  # (twice: nothing more)
    after = _patchable_state()
    assert {k: id(v) for k, v in after.items()} == {k: id(v) for k, v in before.items()}
    assert col.installed_timer() is None and packet._dtprofile_timer is None


def test_remove_leaves_a_patch_made_on_top_in_place():
    import torch.distributed._functional_collectives  # noqa: F401

    original = torch.ops._c10d_functional.broadcast
    timer = CollectiveTimer(_mesh_info())
    timer.install()
    ours = torch.ops._c10d_functional.broadcast
    theirs = object()
    torch.ops._c10d_functional.broadcast = theirs
    try:
        timer.remove()
        assert torch.ops._c10d_functional.broadcast is theirs and ours._dtprofile_timer is None
    finally:
        torch.ops._c10d_functional.broadcast = original


# ---------------------------------------------------------------------------- fast: wired into the engine
class _Listener:
    """What the engine's part (MeshComm) is told, as a list of events and spans."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.events: list = []
        self.spans: list = []

    def launched(self, nbytes):
        self.events.append(("launched", nbytes))
        return {"bytes": nbytes, "end": None} if self.keep else None

    def wait_began(self):
        span = [len(self.events), None]
        self.spans.append(span)
        self.events.append("wait_began")
        return span

    def wait_ended(self, span):
        span[1] = len(self.events)
        self.events.append("wait_ended")

    def completed(self, token, span):
        token["end"] = span[1]
        self.events.append(("completed", token["bytes"]))


def test_the_listener_hears_each_launch_wait_and_completion_and_a_raising_wait_still_ends_its_span():
    listener = _Listener()
    timer = _timer(phase_of=lambda: "forward", listener=listener)
    launch, wait = _stand_ins(timer)
    x = torch.ones(2, IN)
    timer.begin_step()
    wait(launch(x, "sum", "3"))
    # The launch holds the caller too (a span of its own), then the wait, which completes it.
    launched = [("launched", 2 * IN * 4), "wait_began", "wait_ended"]
    assert listener.events == launched + ["wait_began", "wait_ended", ("completed", 2 * IN * 4)]
    out = launch(x, "sum", "3")
    wait._dtprofile_call = lambda t: (_ for _ in ()).throw(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):  # the training's error: it propagates
        wait(out)
    assert all(end is not None for _, end in listener.spans) and timer.enabled  # (the step never waits for it)
    # A blocking collective's whole call is a wait; a listener that keeps nothing gets no span.
    blocking, _ = _stand_ins(timer, kind="all_to_all", blocking=True)
    listener.events.clear()
    blocking(x, "sum", "3")
    assert listener.events == [("launched", 2 * IN * 4), "wait_began", "wait_ended", ("completed", 2 * IN * 4)]
    listener.keep = False
    listener.events.clear()
    wait._dtprofile_call = lambda t: t
    wait(launch(x, "sum", "3"))
    blocking(x, "sum", "3")
    assert listener.events == [("launched", 2 * IN * 4)] * 2
    figures = timer.end_step()["by_dim"]["tp"]
    # (the wait that raised never completed: its collective is not counted)
    assert figures["all_reduce"]["forward"]["count"] == 2 and figures["all_to_all"]["forward"]["count"] == 2


def test_a_tp_steps_waits_are_exposed_communication_never_forward_backward_or_update_compute():
    from dtprofile.capture.clocks import HostClock
    from dtprofile.capture.records import MESH_COLLECTIVE, CommInterval, PendingStep

    step = PendingStep(start=0.0)
    step.forward.append([0.001, 0.011])  # 10 ms, of which 3 waited for the all-reduce of its output
    step.backward.append([0.012, 0.032, 0.032])  # 20 ms, of which 4 waited
    step.optimizer = (0.033, 0.037)  # 4 ms, of which 1 waited (DTensor reducing Partial gradients)
    step.end = 0.040
    for launch, a, b in ((0.004, 0.007, 0.010), (0.015, 0.020, 0.024), (0.034, 0.035, 0.036)):
        step.comm.append(CommInterval(start=launch, end=b, nbytes=4096, bucket=False, kind=MESH_COLLECTIVE))
        step.comm_waits.append([a, b])
    step.comm_measured = True
    record = step.to_record(HostClock(), data_wait_from="gap")
    assert record.forward == pytest.approx(7.0) and record.backward == pytest.approx(16.0)
    assert record.optimizer == pytest.approx(3.0)
    assert record.comm_exposed == pytest.approx(8.0) and record.comm_total == pytest.approx(6.0 + 9.0 + 2.0)
    assert record.compute == pytest.approx(record.step - record.overhead) and record.overhead == pytest.approx(
        record.data_wait + 8.0
    )
    assert record.grad_bytes != record.grad_bytes  # NaN: activations' bytes are no gradient's


def test_the_rows_carry_each_dimensions_figures_and_the_summary_has_their_medians():
    from dtprofile.analysis.mesh_comm import comm_by_dim
    from dtprofile.capture.mesh_comm import slot_of
    from dtprofile.gather import STEP_KEYS, pack, unpack
    from dtprofile.mesh_keys import COLL_KEYS, coll_key
    from dtprofile.summary import rank_row

    mesh = {
        "dims": [
            {"label": "dp", "size": 2, "role": "fsdp", "slot": "d0"},
            {"label": "tp", "size": 2, "role": "tp", "slot": "d1"},
        ]
    }
    assert slot_of(mesh, "tp") == "d1" and slot_of(mesh, "group:9") == "other"
    assert set(COLL_KEYS) <= set(STEP_KEYS)
    rows = []
    for rank, waited in enumerate((1.0, 3.0, 2.0)):
        values = dict.fromkeys(COLL_KEYS, 0.0)
        for phase in ("forward", "backward"):
            values[coll_key("d1", "all_reduce", phase, "count")] = 1.0
            values[coll_key("d1", "all_reduce", phase, "bytes")] = 4096.0
            values[coll_key("d1", "all_reduce", phase, "total_ms")] = 2.0
            values[coll_key("d1", "all_reduce", phase, "waited_ms")] = waited
        values[coll_key("d0", "all_gather", "forward", "count")] = 1.0
        row = rank_row(rank, 10, {"step": 10.0}, 0, {}, collectives=values)
        rows += unpack([pack(row, [float("nan")] * 0, [])])  # (through the gather's vector)
    out = comm_by_dim(rows, mesh)
    assert set(out) == {"dp", "tp"} and out["tp"]["role"] == "tp" and out["tp"]["size"] == 2
    ar = out["tp"]["kinds"]["all_reduce"]
    assert ar["count"] == 2.0 and ar["bytes"] == 8192.0 and ar["waited_ms"] == 4.0  # (each rank's sum, then the median)
    assert set(ar["phases"]) == {"forward", "backward"} and ar["phases"]["forward"]["waited_ms"] == 2.0
    assert out["tp"]["total"]["total_ms"] == 4.0 and set(out["dp"]["kinds"]) == {"all_gather"}
    assert comm_by_dim([rank_row(0, 10, {"step": 10.0}, 0, {})], mesh) is None  # no rank counted a step
    assert comm_by_dim(rows, None) is None


def test_the_report_and_markdown_show_the_mesh_and_its_communication_per_dimension():
    from dtprofile.render import advice_markdown, format_report

    phase = {"count": 1.0, "bytes": 4096.0, "total_ms": 1.5, "waited_ms": 0.5}
    kind = {"count": 2.0, "bytes": 8192.0, "total_ms": 3.0, "waited_ms": 1.0, "phases": {"forward": phase}}
    summary = {
        "world_size": 2,
        "comm_source": "dtensor",
        "per_step_ms": {"step": 10.0, "comm_exposed": 1.0},
        "ratios": {},
        "mesh": {"dims": [{"label": "tp", "size": 2, "role": "tp"}]},
        "comm_by_dim": {"tp": {"size": 2, "role": "tp", "total": phase, "kinds": {"all_reduce": kind}}},
    }
    text, md = format_report(summary), advice_markdown(summary)
    assert "Communication per mesh dimension (mesh tp=2 (tp)):" in text and "Communication per mesh" in md
    line = "tp: all_reduce 2/step (fwd 1), 0.00819 MB, 3.00 ms total, 1.00 ms waited"
    assert line in text and line in md
    assert "DTensor's collectives" in text and "unmeasured" not in text
    plain = {"world_size": 2, "comm_source": "fsdp", "per_step_ms": {"step": 10.0}, "ratios": {}}
    assert "mesh" not in format_report(plain) and "mesh" not in advice_markdown(plain)


# ---------------------------------------------------------------------------- slow: gloo ranks
def _launch(fn, world, cfg):
    from distributed import run_ranks

    return run_ranks(fn, world, cfg, timeout_s=150)


def _check_patches_gone(r: dict) -> None:
    assert r["installed"] and r["enabled"], r["error"]
    assert {
        "_c10d_functional.all_reduce",
        "_c10d_functional.wait_tensor",
        "_c10d_functional.all_gather_into_tensor",
        "_c10d_functional.reduce_scatter_tensor",
    } <= set(r["patched_during"])
    assert r["left_after"] == [] and r["timed_after"] == [] and r["is_packet_after"]


def _check_against_by_hand(r: dict) -> None:
    """The timer's spans against the same collectives timed by hand around ``funcol``'s
    entry points and wait (outside the timer's packets: each by-hand span holds the
    timer's, so it is a little longer, never shorter)."""
    timer_ms = [f["totals"]["tp"]["total_ms"] for f in r["figures"]]
    hand_ms = [sum(ms for _, ms in spans) for spans in r["by_hand"]]
    for t, h, f, spans, wall in zip(timer_ms, hand_ms, r["figures"], r["by_hand"], r["walls"], strict=True):
        assert f["totals"]["tp"]["count"] == len(spans)
        assert t <= h + 0.05 and t <= wall, (t, h, wall)
    assert sum(timer_ms) >= 0.5 * sum(hand_ms), (timer_ms, hand_ms)


@pytest.mark.slow
def test_tp_mlp_all_reduces_in_forward_and_backward_timed_per_step():
    batch, steps = 16, 10
    for r in _launch(_tp_run(), 2, dict(kind="tp", steps=steps, batch=batch)):
        assert r["mesh"]["dim_names"] == ["tp"] and r["mesh"]["dims"][0]["role"] == "tp"
        assert r["mesh"]["dims"][0]["size"] == 2 and r["mesh"]["parameters"] == 4
        assert r["digest_timed"] == r["digest_plain"]  # bitwise: the timer changes nothing
        _check_patches_gone(r)
        assert len(r["figures"]) == steps
        for f in r["figures"]:
            assert set(f["by_dim"]) == {"tp"} and set(f["by_dim"]["tp"]) == {"all_reduce"}
            ar = f["by_dim"]["tp"]["all_reduce"]
            # RowwiseParallel's output in forward, ColwiseParallel's input gradient in backward:
            # batch x 64 float32 each.
            assert set(ar) == {"forward", "backward"}, ar
            for phase in ("forward", "backward"):
                assert ar[phase]["count"] == 1 and ar[phase]["bytes"] == batch * IN * 4
                assert 0 <= ar[phase]["waited_ms"] <= ar[phase]["total_ms"]
            assert f["unwaited"] == 0 and f["untimed"] == {}
        _check_against_by_hand(r)
        # A reference from outside the step: all-reduces of the same bytes on the same group,
        # by hand. Inside the step each span also holds the other rank's lag: the same order
        # of magnitude, bounded loosely.
        spans = [
            f["by_dim"]["tp"]["all_reduce"][phase]["total_ms"]
            for f in r["figures"]
            for phase in ("forward", "backward")
        ]
        per_collective, reference = statistics.median(spans), r["reference_ms"]
        assert 0.2 * min(reference) <= per_collective <= 50 * statistics.median(reference) + 5.0, (spans, reference)


@pytest.mark.slow
def test_sequence_parallel_gathers_and_scatters():
    batch, seq, steps = 4, 8, 5
    for r in _launch(_tp_run(), 2, dict(kind="sp", steps=steps, batch=batch, seq=seq)):
        assert r["digest_timed"] == r["digest_plain"]
        _check_patches_gone(r)
        full = batch * (2 * seq) * IN * 4  # the whole sequence (each rank holds seq of 2 * seq)
        for f in r["figures"]:
            tp = f["by_dim"]["tp"]
            # forward: gather the sequence before ColwiseParallel, reduce-scatter after
            # RowwiseParallel; backward: the reverse.
            for kind in ("all_gather", "reduce_scatter"):
                for phase in ("forward", "backward"):
                    assert tp[kind][phase]["count"] == 1 and tp[kind][phase]["bytes"] == full, (kind, phase, tp)
            # SequenceParallel's LayerNorm gradients are Partial: DTensor all-reduces them when
            # the optimizer reads them, outside forward and backward.
            assert tp["all_reduce"] == {"other": tp["all_reduce"]["other"]}
            assert tp["all_reduce"]["other"]["bytes"] == 2 * IN * 4
        _check_against_by_hand(r)


@pytest.mark.slow
def test_fsdp2_times_tp_on_a_2x2_mesh_each_collective_on_its_dimension():
    from tp_workers import fsdp_tp_run

    results = _launch(fsdp_tp_run, 4, dict(steps=4, batch=8))
    for rank, r in enumerate(results):
        assert r["enabled"], r["error"]
        mesh = r["mesh"]
        assert mesh["dim_names"] == ["dp", "tp"] and mesh["shape"] == [2, 2] and mesh["fsdp"]
        assert [d["role"] for d in mesh["dims"]] == ["fsdp", "tp"]
        assert rank in r["ranks"]["dp"] and rank in r["ranks"]["tp"]
        row = rank - rank % 2
        assert r["ranks"]["dp"] == [rank % 2, rank % 2 + 2] and r["ranks"]["tp"] == [row, row + 1]
        assert r["dp_group"] != r["tp_group"]
        for f in r["figures"][1:]:
            # TP's activations on tp; FSDP2's parameters gathered in forward and gradients
            # reduce-scattered in backward on dp.
            assert set(f["by_dim"]) == {"dp", "tp"}, f["by_dim"]
            tp, dp = f["by_dim"]["tp"], f["by_dim"]["dp"]
            assert set(tp) == {"all_reduce"} and set(tp["all_reduce"]) == {"forward", "backward"}
            assert tp["all_reduce"]["forward"]["bytes"] == 8 * IN * 4
            assert set(dp) == {"all_gather", "reduce_scatter"}, dp
            assert set(dp["all_gather"]) == {"forward"} and set(dp["reduce_scatter"]) == {"backward"}
            assert dp["all_gather"]["forward"]["bytes"] == dp["reduce_scatter"]["backward"]["bytes"] > 0


def _tp_run():
    from tp_workers import tp_run

    return tp_run


@pytest.mark.slow
def test_a_tp_model_profiled_reports_its_mesh_and_its_all_reduces_as_exposed_communication(tmp_path):
    from tp_workers import tp_profiled

    batch, steps = 16, 14
    for rank, r in enumerate(_launch(tp_profiled, 2, dict(steps=steps, batch=batch, logdir=str(tmp_path), every=5))):
        assert r["digest_profiled"] == r["digest_plain"]  # bitwise: profiling changes no weight
        assert r["left_after"] == [] and "_c10d_functional.all_reduce" in r["patched_during"]
        assert not [w for w in r["warnings"] if "not measured" in w or "disabled" in w], r["warnings"]
        s = r["summary"]
        assert s["comm_source"] == "dtensor" and s["comm_unmeasured"] is None
        (dim,) = s["mesh"]["dims"]
        assert dim["label"] == "tp" and dim["size"] == 2 and dim["role"] == "tp"
        tp = s["comm_by_dim"]["tp"]
        assert tp["size"] == 2 and set(tp["kinds"]) == {"all_reduce"}
        ar = tp["kinds"]["all_reduce"]
        # RowwiseParallel's output in forward, ColwiseParallel's input gradient in backward.
        assert ar["count"] == 2 and set(ar["phases"]) == {"forward", "backward"}
        for phase in ("forward", "backward"):
            assert ar["phases"][phase]["count"] == 1 and ar["phases"][phase]["bytes"] == batch * IN * 4
        assert 0 < ar["waited_ms"] <= ar["total_ms"]
        per = s["per_step_ms"]
        # The waits are exposed communication, out of forward and backward: the breakdown adds
        # up, and the exposed figure is the waits' (both averaged over the same kind of steps).
        assert per["comm_exposed"] > 0 and per["comm_exposed"] <= per["comm_total"]
        assert per["compute"] + per["overhead"] == pytest.approx(per["step"])
        assert per["comm_exposed"] <= 3 * ar["waited_ms"] + 0.5 and ar["waited_ms"] <= 3 * per["comm_exposed"] + 0.5
        assert s["grad_bytes"] is None  # no gradient all-reduce: the activations' bytes are not gradients
        # The projection's G counts data-parallel replicas (here one of 2 GPUs), the tensor-parallel
        # waits a cost of every step; the advice speaks of tensor parallelism, never of DDP.
        proj = s["projection"]
        assert proj["measured_gpus"] == 1 and proj["mesh"]["tp"] == 2 and proj["mesh"]["gpus_total"][0] == 2
        assert proj["mesh"]["tp_comm_ms"] == pytest.approx(tp["total"]["waited_ms"])
        ids = [f["id"] for f in s["advice"]]
        assert "comm_bound" not in ids and "parameter_servers" not in ids
        if tp["total"]["waited_ms"] >= 0.1 * per["step"]:
            assert "tp_comm_exposed" in ids
        if rank == 0:
            with open(tmp_path / "dtprofile_summary.json") as f:
                written = json.load(f)
            assert written["comm_by_dim"]["tp"]["kinds"]["all_reduce"]["count"] == 2
            assert written["mesh"]["dims"][0]["label"] == "tp"


@pytest.mark.slow
def test_fsdp2_x_tp_profiled_reports_both_dimensions():
    from tp_workers import fsdp_tp_profiled

    for r in _launch(fsdp_tp_profiled, 4, dict(steps=8, batch=8)):
        s = r["summary"]
        assert r["left_after"] == []
        assert s["comm_source"] == "fsdp"  # the data-parallel dimension's source, as for FSDP alone
        assert [(d["label"], d["size"], d["role"]) for d in s["mesh"]["dims"]] == [("dp", 2, "fsdp"), ("tp", 2, "tp")]
        by_dim = s["comm_by_dim"]
        assert set(by_dim) == {"dp", "tp"}
        assert set(by_dim["tp"]["kinds"]) == {"all_reduce"} and by_dim["tp"]["kinds"]["all_reduce"]["count"] == 2
        assert set(by_dim["dp"]["kinds"]) == {"all_gather", "reduce_scatter"}
        assert set(by_dim["dp"]["kinds"]["all_gather"]["phases"]) == {"forward"}
        assert set(by_dim["dp"]["kinds"]["reduce_scatter"]["phases"]) == {"backward"}
        assert s["run"]["fsdp"]["all_gathers"] == 1 and s["per_step_ms"]["comm_exposed"] > 0
        assert s["projection"]["measured_gpus"] == 2 and s["projection"]["mesh"]["tp"] == 2  # G: the dp replicas
