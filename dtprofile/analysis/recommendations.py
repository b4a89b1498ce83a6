"""Summary + projection -> recommendations: what to set, and to what.

:func:`recommend` builds the summary's ``recommendations`` object (``docs/summary.md``)
from the measurements and the projection of :mod:`dtprofile.analysis.projection`: the
device count that keeps the target efficiency, the link bandwidth that would reach it,
the parameter servers the paper's lemma needs, the largest batch that fits, the
DataLoader workers that hide the data wait and the critical batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .._values import finite, get
from .checks import REL_EPS
from .perf_model import BITS_PER_BYTE, GIGA, bandwidth_needed, min_parameter_servers, two_level_allreduce_seconds
from .phases import SCALING_MODES
from .projection import fixed_comm_seconds_at, project_summary, resolve_bandwidth
from .sizing import critical_batch_size, loader_plan, max_batch_size
from .summary_readers import comm_bytes_per_step

__all__ = [
    "DATA_WAIT_HIDDEN_FRACTION",
    "DEFAULT_TARGET_EFFICIENCY",
    "SCALING_SETTLED_BY",
    "parameter_server_plan",
    "recommend",
    "scaling_modes",
]

#: Where a user says what the job keeps fixed when the GPU count changes.
SCALING_SETTLED_BY = (
    "scaling='weak' or 'strong' (dtprofile.profile, DTProfileCallback, DTPROFILE_SCALING; dtprofile project --scaling)"
)

#: Target fraction of linear speedup (the paper's and the options' default).
DEFAULT_TARGET_EFFICIENCY = 0.8
#: Data wait below this share of the step counts as hidden already (the PyTorch
#: profiler's TensorBoard plugin flagged data loading above 5% of the step).
DATA_WAIT_HIDDEN_FRACTION = 0.05


def _or_none(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or None when the arithmetic breaks down (underflow to 0,
    overflow): a recommendation from degenerate measurements is unknown, not an exception."""
    try:
        result = fn(*args, **kwargs)
    except (ArithmeticError, ValueError):
        return None
    return result


def _index_of_gpus(projection: Mapping[str, Any], g: Any) -> int | None:
    """Where device count ``g`` sits in the projection's lists, or None."""
    gpus = get(projection, "gpus") or []
    return gpus.index(g) if g in gpus else None


def _bandwidth_needed_for(projection: Mapping[str, Any], index: int, nbytes: float, target: float) -> float | None:
    """Inter-node/ring bandwidth (bytes/s) reaching ``target`` at projection[gpus][index]."""

    def item(key: str) -> float | None:
        values = get(projection, key)
        return finite(values[index]) if isinstance(values, list) and index < len(values) else None

    g = finite(projection["gpus"][index])
    step, exposed, hideable = item("step_ms"), item("comm_exposed_ms"), item("hideable_ms")
    reference = finite(get(projection, "reference_step_ms"))
    if g is None or step is None or exposed is None or hideable is None or reference is None:
        return None
    base_s = (step - exposed) / 1e3
    ideal_s = reference / 1e3 if get(projection, "scaling") == "weak" else reference / 1e3 / g
    latency = finite(get(projection, "latency_s")) or 0.0
    # What the link does not carry: the all-reduce's fixed part and DDP's buffer broadcast.
    fixed_s = (
        fixed_comm_seconds_at(
            (finite(get(projection, "fixed_comm_ms")) or 0.0) / 1e3, g, finite(get(projection, "measured_gpus")) or 1.0
        )
        + (finite(get(projection, "comm_buffers_ms")) or 0.0) / 1e3
    )
    if get(projection, "model") != "two_level":
        return bandwidth_needed(
            nbytes, g, base_s, target, 0.0, hideable / 1e3, latency, ideal_seconds=ideal_s, fixed_seconds=fixed_s
        )
    used, per_node = item("nodes_used"), item("gpus_per_node")
    intra_GBps = finite(get(projection, "intra_bandwidth_GBps"))
    if used is None or per_node is None or intra_GBps is None:
        return None
    # Budget for communication, minus the intra-node and latency terms, left to the link.
    if base_s > ideal_s / target * (1 + REL_EPS):
        return math.inf  # misses the target even with all communication hidden
    budget = hideable / 1e3 + ideal_s / target - base_s
    fixed = fixed_s + two_level_allreduce_seconds(nbytes, used, per_node, intra_GBps * GIGA, math.inf, latency)
    if used <= 1:
        return 0.0 if fixed <= budget else math.inf
    available = budget - fixed
    if available <= 0:
        return math.inf
    shard = nbytes / per_node if get(projection, "link_per") == "gpu" else nbytes
    return 2.0 * (used - 1.0) / used * shard / available


