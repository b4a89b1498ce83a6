"""Summary -> projection: the run's step at other device counts and link speeds.

:func:`project_summary` builds the summary's ``projection`` object (``docs/summary.md``):
the paper's alpha and speedup from the measured overhead ratio, and the refined step of
:mod:`dtprofile.analysis.phases` with communication from the cost models of
:mod:`dtprofile.analysis.perf_model`. :func:`resolve_bandwidth` decides which link speed
the projection uses and says where it came from.

Units are in the names (see :mod:`dtprofile.analysis.perf_model`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._values import finite, get
from .checks import check_gpus, check_number
from .mesh_plan import MeshShape, mesh_shape, replica_view, tp_what_if
from .perf_model import (
    BITS_PER_BYTE,
    GIGA,
    LINK_PER,
    alpha,
    paper_r_o,
    parse_bandwidth,
    projected_speedup,
    ring_allreduce_seconds,
    two_level_allreduce_seconds,
)
from .phases import DEFAULT_SCALING, SCALING_MODES, StepPhases, phases_from_summary, project_phases
from .summary_readers import buffer_broadcast_ms, comm_bytes_per_step, overhead_ratio, world_size

__all__ = [
    "ASSUMED_BANDWIDTH_Bps",
    "ASSUMED_BANDWIDTH_NAME",
    "BANDWIDTH_SOURCES",
    "DEFAULT_INTRA_NODE_BANDWIDTH_Bps",
    "DEFAULT_LATENCY_S",
    "DEFAULT_PROJECT_GPUS",
    "fixed_comm_seconds_at",
    "measured_nodes",
    "project_summary",
    "resolve_bandwidth",
    "shared_host",
]

#: Device counts projected when the summary's options do not say (docs/summary.md).
DEFAULT_PROJECT_GPUS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
#: Where a projection's bandwidth came from, most trusted first after an explicit what-if.
BANDWIDTH_SOURCES = ("measured", "user", "nvml", "nic", "assumed")
#: Bandwidth assumed when nothing was measured, set or discovered: 10 Gbit/s Ethernet,
#: the common commodity datacenter NIC. Advice must say it was assumed.
ASSUMED_BANDWIDTH_Bps = 10e9 / 8
ASSUMED_BANDWIDTH_NAME = "10 Gbit/s Ethernet"
#: Intra-node bandwidth for the two-level model when NVML reports nothing: PCIe 4.0 x16
#: moves 32 GB/s raw, about 25 GB/s in practice (NCCL busbw through host bridges).
DEFAULT_INTRA_NODE_BANDWIDTH_Bps = 25e9
#: Per-hop latency of the cost models. 0: a bandwidth-only model; a measured busbw already
#: folds latency in at the measured message size.
DEFAULT_LATENCY_S = 0.0


# --------------------------------------------------------------------------- the link


def _hardware_Bps(hardware: Any, key: str, bits: bool) -> float | None:
    """``run.hardware[key]`` in bytes/s (the key in GB/s, or Gbit/s when ``bits``), or None."""
    value = finite(get(hardware, key))
    if value is None or value <= 0:
        return None
    return value * GIGA / (BITS_PER_BYTE if bits else 1.0)


def resolve_bandwidth(
    summary: Mapping[str, Any], bandwidth: float | str | None = None, *, allow_nvml: bool = True
) -> tuple[float, str]:
    """The projection's link bandwidth and where it came from, the first that applies:

    1. ``bandwidth`` given (what-if): ``user``;
    2. this run's busbw (world_size >= 2 and busbw known): ``measured``;
    3. ``options.link_bandwidth_Bps``: ``user``;
    4. ``run.hardware`` ``nvlink_GBps`` else ``pcie_GBps`` (NVML): ``nvml``;
    5. ``run.hardware`` ``nic_Gbps``: ``nic``;
    6. :data:`ASSUMED_BANDWIDTH_Bps` (10 Gbit/s Ethernet): ``assumed``.

    Args:
        summary: A run summary.
        bandwidth: A what-if bandwidth (bytes/s, or a string with a unit), or None.
        allow_nvml: Whether a link inside the node (step 4) may be the answer; not for
            a link between nodes.

    Returns:
        (bytes/s, source), the source one of :data:`BANDWIDTH_SOURCES`.

    Example:
        >>> resolve_bandwidth({"world_size": 1, "run": {"hardware": {"nic_Gbps": 25}}})
        (3125000000.0, 'nic')
    """
    if bandwidth is not None:
        return parse_bandwidth(bandwidth, "bandwidth"), "user"
    busbw = finite(get(summary, "busbw_GBps"))
    if world_size(summary) >= 2 and busbw is not None and busbw > 0:
        return busbw * GIGA, "measured"
    link = get(get(summary, "options"), "link_bandwidth_Bps")
    if link is not None:
        return parse_bandwidth(link, "link_bandwidth"), "user"
    hardware = get(get(summary, "run"), "hardware")
    if allow_nvml:
        for key in ("nvlink_GBps", "pcie_GBps"):
            found = _hardware_Bps(hardware, key, bits=False)
            if found is not None:
                return found, "nvml"
    nic = _hardware_Bps(hardware, "nic_Gbps", bits=True)
    if nic is not None:
        return nic, "nic"
    return ASSUMED_BANDWIDTH_Bps, "assumed"


def _intra_node_Bps(summary: Mapping[str, Any]) -> tuple[float, str]:
    """(bytes/s, source) inside a node: NVLink, else PCIe (``nvml``), else ``assumed``
    (:data:`DEFAULT_INTRA_NODE_BANDWIDTH_Bps`), so a caption can say it was not measured."""
    hardware = get(get(summary, "run"), "hardware")
    for key in ("nvlink_GBps", "pcie_GBps"):
        found = _hardware_Bps(hardware, key, bits=False)
        if found is not None:
            return found, "nvml"
    return DEFAULT_INTRA_NODE_BANDWIDTH_Bps, "assumed"


def _node_split(gpus: float, nodes: int) -> tuple[int, int]:
    """(nodes used, GPUs per node) for G GPUs spread evenly over at most ``nodes`` nodes.

    The most nodes, up to ``nodes``, that G divides: every node holds the same number of
    GPUs and their product is exactly G (8 GPUs over at most 3 nodes: 2 nodes of 4,
    never 3 nodes of 3, which would model 9).

    Example:
        >>> _node_split(8, 3), _node_split(16, 2), _node_split(2, 4)
        ((2, 4), (2, 8), (2, 1))
    """
    g = max(1, int(round(gpus)))
    used = max(n for n in range(1, min(nodes, g) + 1) if g % n == 0)
    return used, g // used


def measured_nodes(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The nodes the run itself spanned, where two or more: ``{"nodes", "ranks_per_node",
    "source"}``, the source ``hosts`` (the ranks' hostnames, ``rank_spread.nodes``) or
    ``local_world_size`` (``run.ranks_per_host`` below the world size); else None.

    Example:
        >>> measured_nodes({"world_size": 16, "run": {"ranks_per_host": 8}})
        {'nodes': 2, 'ranks_per_node': 8, 'source': 'local_world_size'}
        >>> measured_nodes({"world_size": 8, "run": {"ranks_per_host": 8}}) is None
        True
    """
    world = world_size(summary)
    spread = get(get(summary, "rank_spread"), "nodes")
    count, per_node = finite(get(spread, "count")), finite(get(spread, "ranks_per_node"))
    if get(spread, "source") == "hosts" and count is not None and count >= 2 and per_node:
        return {"nodes": int(count), "ranks_per_node": int(per_node), "source": "hosts"}
    per_host = finite(get(get(summary, "run"), "ranks_per_host"))
    if per_host is None or per_host < 1 or world < 2 or per_host >= world:
        return None
    return {"nodes": math.ceil(world / per_host), "ranks_per_node": int(per_host), "source": "local_world_size"}


