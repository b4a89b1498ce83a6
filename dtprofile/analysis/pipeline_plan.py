"""A pipeline-parallel run: its stages, its bubble, and what more microbatches, another
stage count or an interleaved schedule would give.

A schedule of p stages and m microbatches (GPipe, 1F1B) runs each stage's m forwards and
backwards in m + p - 1 slots of one microbatch's time: (p - 1) / (m + p - 1) of the step
is the *bubble*, where a stage waits for its neighbour, at its start and its end. With v
stages a rank (ScheduleInterleaved1F1B, ScheduleLoopedBFS: each rank's layers in v
chunks), a slot is one chunk's microbatch and the step m v + p - 1 of them: the bubble
falls to (p - 1) / (m v + p - 1). The slowest stage sets every slot's length. dtprofile
measures each stage's compute (forward and backward over the step's microbatches, the
ranks' rows; with data parallel across pipelines, the median over a stage's replicas)
and what it waited for its neighbours (the point-to-point waits: exposed communication,
:mod:`dtprofile.capture.pipeline`).

The model here (framework-free): a step of ``m'`` microbatches on ``p'`` stages of ``v'``
chunks, the global batch fixed, takes ``m' v' s_max + k sum(s_i, i != slowest) + F``,
each stage's slot ``s_i = C_i / (m' v') + h``: the slowest stage runs every one of its
chunk-microbatches, and the fill and the drain take one of every other stage's (equal
stages: ``s (m' v' + k (p' - 1))``). ``C_i`` is stage i's measured compute for the whole
batch (the layers spread evenly over p' stages: the mean's, times p / p'); h the host
work each chunk-microbatch brings whatever its size (the schedule's own, the transfers'
copies: a stage's compute besides its passes and its update, over m v); k the bubble's
share of a fill (1 in theory for the schedules above; for the zero-bubble schedules,
whose weight gradients fill part of it, read off the measured waits); F the step's part
that does not pipeline (the update), read off the measured step, so that the model gives
the measured step at the run's own counts and every projection is that step plus the
model's change.

Example:
    >>> s = {"world_size": 2, "pipeline": {"schedule": "ScheduleGPipe", "stages": 2, "microbatches": 4},
    ...      "per_step_ms": {"step": 92.0},
    ...      "ranks": [{"rank": 0, "step": 92.0, "forward": 24.0, "backward": 48.0, "comm_exposed": 18.0},
    ...                {"rank": 1, "step": 92.0, "forward": 24.0, "backward": 48.0, "comm_exposed": 18.0}]}
    >>> view = pipeline_view(s)
    >>> view["bubble_fraction_theory"], round(view["bubble_fraction"], 3)
    (0.2, 0.196)
    >>> round(step_at(view, microbatches=8), 1), round(step_at(view, virtual=2), 1)
    (83.0, 83.0)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .._values import finite, get

__all__ = [
    "INTERLEAVED_SCHEDULES",
    "ONE_SLOT_SCHEDULES",
    "bubble_theory",
    "layout_words",
    "pipeline_projection",
    "pipeline_ranks",
    "pipeline_view",
    "stage_groups",
    "stage_words",
    "step_at",
    "step_timeline",
]

#: Schedules of one stage a rank whose bubble is (p - 1) / (m + p - 1) with equal stages.
ONE_SLOT_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
#: Schedules of v stages a rank whose bubble is (p - 1) / (m v + p - 1) with equal stages.
INTERLEAVED_SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS")
#: Microbatch counts, stage counts and stages a rank the projection covers (the run's own added).
PROJECT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
PROJECT_STAGES = (1, 2, 4, 8, 16)
PROJECT_VIRTUAL = (1, 2, 4)
#: Ranks named per stage in its figures (more replicas: their count and their median).
RANKS_PER_STAGE_LISTED = 8
# A stage's figures: the medians over its replicas of these row fields.
_STAGE_FIELDS = {"forward_ms": "forward", "backward_ms": "backward", "step_ms": "step", "wait_ms": "comm_exposed"}
#: A row's waits for its pipeline neighbours, where it reported them apart from its other
#: exposed communication (data parallel across pipelines); else its comm_exposed.
_PIPELINE_WAIT = "pipeline_wait"


def bubble_theory(schedule: str | None, stages: int, microbatches: int, virtual: int = 1) -> float | None:
    """The bubble's share of the step for equal stages: (p - 1) / (m v + p - 1), with p the
    ranks a pipeline holds and v the stages each rank holds (1 for GPipe and 1F1B); None
    for a schedule whose share this formula does not give (the zero-bubble ones).

    Example:
        >>> bubble_theory("Schedule1F1B", 4, 8), bubble_theory("ScheduleInterleaved1F1B", 4, 8, virtual=2)
        (0.2727272727272727, 0.15789473684210525)
    """
    if stages < 1 or microbatches < 1 or virtual < 1:
        return None
    if schedule in ONE_SLOT_SCHEDULES:
        virtual = 1
    elif schedule not in INTERLEAVED_SCHEDULES:
        return None
    return (stages - 1) / (microbatches * virtual + stages - 1)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _stage_of(entry: Mapping[str, Any], position: int, ranks_per_pipeline: int) -> int:
    """A row's place in its pipeline: the stage it reported (``pipeline_stage``: its first
    stage's index; an interleaved rank's later stages are p, 2p, ... further), else its
    rank modulo the pipeline's ranks (a mesh's default layout puts a pipeline's ranks in
    its last, fastest-varying dimension)."""
    stage = finite(get(entry, "pipeline_stage"))
    if stage is not None and stage >= 0:
        return int(stage) % ranks_per_pipeline
    rank = finite(get(entry, "rank"))
    return int(rank if rank is not None else position) % ranks_per_pipeline


def pipeline_ranks(summary: Mapping[str, Any]) -> int | None:
    """The ranks one pipeline holds (its group; else its stage count); None without a
    pipeline of two or more stages."""
    pipe = get(summary, "pipeline")
    total = int(finite(get(pipe, "num_stages")) or finite(get(pipe, "stages")) or 0)
    p = int(finite(get(pipe, "group_size")) or 0) or total
    return p if total >= 2 and p >= 1 else None


def stage_groups(summary: Mapping[str, Any]) -> dict[int, list[Mapping[str, Any]]] | None:
    """The ranks' rows by the pipeline stage they run (one each without data parallel
    across pipelines); None without a pipeline. The ranks of one stage do the same work:
    they, not the stages, are the ones to compare for a straggler.

    Example:
        >>> s = {"pipeline": {"stages": 2, "microbatches": 4},
        ...      "ranks": [{"rank": r, "pipeline_stage": r % 2} for r in range(4)]}
        >>> {k: [x["rank"] for x in v] for k, v in stage_groups(s).items()}
        {0: [0, 2], 1: [1, 3]}
    """
    p = pipeline_ranks(summary)
    if p is None:
        return None
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for i, entry in enumerate(get(summary, "ranks") or []):
        if isinstance(entry, Mapping):
            groups.setdefault(_stage_of(entry, i, p), []).append(entry)
    return groups


def _stage_rows(rows: Sequence[Mapping[str, Any]], ranks_per_pipeline: int) -> dict[int, list[dict[str, Any]]]:
    """Each stage's rows, as figures: forward, backward, their sum, waits, step and host
    work (a row without forward, backward or a step is left out)."""
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for i, entry in enumerate(rows):
        values = {k: finite(get(entry, field)) for k, field in _STAGE_FIELDS.items()}
        own_waits = finite(get(entry, _PIPELINE_WAIT))
        if own_waits is not None:
            values["wait_ms"] = own_waits
        forward, backward, step = values["forward_ms"], values["backward_ms"], values["step_ms"]
        if forward is None or backward is None or step is None or step <= 0:
            continue
        # The stage's work besides its passes and its update (the schedule's own host work a
        # microbatch, the transfers' copies): it comes with every microbatch.
        busy = finite(get(entry, "compute"))
        host = max(0.0, busy - forward - backward - (finite(get(entry, "optimizer")) or 0.0)) if busy else 0.0
        figure = {
            "rank": get(entry, "rank"),
            "forward_ms": forward,
            "backward_ms": backward,
            "compute_ms": forward + backward,
            "wait_ms": values["wait_ms"] or 0.0,
            "step_ms": step,
            "host_ms": host,
            "optimizer_ms": finite(get(entry, "optimizer")) or 0.0,
        }
        by_stage.setdefault(_stage_of(entry, i, ranks_per_pipeline), []).append(figure)
    return by_stage


def _stage_figure(stage: int, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage's figures: the median over its replicas (one rank each without data
    parallel across pipelines), its first rank and the ranks that run it (bounded)."""
    ranks = sorted(int(f["rank"]) for f in replicas if f["rank"] is not None)
    figure: dict[str, Any] = {"stage": stage, "rank": ranks[0] if ranks else None}
    for key in ("forward_ms", "backward_ms", "compute_ms", "wait_ms", "step_ms", "host_ms", "optimizer_ms"):
        figure[key] = _median([f[key] for f in replicas])
    if len(replicas) > 1:
        figure["replicas"] = len(replicas)
        figure["ranks"] = ranks[:RANKS_PER_STAGE_LISTED]
        slow = max(replicas, key=lambda f: f["compute_ms"])
        figure["slowest_replica_rank"], figure["slowest_replica_compute_ms"] = slow["rank"], slow["compute_ms"]
    return figure