def _gpus_range(summary: Mapping[str, Any], gpus: list[Any], target: float) -> list[Any] | None:
    """The device counts that keep ``target`` within the run's noise: from the largest
    whose efficiency interval lies at or above it to the largest whose interval reaches
    it (``uncertainty.projection``); None without intervals for these counts."""
    ranges = get(get(summary, "uncertainty"), "projection")
    spans = get(ranges, "efficiency")
    if (
        not isinstance(spans, list)
        or list(get(ranges, "gpus") or []) != gpus
        or get(ranges, "scaling") != get(get(summary, "projection"), "scaling")
    ):
        return None
    low = [g for g, span in zip(gpus, spans, strict=False) if isinstance(span, list) and span[0] >= target - 1e-12]
    high = [g for g, span in zip(gpus, spans, strict=False) if isinstance(span, list) and span[1] >= target - 1e-12]
    if not any(isinstance(span, list) for span in spans):
        return None
    return [max(low, default=1), max(high, default=1)]


def _reaches(summary: Mapping[str, Any], ratio: str, threshold: float) -> bool:
    """Whether ``ratios[ratio]``'s interval within the run's noise reaches ``threshold``, so
    that advice the point figure misses is sized all the same (False without intervals)."""
    span = get(get(get(summary, "uncertainty"), "ratios"), ratio)
    high = finite(span[1]) if isinstance(span, list) and len(span) == 2 else None
    return high is not None and high >= threshold


def _server_bandwidth(summary: Mapping[str, Any], projection: Mapping[str, Any]) -> tuple[float, str]:
    """(bytes/s, source) of one parameter server's network link: the projection's link,
    unless that is NVLink or PCIe inside this node (NVML), which no server is reached by."""
    source = get(projection, "bandwidth_source")
    bw_GBps = finite(get(projection, "bandwidth_GBps"))
    if source != "nvml" and bw_GBps:
        return bw_GBps * GIGA, str(source)
    return resolve_bandwidth(summary, allow_nvml=False)


def _parameter_server_fields(
    summary: Mapping[str, Any],
    projection: Mapping[str, Any],
    gpus: float | None,
    known: list[Any],
    nbytes: float | None,
) -> dict[str, Any]:
    """The lemma's server count for this model, and how unevenly its tensors split.

    A server deployment pushes the gradients once per optimizer step, however many
    micro-batches all-reduced them here (accumulation without no_sync()). Servers hold
    whole tensors, so the one holding the largest tensor (L bytes) carries at least
    ``max(L, S/N)``: ``imbalance = max(1, L N / S)`` at the even-split count N, and a
    tensor larger than one server's budget ``B_ps T_C / (2 G)`` saturates it however
    many servers there are (``..._largest_tensor_share`` > 1).
    """
    # A deployment at one device is moot: when all-reduce does not scale past G = 1,
    # size the servers for the largest projected G instead.
    ps_gpus = gpus
    if ps_gpus is not None and ps_gpus <= 1 and known:
        ps_gpus = max(g for g, _ in known)
    fields = _servers_at(summary, projection, _index_of_gpus(projection, ps_gpus), nbytes)
    if fields is None:
        return {}
    return {
        "num_parameter_servers": fields["num_parameter_servers"],
        "num_parameter_servers_at_gpus": ps_gpus,
        "num_parameter_servers_bytes": fields["bytes"],
        "num_parameter_servers_bandwidth_Gbps": fields["bandwidth_Gbps"],
        "num_parameter_servers_bandwidth_source": fields["bandwidth_source"],
        "num_parameter_servers_imbalance": fields["imbalance"],
        "num_parameter_servers_largest_tensor_share": fields["largest_tensor_share"],
    }


