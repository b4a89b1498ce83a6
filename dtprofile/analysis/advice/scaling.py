"""Rules about scaling to more devices: the link's bandwidth, the device count, parameter servers."""

from __future__ import annotations

from typing import Any, cast

from ..._values import finite, get
from ..perf_model import BITS_PER_BYTE
from .readings import Readings
from .registry import Finding, rule
from .thresholds import COMM_BOUND_FRACTION
from .wording import gpus_text, round_up, standard_link

__all__ = ["gpu_count", "network_bandwidth", "parameter_servers"]


@rule("network_bandwidth", order=500)
def network_bandwidth(r: Readings) -> Finding | None:
    """The projection at the largest device count misses the target efficiency because of
    communication: the link bandwidth that reaches it.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    at = get(r.recommendations, "bandwidth_needed_at_gpus")
    if at is None:
        return None
    eff = r.projected(at, "efficiency")
    step = r.projected(at, "step_ms")
    exposed = r.projected(at, "comm_exposed_ms")
    if eff is None or step is None or exposed is None or step <= 0:
        return None
    forecast = eff < r.target and exposed / step >= COMM_BOUND_FRACTION
    if not (r.comm_bound or forecast) or eff >= r.target:
        return None
    current_gbps = (finite(get(r.projection, "bandwidth_GBps")) or 0.0) * BITS_PER_BYTE
    needed = finite(get(r.recommendations, "bandwidth_needed_Gbps"))
    # The measured figures under their usual keys (one figure per quantity in every
    # finding); the model's at ``at_gpus`` under projected_* keys.
    evidence = {
        "bandwidth_Gbps": current_gbps,
        "bandwidth_source": get(r.projection, "bandwidth_source"),
        "bandwidth_needed_Gbps": needed,
        "at_gpus": at,
        "projected_efficiency": eff,
        "efficiency_now": eff,  # (the projected efficiency at at_gpus, as before)
        "target_efficiency": r.target,
        "projected_comm_ms": r.projected(at, "comm_ms"),
        "projected_comm_exposed_ms": exposed,
        "projected_step_ms": step,
        "comm_exposed_ms": r.comm_exposed,
        "step_ms": r.step,
        "grad_bytes": get(r.projection, "grad_bytes"),
        "model": get(r.projection, "model"),
    }
    severity = "medium" if r.comm_bound else "info"
    if needed is None:
        title = (
            f"No link bandwidth reaches efficiency {r.target:.2f} at {at} {r.g_unit} "
            f"(now {eff:.2f} with {r.bandwidth_note()}): latency or serial work "
            "dominates"
        )
        action = (
            "batch_size larger per device (see batch_headroom) or fewer GPUs (see "
            "gpu_count); bandwidth alone cannot fix it"
        )
        return Finding("network_bandwidth", severity, title, evidence, action, None)
    title = (
        f"Link bandwidth limits scaling: efficiency {eff:.2f} at {at} {r.g_unit} with "
        f"{r.bandwidth_note()}; {round_up(needed)} Gbit/s reaches {r.target:.2f}"
    )
    action = f"link bandwidth >= {round_up(needed)} Gbit/s (e.g. {standard_link(needed)})"
    gain = (
        f"efficiency at {at} {r.g_unit} {eff:.2f} -> {r.target:.2f} (speedup {eff * at:.1f}x -> {r.target * at:.1f}x)"
    )
    return Finding("network_bandwidth", severity, title, evidence, action, gain)


@rule("gpu_count", order=600)
def gpu_count(r: Readings) -> Finding | None:
    """Projected efficiency falls below the target before the largest projected device count:
    the largest count that keeps it.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    best = finite(get(r.recommendations, "gpus"))
    largest = r.largest_projected_gpus()
    if best is None or largest is None:
        return None
    best = get(r.recommendations, "gpus")
    # Decided on the counts that may keep the target within the run's noise (the upper end
    # of the range), so that a run profiled again does not flip the finding on noise.
    span = get(r.recommendations, "gpus_range")
    most = span[1] if isinstance(span, list) and len(span) == 2 and finite(span[1]) is not None else best
    if most >= largest and most >= r.g_now:
        return None
    if most < r.g_now:
        decision = _below_target_now(r, best)
        if decision is not None:
            return decision
    eff_largest = r.projected(largest, "efficiency")
    eff_best = r.projected(best, "efficiency")
    evidence = {
        "recommended_gpus": best,
        **({"recommended_gpus_range": span} if span else {}),
        "efficiency_at_recommended": eff_best,
        "largest_projected_gpus": largest,
        "efficiency_at_largest": eff_largest,
        "target_efficiency": r.target,
        "world_size": r.world_size,
        "scaling": get(r.projection, "scaling"),
        "bandwidth_source": get(r.projection, "bandwidth_source"),
        "bandwidth_GBps": get(r.projection, "bandwidth_GBps"),
        "gpus": get(r.projection, "gpus"),
        "efficiency": get(r.projection, "efficiency"),
    }
    noise = (
        f" ({span[0]}-{span[1]} within this run's noise)"
        if isinstance(span, list) and len(span) == 2 and span[0] != span[1]
        else ""
    )
    title = (
        f"Scaling knee: efficiency stays >= {r.target:.2f} up to {gpus_text(best)}{noise} and falls "
        f"to {eff_largest:.2f} at {largest} ({get(r.projection, 'scaling')} scaling, "
        f"{r.bandwidth_note()})"
    )
    severity = "medium" if most < r.g_now else "info"
    launch = _launch_setting(r)
    action = f"{launch} <= {most if noise else best} at this bandwidth" + _other_mode(r)
    gain = None
    if eff_best is not None:
        gain = f"efficiency {eff_best:.2f} at {gpus_text(best)} vs {eff_largest:.2f} at {largest}"
        now, fewer = r.projected(r.g_now, "speedup"), r.projected(best, "speedup")
        if best < r.g_now and now is not None and fewer is not None:
            # Fewer GPUs than now: each works more efficiently, the run as a whole goes slower.
            gain += (
                f"; speedup {fewer:.2f} at {gpus_text(best)} vs {now:.2f} at the {r.g_now} used "
                "now: less throughput, each GPU better used"
            )
    return Finding("gpu_count", severity, title, evidence, action, gain)


