"""Rules for a job on a DeviceMesh: tensor parallelism's communication, a tensor-parallel
group across nodes, and the data-parallel dimension's communication of a 2-D job.

The figures come from :func:`dtprofile.analysis.mesh_plan.mesh_shape` (the summary's
``mesh`` and ``comm_by_dim``); a run without a tensor-parallel dimension gets none of
these, and the data-parallel rules (``comm_bound``) keep it.
"""

from __future__ import annotations

from typing import Any

from ..._values import finite
from ..projection import project_summary
from .readings import Readings
from .registry import Finding, rule
from .thresholds import COMM_BOUND_FRACTION, CRITICAL_FRACTION
from .wording import percent


def _per_gpu_gain(r: Readings, tp: int) -> float | None:
    """Samples a second per device at tensor-parallel degree ``tp`` over the run's, at the
    run's replicas (the projection's what-if; None where it has no step)."""
    shape = r.mesh
    if shape is None or r.step is None or r.step <= 0:
        return None
    try:
        there = project_summary(r.summary, gpus=[shape.replicas], tp=tp)["step_ms"][0]
    except (ArithmeticError, ValueError):
        return None
    there_ms = finite(there)
    if not there_ms:
        return None
    return (r.step * shape.tp) / (there_ms * tp)


@rule("tp_comm_exposed", order=290)
def tp_comm_exposed(r: Readings) -> Finding | None:
    """The step waits for tensor parallelism's collectives for at least
    :data:`COMM_BOUND_FRACTION` of its time: sequence parallel, async TP, a smaller degree."""
    shape = r.mesh
    if shape is None or r.step is None or r.step <= 0:
        return None
    share = shape.tp_comm_waited_ms / r.step
    if share < COMM_BOUND_FRACTION:
        return None
    dims = "/".join(shape.tp_labels) or "tp"
    evidence: dict[str, Any] = {
        "tp_comm_waited_ms": shape.tp_comm_waited_ms,
        "tp_comm_total_ms": shape.tp_comm_total_ms,
        "tp_comm_bytes": shape.tp_comm_bytes,
        "tp_kinds": list(shape.tp_kinds),
        "tp": shape.tp,
        "step_ms": r.step,
        "tp_comm_fraction": share,
        "threshold": COMM_BOUND_FRACTION,
    }
    steps: list[str] = []
    if set(shape.tp_kinds) <= {"all_reduce"}:
        steps.append(
            "SequenceParallel() on the norms and dropouts between the parallel layers (with "
            "ColwiseParallel(input_layouts=Shard(1)) and RowwiseParallel(output_layouts=Shard(1))): "
            "each all-reduce becomes a reduce-scatter and an all-gather, and the work between them "
            "runs on a shard"
        )
    steps.append(
        "async tensor parallel under torch.compile (torch._inductor.config._micro_pipeline_tp = True, "
        "with torch.distributed._symmetric_memory.enable_symm_mem_for_group(mesh['"
        + dims
        + "'].get_group().group_name)): the collectives overlap the matmuls"
    )
    gain = None
    if shape.tp % 2 == 0:
        smaller = shape.tp // 2
        per_gpu = _per_gpu_gain(r, smaller)
        if per_gpu is not None:
            evidence["per_gpu_throughput_at_half_tp"] = per_gpu
            gain = f"tp={smaller}: {per_gpu:.2f}x the samples a second per device (projected)"
        steps.append(
            f"a smaller tensor-parallel degree where memory allows (dtprofile project --mesh "
            f"dp={shape.replicas * 2},tp={smaller} shows it), more data parallel instead"
        )
    title = (
        f"Tensor parallelism's communication exposed: {shape.tp_comm_waited_ms:.1f} ms of the step waits for "
        f"the {dims} group's collectives ({percent(share)}, threshold {percent(COMM_BOUND_FRACTION)})"
    )
    severity = "high" if share >= CRITICAL_FRACTION else "medium"
    return Finding("tp_comm_exposed", severity, title, evidence, "; ".join(steps), gain)


@rule("tp_across_nodes", order=250)
def tp_across_nodes(r: Readings) -> Finding | None:
    """A tensor-parallel group spans nodes (``run.ranks_per_host`` from the launcher): its
    collectives, inside every forward and backward, cross the slow link."""
    shape = r.mesh
    per_node = r.run_info.get("ranks_per_host") if isinstance(r.run_info, dict) else None
    if shape is None or not isinstance(per_node, int) or not shape.crosses_nodes(None, per_node):
        return None
    dims = "/".join(shape.tp_labels) or "tp"
    evidence = {"tp": shape.tp, "tp_stride": shape.tp_stride, "ranks_per_host": per_node}
    fits = shape.tp <= per_node
    action = (
        f"make '{dims}' the last (innermost) mesh dimension, as init_device_mesh('cuda', (dp, tp), "
        f"mesh_dim_names=('dp', '{dims}')) does, so that each group's ranks share a node"
        if fits
        else f"a tensor-parallel degree of at most {per_node} (the GPUs of a node), and data parallel "
        "across nodes (dtprofile project --mesh dp=...,tp=... shows the step)"
    )
    title = (
        f"The {dims} group ({shape.tp} ranks, {shape.tp_stride} apart) spans nodes of {per_node}: its "
        "collectives cross the inter-node link inside every forward and backward"
    )
    return Finding("tp_across_nodes", "high", title, evidence, action)


@rule("dp_comm_exposed", order=310)
def dp_comm_exposed(r: Readings) -> Finding | None:
    """A 2-D job's data-parallel dimension (FSDP2 across replicas) waited for at least
    :data:`COMM_BOUND_FRACTION` of the step: prefetch, resharding, HSDP."""
    shape = r.mesh
    if shape is None or shape.dp_comm_waited_ms is None or r.step is None or r.step <= 0:
        return None
    share = shape.dp_comm_waited_ms / r.step
    if share < COMM_BOUND_FRACTION:
        return None
    evidence = {
        "dp_comm_waited_ms": shape.dp_comm_waited_ms,
        "dp_comm_total_ms": shape.dp_comm_total_ms,
        "dp_comm_bytes": shape.dp_comm_bytes,
        "replicas": shape.replicas,
        "step_ms": r.step,
        "dp_comm_fraction": share,
        "threshold": COMM_BOUND_FRACTION,
    }
    action = (
        "FSDP2 on the data-parallel dimension: prefetch the next unit's all-gather "
        "(module.set_modules_to_forward_prefetch([...]) and set_modules_to_backward_prefetch([...])), "
        "reshard_after_forward=False on the units backward gathers again first (memory for fewer "
        "all-gathers), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16); "
        "across nodes, HSDP: fully_shard(..., mesh=mesh['replicate', 'shard']) shards within a node "
        "and all-reduces across nodes"
    )
    title = (
        f"The data-parallel dimension's collectives exposed: {shape.dp_comm_waited_ms:.1f} ms of the step "
        f"({percent(share)}, threshold {percent(COMM_BOUND_FRACTION)})"
    )
    severity = "high" if share >= CRITICAL_FRACTION else "medium"
    return Finding("dp_comm_exposed", severity, title, evidence, action)