def _servers_at(
    summary: Mapping[str, Any], projection: Mapping[str, Any], index: int | None, nbytes: float | None
) -> dict[str, Any] | None:
    """The lemma's servers at the projection's ``index``-th G, or None where unknown.

    A server deployment pushes the gradients once per optimizer step, however many
    micro-batches all-reduced them here (accumulation without no_sync()).
    """
    gpus = list(get(projection, "gpus") or [])
    compute = get(projection, "compute_ms")
    if index is None or index >= len(gpus) or not isinstance(compute, list) or index >= len(compute):
        return None
    ps_gpus, compute_ms = finite(gpus[index]), finite(compute[index])
    if ps_gpus is None or nbytes is None or compute_ms is None or compute_ms <= 0:
        return None
    run_info = get(summary, "run")
    passes = finite(get(run_info, "sync_passes"))
    ps_bytes = nbytes / passes if passes is not None and passes > 1 else nbytes
    server_Bps, source = _server_bandwidth(summary, projection)
    n_ps = _or_none(min_parameter_servers, ps_bytes, ps_gpus, server_Bps, compute_ms / 1e3)
    if n_ps is None:
        return None
    out: dict[str, Any] = {
        "gpus": gpus[index],
        "num_parameter_servers": n_ps,
        "bytes": ps_bytes,
        "bandwidth_Gbps": server_Bps * BITS_PER_BYTE / GIGA,
        "bandwidth_source": source,
        "compute_ms": compute_ms,
        "imbalance": 1.0,
        "largest_tensor_share": None,
    }
    largest = finite(get(run_info, "largest_trainable_param_bytes"))
    whole = finite(get(run_info, "trainable_param_bytes")) or finite(get(run_info, "param_bytes"))
    if largest is not None and whole and 0 < largest <= whole:
        # On the wire as the rest is (a 16-bit compression hook halves both).
        largest *= ps_bytes / whole
        budget = server_Bps * compute_ms / 1e3 / (2.0 * ps_gpus)
        out["imbalance"] = max(1.0, largest * n_ps / ps_bytes)
        out["largest_tensor_share"] = largest / budget
    return out