def _other_mode(r: Readings) -> str:
    """Where the run did not say what the job keeps fixed and the other scaling mode
    recommends another count: that count, and how to settle it ("" otherwise)."""
    modes = get(r.summary, "scaling_modes")
    if not get(modes, "differ"):
        return ""
    other = "strong" if get(modes, "assumed") == "weak" else "weak"
    gpus = get(get(modes, other), "gpus")
    kept = "the global batch stays fixed" if other == "strong" else "each device keeps its batch"
    return f"; if {kept} ({other} scaling), <= {gpus}: say which with {get(modes, 'settled_by')}"


def _efficiency_range(r: Readings, gpus: Any) -> list[Any] | None:
    """The efficiency interval at ``gpus`` (``uncertainty.projection``), or None."""
    ranges = get(get(r.summary, "uncertainty"), "projection")
    counts = get(ranges, "gpus") or []
    spans = get(ranges, "efficiency")
    if gpus not in counts or not isinstance(spans, list) or counts.index(gpus) >= len(spans):
        return None
    span: list[Any] | None = spans[counts.index(gpus)]
    return span


def _launch_setting(r: Readings) -> str:
    """Where the user sets the device count: Lightning's Trainer, Accelerate's launcher, else torchrun;
    on a mesh, its data-parallel dimension (the count is of replicas)."""
    if r.mesh is not None:
        return (
            f"the data-parallel mesh dimension, replicas (init_device_mesh(..., (replicas, {r.mesh.per_replica})) "
            f"on replicas x {r.mesh.per_replica} ranks)"
        )
    if r.lightning:
        return "Trainer(devices=..., num_nodes=...) with devices x num_nodes"
    if r.accelerate:
        return "the process count (accelerate launch --num_processes=... --num_machines=..., or torchrun)"
    return "world_size (torchrun --nnodes/--nproc_per_node)"


