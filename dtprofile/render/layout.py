"""The parallel layout in words: a DeviceMesh and its collectives per dimension, a
pipeline's schedule and stages, many ranks as a distribution, and what a projection over
replicas holds fixed. Shared by the terminal report, its Markdown and the tab, as
:mod:`.views` is; each function takes a summary (or part of one) and returns lines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._values import get, parse_finite
from ..analysis.pipeline_plan import layout_words, stage_words
from ..analysis.rank_spread import RANKS_LISTED, node_label
from .numbers import fmt, fmt_compact, fmt_pct, g_label

__all__ = [
    "RANKS_LISTED",
    "comm_by_dim_lines",
    "mesh_caption",
    "mesh_text",
    "pipeline_lines",
    "pipeline_timeline_lines",
    "rank_spread_lines",
]


def mesh_text(summary: Mapping[str, Any]) -> str | None:
    """The run's DeviceMesh in words: each dimension's name, size and role.

    Example:
        >>> mesh_text({"mesh": {"dims": [{"label": "dp", "size": 2, "role": "fsdp"},
        ...                              {"label": "tp", "size": 4, "role": "tp"}]}})
        'mesh dp=2 (fsdp) x tp=4 (tp)'
    """
    dims = get(get(summary, "mesh"), "dims")
    if not isinstance(dims, Sequence) or not dims:
        return None
    parts = [
        f"{get(d, 'label')}={fmt(get(d, 'size'))}" + (f" ({get(d, 'role')})" if get(d, "role") else "")
        for d in dims
        if isinstance(d, Mapping)
    ]
    return "mesh " + " x ".join(parts) if parts else None


_PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "other": "other"}


def rank_spread_lines(summary: Mapping[str, Any]) -> list[str]:
    """The ranks as a distribution (``rank_spread``): the step's median and percentiles with
    the slowest and the fastest rank named, and the slowest node where nodes are known,
    by its host where the ranks' hosts are (``[]`` for fewer than two ranks).

    Example:
        >>> spread = {"ranks": 1024, "step": {"median": 45.0, "p10": 44.0, "p90": 47.0, "min": 43.0,
        ...           "min_rank": 3, "max": 52.0, "max_rank": 517},
        ...           "nodes": {"count": 128, "ranks_per_node": 8, "median_busy_ms": 45.0,
        ...                     "slowest": {"node": 64, "ranks": [512, 519], "busy_ms": 49.0, "excess_ms": 4.0}}}
        >>> first, second = rank_spread_lines({"rank_spread": spread})
        >>> for part in first.split("; "):
        ...     print(part)
        1024 ranks: step median 45.0 ms (10% of ranks under 44.0, 10% over 47.0)
        slowest rank 517 (52.0 ms), fastest rank 3 (43.0 ms)
        >>> print(second)
        128 nodes of 8 ranks: the slowest, node 64 (ranks 512-519), busy 49.0 ms a step, 4.00 ms over the median node
        >>> spread["nodes"].update(source="hosts")
        >>> spread["nodes"]["slowest"].update(host="gpu-064", rank_count=8)
        >>> print(rank_spread_lines({"rank_spread": spread})[1])  # doctest: +NORMALIZE_WHITESPACE
        128 hosts of about 8 ranks: the slowest, host gpu-064 (node 64, ranks 512-519), busy 49.0 ms a step,
        4.00 ms over the median node
    """
    spread = get(summary, "rank_spread")
    step = get(spread, "step")
    if not isinstance(step, Mapping):
        return []
    lines = [
        f"{g_label(get(spread, 'ranks'))} ranks: step median {fmt(step.get('median'))} ms (10% of ranks under "
        f"{fmt(step.get('p10'))}, 10% over {fmt(step.get('p90'))}); slowest rank {step.get('max_rank')} "
        f"({fmt(step.get('max'))} ms), fastest rank {step.get('min_rank')} ({fmt(step.get('min'))} ms)"
    ]
    nodes = get(spread, "nodes")
    slow = get(nodes, "slowest")
    if isinstance(slow, Mapping):
        by_host = nodes.get("source") == "hosts"
        lines.append(
            f"{g_label(nodes.get('count'))} {'hosts' if by_host else 'nodes'} of "
            f"{'about ' if by_host else ''}{g_label(nodes.get('ranks_per_node'))} ranks: the slowest, "
            f"{node_label(slow)}, busy {fmt(slow.get('busy_ms'))} ms a step, "
            f"{fmt(slow.get('excess_ms'))} ms over the median node"
        )
    return lines


def pipeline_lines(summary: Mapping[str, Any]) -> list[str]:
    """A pipeline's schedule and bubble, each stage's compute and waits, and the step its
    model projects at more microbatches and with balanced stages (``[]``: no pipeline).

    Example:
        >>> s = {"pipeline": {"schedule": "ScheduleGPipe", "stages": 2, "microbatches": 4,
        ...      "bubble_fraction": 0.22, "bubble_fraction_theory": 0.2,
        ...      "stage_figures": [{"rank": 0, "forward_ms": 24.0, "backward_ms": 48.0, "wait_ms": 20.0}],
        ...      "projection": {"microbatches": [4, 8], "step_ms_by_microbatches": [92.0, 83.0],
        ...                     "balanced_step_ms": 92.0}}}
        >>> for line in pipeline_lines(s):  # doctest: +ELLIPSIS
        ...     print(line.replace(" in theory with equal stages)", " ..."))
        ScheduleGPipe, 2 stages, 4 microbatches: each stage waits 22.0% of the step for its neighbours (20.0% ...
        rank 0: forward 24.0 ms + backward 48.0 ms, waits 20.0 ms
        projected step (the global batch fixed): 8 microbatches 83.0 ms; balanced stages 92.0 ms
    """
    pipe = get(summary, "pipeline")
    share = parse_finite(get(pipe, "bubble_fraction"))
    if not isinstance(pipe, Mapping) or share is None:
        return []
    theory = parse_finite(get(pipe, "bubble_fraction_theory"))
    lines = [
        layout_words({**pipe, "stages": g_label(pipe.get("stages")), "microbatches": g_label(pipe.get("microbatches"))})
        + f": each stage waits {fmt_pct(share)} of the step for its neighbours"
        + (f" ({fmt_pct(theory)} in theory with equal stages)" if theory is not None else "")
    ]
    for f in (get(pipe, "stage_figures") or [])[:RANKS_LISTED]:  # (more ranks: the Ranks lines' distribution)
        who = f"rank {f.get('rank')}" if not f.get("ranks") else stage_words(f)
        lines.append(
            f"{who}: forward {fmt(f.get('forward_ms'))} ms + backward {fmt(f.get('backward_ms'))} ms, "
            f"waits {fmt(f.get('wait_ms'))} ms"
            + (f"; its slowest replica rank {f.get('slowest_replica_rank')}" if f.get("replicas") else "")
        )
    proj = get(pipe, "projection")
    counts, steps = get(proj, "microbatches") or [], get(proj, "step_ms_by_microbatches") or []
    now = parse_finite(get(pipe, "microbatches"))
    more = [(m, v) for m, v in zip(counts, steps, strict=False) if now is not None and m > now][:2]
    chunks = parse_finite(get(pipe, "stages_per_rank")) or 1
    interleaved = [
        (v, ms)
        for v, ms in zip(
            get(proj, "stages_per_rank") or [], get(proj, "step_ms_by_stages_per_rank") or [], strict=False
        )
        if v > chunks
    ][:1]
    if more or interleaved:
        balanced = parse_finite(get(proj, "balanced_step_ms"))
        parts = [f"{g_label(m)} microbatches {fmt(v)} ms" for m, v in more]
        parts += [f"{g_label(v)} stages a rank (interleaved) {fmt(ms)} ms" for v, ms in interleaved]
        lines.append(
            "projected step (the global batch fixed): "
            + ", ".join(parts)
            + (f"; balanced stages {fmt(balanced)} ms" if balanced is not None else "")
            + ("; the bubble's size read off the measured waits" if get(proj, "bubble_model") == "measured" else "")
        )
    return lines


#: Timeline symbols: F forward, B backward, . a receive wait, > a send wait, u the update.
_TIMELINE_MARKS = {"F": "F", "B": "B", "R": ".", "S": ">", "U": "u"}
#: Columns of a text timeline.
TIMELINE_COLUMNS = 64


def pipeline_timeline_lines(summary: Mapping[str, Any], columns: int = TIMELINE_COLUMNS) -> list[str]:
    """One step of the pipeline as text, a row a stage (the summary's ``pipeline.timeline``):
    the picture of the schedule people draw by hand; ``[]`` without one.

    Example:
        >>> t = {"step": 8, "step_ms": 8.0, "stages": [
        ...     {"stage": 0, "rank": 0, "step_ms": 8.0, "events": [["F", 0, 2], ["R", 2, 4], ["B", 4, 8]]},
        ...     {"stage": 1, "rank": 1, "step_ms": 8.0, "events": [["R", 0, 2], ["F", 2, 4], ["B", 4, 6]]}]}
        >>> for line in pipeline_timeline_lines({"pipeline": {"timeline": t}}, columns=8):
        ...     print(line)
        step 8, 8.00 ms (1 column = 1.00 ms; F forward, B backward, . waiting for a neighbour, > sending, u update):
          stage 0 (rank 0) |FF..BBBB|
          stage 1 (rank 1) |..FFBB  |
    """
    timeline = get(get(summary, "pipeline"), "timeline")
    length = parse_finite(get(timeline, "step_ms"))
    rows = get(timeline, "stages") or []
    if not rows or not length or length <= 0:
        return []
    per_column = length / columns
    step = get(timeline, "step")
    lines = [
        (f"step {step}, " if step is not None else "the stages' latest sampled steps, ")
        + f"{length:.2f} ms (1 column = {per_column:.2f} ms; F forward, B backward, . waiting for a neighbour, "
        "> sending, u update):"
    ]
    for row in rows[:RANKS_LISTED]:
        cells = [" "] * columns
        # Waits first: where a column holds both, the compute shows.
        events = sorted(get(row, "events") or [], key=lambda e: e[0] in "FBU")
        for kind, start, end in events:
            first = min(columns - 1, max(0, int(start / per_column)))
            last = min(columns, max(first + 1, round(end / per_column)))
            cells[first:last] = _TIMELINE_MARKS.get(kind, "?") * (last - first)
        lines.append(f"  stage {get(row, 'stage')} (rank {get(row, 'rank')}) |{''.join(cells)}|")
    return lines


def comm_by_dim_lines(summary: Mapping[str, Any]) -> list[str]:
    """Communication per mesh dimension (the summary's ``comm_by_dim``), a line each:
    per kind of collective its count per step with the phases', bytes, total and waited ms.

    Example:
        >>> phase = {"count": 1.0, "bytes": 4096.0, "total_ms": 1.5, "waited_ms": 0.5}
        >>> kind = {"count": 2.0, "bytes": 8192.0, "total_ms": 3.0, "waited_ms": 1.0,
        ...         "phases": {"forward": phase, "backward": phase}}
        >>> comm_by_dim_lines({"comm_by_dim": {"tp": {"kinds": {"all_reduce": kind}}}})
        ['tp: all_reduce 2/step (fwd 1, bwd 1), 0.00819 MB, 3.00 ms total, 1.00 ms waited']
    """
    by_dim = get(summary, "comm_by_dim")
    if not isinstance(by_dim, Mapping):
        return []
    lines = []
    for label, entry in by_dim.items():
        kinds = get(entry, "kinds")
        if not isinstance(kinds, Mapping):
            continue
        bits = []
        for kind, c in kinds.items():
            phases = get(c, "phases") if isinstance(get(c, "phases"), Mapping) else {}
            split = ", ".join(f"{_PHASE_SHORT.get(p, p)} {fmt_compact(get(v, 'count'))}" for p, v in phases.items())
            bytes_ = parse_finite(get(c, "bytes"))
            bits.append(
                f"{kind} {fmt_compact(get(c, 'count'))}/step"
                + (f" ({split})" if split else "")
                + (f", {fmt(bytes_ / 1e6)} MB" if bytes_ is not None else "")
                + f", {fmt(get(c, 'total_ms'))} ms total, {fmt(get(c, 'waited_ms'))} ms waited"
            )
        if bits:
            lines.append(f"{label}: " + "; ".join(bits))
    return lines


def mesh_caption(mesh: Mapping[str, Any]) -> str:
    """What a mesh projection holds fixed and grows: replicas of ``tp`` GPUs each, and the
    tensor-parallel collectives' time per step (a what-if degree's, said so)."""
    tp, measured = parse_finite(mesh.get("tp")), parse_finite(mesh.get("tp_measured"))
    pp = parse_finite(mesh.get("pp")) or 1
    per = parse_finite(mesh.get("gpus_per_replica")) or tp
    comm = parse_finite(mesh.get("tp_comm_ms"))
    labels = "/".join(str(x) for x in mesh.get("tp_labels") or []) or "tp"
    tensor_parallel = bool(tp and tp > 1 or measured and measured > 1)
    degrees = ([f"{labels}={g_label(tp)}"] if tensor_parallel else []) + (
        [f"{g_label(pp)} pipeline stages"] if pp > 1 else []
    )
    text = f"G = data-parallel replicas of {g_label(per)} GPU{'' if per == 1 else 's'} ({', '.join(degrees)}"
    text += f", measured at {labels}={g_label(measured)})" if measured is not None and measured != tp else ")"
    if comm is not None and tensor_parallel:
        text += f", tensor-parallel collectives {fmt(comm)} ms a step" + (
            " (projected)" if measured is not None and measured != tp else " (measured)"
        )
    wait = parse_finite(mesh.get("pp_wait_ms"))
    if pp > 1 and wait is not None:
        text += f", the pipeline's waits {fmt(wait)} ms a step (measured)"
    if mesh.get("tp_crosses_nodes"):
        text += f", the {labels} group across nodes of {g_label(mesh.get('gpus_per_node'))}"
    return text