def _nodes_of(per_node: int) -> Callable[[float], tuple[int, int]]:
    """G -> (nodes, GPUs per node) with nodes of at most ``per_node`` GPUs: the fewest
    nodes, at least ceil(G / per_node), that G divides evenly (12 GPUs of 8 a node: 2
    nodes of 6; 16 of 6 a node: 4 of 4, never 2 of 8, which no node holds).

    Example:
        >>> split = _nodes_of(6)
        >>> split(12), split(16), split(7)
        ((2, 6), (4, 4), (7, 1))
    """

    def split(gpus: float) -> tuple[int, int]:
        g = max(1, int(round(gpus)))
        used = next(n for n in range(max(1, math.ceil(g / per_node)), g + 1) if g % n == 0)
        return used, g // used

    return split


def _fitted_inter_Bps(
    nbytes: float | None, world: float, busbw: float, measured: Mapping[str, Any], intra: float, link_per: str
) -> float | None:
    """The inter-node rate that makes the two-level model give the run's own all-reduce at
    its own nodes; None where the node-internal part alone explains it (or no bytes).

    The measured busbw is the whole all-reduce's, over every rank: fed to the two-level
    model as the link between nodes it would halve the run's own communication at 2 nodes
    of 8 (2(n-1)/n = 1 there against 2(G-1)/G = 1.875). Solving the model at the measured
    split for that link instead reproduces what was measured at the run's own count, and
    projects other counts from the nodes' real shape."""
    if not nbytes:
        return None
    n = float(measured["nodes"])
    g = world / n
    total_s = ring_allreduce_seconds(nbytes, world, busbw)
    inter_s = total_s - two_level_allreduce_seconds(nbytes, 1, g, intra, math.inf)
    if inter_s <= 0 or n < 2:
        return None
    return 2.0 * (n - 1.0) / n * nbytes / (g if link_per == "gpu" else 1.0) / inter_s