def _below_target_now(r: Readings, best: int) -> Finding | None:
    """Efficiency at the run's own device count is below the target: a decision, not an
    order to scale down. What limits it, and what each way out buys in throughput
    (speedup against one device) and efficiency: more devices, a faster link, a larger
    batch, fewer devices. Scaling down is the action only for a user whose goal is the
    cost per sample; the finding says so and leaves the count to them.
    """
    g = r.g_now
    eff_now, speed_now = r.projected(g, "efficiency"), r.projected(g, "speedup")
    step_now, exposed_now = r.projected(g, "step_ms"), r.projected(g, "comm_exposed_ms")
    if eff_now is None or not speed_now or step_now is None:
        return None
    gpus = [x for x in (get(r.projection, "gpus") or []) if finite(x) is not None]
    faster = [x for x in gpus if x > g and (r.projected(x, "speedup") or 0.0) > speed_now * 1.01]
    more = max(faster, key=lambda x: cast(float, r.projected(x, "speedup"))) if faster else None  # each > speed_now
    speed_best, eff_best = r.projected(best, "speedup"), r.projected(best, "efficiency")
    options = {}
    if more is not None:
        options["more_gpus"] = {
            "gpus": more,
            "speedup": r.projected(more, "speedup"),
            "efficiency": r.projected(more, "efficiency"),
        }
    if speed_best is not None:
        options["fewer_gpus"] = {"gpus": best, "speedup": speed_best, "efficiency": eff_best}
    bandwidth = finite(get(r.recommendations, "bandwidth_needed_Gbps"))
    # At the run's own count the measured figures, the same as every other finding quotes.
    if r.comm_exposed is not None and r.step:
        exposed_now, step_now = r.comm_exposed, r.step
    limit = (
        f"exposed communication {exposed_now:.1f} ms of a {step_now:.1f} ms step (measured)"
        if exposed_now is not None and exposed_now > 0
        else "the overhead per step"
    )
    spans = {
        "efficiency_now_range": _efficiency_range(r, g),
        "recommended_gpus_range": get(r.recommendations, "gpus_range"),
    }
    evidence = {
        "world_size": g,
        "efficiency_now": eff_now,
        "speedup_now": speed_now,
        "target_efficiency": r.target,
        "recommended_gpus": best,
        **{k: v for k, v in spans.items() if v is not None},
        "efficiency_at_recommended": eff_best,
        "options": options,
        "scaling": get(r.projection, "scaling"),
        "bandwidth_source": get(r.projection, "bandwidth_source"),
        "bandwidth_GBps": get(r.projection, "bandwidth_GBps"),
        "gpus": get(r.projection, "gpus"),
        "efficiency": get(r.projection, "efficiency"),
    }
    title = (
        f"Efficiency {eff_now:.2f} at the {g} {r.g_unit} used now, below the target {r.target:.2f}: "
        f"{limit} ({get(r.projection, 'scaling')} scaling, {r.bandwidth_note()})"
    )
    launch = _launch_setting(r)
    choices = []
    if more is not None:
        m = options["more_gpus"]
        choices.append(
            f"for throughput, {launch} = {m['gpus']}: speedup {m['speedup']:.1f}x "
            f"({m['speedup'] / speed_now:.2f}x today's) at efficiency {m['efficiency']:.2f}"
        )
    else:
        choices.append(
            f"for throughput, keep {g} {r.g_unit} (speedup {speed_now:.1f}x): more would not go faster "
            "at this bandwidth"
        )
    if bandwidth is not None:
        choices.append(
            f"for efficiency at any count, a faster link (>= {round_up(bandwidth)} Gbit/s: see network_bandwidth)"
        )
    choices.append("or a larger per-device batch (see batch_headroom), which hides more communication")
    if speed_best is not None:
        choices.append(
            f"only if the cost per sample matters more than time: at {gpus_text(best)}, "
            f"efficiency {eff_best:.2f} and speedup {speed_best:.1f}x ({speed_best / speed_now:.2f}x "
            "today's throughput)"
        )
    action = "; ".join(choices)
    gain = f"speedup {speed_now:.1f}x at {g} now" + (
        f" -> {options['more_gpus']['speedup']:.1f}x at {more}" if more is not None else ""
    )
    return Finding("gpu_count", "medium", title, evidence, action, gain)


