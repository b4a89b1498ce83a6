"""Rules about stragglers: one rank slower than the others, whom every rank then waits for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ..._values import finite, get, median
from ..pipeline_plan import stage_groups
from ..rank_spread import RANKS_LISTED, in_node, node_label
from .readings import Readings
from .registry import Finding, rule, severity_band
from .thresholds import (
    STRAGGLER_MIN_EXCESS_FRACTION,
    STRAGGLER_MIN_EXCESS_MS,
    STRAGGLER_MIN_EXCESS_STEP_FRACTION,
    STRAGGLER_PHASE_SHARE,
)
from .wording import gain_text

__all__ = ["straggler"]

#: The phases a straggler's excess is looked for in, in the per-rank figures.
_STEP_PHASES = ("data_wait", "forward", "backward", "optimizer")
#: NVML throttle reasons that do not slow a GPU down (idle, clocks set by the user).
_NOT_THROTTLING = ("", "none", "idle", "gpu_idle", "applications_clocks_setting")


@rule("straggler", order=400)
def straggler(r: Readings) -> Finding | None:
    """One rank slower than the others' median, from the per-rank step times, else from a
    GPU that throttled its clocks (telemetry).

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    stages = stage_groups(r.summary)
    if stages is not None:  # (a pipeline's stages differ by design: stage_imbalance's; compare a stage's replicas)
        found = [
            f
            for stage, group in stages.items()
            if len(group) >= 2
            if (f := _straggler_from_step_times(r, group, f"pipeline stage {stage}'s other replicas'"))
        ]
        return max(found, key=lambda f: f.evidence["excess_ms"], default=None) or _straggler_from_throttling(r)
    ranks = [x for x in (get(r.summary, "ranks") or []) if isinstance(x, Mapping)]
    found_one = _straggler_from_step_times(r, ranks) if len(ranks) >= 2 else None
    return found_one or _straggler_from_throttling(r)


def _balance_action(run_info: Mapping[str, Any]) -> str:
    """How to give every rank the same work, in the knobs this loop has.

    A DataLoader's sampler decides what each rank gets; length bucketing only helps where
    the samples' shapes vary (``run.sample_shapes_vary``, sampled from the batches); a loop
    that draws its own batches (no DataLoader seen) has its own batch size and shapes.
    """
    if get(run_info, "num_workers") is None:
        return "balance the work: the same batch size and shapes drawn on every rank"
    vary = get(run_info, "sample_shapes_vary")
    if vary is True:
        return (
            "balance the work: same batch_size and sequence lengths on every rank "
            "(DistributedSampler(drop_last=True), length bucketing)"
        )
    if vary is False:
        return (
            "balance the work: same batch_size on every rank (DistributedSampler(drop_last=True)); "
            "the samples' shapes do not vary, so look past the data"
        )
    return (
        "balance the work: same batch_size on every rank (DistributedSampler(drop_last=True)), "
        "and length bucketing if the samples' lengths vary"
    )


def _busy_ms(rank: Mapping[str, Any]) -> float | None:
    """Time a rank is not waiting for its peers: step - comm_exposed, else the phases."""
    step, exposed = finite(get(rank, "step")), finite(get(rank, "comm_exposed"))
    if step is not None and exposed is not None:
        return step - exposed
    compute, data = finite(get(rank, "compute")), finite(get(rank, "data_wait"))
    if compute is not None:
        return compute + (data or 0.0)
    phases = [finite(get(rank, p)) for p in _STEP_PHASES]
    return sum(p for p in phases if p is not None) if any(p is not None for p in phases) else None