def _split(
    nodes: int | None, run_nodes: Mapping[str, Any] | None, gpus_per_node: float | None
) -> Callable[[float], tuple[int, int]] | None:
    """G -> (nodes, GPUs a node) for the two-level model; None: the ring.

    With ``nodes``: G GPUs spread evenly over the most nodes, at most ``nodes``, that G
    divides (``nodes_used`` x ``gpus_per_node`` = G). Else, where the run spanned nodes
    (``nodes_source``: ``hosts`` or ``local_world_size``), G over ceil(G / its ranks a
    node) nodes (``gpus_per_node`` a node where given). The link inside a node comes
    from ``run.hardware`` (NVLink, PCIe; ``intra_bandwidth_source`` ``nvml``) or
    :data:`DEFAULT_INTRA_NODE_BANDWIDTH_Bps` (``assumed``), the one between nodes as
    :func:`resolve_bandwidth` resolves it (without NVML)."""
    if nodes is not None:
        return lambda g: _node_split(g, nodes)
    if run_nodes is None:
        return None
    per_node = int(check_gpus(gpus_per_node, "gpus_per_node")) if gpus_per_node else run_nodes["ranks_per_node"]
    return _nodes_of(per_node)


def _two_level_fields(
    projection: dict[str, Any],
    summary: Mapping[str, Any],
    split: Callable[[float], tuple[int, int]],
    run_nodes: Mapping[str, Any] | None,
    source: str,
    nbytes: float | None,
    bw_Bps: float,
    link_per: str,
) -> tuple[float, float]:
    """The two-level model's fields of ``projection`` (the link inside a node, each G's
    nodes); ``(intra-node B/s, the link between nodes in B/s)``, the latter fitted to the
    run's own nodes where it spanned several and its bandwidth is the measured one.

    The measured per-node figures (``rank_spread.nodes``: each node's busy time) are not
    put in the step: the cluster's per-step figures are the ranks' medians with each
    rank's wait for a slower one taken out (``summary._cluster_per_step``), so they
    already describe a typical node, and a slow node is a fault the straggler finding
    names by its host, not a property of the node count projected to (carried to every
    G it would price a fault as scaling). What the mapping does give, the nodes' shape
    and the link between them, is used here."""
    intra, intra_source = _intra_node_Bps(summary)
    projection.update(intra_bandwidth_GBps=intra / GIGA, intra_bandwidth_source=intra_source, link_per=link_per)
    projection["nodes_used"] = [split(g)[0] for g in projection["gpus"]]
    projection["gpus_per_node"] = [split(g)[1] for g in projection["gpus"]]
    if run_nodes is not None and source == "measured":
        fitted = _fitted_inter_Bps(nbytes, world_size(summary), bw_Bps, run_nodes, intra, link_per)
        if fitted is not None:
            projection.update(bandwidth_GBps=fitted / GIGA, bandwidth_fitted_to_nodes=True)
            return intra, fitted
    return intra, bw_Bps