@rule("parameter_servers", order=1500)
def parameter_servers(r: Readings) -> Finding | None:
    """The parameter servers the paper's lemma needs for the user's model (info), for a run
    whose summary says it exchanged gradients through servers (``run.gradient_exchange``
    is ``"parameter_server"``).

    An all-reduce or FSDP job gets no such finding: servers are not a knob it has, and each
    worker's link carries at least as much to servers as to a ring. Its report shows the
    lemma as a projection section instead (:func:`dtprofile.render.views.parameter_server_text`),
    and ``dtprofile project --model ps`` gives it at each G.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    if get(r.run_info, "gradient_exchange") != "parameter_server":
        return None
    n_ps = get(r.recommendations, "num_parameter_servers")
    g = get(r.recommendations, "num_parameter_servers_at_gpus") or get(r.recommendations, "gpus")
    if n_ps is None or g is None:
        return None
    gbps = finite(get(r.recommendations, "num_parameter_servers_bandwidth_Gbps"))
    if gbps is None:  # a summary from before 0.5
        gbps = (finite(get(r.projection, "bandwidth_GBps")) or 0.0) * BITS_PER_BYTE
    imbalance = finite(get(r.recommendations, "num_parameter_servers_imbalance")) or 1.0
    share = finite(get(r.recommendations, "num_parameter_servers_largest_tensor_share"))
    evidence = {
        "num_parameter_servers": n_ps,
        "gpus": g,
        "param_bytes": get(r.run_info, "param_bytes") or get(r.projection, "grad_bytes"),
        "bytes_per_step": get(r.recommendations, "num_parameter_servers_bytes") or get(r.projection, "grad_bytes"),
        "largest_tensor_bytes": get(r.run_info, "largest_trainable_param_bytes"),
        "server_bandwidth_Gbps": gbps,
        "compute_ms": r.projected(g, "compute_ms"),
        "imbalance": imbalance,
        "largest_tensor_share": share,
        "bandwidth_source": get(r.recommendations, "num_parameter_servers_bandwidth_source")
        or get(r.projection, "bandwidth_source"),
    }
    title = (
        f"A parameter-server deployment of this model at {gpus_text(g)} needs >= {n_ps} "
        f"servers at {gbps:.3g} Gbit/s each (lemma N_ps >= 2*S*G/(B_ps*T_C))"
    )
    if share is not None and share > 1.0:
        action = (
            f"num_parameter_servers >= {n_ps}, and split the largest parameter tensor "
            f"across servers: on one server it alone needs {share:.3g}x the time the "
            "compute hides, however many servers there are"
        )
    elif share is not None:
        # Every tensor fits one server's budget: whole tensors pack into about N servers.
        action = f"num_parameter_servers >= {n_ps}; shard by tensor, no tensor is too large for one server"
    else:  # the tensors' sizes are not in the summary (before 0.5)
        action = (
            f"num_parameter_servers >= {n_ps}, more if the parameters split unevenly over "
            "the servers (x largest/mean shard)"
        )
    return Finding("parameter_servers", "info", title, evidence, action, None)