def parameter_server_plan(summary: Mapping[str, Any], projection: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The paper's parameter-server lemma at each projected G (``dtprofile project --model ps``).

    What a parameter-server deployment of this model would need, were the job to exchange
    its gradients through servers rather than all-reduce: ``N_ps >= 2 S G / (B_ps T_C)``
    servers, each on one network link (the projection's, unless that is inside the node),
    with T_C the projected compute at G. Servers hold whole tensors: ``imbalance`` is the
    largest shard over the mean one, and ``largest_tensor_share`` > 1 means one tensor
    alone outgrows a server's share of the step.

    Args:
        summary: A run summary.
        projection: Its projection (:func:`~dtprofile.analysis.projection.project_summary`).

    Returns:
        One dict per G that has a compute time and bytes: ``gpus``,
        ``num_parameter_servers``, ``bytes``, ``bandwidth_Gbps``, ``bandwidth_source``,
        ``compute_ms``, ``imbalance``, ``largest_tensor_share``.

    Example:
        >>> from dtprofile.analysis.projection import project_summary
        >>> s = {"world_size": 1, "grad_bytes": 1e8, "per_step_ms": {"step": 100.0, "compute": 100.0}}
        >>> plan = parameter_server_plan(s, project_summary(s, gpus=[2, 8], bandwidth="10Gbps"))
        >>> [(p["gpus"], p["num_parameter_servers"]) for p in plan]  # 2 * 1e8 B * G / (1.25e9 B/s * 0.1 s)
        [(2, 4), (8, 13)]
    """
    nbytes = comm_bytes_per_step(summary)
    plan = (_servers_at(summary, projection, i, nbytes) for i in range(len(get(projection, "gpus") or [])))
    return [p for p in plan if p is not None]


def _loader_fields(summary: Mapping[str, Any], run_info: Mapping[str, Any]) -> dict[str, Any]:
    """The loader's recommendations (:func:`~dtprofile.analysis.sizing.loader_plan` where the
    data wait, or its interval, reaches :data:`DATA_WAIT_HIDDEN_FRACTION` of the step; else
    the workers the run has): ``num_workers`` and the plan's figures."""
    out: dict[str, Any] = {}
    per_step = get(summary, "per_step_ms") or {}
    step, data = finite(get(per_step, "step")), finite(get(per_step, "data_wait"))
    current = finite(get(run_info, "num_workers"))
    current = int(current) if current is not None and current >= 0 else None
    if step is not None and step > 0 and data is not None and data >= 0:
        # Loader workers do not run the batch's transfer to the device (Lightning's hooks).
        data = max(0.0, data - (finite(get(per_step, "data_transfer")) or 0.0))
        if data / step >= DATA_WAIT_HIDDEN_FRACTION or _reaches(summary, "data_fraction", DATA_WAIT_HIDDEN_FRACTION):
            loader = get(run_info, "cpu_time")
            # The CPU a batch costs: the main process's while it loads, else the workers'.
            cpu = finite(get(loader, "worker_cpu_ms_per_batch" if current else "fetch_cpu_ms"))
            plan = _or_none(
                loader_plan,
                data,
                step,
                current,
                int(finite(get(run_info, "micro_batches")) or 1),
                cpu,
                finite(get(run_info, "cpus_per_rank")),
                finite(get(loader, "training_cpu_cores")),
                batch_bytes=finite(get(run_info, "batch_bytes")),
                shm_copy_ms=finite(get(run_info, "shm_copy_ms")),
                shm_release_ms=finite(get(run_info, "shm_release_ms")),
            )
            if plan is not None:
                out.update(
                    num_workers=plan.workers,
                    num_workers_needed=plan.workers_needed,
                    num_workers_step_ms=plan.predicted_step_ms,
                    loader_kind=plan.kind,
                    loader_cpu_share=plan.cpu_share,
                    loader_cores_needed=plan.cores_needed,
                )
        else:
            out["num_workers"] = current
    return out


def recommend(summary: Mapping[str, Any], projection: Mapping[str, Any]) -> dict[str, Any]:
    """The ``recommendations`` object: what to set, from the measurements and projection.

    - ``gpus``: largest projected G with efficiency >= ``options.target_efficiency``.
    - ``num_parameter_servers``: :func:`~dtprofile.analysis.perf_model.min_parameter_servers`
      for the user's model at that G (the largest projected G when that G is 1;
      ``num_parameter_servers_at_gpus`` says which), with the projected compute and a
      network link per server: the projection's, unless that is inside the node (NVML),
      then the user's link, the NIC or the assumed Ethernet
      (``num_parameter_servers_bandwidth_{Gbps,source}``); see
      :func:`_parameter_server_fields` for ``..._imbalance`` and
      ``..._largest_tensor_share``.
    - ``bandwidth_needed_Gbps``: ring (or inter-node) bandwidth reaching the target at
      ``bandwidth_needed_at_gpus`` (the largest projected G > 1); None when unreachable
      at any bandwidth (``bandwidth_needed_reachable`` False) or unknown.
    - ``max_batch_size``: :func:`~dtprofile.analysis.sizing.max_batch_size` from
      ``run.memory`` (CUDA only).
    - ``num_workers``: :func:`~dtprofile.analysis.sizing.loader_plan` when data wait is at
      least :data:`DATA_WAIT_HIDDEN_FRACTION` of the step (``num_workers_needed`` before
      any cap, ``num_workers_step_ms`` the step it predicts, ``loader_kind`` "io" or
      "cpu" from ``loader_cpu_share``, ``loader_cores_needed`` for a computing loader);
      otherwise the current setting (already hidden).
    - ``critical_batch_size``: ``run.gradient_noise.B_simple`` (global batch), or None.

    Args:
        summary: A run summary.
        projection: Its projection (:func:`~dtprofile.analysis.projection.project_summary`).

    Returns:
        The recommendations (``docs/summary.md``); None where nothing was measured.

    Example:
        >>> from dtprofile.analysis.projection import project_summary
        >>> s = {"world_size": 1, "grad_bytes": 1e8, "per_step_ms": {"step": 100.0, "compute": 100.0}}
        >>> rec = recommend(s, project_summary(s, gpus=[1, 8], bandwidth="100Gbps"))
        >>> rec["gpus"], round(rec["bandwidth_needed_Gbps"], 1)  # 1.75e8 B in the 25 ms left at 0.8
        (8, 56.0)
    """
    options = get(summary, "options") or {}
    run_info = get(summary, "run") or {}
    target = finite(get(options, "target_efficiency")) or DEFAULT_TARGET_EFFICIENCY
    rec: dict[str, Any] = {
        "gpus": None,
        "gpus_range": None,
        "num_parameter_servers": None,
        "bandwidth_needed_Gbps": None,
        "max_batch_size": None,
        "num_workers": None,
        "critical_batch_size": None,
        "target_efficiency": target,
        "bandwidth_needed_at_gpus": None,
        "bandwidth_needed_reachable": None,
        "num_workers_needed": None,
        "num_parameter_servers_at_gpus": None,
        "num_parameter_servers_bytes": None,
        "num_parameter_servers_bandwidth_Gbps": None,
        "num_parameter_servers_bandwidth_source": None,
        "num_parameter_servers_imbalance": None,
        "num_parameter_servers_largest_tensor_share": None,
        "num_workers_step_ms": None,
        "loader_kind": None,
        "loader_cpu_share": None,
        "loader_cores_needed": None,
    }
    gpus = list(get(projection, "gpus") or [])
    efficiency = list(get(projection, "efficiency") or [])
    known = [(g, e) for g, e in zip(gpus, efficiency, strict=False) if finite(e) is not None]
    good = [g for g, e in known if e >= target - 1e-12]  # float slack: exactly on target counts
    if good:
        rec["gpus"] = max(good)
    elif known:  # one device is efficiency 1 by definition
        rec["gpus"] = 1
    rec["gpus_range"] = _gpus_range(summary, gpus, target) if rec["gpus"] is not None else None

    nbytes = comm_bytes_per_step(summary)
    rec.update(_parameter_server_fields(summary, projection, rec["gpus"], known, nbytes))

    multi = [g for g in gpus if finite(g) is not None and g > 1]
    if multi and nbytes is not None:
        at = max(multi)
        needed = _or_none(_bandwidth_needed_for, projection, gpus.index(at), nbytes, target)
        if needed is not None:  # the G only beside what was found there (a figure or unreachable)
            rec["bandwidth_needed_at_gpus"] = at
            gbps = needed * BITS_PER_BYTE / GIGA
            rec["bandwidth_needed_reachable"] = math.isfinite(gbps)
            if math.isfinite(gbps):
                rec["bandwidth_needed_Gbps"] = gbps

    memory = get(run_info, "memory")
    if get(summary, "device") == "cuda" and isinstance(memory, Mapping):
        peak, static, total = (finite(get(memory, k)) for k in ("peak_bytes", "static_bytes", "total_bytes"))
        batch = finite(get(run_info, "batch_size"))
        if (
            peak is not None
            and static is not None
            and total is not None
            and batch is not None
            and total > 0
            and batch > 0
        ):
            rec["max_batch_size"] = _or_none(max_batch_size, peak, static, total, batch)

    rec.update(_loader_fields(summary, run_info))
    rec["critical_batch_size"] = critical_batch_size(run_info)
    return rec


def scaling_modes(
    summary: Mapping[str, Any], projection: Mapping[str, Any], rec: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Weak and strong scaling's answers side by side, where the run did not say which one
    the job follows (``options.scaling`` null): a run cannot tell whether its user keeps
    the per-device batch (weak) or the global batch (strong) when the GPU count changes.

    Args:
        summary: The summary (its ``options``).
        projection: Its projection, in the mode assumed (weak).
        rec: Its recommendations from that projection.

    Returns:
        ``{"assumed", "settled_by", "differ", "weak": {...}, "strong": {...}}``, each mode's
        ``gpus`` (the recommended count), ``largest_gpus`` and ``efficiency_at_largest``;
        None where the run said which, or nothing was projected.
    """
    if get(get(summary, "options"), "scaling") in SCALING_MODES:
        return None
    assumed = get(projection, "scaling")
    if assumed not in SCALING_MODES:
        return None
    other = "strong" if assumed == "weak" else "weak"
    try:
        other_projection = project_summary(summary, scaling=other)
    except (ArithmeticError, ValueError, TypeError):
        return None
    other_rec = recommend(summary, other_projection)

    def answer(proj: Mapping[str, Any], r: Mapping[str, Any]) -> dict[str, Any]:
        gpus = [
            g
            for g, e in zip(get(proj, "gpus") or [], get(proj, "efficiency") or [], strict=False)
            if finite(e) is not None
        ]
        largest = max(gpus) if gpus else None
        eff = (get(proj, "efficiency") or [])[list(get(proj, "gpus")).index(largest)] if largest is not None else None
        return {"gpus": get(r, "gpus"), "largest_gpus": largest, "efficiency_at_largest": finite(eff)}

    answers = {assumed: answer(projection, rec), other: answer(other_projection, other_rec)}
    return {
        "assumed": assumed,
        "settled_by": SCALING_SETTLED_BY,
        "differ": answers["weak"]["gpus"] != answers["strong"]["gpus"],
        **answers,
    }
