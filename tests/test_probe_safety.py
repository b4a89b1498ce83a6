"""What keeps a probe step from changing training: the ranks' agreement on the store, the
shape every rank must agree a probe's pass had, and the check of the reduced gradients
(the safety net), each with its failure made on purpose."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from distributed import run_ranks
from workers import probe_safety_net

from dtprofile.capture.agree import StoreAgreement


def _ranks(agreements, fn):
    """Run ``fn(rank, agreement)`` for each agreement on a thread of its own; the results."""
    results = [None] * len(agreements)

    def run(rank: int) -> None:
        results[rank] = fn(rank, agreements[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(agreements))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def _agreements(size: int, timeout_s: float = 10.0):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    # (one instance number a rank: each process counts its own agreements)
    return store, [StoreAgreement(store, f"g{size}-{timeout_s}", size, timeout_s) for _ in range(size)]


def test_the_ranks_agree_on_flags_and_values_through_the_store_and_its_keys_go():
    store, agreements = _agreements(3)
    for a in agreements[1:]:
        a.prefix = agreements[0].prefix  # (in one process each would count its own instance)
    results = _ranks(
        agreements,
        lambda rank, a: [
            a.any_flag("0/shape", False),
            a.any_flag("1/shape", rank == 2),
            a.same_value("1/grads", b"x"),
            a.same_value("2/grads", b"x" if rank else b"y"),
        ],
    )
    assert results == [[False, True, True, False]] * 3
    # Each meeting's keys go once every rank has left it: only the last meeting's remain.
    prefix = agreements[0].prefix
    assert not store.check([f"{prefix}/0/shape/go"]) and not store.check([f"{prefix}/1/grads/value"])
    assert store.check([f"{prefix}/2/grads/go"])


def test_a_rank_that_never_comes_makes_the_meeting_fail_after_the_timeout_not_hang():
    _, agreements = _agreements(2, timeout_s=0.3)
    assert agreements[0].any_flag("0/shape", False) is None
    assert agreements[0].same_value("1/grads", b"x") is None


@pytest.mark.slow
@pytest.mark.parametrize("sabotage", ["every", "rank1"])
def test_the_safety_net_repairs_a_sabotaged_probe_reduction_and_stops_probes(sabotage):
    """The probe's reduction forgets to write the sum back into the gradients. Every rank
    then holds its own gradients: the check sees it, they are all-reduced as DDP would
    have, and the weights equal the unprofiled run's. On rank 1 only: the ranks' check
    differs, the gradients are reduced again, and the ranks stay equal."""
    res = run_ranks(probe_safety_net, 2, dict(steps=12, sabotage=sabotage), timeout_s=120)
    assert res[1]["sabotaged"] >= 1
    for r in res:
        assert r["same_across_ranks"], r
        s = r["summary"]
        assert "different gradients" in (s["probes_stopped"] or ""), s["probes_stopped"]
        assert s["probe"] is None  # the one probe step was the sabotaged one: not in the figures
    assert res[0]["same_as_unprofiled"] == (sabotage == "every")
    assert any("probe steps stopped" in w for w in res[0]["warnings"]), res[0]["warnings"]


@pytest.mark.slow
def test_two_forwards_before_one_backward_are_never_a_probe_and_the_second_such_window_stops_them():
    res = run_ranks(probe_safety_net, 2, dict(steps=14, siamese=True), timeout_s=120)
    for r in res:
        assert r["same_as_unprofiled"] and r["same_across_ranks"], r
        s = r["summary"]
        assert s["probe"] is None and s["compute_source"] == "residual", s["probe"]
        assert "two or more training forwards" in s["probes_stopped"], s["probes_stopped"]
        assert s["steps_profiled"] == 14 - 2 - 2  # the two windows are left out
    assert sum("probe steps stopped" in w for w in res[0]["warnings"]) == 1, res[0]["warnings"]


@pytest.mark.slow
def test_a_collective_of_the_loops_inside_a_turn_costs_a_bounded_wait_and_ends_turns():
    """On CPU ranks some probe steps run their passes one rank at a time, once a probe
    was agreed plain. A loop that all-reduces between forward and backward on such a
    step (here the second probe step, step 6) holds rank 0 in its collective while rank 1
    waits for its turn: rank 1 stops waiting after a bounded time, both go on, the step
    is left out and no turn is taken again. Training is as without dtprofile."""
    res = run_ranks(probe_safety_net, 2, dict(steps=24, collective_at=(6,)), timeout_s=120)
    for r in res:
        assert r["same_as_unprofiled"] and r["same_across_ranks"], r
        s = r["summary"]
        assert s["probe"]["alone_steps"] == 0 and s["probe"]["steps"] >= 2, s["probe"]
        assert s["probes_stopped"] is None  # one step is not the loop's shape
        assert r["wall_s"] < 30, r["wall_s"]  # the wait is bounded (a second and a little)