# --------------------------------------------------------------------------- the measured fixed part of communication


def _fixed_comm_seconds(summary: Mapping[str, Any], nbytes: float | None, latency: float = 0.0) -> float:
    """Measured all-reduce time beyond what the run's own link rate explains, in s.

    F = comm_total - 2(G-1)/G * S / B_link, with B_link the link this run used
    (``options.link_bandwidth_Bps``, else the NIC speed); 0 when either is unknown or
    the run had one rank.
    """
    world = world_size(summary)
    comm_total_ms = finite(get(get(summary, "per_step_ms"), "comm_total"))
    if world < 2 or comm_total_ms is None or not nbytes:
        return 0.0
    comm_total_ms -= buffer_broadcast_ms(summary)  # modelled on its own
    link = get(get(summary, "options"), "link_bandwidth_Bps")
    link_Bps = (
        parse_bandwidth(link, "link_bandwidth")
        if link is not None
        else _hardware_Bps(get(get(summary, "run"), "hardware"), "nic_Gbps", bits=True)
    )
    if link_Bps is None:
        return 0.0
    return max(0.0, comm_total_ms / 1e3 - ring_allreduce_seconds(nbytes, world, link_Bps, latency))


def shared_host(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """Whether the measured ranks shared a host, and what that cost their compute where it
    shows: None when they did not, or it is not known (``LOCAL_WORLD_SIZE`` unset and no
    probe steps whose passes ran one rank at a time).

    Ranks on one host share its CPUs, memory bandwidth and (GPUs) its PCIe links: the
    compute measured here is what a rank got beside the others. On the CPU the training
    thread's CPU time per step against the step's compute says how much of it the thread
    actually ran (``compute_cpu_share``; below 1, it waited for a core). On CPU ranks of a
    gloo group some probe steps run the passes one rank at a time: how much slower they
    are beside the others is ``sharing_slowdown`` (also what memory bandwidth and caches
    cost, which CPU time does not show), and the projected one-device step runs its passes
    alone (``compute_alone_ms``); every count above one keeps the compute as measured.

    Args:
        summary: A run summary.

    Returns:
        ``{"ranks_per_host", "compute_cpu_share", "sharing_slowdown", "compute_alone_ms"}``
        (each None where not measured), or None.

    Example:
        >>> shared_host({"device": "cpu", "per_step_ms": {"compute": 10.0},
        ...              "run": {"ranks_per_host": 2, "cpu_time": {"training_thread_cpu_ms_per_step": 6.0}}})
        {'ranks_per_host': 2, 'compute_cpu_share': 0.6, 'sharing_slowdown': None, 'compute_alone_ms': None}
    """
    run_info = get(summary, "run") or {}
    ranks = finite(get(run_info, "ranks_per_host"))
    probe = get(summary, "probe") or {}
    slowdown = finite(get(probe, "sharing_slowdown"))
    if (ranks is None or ranks < 2) and slowdown is None:
        return None
    share = None
    compute = finite(get(get(summary, "per_step_ms"), "compute"))
    thread = finite(get(get(run_info, "cpu_time"), "training_thread_cpu_ms_per_step"))
    if get(summary, "device") == "cpu" and compute and thread is not None:
        share = min(1.0, thread / compute)
    return {
        "ranks_per_host": int(ranks) if ranks is not None else None,
        "compute_cpu_share": share,
        "sharing_slowdown": slowdown,
        "compute_alone_ms": finite(get(probe, "compute_alone_ms")),
    }


def fixed_comm_seconds_at(fixed_seconds: float, gpus: float, measured_gpus: float) -> float:
    """The measured fixed part of the all-reduce at G ranks, in s.

    Scaled like the ring's traffic, 2(G-1)/G over its value at the measured G_m
    (reduction arithmetic and copies grow with the data each rank handles), so a what-if
    at the run's own link rate projects what the measured bandwidth does, at every G.

    Args:
        fixed_seconds: The fixed part at the measured G_m (``fixed_comm_ms`` / 1e3).
        gpus: The ranks G to scale it to.
        measured_gpus: The ranks G_m it was measured on.

    Returns:
        Seconds; 0 when nothing is fixed or either G is 1.

    Example:
        >>> fixed_comm_seconds_at(0.02, 16, 2)  # 20 ms at 2 ranks: x (15/16) / (1/2)
        0.0375
    """
    if fixed_seconds <= 0 or gpus <= 1 or measured_gpus <= 1:
        return 0.0
    return fixed_seconds * ((gpus - 1.0) / gpus) / ((measured_gpus - 1.0) / measured_gpus)


# --------------------------------------------------------------------------- the projection


def _batch_factor(summary: Mapping[str, Any], batch: Any) -> float:
    """The what-if per-device batch over the run's (1.0 without one)."""
    if batch is None:
        return 1.0
    wanted = check_number(batch, "batch", minimum=1.0)
    if wanted != int(wanted):
        raise ValueError(f"batch must be a whole number of samples per device, got {batch!r}")
    measured = finite(get(get(summary, "run"), "batch_size"))
    if measured is None or measured <= 0:
        raise ValueError(
            "batch: this run's per-device batch size is unknown (run.batch_size), "
            "so a batch cannot be projected from it"
        )
    return wanted / measured


def _comm_model(
    summary: Mapping[str, Any],
    nbytes: float | None,
    fixed_s: float,
    bw_Bps: float,
    latency: float,
    split: Callable[[float], tuple[int, int]] | None,
    intra: float,
    link_per: str,
) -> Callable[[float], float]:
    """G -> the step's communication in ms at G devices: the all-reduce's cost model (ring,
    or two-level over ``split(G)``: nodes and GPUs a node), its measured fixed part, and DDP's buffer broadcast
    before each forward (BatchNorm's statistics: exposed in full, the time measured here
    at any G >= 2, its bytes few: latency-bound). 0 at G = 1; nan without bytes."""
    buffers_ms = buffer_broadcast_ms(summary)
    measured = world_size(summary)

    def comm_ms(g: float) -> float:
        if g <= 1.0:
            return 0.0
        if nbytes is None:
            return math.nan
        fixed_ms = 1e3 * fixed_comm_seconds_at(fixed_s, g, measured)
        if split is None:
            return buffers_ms + fixed_ms + 1e3 * ring_allreduce_seconds(nbytes, g, bw_Bps, latency)
        used, per_node = split(g)
        wire_s = two_level_allreduce_seconds(nbytes, used, per_node, intra, bw_Bps, latency, link_per=link_per)
        return buffers_ms + fixed_ms + 1e3 * wire_s

    return comm_ms


def _scaled_phases(phases: StepPhases | None, batch_factor: float) -> StepPhases | None:
    """The step's phases at a what-if batch: forward, backward and the data wait scale with
    the per-device batch (``batch_factor`` times the run's); the rest does not."""
    if phases is None or batch_factor == 1.0:
        return phases
    return dataclasses.replace(
        phases,
        scalable_ms=batch_factor * phases.scalable_ms,
        backward_ms=batch_factor * phases.backward_ms,
        data_wait_ms=batch_factor * phases.data_wait_ms,
    )


def _mesh_fields(
    summary: Mapping[str, Any], shape: MeshShape, tp: int | None, gpus_per_node: int | None
) -> dict[str, Any]:
    """The projection's ``mesh``: the tensor-parallel degree projected at, its collectives'
    exposed time per step there, whether its group spans nodes, and the factor on each
    device's compute (the run's degree over the projected one)."""
    degree = shape.tp if tp is None else int(check_gpus(tp, "tp"))
    if shape.tp == 1 and degree != 1:
        raise ValueError("tp: this run has no tensor-parallel mesh dimension (summary.mesh), so no tp to change")
    per_node = gpus_per_node if gpus_per_node is not None else finite(get(get(summary, "run"), "ranks_per_host"))
    per_node_int = int(check_number(per_node, "gpus_per_node", minimum=1.0)) if per_node is not None else None
    crosses, crossed = shape.crosses_nodes(degree, per_node_int), shape.crosses_nodes(None, per_node_int)
    link = 1.0
    if crosses != crossed:  # a group moved across nodes (or back inside one): the other link
        # Both links' nominal rates (what was measured here crossed neither or both).
        intra_Bps, _ = _intra_node_Bps(summary)
        inter_Bps, _ = resolve_bandwidth({**summary, "busbw_GBps": None}, allow_nvml=False)
        link = intra_Bps / inter_Bps if crosses else inter_Bps / intra_Bps
    compute_factor, comm_factor = tp_what_if(shape, degree, link) if shape.tp > 1 else (1.0, 1.0)
    return {
        "axis": "replicas",
        "gpus_per_replica": degree * shape.pp,
        "pp": shape.pp,
        "pp_wait_ms": shape.pp_wait_ms,
        "tp": degree,
        "tp_measured": shape.tp,
        "tp_labels": list(shape.tp_labels),
        "replicas_measured": shape.replicas,
        "tp_comm_ms": shape.tp_comm_waited_ms * comm_factor,
        "tp_comm_measured_ms": shape.tp_comm_waited_ms,
        "gpus_per_node": per_node_int,
        "tp_crosses_nodes": crosses,
        "compute_factor": compute_factor,
    }


def _per_replica(summary: Mapping[str, Any], tp: int | None) -> tuple[Mapping[str, Any], MeshShape | None]:
    """``(summary, shape)``: a mesh run's summary as one replica's figures (G: the replicas,
    the tensor-parallel waits apart) and its shape; another run's as it is, and no shape."""
    shape = mesh_shape(summary)
    if shape is not None:
        return replica_view(summary, shape), shape
    if tp is not None:
        raise ValueError("tp: this run has no tensor-parallel mesh dimension (summary.mesh), so no tp to change")
    return summary, None


def _mesh_phases(phases: StepPhases | None, mesh: Mapping[str, Any]) -> StepPhases | None:
    """One replica's step at the projected tensor-parallel degree: each device's share of
    the passes and the update scaled, the tensor-parallel collectives' wait a fixed cost."""
    if phases is None:
        return None
    factor = mesh["compute_factor"]
    return dataclasses.replace(
        phases,
        scalable_ms=phases.scalable_ms * factor,
        backward_ms=phases.backward_ms * factor,
        optimizer_ms=phases.optimizer_ms * factor,
        fixed_comm_ms=mesh["tp_comm_ms"] + mesh["pp_wait_ms"],
    )


def _settings(
    summary: Mapping[str, Any],
    gpus: Sequence[float] | None,
    scaling: str | None,
    nodes: int | None,
    link_per: str | None,
    latency_s: float | None,
) -> tuple[list[Any], str, int | None, str, float]:
    """:func:`project_summary`'s arguments checked, each defaulting to the run's option:
    ``(gpus, scaling, nodes, link_per, latency_s)``."""
    options = get(summary, "options") or {}
    gpus_list = list(gpus if gpus is not None else (get(options, "project_gpus") or DEFAULT_PROJECT_GPUS))
    measured = world_size(summary)
    if gpus is None and measured > 1 and measured not in gpus_list:
        # The run's own count too: the advice weighs every option against it.
        gpus_list = sorted(gpus_list + [int(measured)])
    for g in gpus_list:
        check_gpus(g, "gpus")
    scaling = scaling or get(options, "scaling") or DEFAULT_SCALING
    if scaling not in SCALING_MODES:
        raise ValueError(f"scaling must be one of {SCALING_MODES}, got {scaling!r}")
    if nodes is not None:
        nodes = int(check_number(nodes, "nodes", minimum=1.0))
    link_per = link_per or get(options, "link_bandwidth_per") or "node"
    if link_per not in LINK_PER:
        raise ValueError(f"link_per must be one of {LINK_PER}, got {link_per!r}")
    latency = DEFAULT_LATENCY_S if latency_s is None else check_number(latency_s, "latency_s")
    return gpus_list, scaling, nodes, link_per, latency


def project_summary(
    summary: Mapping[str, Any],
    *,
    gpus: Sequence[float] | None = None,
    scaling: str | None = None,
    bandwidth: float | str | None = None,
    nodes: int | None = None,
    latency_s: float | None = None,
    link_per: str | None = None,
    batch: int | None = None,
    tp: int | None = None,
    gpus_per_node: int | None = None,
) -> dict[str, Any]:
    """The ``projection`` object of the summary: the paper's figures and the refined model.

    The refined step (see :func:`dtprofile.analysis.phases.step_parts_ms`):
    forward/backward scale with the per-device batch (strong scaling: global / G'), the
    optimizer step does not (DDP replicates it on every rank), unattributed host time
    does not, data wait is per process, communication follows the cost model for
    ``grad_bytes`` and only the part backward cannot hide is exposed, plus DDP's buffer
    broadcast as measured (``comm_buffers``, exposed). G' = 1 has no communication.

    Args:
        summary: A run summary; ``options`` gives the defaults (``project_gpus``,
            ``scaling``, ``link_bandwidth_Bps``, ``link_bandwidth_per``).
        gpus: The device counts to project to.
        scaling: ``"weak"`` or ``"strong"``.
        bandwidth: A what-if link (bytes/s or a string, see
            :func:`~dtprofile.analysis.perf_model.parse_bandwidth`): source ``user``,
            overriding the measured one.
        nodes: Switches to the two-level all-reduce over at most ``nodes`` nodes
            (:func:`_split`, :func:`_two_level_fields`); without it, a run that spanned
            two or more nodes (:func:`measured_nodes`) is projected over nodes like its own.
        latency_s: Seconds per hop.
        link_per: ``"node"`` (each node's link shared by its GPUs) or ``"gpu"``; default:
            the run's option ``link_bandwidth_per``, else ``"node"`` (see
            :func:`~dtprofile.analysis.perf_model.two_level_allreduce_seconds`).
        batch: A what-if per-device batch (at the measured device count): forward,
            backward and the data wait scale with it from the run's ``run.batch_size``,
            as in the refined model's strong scaling; the paper's figures stay the run's.
        tp: A run on a DeviceMesh with tensor parallelism: G counts data-parallel
            replicas, and ``tp`` is the what-if degree (default: the run's; see
            :mod:`dtprofile.analysis.mesh_plan`); a group of ``tp`` across nodes of
            ``gpus_per_node`` communicates over the inter-node link.
        gpus_per_node: Devices per node for that test and the two-level model's nodes
            (default: the run's ``run.ranks_per_host``).

    Returns:
        The projection (``docs/summary.md``): lists aligned with ``gpus``, entries None
        where nothing was measured.

    Example:
        >>> s = {"world_size": 1, "grad_bytes": 1e8, "per_step_ms": {"step": 100.0, "compute": 100.0}}
        >>> p = project_summary(s, gpus=[1, 8], bandwidth="100Gbps")  # ring: 14 ms more
        >>> p["bandwidth_source"], [round(e, 3) for e in p["efficiency"]]
        ('user', [1.0, 0.877])
    """
    summary, shape = _per_replica(summary, tp)
    gpus_list, scaling, nodes, link_per, latency = _settings(summary, gpus, scaling, nodes, link_per, latency_s)
    batch_factor = _batch_factor(summary, batch)
    # A run that spanned nodes projects over nodes like its own (a mesh's G counts replicas).
    spanned = measured_nodes(summary) if shape is None else None
    run_nodes = spanned if nodes is None else None  # (nodes given win)
    split = _split(nodes, run_nodes, gpus_per_node)
    bw_Bps, source = resolve_bandwidth(summary, bandwidth, allow_nvml=split is None)
    nbytes = comm_bytes_per_step(summary)
    mesh = _mesh_fields(summary, shape, tp, gpus_per_node) if shape is not None else None
    nbytes = nbytes * mesh["compute_factor"] if mesh is not None and nbytes is not None else nbytes  # (a shard's)
    fixed_s = _fixed_comm_seconds(summary, nbytes, latency) if bandwidth is not None else 0.0
    r_o = overhead_ratio(summary)
    r_o_paper = None if r_o is None else paper_r_o(r_o, world_size(summary))
    n = len(gpus_list)

    projection: dict[str, Any] = {
        "scaling": scaling,
        "bandwidth_source": source,
        "bandwidth_GBps": bw_Bps / GIGA,
        "gpus": gpus_list,
        "alpha_paper": [None if r_o_paper is None else alpha(r_o_paper, g) for g in gpus_list],
        "speedup_paper": [None if r_o_paper is None else projected_speedup(r_o_paper, g) for g in gpus_list],
        "step_ms": [None] * n,
        "speedup": [None] * n,
        "efficiency": [None] * n,
        "R_O": r_o,
        "R_O_paper": r_o_paper,
        "measured_gpus": world_size(summary),
        "grad_bytes": nbytes,
        "model": "two_level" if split is not None else "ring",
        "latency_s": latency,
        "fixed_comm_ms": fixed_s * 1e3,
        "comm_buffers_ms": buffer_broadcast_ms(summary),
        "nodes": nodes,
        "nodes_source": "user" if nodes is not None else (run_nodes["source"] if run_nodes else None),
        "measured_nodes": spanned,
        "compute_ms": [None] * n,
        "comm_ms": [None] * n,
        "comm_exposed_ms": [None] * n,
        "hideable_ms": [None] * n,
        "reference_step_ms": None,
        "shared_host": shared_host(summary),
    }
    intra = math.nan
    if split is not None:
        intra, bw_Bps = _two_level_fields(projection, summary, split, run_nodes, source, nbytes, bw_Bps, link_per)
    if batch is not None:
        projection["batch_size"] = int(batch)
    phases = _scaled_phases(phases_from_summary(summary), batch_factor)
    if mesh is not None:
        projection["mesh"] = {k: v for k, v in mesh.items() if k != "compute_factor"}
        projection["mesh"]["gpus_total"] = [g * mesh["gpus_per_replica"] for g in gpus_list]
        phases = _mesh_phases(phases, mesh)
    if phases is None:
        return projection
    comm_ms = _comm_model(summary, nbytes, fixed_s, bw_Bps, latency, split, intra, link_per)
    result = project_phases(phases, gpus_list, comm_ms, scaling)
    for key, values in result.items():
        if isinstance(values, list):  # nan (bytes unknown), overflow -> None, as JSON allows
            projection[key] = [None if v is None or not math.isfinite(v) else v for v in values]
    projection["reference_step_ms"] = result["reference_step_ms"]
    return projection