def _straggler_from_step_times(
    r: Readings, ranks: list[Mapping[str, Any]], peers: str = "the other ranks'"
) -> Finding | None:
    """The rank the others wait for, when its busy time exceeds theirs past the thresholds
    (``peers``: whom it is compared with, in words)."""
    exposed = [finite(get(x, "comm_exposed")) for x in ranks]
    busy = [_busy_ms(x) for x in ranks]
    if all(e is not None for e in exposed):
        # The all-reduce equalises the steps: the rank the others wait for waits least (of
        # ranks that wait alike, the busiest: a slow node's ranks wait for one another).
        slow = min(range(len(ranks)), key=lambda i: (cast(float, exposed[i]), -(busy[i] or 0.0)))  # all measured
    elif all(b is not None for b in busy):
        slow = max(range(len(ranks)), key=lambda i: cast(float, busy[i]))  # all measured
    else:
        return None
    others = [i for i in range(len(ranks)) if i != slow]
    typical = median(busy[i] for i in others)
    if busy[slow] is None or typical is None:
        return None
    excess = cast(float, busy[slow]) - typical  # not None: checked above
    step_ms = finite(get(ranks[slow], "step"))
    if (
        excess <= STRAGGLER_MIN_EXCESS_MS
        or excess <= STRAGGLER_MIN_EXCESS_FRACTION * typical
        or (step_ms is not None and excess <= STRAGGLER_MIN_EXCESS_STEP_FRACTION * step_ms)
    ):
        return None
    diffs = {}
    for phase in _STEP_PHASES:
        mine = finite(get(ranks[slow], phase))
        theirs = median(finite(get(ranks[i], phase)) for i in others)
        if mine is not None and theirs is not None:
            diffs[phase] = mine - theirs
    phase = max(diffs, key=diffs.__getitem__) if diffs else "unattributed"
    if phase != "unattributed" and diffs[phase] < STRAGGLER_PHASE_SHARE * excess:
        phase = "unattributed"
    rank_id = get(ranks[slow], "rank")
    rank_id = slow if rank_id is None else rank_id
    step = r.step or median(finite(get(x, "step")) for x in ranks)
    evidence = {
        "rank": rank_id,
        "slow_phase": phase,
        "excess_ms": excess,
        "busy_ms": busy[slow],
        "others_median_busy_ms": typical,
        "phase_excess_ms": diffs,
        # Each rank's wait, up to RANKS_LISTED ranks; past them the straggler's and the median
        # (the evidence, and the Markdown that prints it, stay bounded at any rank count).
        "comm_exposed_ms": (
            {str(get(x, "rank") if get(x, "rank") is not None else i): exposed[i] for i, x in enumerate(ranks)}
            if len(ranks) <= RANKS_LISTED
            else {str(rank_id): exposed[slow], "median": median(exposed)}
        ),
        "threshold_fraction": STRAGGLER_MIN_EXCESS_FRACTION,
        "threshold_ms": STRAGGLER_MIN_EXCESS_MS,
    }
    fraction = excess / step if step else 0.0
    severity = severity_band(fraction, 0.0)
    severity = "low" if severity == "info" else severity
    where = "between its phases" if phase == "unattributed" else f"in {phase}"
    node = _slow_node(r.summary, rank_id)
    if node is not None:
        evidence["node"] = node
    title = (
        f"Straggler: rank {rank_id} is {excess:.1f} ms slower {where} than {peers} "
        f"median, and every rank waits for it in {r.sync_name}"
        + (
            f"; its {node_label(node)} is the slowest node, "
            f"{node['excess_ms']:.1f} ms over the median node: look at the node"
            if node is not None
            else ""
        )
    )
    balance = _balance_action(r.run_info)
    actions = {
        "data_wait": f"rank {rank_id}: DataLoader(num_workers=...) higher, check its storage and CPU affinity",
        "forward": f"{balance}; check rank {rank_id}'s device for throttling or other processes",
        "backward": f"{balance}; check rank {rank_id}'s device for throttling or other processes",
        "optimizer": f"rank {rank_id}: same optimizer and parameter groups on every rank; "
        "move rank-0-only work (logging, checkpoints) out of the step",
        "unattributed": f"rank {rank_id}: move host work (logging, checkpoints, metrics) out of the step",
    }
    gain = gain_text(step, step - excess) if step and step > excess else None
    return Finding("straggler", severity, title, evidence, actions[phase], gain)


def _slow_node(summary: Mapping[str, Any], rank: Any) -> dict[str, Any] | None:
    """The slowest node (``rank_spread.nodes``) when it holds ``rank`` and is itself past
    the straggler's thresholds over the median node: the node, not the rank, is slow."""
    slowest = get(get(get(summary, "rank_spread"), "nodes"), "slowest")
    excess, median_ms = (
        finite(get(slowest, "excess_ms")),
        finite(get(get(get(summary, "rank_spread"), "nodes"), "median_busy_ms")),
    )
    if not isinstance(slowest, Mapping) or not in_node(slowest, rank) or excess is None:
        return None
    if excess <= STRAGGLER_MIN_EXCESS_MS:
        return None
    if median_ms is not None and excess <= STRAGGLER_MIN_EXCESS_FRACTION * median_ms:
        return None
    return dict(slowest)


def _throttled(entry: Mapping[str, Any]) -> bool:
    """Whether a rank's telemetry says its GPU slowed its clocks."""
    if entry.get("throttled") is True:
        return True
    reasons = entry.get("throttle_reasons")
    if isinstance(reasons, str):
        reasons = [reasons]
    if isinstance(reasons, (list, tuple)):
        return any(str(x).lower() not in _NOT_THROTTLING for x in reasons)
    return False


def _straggler_from_throttling(r: Readings) -> Finding | None:
    """The ranks whose GPU throttled its clocks (NVML telemetry), if any."""
    telemetry = get(r.run_info, "telemetry")
    per_rank = get(telemetry, "ranks")
    if not isinstance(per_rank, list):
        return None
    entries = [x for x in per_rank if isinstance(x, Mapping)]
    slow = [x.get("rank", i) for i, x in enumerate(entries) if _throttled(x)]
    if not slow:
        return None
    evidence = {
        "throttled_ranks": slow,
        "throttle_reasons": {
            str(x.get("rank", i)): x.get("throttle_reasons") for i, x in enumerate(entries) if _throttled(x)
        },
    }
    title = f"Straggler: GPU of rank(s) {', '.join(map(str, slow))} throttled its clocks (telemetry)"
    if r.world_size > 1:
        title += f"; every rank waits for it in {r.sync_name}"
    action = "check cooling, power limits (nvidia-smi -q -d PERFORMANCE) and other processes on the throttled GPU(s)"
    return Finding("straggler", "medium", title, evidence, action, None)