def layout_words(view: Mapping[str, Any]) -> str:
    """``"ScheduleGPipe, 2 stages, 4 microbatches"``, with the chunks a rank holds and the
    pipelines side by side where there are several."""
    v, replicas = int(view.get("stages_per_rank") or 1), int(view.get("replicas") or 1)
    return (
        f"{view['schedule']}, {view['stages']} stages"
        + (f" of {v} chunks each" if v > 1 else "")
        + f", {view['microbatches']} microbatches"
        + (f", {replicas} pipelines side by side" if replicas > 1 else "")
    )


def stage_words(figure: Mapping[str, Any]) -> str:
    """A stage by its rank (``"rank 1's stage"``), or by its index and ranks when
    pipelines run side by side (``"stage 1 (ranks 1, 3)"``)."""
    ranks = figure.get("ranks")
    if not ranks:
        return f"rank {figure['rank']}'s stage"
    more = ", ..." if figure.get("replicas", len(ranks)) > len(ranks) else ""
    return f"stage {figure['stage']} (ranks {', '.join(map(str, ranks))}{more})"


def pipeline_view(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The run's pipeline: its schedule, stages and microbatches, each stage's figures,
    the bubble measured and in theory, and the imbalance (the slowest stage's compute over
    the median's); None without a pipeline.

    Args:
        summary: A run summary with ``pipeline`` (rank 0's schedule and waits) and ``ranks``
            (each with ``pipeline_stage`` where the rank reported its stage).

    Returns:
        ``schedule``, ``stages`` (the ranks one pipeline holds), ``stages_per_rank`` (v),
        ``microbatches``, ``replicas`` (pipelines side by side: data parallel across
        them), ``stage_figures`` (per stage: stage, rank (its first), forward_ms,
        backward_ms, compute_ms = forward + backward, wait_ms, step_ms, host_ms; with
        replicas, the medians over them, and ``replicas``, ``ranks``,
        ``slowest_replica_rank``), ``bubble_fraction`` (the median stage's waits over its
        step), ``bubble_fraction_theory``, ``bubble_slots`` (k) and ``bubble_model``
        ("theory" or "measured"), ``slowest_stage`` (its first rank), ``slowest_stage_index``,
        ``imbalance``, ``per_microbatch_ms`` (h), ``fixed_ms`` (the step's part that does
        not pipeline).
    """
    pipe = get(summary, "pipeline")
    # (``num_stages``: every stage of the schedule, kept where an analysed summary's
    # ``stages`` became the ranks a pipeline holds)
    total_stages = int(finite(get(pipe, "num_stages")) or finite(get(pipe, "stages")) or 0)
    microbatches = int(finite(get(pipe, "microbatches")) or 0)
    # The ranks one pipeline holds (its group); an interleaved schedule's stages are more.
    p = pipeline_ranks(summary)
    if p is None or microbatches < 1:
        return None
    v = max(1, total_stages // p)
    by_stage = _stage_rows(get(summary, "ranks") or [], p)
    if not by_stage:
        return None
    figures = [_stage_figure(stage, by_stage[stage]) for stage in sorted(by_stage)]
    computes = [f["compute_ms"] for f in figures]
    slowest = max(range(len(figures)), key=lambda i: computes[i])
    step = finite(get(get(summary, "per_step_ms"), "step")) or _median([f["step_ms"] for f in figures])
    schedule = get(pipe, "schedule")
    theory = bubble_theory(schedule, p, microbatches, v)
    bubble = _median([f["wait_ms"] / f["step_ms"] for f in figures])
    chunks = microbatches * v  # (a slot: one chunk's microbatch)
    per_slot_host = max(f["host_ms"] for f in figures) / chunks
    # The stages a pipeline holds (a row missing: the mean stage's in its place).
    stage_computes = computes + [sum(computes) / len(computes)] * max(0, p - len(computes))
    fill = _fill_ms(stage_computes, chunks, per_slot_host)
    if theory is not None or p < 2:
        k, model = 1.0, "theory"
    else:  # (zero bubble: the weight gradients fill part of it; the waits say how much)
        k, model = (max(0.0, _median([f["wait_ms"] for f in figures]) / fill) if fill > 0 else 1.0), "measured"
    return {
        "schedule": schedule,
        "stages": p,
        "num_stages": total_stages,
        "stages_per_rank": v,
        "microbatches": microbatches,
        "replicas": max(len(rows) for rows in by_stage.values()),
        "stage_figures": figures,
        "bubble_fraction": bubble,
        "bubble_fraction_theory": theory,
        "bubble_slots": k,
        "bubble_model": model,
        "slowest_stage": figures[slowest]["rank"],
        "slowest_stage_index": figures[slowest]["stage"],
        "imbalance": computes[slowest] / _median(computes) if _median(computes) > 0 else None,
        "slowest_compute_ms": computes[slowest],
        "mean_compute_ms": sum(computes) / len(computes),
        "stage_compute_ms": stage_computes,
        "step_ms": step,
        "per_microbatch_ms": per_slot_host,
        # (negative where the slots overstate the step: a fast stage's host work hides
        # behind the slow one's compute; it anchors every projection to the measured step)
        "fixed_ms": step - _slots_ms(stage_computes, chunks, per_slot_host, k),
    }


def step_at(
    view: Mapping[str, Any],
    microbatches: int | None = None,
    stages: int | None = None,
    balanced: bool = False,
    virtual: int | None = None,
) -> float:
    """The step (ms) at ``microbatches``, ``stages`` (ranks a pipeline) and ``virtual``
    (stages a rank; default: the run's), the global batch fixed; ``balanced``: the
    stages' compute evened out (the mean stage's instead of the slowest's).

    A run of one stage a rank projected to ``virtual`` > 1 takes the interleaved
    schedule's bubble, (p - 1) slots of a chunk's microbatch (its extra transfers not
    counted).

    Example:
        >>> v = {"stages": 2, "microbatches": 4, "slowest_compute_ms": 72.0, "mean_compute_ms": 72.0,
        ...      "fixed_ms": 2.0}
        >>> step_at(v), step_at(v, microbatches=1), step_at(v, virtual=2)
        (92.0, 146.0, 83.0)
    """
    m = microbatches or int(view["microbatches"])
    p = stages or int(view["stages"])
    chunks_per_rank = virtual or int(view.get("stages_per_rank", 1))
    if m < 1 or p < 1 or chunks_per_rank < 1:
        raise ValueError(f"microbatches, stages and virtual must be >= 1, got {m}, {p} and {chunks_per_rank}")
    if balanced or p != view["stages"]:  # (the model's layers spread evenly over p stages)
        computes = [view["mean_compute_ms"] * view["stages"] / p] * p
    else:
        computes = list(view.get("stage_compute_ms") or [view["slowest_compute_ms"]] * p)
    # A zero-bubble schedule's measured k holds for its own layout; another v is interleaved.
    k = view.get("bubble_slots", 1.0) if chunks_per_rank == int(view.get("stages_per_rank", 1)) else 1.0
    chunks = m * chunks_per_rank
    step = _slots_ms(computes, chunks, view.get("per_microbatch_ms", 0.0), k) + view["fixed_ms"]
    # (never below the slowest stage's own compute: an anchor below zero does not take it away)
    return float(max(max(computes), step))


def _fill_ms(computes: Sequence[float], chunks: int, host_ms: float) -> float:
    """The fill and the drain of a step: one chunk-microbatch of every stage but the
    slowest (each stage's slot its own compute's share and the host work each brings)."""
    slots = [c / chunks + host_ms for c in computes]
    return sum(slots) - max(slots)


def _slots_ms(computes: Sequence[float], chunks: int, host_ms: float, k: float) -> float:
    """The schedule's slots: the slowest stage's every chunk-microbatch, and k times the
    fill and the drain (:func:`_fill_ms`): ``m v s_max + k sum(s_i, i != slowest)``, which
    for equal stages is ``s (m v + k (p - 1))``."""
    slowest = max(computes) / chunks + host_ms
    return slowest * chunks + k * _fill_ms(computes, chunks, host_ms)


def pipeline_projection(view: Mapping[str, Any]) -> dict[str, Any]:
    """The step over microbatch counts (the run's stages), over stage counts (the run's
    microbatches; the model's layers spread evenly over them), over stages a rank, and
    with the stages balanced: the summary's ``pipeline.projection``.

    Returns:
        ``{"microbatches": [...], "step_ms_by_microbatches": [...], "stages": [...],
        "step_ms_by_stages": [...], "stages_per_rank": [...], "step_ms_by_stages_per_rank":
        [...], "balanced_step_ms": ..., "bubble_model": ...}``; a stage count's GPUs are
        that many per replica, its throughput per GPU the step's inverse over them.
    """
    ms = sorted(set(PROJECT_MICROBATCHES) | {int(view["microbatches"])})
    ps = sorted(set(PROJECT_STAGES) | {int(view["stages"])})
    vs = sorted(set(PROJECT_VIRTUAL) | {int(view.get("stages_per_rank", 1))})
    return {
        "microbatches": ms,
        "step_ms_by_microbatches": [step_at(view, microbatches=m) for m in ms],
        "stages": ps,
        "step_ms_by_stages": [step_at(view, stages=p) for p in ps],
        "stages_per_rank": vs,
        "step_ms_by_stages_per_rank": [step_at(view, virtual=v) for v in vs],
        "balanced_step_ms": step_at(view, balanced=True),
        "bubble_model": view.get("bubble_model", "theory"),
    }


def step_timeline(stages: Sequence[tuple[int, int, Sequence[Mapping[str, Any]]]]) -> dict[str, Any] | None:
    """One representative step's timeline across the stages: of the steps every stage
    sampled (:meth:`~dtprofile.capture.pipeline.PipelineComm.timelines`), the one whose
    longest stage's step is the median; each stage's latest where they sampled no step in
    common. The summary's ``pipeline.timeline``.

    Args:
        stages: Per stage, ``(stage, rank, timelines)``; each timeline ``{"step", "step_ms",
            "events": [[kind, start_ms, end_ms], ...]}``.

    Returns:
        ``{"step": n (None: the stages' latest, not one step), "step_ms": the longest
        stage's, "stages": [{"stage", "rank", "step_ms", "events"}, ...]}``, in stage
        order; None without a timeline.

    Example:
        >>> a = [{"step": 4, "step_ms": 9.0, "events": [["F", 0.0, 2.0]]},
        ...      {"step": 8, "step_ms": 10.0, "events": [["F", 0.0, 2.5]]}]
        >>> b = [{"step": 8, "step_ms": 10.5, "events": [["R", 0.0, 2.5], ["F", 2.5, 5.0]]}]
        >>> t = step_timeline([(0, 0, a), (1, 1, b)])
        >>> t["step"], t["step_ms"], [s["events"][0][0] for s in t["stages"]]
        (8, 10.5, ['F', 'R'])
    """
    kept = [(stage, rank, list(timelines)) for stage, rank, timelines in sorted(stages) if timelines]
    if not kept:
        return None
    common = set.intersection(*({int(t["step"]) for t in timelines} for _, _, timelines in kept))
    step = None
    if common:
        longest = {n: max(next(t["step_ms"] for t in tl if t["step"] == n) for _, _, tl in kept) for n in common}
        by_length = sorted(common, key=lambda n: (longest[n], n))
        step = by_length[(len(by_length) - 1) // 2]
    rows = []
    for stage, rank, timelines in kept:
        chosen = timelines[-1] if step is None else next(t for t in timelines if t["step"] == step)
        rows.append({"stage": stage, "rank": rank, "step_ms": chosen["step_ms"], "events": chosen["events"]})
    return {"step": step, "step_ms": max(r["step_ms"] for r in rows), "stages": rows}
