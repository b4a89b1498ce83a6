"""The performance model of data-parallel training: pure functions of plain numbers.

Zou, Chen et al., *Distributed Training Large-Scale Deep Architectures* (2017) model a
training step as computation ``T_C`` (parallelises) plus overhead ``T_O`` (does not:
gradient communication and I/O). This module holds

- the paper's Amdahl bound: :func:`alpha` and :func:`projected_speedup`;
- communication cost models: :func:`ring_allreduce_seconds`,
  :func:`two_level_allreduce_seconds`, :func:`parameter_server_seconds`, the
  parameter-server lemma :func:`min_parameter_servers` and its inverse for all-reduce,
  :func:`bandwidth_needed`;
- :func:`parse_bandwidth` for the ways people write link speeds;
- the refined projection to other device counts (:func:`project_phases`, driven from a
  run summary by :func:`project_summary`) and the recommendations (:func:`recommend`);
- :class:`GradientNoiseScale`, the critical-batch-size estimator the engine feeds.

Units are in the names: ``*_ms`` milliseconds, ``*_seconds``/``*_s`` seconds, ``nbytes``
and ``*_bytes`` bytes, ``*_Bps`` and bandwidth arguments bytes per second, ``*_GBps``
1e9 bytes/s, ``*_Gbps`` 1e9 bits/s. No torch import: this module must stay importable and
testable without a training run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "ASSUMED_BANDWIDTH_Bps",
    "ASSUMED_BANDWIDTH_NAME",
    "BANDWIDTH_SOURCES",
    "DATA_WAIT_HIDDEN_FRACTION",
    "DEFAULT_INTRA_NODE_BANDWIDTH_Bps",
    "DEFAULT_LATENCY_S",
    "DEFAULT_PROJECT_GPUS",
    "DEFAULT_SCALING",
    "DEFAULT_TARGET_EFFICIENCY",
    "MEMORY_USABLE_FRACTION",
    "NUM_WORKERS_MARGIN",
    "SCALING_MODES",
    "GradientNoiseScale",
    "StepPhases",
    "alpha",
    "paper_r_o",
    "bandwidth_needed",
    "dataloader_workers_needed",
    "max_batch_size",
    "min_parameter_servers",
    "parameter_server_seconds",
    "parse_bandwidth",
    "phases_from_summary",
    "project_phases",
    "project_summary",
    "projected_speedup",
    "recommend",
    "resolve_bandwidth",
    "ring_allreduce_seconds",
    "step_parts_ms",
    "two_level_allreduce_seconds",
    "LINK_PER",
]

# --------------------------------------------------------------------------- constants

#: Target fraction of linear speedup (DESIGN.md section 3: "default 0.8").
DEFAULT_TARGET_EFFICIENCY = 0.8
#: Device counts projected when the summary's options do not say (docs/summary.md).
DEFAULT_PROJECT_GPUS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
#: Scaling modes (DESIGN.md section 3). Weak: per-device batch fixed (usual DDP practice).
SCALING_MODES = ("weak", "strong")
DEFAULT_SCALING = "weak"
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
#: Share of device memory a batch may plan to fill (fragmentation, allocator slack,
#: cuDNN workspaces): the recommended max batch keeps 10% free.
MEMORY_USABLE_FRACTION = 0.9
#: Extra dataloader worker on top of the throughput minimum, absorbing jitter in load time.
NUM_WORKERS_MARGIN = 1
#: Data wait below this share of the step counts as hidden already (the PyTorch
#: profiler's TensorBoard plugin flagged data loading above 5% of the step).
DATA_WAIT_HIDDEN_FRACTION = 0.05

_BITS_PER_BYTE = 8.0
_GIGA = 1e9
_REL_EPS = 1e-9  # float slack for ceil() of quantities that are exact in real arithmetic


# --------------------------------------------------------------------------- validation


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, null, bool, nan, inf, not a number)."""
    if not _is_number(value):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _check(value: Any, name: str, *, minimum: float = 0.0, strict: bool = False,
           allow_inf: bool = False) -> float:
    """Validate a number argument; raise ValueError naming ``name`` and the accepted values."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    accepted = f"a finite number {bound}" if not allow_inf else f"a number {bound}"
    if not _is_number(value):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return value


def _check_gpus(gpus: Any, name: str = "gpus") -> float:
    return _check(gpus, name, minimum=1.0)


def _ceil(x: float) -> int:
    """ceil() that ignores float noise: 3.0000000000004 -> 3."""
    return math.ceil(x - _REL_EPS * max(1.0, abs(x)))


# --------------------------------------------------------------------------- the paper


def alpha(r_o: float, gpus: float) -> float:
    """The paper's fraction of linear speedup on ``gpus`` devices (Amdahl's law).

    ``alpha = (1 + R_O) / (1 + G * R_O)`` with ``R_O = T_O / T_C`` the overhead ratio
    (dimensionless) and ``G`` the number of devices. One device takes ``T_C + T_O`` per
    global batch; G devices take ``T_C / G + T_O``. Dimensionless, in (0, 1].

    >>> alpha(0.25, 4)
    0.625
    >>> alpha(0.0, 64)
    1.0
    """
    r_o = _check(r_o, "r_o")
    gpus = _check_gpus(gpus)
    return (1.0 + r_o) / (1.0 + gpus * r_o)


def paper_r_o(r_o: float, measured_gpus: float = 1.0) -> float:
    """The paper's R_O for a run measured on ``measured_gpus`` ranks: T_O over the
    global batch's compute on one device.

    The paper's derivation takes T_C as one device's compute for the whole global batch;
    a rank of a G_m-rank run computes 1/G_m of it, so ``R_O_paper = R_O / G_m``. A
    one-device run needs no change.

    >>> paper_r_o(0.25, 8), paper_r_o(0.25)
    (0.03125, 0.25)
    """
    r_o = _check(r_o, "r_o")
    return r_o / _check_gpus(measured_gpus, "measured_gpus")


def projected_speedup(r_o: float, gpus: float) -> float:
    """The paper's projected speedup ``G * alpha = G (1 + R_O) / (1 + G R_O)``.

    Dimensionless; bounded by ``(1 + R_O) / R_O`` however many devices.

    >>> projected_speedup(0.25, 4)
    2.5
    """
    return float(gpus) * alpha(r_o, gpus)


# --------------------------------------------------------------------------- cost models


#: Whose network link a bandwidth is under the two-level model: each node's (its GPUs
#: share it) or each GPU's (a NIC per GPU).
LINK_PER: tuple[str, ...] = ("node", "gpu")


def ring_allreduce_seconds(nbytes: float, gpus: float, bus_bandwidth: float,
                           latency: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``gpus`` ranks.

    ``T = 2 (G - 1) / G * S / B + 2 (G - 1) * latency`` with S bytes, B the bus bandwidth
    in bytes/s (nccl-tests' busbw: the per-link rate a ring sustains) and ``latency``
    seconds per ring step. G = 1 costs nothing.

    >>> ring_allreduce_seconds(1e9, 4, 1e9)
    1.5
    >>> ring_allreduce_seconds(1e9, 1, 1e9)
    0.0
    """
    nbytes = _check(nbytes, "nbytes")
    gpus = _check_gpus(gpus)
    bus_bandwidth = _check(bus_bandwidth, "bus_bandwidth", strict=True, allow_inf=True)
    latency = _check(latency, "latency")
    steps = 2.0 * (gpus - 1.0)
    return steps / gpus * nbytes / bus_bandwidth + steps * latency


def two_level_allreduce_seconds(nbytes: float, nodes: float, gpus_per_node: float,
                                intra_bandwidth: float, inter_bandwidth: float,
                                latency: float = 0.0, link_per: str = "node") -> float:
    """Seconds for a hierarchical all-reduce of ``nbytes`` over ``nodes * gpus_per_node`` ranks.

    Reduce-scatter inside each node (every GPU ends with 1/g of the sum), a ring
    all-reduce across the ``n`` nodes of that 1/g shard (the g shards run in parallel,
    one per GPU), then all-gather inside the node. With S bytes, g GPUs per node, n
    nodes, bandwidths in bytes/s, the inter-node term depends on whose link
    ``inter_bandwidth`` is (``link_per``):

    - ``"node"`` (the default: one network link per node, which its GPUs share): the g
      shards together put all S bytes through it,
      ``T = 2 (g-1)/g * S / B_intra + 2 (n-1)/n * S / B_inter``;
    - ``"gpu"`` (a NIC per GPU, as in rail-optimised clusters): each shard has a link of
      its own, ``... + 2 (n-1)/n * (S/g) / B_inter``.

    Both add ``2 (g-1 + n-1) * latency``. Under a per-node link, more GPUs per node never
    make the all-reduce cheaper. It reduces to :func:`ring_allreduce_seconds` for n = 1
    (intra only) or g = 1.

    >>> round(two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9), 6)  # 0.14 + 0.64
    0.78
    >>> round(two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9, link_per="gpu"), 6)  # 0.14 + 0.08
    0.22
    """
    if link_per not in LINK_PER:
        raise ValueError(f"link_per must be one of {LINK_PER}, got {link_per!r}")
    nbytes = _check(nbytes, "nbytes")
    nodes = _check(nodes, "nodes", minimum=1.0)
    gpus_per_node = _check(gpus_per_node, "gpus_per_node", minimum=1.0)
    intra_bandwidth = _check(intra_bandwidth, "intra_bandwidth", strict=True, allow_inf=True)
    inter_bandwidth = _check(inter_bandwidth, "inter_bandwidth", strict=True, allow_inf=True)
    latency = _check(latency, "latency")
    g, n = gpus_per_node, nodes
    intra = 2.0 * (g - 1.0) / g * nbytes / intra_bandwidth
    inter = 2.0 * (n - 1.0) / n * (nbytes / (g if link_per == "gpu" else 1.0)) / inter_bandwidth
    return intra + inter + 2.0 * ((g - 1.0) + (n - 1.0)) * latency


def parameter_server_seconds(nbytes: float, gpus: float, num_servers: float,
                             server_bandwidth: float,
                             worker_bandwidth: float | None = None) -> float:
    """Seconds per step to push gradients and pull parameters through parameter servers.

    Every worker sends S bytes and receives S bytes: the servers move ``2 S G`` bytes
    spread over ``N_ps`` servers of ``B_ps`` bytes/s each; each worker moves ``2 S`` over
    its own link ``B_w``. ``T = max(2 S G / (N_ps B_ps), 2 S / B_w)``. With
    ``worker_bandwidth=None`` the worker side is not a limit (the paper's model).

    >>> parameter_server_seconds(1e8, 8, 4, 1e9)
    0.4
    >>> parameter_server_seconds(1e8, 8, 16, 1e9, worker_bandwidth=1e9)
    0.2
    """
    nbytes = _check(nbytes, "nbytes")
    gpus = _check_gpus(gpus)
    num_servers = _check(num_servers, "num_servers", minimum=1.0)
    server_bandwidth = _check(server_bandwidth, "server_bandwidth", strict=True,
                              allow_inf=True)
    server_side = 2.0 * nbytes * gpus / (num_servers * server_bandwidth)
    if worker_bandwidth is None:
        return server_side
    worker_bandwidth = _check(worker_bandwidth, "worker_bandwidth", strict=True,
                              allow_inf=True)
    return max(server_side, 2.0 * nbytes / worker_bandwidth)


def min_parameter_servers(nbytes: float, gpus: float, server_bandwidth: float,
                          compute_seconds: float, imbalance: float = 1.0) -> int:
    """The paper's lemma: servers needed to hide parameter-server traffic under compute.

    ``N_ps = ceil(imbalance * 2 S G / (B_ps T_C))`` with S bytes of parameters, G workers,
    B_ps bytes/s per server, T_C seconds of computation per step and ``imbalance`` =
    largest shard / mean shard (>= 1; uneven sharding needs more servers). At least 1.

    >>> min_parameter_servers(180e6, 8, 1.25e8, 0.25)
    93
    >>> min_parameter_servers(1e8, 4, 1e9, 0.2, imbalance=1.5)
    6
    """
    nbytes = _check(nbytes, "nbytes")
    gpus = _check_gpus(gpus)
    server_bandwidth = _check(server_bandwidth, "server_bandwidth", strict=True)
    compute_seconds = _check(compute_seconds, "compute_seconds", strict=True)
    imbalance = _check(imbalance, "imbalance", minimum=1.0)
    needed = imbalance * 2.0 * nbytes * gpus / server_bandwidth / compute_seconds
    return max(1, _ceil(needed))


def bandwidth_needed(nbytes: float, gpus: float, compute_seconds: float,
                     target_efficiency: float, other_overhead_seconds: float = 0.0,
                     hideable_seconds: float = 0.0, latency: float = 0.0,
                     ideal_seconds: float | None = None, fixed_seconds: float = 0.0) -> float:
    """Ring bus bandwidth (bytes/s) at which the projected efficiency reaches a target at G.

    The step at G devices is ``base + max(0, T_ring(B) - hideable)`` with
    ``base = compute_seconds + other_overhead_seconds`` (everything but communication)
    and ``hideable`` the communication backward can hide. Efficiency is
    ``ideal / step``; ``ideal`` defaults to ``base`` (weak scaling: the step without
    communication is the one-device step). For strong scaling pass
    ``ideal_seconds = step(1) / G``. Solving ``step <= ideal / target``:

    ``B = 2 (G-1)/G * S / (hideable + ideal/target - base - 2 (G-1) latency - fixed)``

    with ``fixed_seconds`` the all-reduce's time that no bandwidth changes (see
    :func:`project_summary`'s ``fixed_comm_ms``).

    Returns 0.0 when no communication is needed (G = 1 or S = 0) and ``math.inf`` when
    no bandwidth reaches the target (latency alone, or the non-communication part of the
    step, already misses it). Seconds in, bytes/s out.

    >>> round(bandwidth_needed(180e6, 8, 0.25, 0.8) / 1e9, 6)  # GB/s, i.e. ~40 Gbit/s
    5.04
    >>> bandwidth_needed(1e9, 1, 0.1, 0.8)
    0.0
    """
    nbytes = _check(nbytes, "nbytes")
    gpus = _check_gpus(gpus)
    compute_seconds = _check(compute_seconds, "compute_seconds")
    target_efficiency = _check(target_efficiency, "target_efficiency", strict=True)
    if target_efficiency > 1.0:
        raise ValueError(f"target_efficiency must be in (0, 1], got {target_efficiency!r}")
    other_overhead_seconds = _check(other_overhead_seconds, "other_overhead_seconds")
    hideable_seconds = _check(hideable_seconds, "hideable_seconds")
    latency = _check(latency, "latency")
    fixed_seconds = _check(fixed_seconds, "fixed_seconds")
    base = compute_seconds + other_overhead_seconds
    ideal = base if ideal_seconds is None else _check(ideal_seconds, "ideal_seconds")
    if base > ideal / target_efficiency * (1 + _REL_EPS):
        return math.inf  # even with no exposed communication the step misses the target
    if gpus == 1.0 or nbytes == 0.0:
        return 0.0
    available = hideable_seconds + ideal / target_efficiency - base \
        - 2.0 * (gpus - 1.0) * latency - fixed_seconds
    if available <= 0.0:
        return math.inf
    return 2.0 * (gpus - 1.0) / gpus * nbytes / available


# --------------------------------------------------------------------------- bandwidth parsing

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH_RE = re.compile(
    r"^\s*(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"
    r"(?P<prefix>[kKmMgGtT]?)(?P<unit>[A-Za-z/]*)\s*$")
_BIT_UNITS_ANY_CASE = {"bit", "bits", "bit/s", "bits/s", "bitps"}
_BIT_UNITS = {"b", "bps", "b/s"}
_BYTE_UNITS = {"B", "Bps", "B/s"}
_BYTE_UNITS_ANY_CASE = {"byte", "bytes", "byte/s", "bytes/s"}
#: The written forms of a bandwidth, for error messages (the CLI's and the options').
BANDWIDTH_UNIT_FORMS = ("'25Gbps', '400Gb/s', '10 Gbit/s' (bits) or '100GB/s', '12.5GBps' (bytes), "
                        "prefix k, M, G or T")
_BANDWIDTH_FORMS = f"a positive number of bytes/s (e.g. 1.25e9) or a string with a unit: {BANDWIDTH_UNIT_FORMS}"


def parse_bandwidth(value: float | str, name: str = "bandwidth") -> float:
    """A link speed in bytes/s, from a number (already bytes/s) or a string with a unit.

    Units: ``bps``, ``b/s``, ``bit``, ``bit/s`` are bits (divided by 8); ``B/s``, ``Bps``,
    ``B`` are bytes. The case of the b decides: ``Gb`` is gigabits, ``GB`` gigabytes;
    ``bit`` is bits in any case (``1gbit``). Decimal prefixes k, M, G, T (1e3 ... 1e12;
    ``m`` is mega too, as in ``mbps``). A number is bytes/s; a string needs its unit
    ("10" could be bits or bytes, per second or per node, so it is refused, as on the
    command line and in ``DTPROFILE_LINK_BANDWIDTH``). Anything else (negative, zero,
    nan, inf, bool, a prefix without a unit, garbage) raises a one-line ValueError
    naming ``name`` and the accepted forms.

    >>> parse_bandwidth("25Gbps")
    3125000000.0
    >>> parse_bandwidth("100 GB/s")
    100000000000.0
    >>> parse_bandwidth("1gbit")
    125000000.0
    >>> parse_bandwidth(1.25e9)
    1250000000.0
    """
    def fail(why: str = "") -> ValueError:
        return ValueError(f"{name} must be {_BANDWIDTH_FORMS}; got {value!r}{why}")

    if _is_number(value):
        number = float(value)
        if not math.isfinite(number) or number <= 0.0:
            raise fail()
        return number
    if not isinstance(value, str):
        raise fail()
    match = _BANDWIDTH_RE.match(value)
    if match is None:
        raise fail()
    number = float(match["num"])
    prefix, unit = match["prefix"], match["unit"]
    if unit == "":  # "10", "25G": bits or bytes?
        raise fail(" (a string needs a unit)")
    if unit.lower() in _BIT_UNITS_ANY_CASE or unit in _BIT_UNITS:
        per_unit = 1.0 / _BITS_PER_BYTE
    elif unit in _BYTE_UNITS or unit.lower() in _BYTE_UNITS_ANY_CASE:
        per_unit = 1.0
    else:
        raise fail()
    result = number * _PREFIXES[prefix.lower()] * per_unit
    if not math.isfinite(result) or result <= 0.0:
        raise fail()
    return result


# --------------------------------------------------------------------------- the refined projection


@dataclass(frozen=True)
class StepPhases:
    """One optimizer step at the measured device count, split by how each part scales.

    All times in ms per step. ``scalable_ms`` (forward + backward) scales with the
    per-device batch; ``optimizer_ms`` and ``other_ms`` (unattributed host time:
    zero_grad, logging, Python) do not; ``data_wait_ms`` is per process and scales with
    the per-device batch when ``data_wait_scales``; ``backward_ms`` bounds how much
    communication can hide; ``hideable_ms`` is the communication measured hidden.
    """

    scalable_ms: float
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    other_ms: float = 0.0
    data_wait_ms: float = 0.0
    hideable_ms: float = 0.0
    measured_gpus: float = 1.0


def _batch_factor(gpus: float, measured_gpus: float, scaling: str) -> float:
    """Per-device batch at G' relative to the measured one: 1 (weak), G/G' (strong)."""
    return 1.0 if scaling == "weak" else measured_gpus / gpus


def step_parts_ms(phases: StepPhases, batch_factor: float, comm_ms: float,
                  data_wait_scales: bool = True) -> dict[str, float]:
    """The refined step (ms) when the per-device batch is ``batch_factor`` x the measured one.

    ``step = k (F + B) + D' + optimizer + other + max(0, comm - min(hideable, k B))``
    with ``D' = k D`` when ``data_wait_scales`` else ``D``. Communication that backward
    cannot hide is exposed; backward shrinking with the batch hides less.

    >>> step_parts_ms(StepPhases(60.0, 40.0, 5.0, 0.0, 2.0, 10.0), 1.0, 30.0)["step"]
    87.0
    """
    k = batch_factor
    data = phases.data_wait_ms * (k if data_wait_scales else 1.0)
    compute = k * phases.scalable_ms + phases.optimizer_ms + phases.other_ms
    hideable = min(phases.hideable_ms, k * phases.backward_ms)
    exposed = comm_ms if math.isnan(comm_ms) else max(0.0, comm_ms - hideable)
    return {"step": compute + data + exposed, "compute": compute, "data_wait": data,
            "comm_exposed": exposed, "hideable": hideable}


def project_phases(phases: StepPhases, gpus: Sequence[float],
                   comm_ms: Callable[[float], float], scaling: str = DEFAULT_SCALING,
                   data_wait_scales: bool = True) -> dict[str, Any]:
    """Refined step time, speedup and efficiency at each device count in ``gpus``.

    ``comm_ms(G)`` gives the communication time (ms) at G devices (a cost model; 0 at
    G = 1 for all-reduce). Per-device batch factor k = 1 (weak) or G_measured / G
    (strong); the step is :func:`step_parts_ms`. Weak scaling: throughput speedup
    ``G step(1) / step(G)``; strong: ``step(1) / step(G)``; efficiency = speedup / G.

    Under the paper's assumptions (strong scaling, measured on one device, no optimizer
    or other serial part, constant overhead: ``data_wait_scales=False`` and constant
    ``comm_ms``) this is exactly ``G * alpha(R_O, G)``:

    >>> p = project_phases(StepPhases(80.0, data_wait_ms=20.0), [1, 4], lambda g: 0.0,
    ...                    "strong", data_wait_scales=False)
    >>> p["speedup"][1], projected_speedup(20 / 80, 4)
    (2.5, 2.5)
    """
    if scaling not in SCALING_MODES:
        raise ValueError(f"scaling must be one of {SCALING_MODES}, got {scaling!r}")
    measured = phases.measured_gpus

    def at(g: float) -> dict[str, float]:
        comm = float(comm_ms(g))
        parts = step_parts_ms(phases, _batch_factor(g, measured, scaling), comm,
                              data_wait_scales)
        parts["comm"] = comm
        return parts

    reference = at(1.0)["step"]
    out: dict[str, list] = {k: [] for k in ("step_ms", "speedup", "efficiency", "compute_ms",
                                            "data_wait_ms", "comm_ms", "comm_exposed_ms",
                                            "hideable_ms")}
    for g in gpus:
        g = _check_gpus(g)
        parts = at(g)
        step = parts["step"]
        if step > 0:
            speedup = (g * reference / step) if scaling == "weak" else reference / step
        else:
            speedup = None
        out["step_ms"].append(step)
        out["speedup"].append(speedup)
        out["efficiency"].append(None if speedup is None else speedup / g)
        out["compute_ms"].append(parts["compute"])
        out["data_wait_ms"].append(parts["data_wait"])
        out["comm_ms"].append(parts["comm"])
        out["comm_exposed_ms"].append(parts["comm_exposed"])
        out["hideable_ms"].append(parts["hideable"])
    out["reference_step_ms"] = reference
    return out


def _get(mapping: Any, key: str) -> Any:
    return mapping.get(key) if isinstance(mapping, Mapping) else None


def _model_bytes(summary: Mapping[str, Any]) -> float | None:
    """Bytes communicated per step: grad_bytes, else the trainable (else all) parameters."""
    run = _get(summary, "run")
    for value in (_get(summary, "grad_bytes"), _get(run, "trainable_param_bytes"),
                  _get(run, "param_bytes")):
        value = _num(value)
        if value is not None and value > 0:
            return value
    return None


def _world_size(summary: Mapping[str, Any]) -> int:
    ws = _num(_get(summary, "world_size"))
    return int(ws) if ws is not None and ws >= 1 else 1


def phases_from_summary(summary: Mapping[str, Any]) -> StepPhases | None:
    """The measured step split for the projection, from ``summary["per_step_ms"]``.

    None when no step time was measured. Missing phases count as 0, except forward and
    backward: without them all of compute minus the optimizer scales. Hidden
    communication = comm_total - comm_exposed, bounded by backward. ``other_ms`` is what
    the phases leave of compute (host time that does not scale).
    """
    per = _get(summary, "per_step_ms") or {}
    step = _num(_get(per, "step"))
    data = _num(_get(per, "data_wait")) or 0.0
    exposed = _num(_get(per, "comm_exposed"))
    total = _num(_get(per, "comm_total"))
    compute = _num(_get(per, "compute"))
    if compute is None:
        if step is None:
            return None
        compute = step - data - (exposed or 0.0)
    compute = max(0.0, compute)
    optimizer = _num(_get(per, "optimizer")) or 0.0
    forward, backward = _num(_get(per, "forward")), _num(_get(per, "backward"))
    if forward is not None and backward is not None:
        scalable = forward + backward
        other = max(0.0, compute - scalable - optimizer)
    else:
        scalable = max(0.0, compute - optimizer)
        backward = scalable if backward is None else backward
        other = 0.0
    hidden = 0.0
    if total is not None and exposed is not None:
        # Hidden now = comm_total - comm_exposed; bounded by backward, which it overlaps.
        hidden = min(max(0.0, total - exposed), backward)
    # Unmeasured communication (world_size 1, or comm_source null): nothing is known to
    # hide, so all modelled communication counts as exposed (the conservative bound).
    return StepPhases(scalable_ms=scalable, backward_ms=backward, optimizer_ms=optimizer,
                      other_ms=other, data_wait_ms=data, hideable_ms=hidden,
                      measured_gpus=float(_world_size(summary)))


def _hardware_Bps(hardware: Any, key: str, bits: bool) -> float | None:
    value = _num(_get(hardware, key))
    if value is None or value <= 0:
        return None
    return value * _GIGA / (_BITS_PER_BYTE if bits else 1.0)


def resolve_bandwidth(summary: Mapping[str, Any], bandwidth: float | str | None = None,
                      *, allow_nvml: bool = True) -> tuple[float, str]:
    """(bytes/s, source) for the projection's link, first that applies:

    1. ``bandwidth`` given (what-if): ``user``;
    2. this run's busbw (world_size >= 2 and busbw known): ``measured``;
    3. ``options.link_bandwidth_Bps``: ``user``;
    4. ``run.hardware`` ``nvlink_GBps`` else ``pcie_GBps`` (NVML): ``nvml``;
    5. ``run.hardware`` ``nic_Gbps``: ``nic``;
    6. :data:`ASSUMED_BANDWIDTH_Bps` (10 Gbit/s Ethernet): ``assumed``.

    >>> resolve_bandwidth({"world_size": 1, "run": {"hardware": {"nic_Gbps": 25}}})
    (3125000000.0, 'nic')
    """
    if bandwidth is not None:
        return parse_bandwidth(bandwidth, "bandwidth"), "user"
    busbw = _num(_get(summary, "busbw_GBps"))
    if _world_size(summary) >= 2 and busbw is not None and busbw > 0:
        return busbw * _GIGA, "measured"
    link = _get(_get(summary, "options"), "link_bandwidth_Bps")
    if link is not None:
        return parse_bandwidth(link, "link_bandwidth"), "user"
    hardware = _get(_get(summary, "run"), "hardware")
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
    hardware = _get(_get(summary, "run"), "hardware")
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

    >>> _node_split(8, 3), _node_split(16, 2), _node_split(2, 4)
    ((2, 4), (2, 8), (2, 1))
    """
    g = max(1, int(round(gpus)))
    used = max(n for n in range(1, min(nodes, g) + 1) if g % n == 0)
    return used, g // used


def _r_o(summary: Mapping[str, Any]) -> float | None:
    r_o = _num(_get(_get(summary, "ratios"), "R_O"))
    if r_o is None:
        per = _get(summary, "per_step_ms")
        overhead, compute = _num(_get(per, "overhead")), _num(_get(per, "compute"))
        if overhead is not None and compute is not None and compute > 0:
            r_o = overhead / compute
    # A compute time of ~0 (a denormal) makes R_O overflow: no meaningful ratio then.
    return r_o if r_o is not None and 0 <= r_o < math.inf else None


def _buffers_ms(summary: Mapping[str, Any]) -> float:
    """DDP's buffer broadcast before each forward, as measured (ms per step)."""
    return max(0.0, _num(_get(_get(summary, "per_step_ms"), "comm_buffers")) or 0.0)


def _fixed_comm_seconds(summary: Mapping[str, Any], nbytes: float | None, latency: float = 0.0) -> float:
    """Measured all-reduce time beyond what the run's own link rate explains, in s.

    F = comm_total - 2(G-1)/G * S / B_link, with B_link the link this run used
    (``options.link_bandwidth_Bps``, else the NIC speed); 0 when either is unknown or
    the run had one rank.
    """
    world = _world_size(summary)
    comm_total_ms = _num(_get(_get(summary, "per_step_ms"), "comm_total"))
    if world < 2 or comm_total_ms is None or not nbytes:
        return 0.0
    comm_total_ms -= _buffers_ms(summary)  # modelled on its own
    link = _get(_get(summary, "options"), "link_bandwidth_Bps")
    link_Bps = parse_bandwidth(link, "link_bandwidth") if link is not None else _hardware_Bps(
        _get(_get(summary, "run"), "hardware"), "nic_Gbps", bits=True)
    if link_Bps is None:
        return 0.0
    return max(0.0, comm_total_ms / 1e3 - ring_allreduce_seconds(nbytes, world, link_Bps, latency))


def _fixed_comm_seconds_at(fixed_seconds: float, gpus: float, measured_gpus: float) -> float:
    """The measured fixed part of the all-reduce at G ranks, in s: scaled like the ring's
    traffic, 2(G-1)/G over its value at the measured G_m (reduction arithmetic and
    copies grow with the data each rank handles), so a what-if at the run's own link
    rate projects what the measured bandwidth does, at every G."""
    if fixed_seconds <= 0 or gpus <= 1 or measured_gpus <= 1:
        return 0.0
    return fixed_seconds * ((gpus - 1.0) / gpus) / ((measured_gpus - 1.0) / measured_gpus)


def project_summary(summary: Mapping[str, Any], *, gpus: Sequence[float] | None = None,
                    scaling: str | None = None, bandwidth: float | str | None = None,
                    nodes: int | None = None, latency_s: float | None = None,
                    link_per: str | None = None) -> dict:
    """The ``projection`` object of the summary: the paper's figures and the refined model.

    Defaults come from ``summary["options"]`` (``project_gpus``, ``scaling``,
    ``link_bandwidth_Bps``). ``bandwidth`` (bytes/s or a string, see
    :func:`parse_bandwidth`) is a what-if: source ``user``, overriding the measured one.
    ``nodes`` switches to the two-level all-reduce: G GPUs spread evenly over the most
    nodes, at most ``nodes``, that G divides (``nodes_used`` x ``gpus_per_node`` = G),
    intra-node bandwidth from ``run.hardware`` (NVLink, PCIe; ``intra_bandwidth_source``
    ``nvml``) or :data:`DEFAULT_INTRA_NODE_BANDWIDTH_Bps` (``assumed``), inter-node
    bandwidth as resolved by :func:`resolve_bandwidth` (without NVML), each node's link
    shared by its GPUs unless ``link_per`` is ``"gpu"`` (default: the run's option
    ``link_bandwidth_per``, else ``"node"``; see :func:`two_level_allreduce_seconds`).
    ``latency_s``: seconds per hop.

    The refined step (see :func:`step_parts_ms`): forward/backward scale with the
    per-device batch (strong scaling: global / G'), the optimizer step does not (DDP
    replicates it on every rank), unattributed host time does not, data wait is per
    process, communication follows the cost model for ``grad_bytes`` and only the part
    backward cannot hide is exposed, plus DDP's buffer broadcast as measured
    (``comm_buffers``, exposed). G' = 1 has no communication. Lists are aligned with
    ``gpus``; entries are None where nothing was measured.
    """
    options = _get(summary, "options") or {}
    gpus_list = list(gpus if gpus is not None else
                     (_get(options, "project_gpus") or DEFAULT_PROJECT_GPUS))
    for g in gpus_list:
        _check_gpus(g, "gpus")
    scaling = scaling or _get(options, "scaling") or DEFAULT_SCALING
    if scaling not in SCALING_MODES:
        raise ValueError(f"scaling must be one of {SCALING_MODES}, got {scaling!r}")
    if nodes is not None:
        nodes = int(_check(nodes, "nodes", minimum=1.0))
    link_per = link_per or _get(options, "link_bandwidth_per") or "node"
    if link_per not in LINK_PER:
        raise ValueError(f"link_per must be one of {LINK_PER}, got {link_per!r}")
    latency = DEFAULT_LATENCY_S if latency_s is None else _check(latency_s, "latency_s")
    bw_Bps, source = resolve_bandwidth(summary, bandwidth, allow_nvml=nodes is None)
    nbytes = _model_bytes(summary)
    fixed_s = _fixed_comm_seconds(summary, nbytes, latency) if bandwidth is not None else 0.0
    r_o = _r_o(summary)
    r_o_paper = None if r_o is None else paper_r_o(r_o, _world_size(summary))
    n = len(gpus_list)

    projection: dict[str, Any] = {
        "scaling": scaling,
        "bandwidth_source": source,
        "bandwidth_GBps": bw_Bps / _GIGA,
        "gpus": gpus_list,
        "alpha_paper": [None if r_o_paper is None else alpha(r_o_paper, g) for g in gpus_list],
        "speedup_paper": [None if r_o_paper is None else projected_speedup(r_o_paper, g)
                          for g in gpus_list],
        "step_ms": [None] * n, "speedup": [None] * n, "efficiency": [None] * n,
        "R_O": r_o,
        "R_O_paper": r_o_paper,
        "measured_gpus": _world_size(summary),
        "grad_bytes": nbytes,
        "model": "two_level" if nodes is not None else "ring",
        "latency_s": latency,
        "fixed_comm_ms": fixed_s * 1e3,
        "comm_buffers_ms": _buffers_ms(summary),
        "nodes": nodes,
        "compute_ms": [None] * n, "comm_ms": [None] * n, "comm_exposed_ms": [None] * n,
        "hideable_ms": [None] * n, "reference_step_ms": None,
    }
    if nodes is not None:
        intra, intra_source = _intra_node_Bps(summary)
        projection["intra_bandwidth_GBps"] = intra / _GIGA
        projection["intra_bandwidth_source"] = intra_source
        projection["link_per"] = link_per
        projection["nodes_used"] = [_node_split(g, nodes)[0] for g in gpus_list]
        projection["gpus_per_node"] = [_node_split(g, nodes)[1] for g in gpus_list]

    phases = phases_from_summary(summary)
    if phases is None:
        return projection
    # DDP's buffer broadcast (BatchNorm's statistics) before each forward: exposed in
    # full, the time measured here at any G' >= 2 (its bytes are few: latency-bound).
    buffers_ms = _buffers_ms(summary)

    def comm_ms(g: float) -> float:
        if g <= 1.0:
            return 0.0
        if nbytes is None:
            return math.nan
        fixed_ms = 1e3 * _fixed_comm_seconds_at(fixed_s, g, _world_size(summary))
        if nodes is None:
            return buffers_ms + fixed_ms + 1e3 * ring_allreduce_seconds(nbytes, g, bw_Bps, latency)
        used, per_node = _node_split(g, nodes)
        return buffers_ms + fixed_ms + 1e3 * two_level_allreduce_seconds(
            nbytes, used, per_node, intra, bw_Bps, latency, link_per=link_per)

    result = project_phases(phases, gpus_list, comm_ms, scaling)
    for key, values in result.items():
        if isinstance(values, list):  # nan (bytes unknown), overflow -> None, as JSON allows
            projection[key] = [None if v is None or not math.isfinite(v) else v
                               for v in values]
    projection["reference_step_ms"] = result["reference_step_ms"]
    return projection


# --------------------------------------------------------------------------- recommendations


def max_batch_size(peak_bytes: float, static_bytes: float, total_bytes: float,
                   batch_size: float,
                   usable_fraction: float = MEMORY_USABLE_FRACTION) -> int | None:
    """Largest per-device batch that fits, from ``peak = static + per_sample * batch``.

    ``per_sample = (peak - static) / batch``; ``max = floor((total * usable - static) /
    per_sample)``. Bytes in, samples out; None when the per-sample cost is not positive.

    >>> max_batch_size(10e9, 2e9, 80e9, 32)
    280
    """
    peak = _check(peak_bytes, "peak_bytes")
    static = _check(static_bytes, "static_bytes")
    total = _check(total_bytes, "total_bytes", strict=True)
    batch = _check(batch_size, "batch_size", strict=True)
    per_sample = (peak - static) / batch
    if per_sample <= 0:
        return None
    return max(0, math.floor((total * usable_fraction - static) / per_sample + _REL_EPS))


def dataloader_workers_needed(data_wait_ms: float, step_ms: float,
                              num_workers: int | None = 0, micro_batches: int = 1,
                              margin: int = NUM_WORKERS_MARGIN) -> int:
    """DataLoader workers that keep up with the step, before any CPU cap.

    Per batch: ``wait = data_wait / m`` and ``busy = (step - data_wait) / m`` (m
    micro-batches per step). With w workers loading in parallel, each taking ``t_load``
    per batch, supply is ``w / t_load`` batches/s and must reach demand ``1 / busy``, so
    ``w = ceil(t_load / busy) + margin``. ``t_load`` is inferred from the wait:

    - ``num_workers == 0`` (or unknown): the main process loads, so ``t_load = wait``;
    - ``num_workers = w0 > 0`` and waiting: the workers are the bottleneck, so in steady
      state one batch arrives every ``busy + wait`` = ``t_load / w0``, hence
      ``t_load = w0 (busy + wait)``.

    >>> dataloader_workers_needed(30.0, 50.0)  # 30 ms loading per 20 ms step
    3
    >>> dataloader_workers_needed(10.0, 30.0, num_workers=2)  # t_load = 60 ms
    4
    """
    data_wait_ms = _check(data_wait_ms, "data_wait_ms")
    step_ms = _check(step_ms, "step_ms", strict=True)
    m = max(1.0, float(micro_batches or 1))
    w0 = int(num_workers or 0)
    wait = data_wait_ms / m
    busy = max(step_ms - data_wait_ms, 0.0) / m
    t_load = wait if w0 == 0 else w0 * (busy + wait)
    if busy <= 0.0:  # the step is all waiting: no compute to set the pace against
        busy = step_ms * 1e-3 / m
    return max(1, _ceil(t_load / busy) + margin)


def _safe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, or None when the arithmetic breaks down (underflow to 0, overflow):
    a recommendation from degenerate measurements is unknown, not an exception."""
    try:
        result = fn(*args, **kwargs)
    except (ArithmeticError, ValueError):
        return None
    return result


def _index_of_gpus(projection: Mapping[str, Any], g: Any) -> int | None:
    gpus = _get(projection, "gpus") or []
    return gpus.index(g) if g in gpus else None


def _bandwidth_needed_for(projection: Mapping[str, Any], index: int, nbytes: float,
                          target: float) -> float | None:
    """Inter-node/ring bandwidth (bytes/s) reaching ``target`` at projection[gpus][index]."""
    def item(key: str) -> float | None:
        values = _get(projection, key)
        return _num(values[index]) if isinstance(values, list) and index < len(values) \
            else None

    g = _num(projection["gpus"][index])
    step, exposed, hideable = item("step_ms"), item("comm_exposed_ms"), item("hideable_ms")
    reference = _num(_get(projection, "reference_step_ms"))
    if None in (g, step, exposed, hideable, reference):
        return None
    base_s = (step - exposed) / 1e3
    ideal_s = reference / 1e3 if _get(projection, "scaling") == "weak" else reference / 1e3 / g
    latency = _num(_get(projection, "latency_s")) or 0.0
    # What the link does not carry: the all-reduce's fixed part and DDP's buffer broadcast.
    fixed_s = _fixed_comm_seconds_at((_num(_get(projection, "fixed_comm_ms")) or 0.0) / 1e3, g,
                                     _num(_get(projection, "measured_gpus")) or 1.0) \
        + (_num(_get(projection, "comm_buffers_ms")) or 0.0) / 1e3
    if _get(projection, "model") != "two_level":
        return bandwidth_needed(nbytes, g, base_s, target, 0.0, hideable / 1e3, latency,
                                ideal_seconds=ideal_s, fixed_seconds=fixed_s)
    used, per_node = item("nodes_used"), item("gpus_per_node")
    intra_GBps = _num(_get(projection, "intra_bandwidth_GBps"))
    if None in (used, per_node, intra_GBps):
        return None
    # Budget for communication, minus the intra-node and latency terms, left to the link.
    if base_s > ideal_s / target * (1 + _REL_EPS):
        return math.inf  # misses the target even with all communication hidden
    budget = hideable / 1e3 + ideal_s / target - base_s
    fixed = fixed_s + two_level_allreduce_seconds(nbytes, used, per_node, intra_GBps * _GIGA,
                                                  math.inf, latency)
    if used <= 1:
        return 0.0 if fixed <= budget else math.inf
    available = budget - fixed
    if available <= 0:
        return math.inf
    shard = nbytes / per_node if _get(projection, "link_per") == "gpu" else nbytes
    return 2.0 * (used - 1.0) / used * shard / available


def _server_bandwidth(summary: Mapping[str, Any], projection: Mapping[str, Any]) -> tuple[float, str]:
    """(bytes/s, source) of one parameter server's network link: the projection's link,
    unless that is NVLink or PCIe inside this node (NVML), which no server is reached by."""
    source = _get(projection, "bandwidth_source")
    bw_GBps = _num(_get(projection, "bandwidth_GBps"))
    if source != "nvml" and bw_GBps:
        return bw_GBps * _GIGA, str(source)
    return resolve_bandwidth(summary, allow_nvml=False)


def _parameter_servers(summary: Mapping[str, Any], projection: Mapping[str, Any],
                       gpus: float | None, known: list, nbytes: float | None) -> dict:
    """The lemma's server count for this model, and how unevenly its tensors split.

    A server deployment pushes the gradients once per optimizer step, however many
    micro-batches all-reduced them here (accumulation without no_sync()). Servers hold
    whole tensors, so the one holding the largest tensor (L bytes) carries at least
    ``max(L, S/N)``: ``imbalance = max(1, L N / S)`` at the even-split count N, and a
    tensor larger than one server's budget ``B_ps T_C / (2 G)`` saturates it however
    many servers there are (``..._largest_tensor_share`` > 1).
    """
    out: dict[str, Any] = {}
    # A deployment at one device is moot: when all-reduce does not scale past G = 1,
    # size the servers for the largest projected G instead.
    ps_gpus = gpus
    if ps_gpus is not None and ps_gpus <= 1 and known:
        ps_gpus = max(g for g, _ in known)
    index = _index_of_gpus(projection, ps_gpus)
    compute = _get(projection, "compute_ms")
    compute_ms = _num(compute[index]) if isinstance(compute, list) and index is not None \
        and index < len(compute) else None
    if ps_gpus is None or nbytes is None or compute_ms is None or compute_ms <= 0:
        return out
    run = _get(summary, "run")
    passes = _num(_get(run, "sync_passes"))
    ps_bytes = nbytes / passes if passes is not None and passes > 1 else nbytes
    server_Bps, source = _server_bandwidth(summary, projection)
    n_ps = _safe(min_parameter_servers, ps_bytes, ps_gpus, server_Bps, compute_ms / 1e3)
    if n_ps is None:
        return out
    out.update({"num_parameter_servers": n_ps, "num_parameter_servers_at_gpus": ps_gpus,
                "num_parameter_servers_bytes": ps_bytes,
                "num_parameter_servers_bandwidth_Gbps": server_Bps * _BITS_PER_BYTE / _GIGA,
                "num_parameter_servers_bandwidth_source": source,
                "num_parameter_servers_imbalance": 1.0,
                "num_parameter_servers_largest_tensor_share": None})
    largest = _num(_get(run, "largest_trainable_param_bytes"))
    whole = _num(_get(run, "trainable_param_bytes")) or _num(_get(run, "param_bytes"))
    if largest is not None and whole and 0 < largest <= whole:
        # On the wire as the rest is (a 16-bit compression hook halves both).
        largest *= ps_bytes / whole
        budget = server_Bps * compute_ms / 1e3 / (2.0 * ps_gpus)
        out["num_parameter_servers_imbalance"] = max(1.0, largest * n_ps / ps_bytes)
        out["num_parameter_servers_largest_tensor_share"] = largest / budget
    return out


def recommend(summary: Mapping[str, Any], projection: Mapping[str, Any]) -> dict:
    """The ``recommendations`` object: what to set, from the measurements and projection.

    - ``gpus``: largest projected G with efficiency >= ``options.target_efficiency``.
    - ``num_parameter_servers``: :func:`min_parameter_servers` for this model at that G
      (the largest projected G when that G is 1; ``num_parameter_servers_at_gpus`` says
      which), with the projected compute and a network link per server: the
      projection's, unless that is inside the node (NVML), then the user's link, the
      NIC or the assumed Ethernet (``num_parameter_servers_bandwidth_{Gbps,source}``);
      see :func:`_parameter_servers` for ``..._imbalance`` and ``..._largest_tensor_share``.
    - ``bandwidth_needed_Gbps``: ring (or inter-node) bandwidth reaching the target at
      ``bandwidth_needed_at_gpus`` (the largest projected G > 1); None when unreachable
      at any bandwidth (``bandwidth_needed_reachable`` False) or unknown.
    - ``max_batch_size``: :func:`max_batch_size` from ``run.memory`` (CUDA only).
    - ``num_workers``: :func:`dataloader_workers_needed` when data wait is at least
      :data:`DATA_WAIT_HIDDEN_FRACTION` of the step, capped by floor(cpus_per_rank) (at
      least 1); otherwise the current setting (already hidden).
    - ``critical_batch_size``: ``run.gradient_noise.B_simple`` (global batch), or None.
    """
    options = _get(summary, "options") or {}
    run = _get(summary, "run") or {}
    target = _num(_get(options, "target_efficiency")) or DEFAULT_TARGET_EFFICIENCY
    rec: dict[str, Any] = {
        "gpus": None, "num_parameter_servers": None, "bandwidth_needed_Gbps": None,
        "max_batch_size": None, "num_workers": None, "critical_batch_size": None,
        "target_efficiency": target, "bandwidth_needed_at_gpus": None,
        "bandwidth_needed_reachable": None, "num_workers_needed": None,
        "num_parameter_servers_at_gpus": None, "num_parameter_servers_bytes": None,
        "num_parameter_servers_bandwidth_Gbps": None,
        "num_parameter_servers_bandwidth_source": None,
        "num_parameter_servers_imbalance": None,
        "num_parameter_servers_largest_tensor_share": None,
    }
    gpus = list(_get(projection, "gpus") or [])
    efficiency = list(_get(projection, "efficiency") or [])
    known = [(g, e) for g, e in zip(gpus, efficiency) if _num(e) is not None]
    good = [g for g, e in known if e >= target - 1e-12]
    if good:
        rec["gpus"] = max(good)
    elif known:  # one device is efficiency 1 by definition
        rec["gpus"] = 1

    nbytes = _model_bytes(summary)
    rec.update(_parameter_servers(summary, projection, rec["gpus"], known, nbytes))

    multi = [g for g in gpus if _num(g) is not None and g > 1]
    if multi and nbytes is not None:
        at = max(multi)
        needed = _safe(_bandwidth_needed_for, projection, gpus.index(at), nbytes, target)
        if needed is not None:  # the G only beside what was found there (a figure or unreachable)
            rec["bandwidth_needed_at_gpus"] = at
            gbps = needed * _BITS_PER_BYTE / _GIGA
            rec["bandwidth_needed_reachable"] = math.isfinite(gbps)
            if math.isfinite(gbps):
                rec["bandwidth_needed_Gbps"] = gbps

    memory = _get(run, "memory")
    if _get(summary, "device") == "cuda" and isinstance(memory, Mapping):
        peak, static, total = (_num(_get(memory, k)) for k in
                               ("peak_bytes", "static_bytes", "total_bytes"))
        batch = _num(_get(run, "batch_size"))
        if None not in (peak, static, total, batch) and total > 0 and batch > 0:
            rec["max_batch_size"] = _safe(max_batch_size, peak, static, total, batch)

    per = _get(summary, "per_step_ms") or {}
    step, data = _num(_get(per, "step")), _num(_get(per, "data_wait"))
    current = _num(_get(run, "num_workers"))
    current = int(current) if current is not None and current >= 0 else None
    if step is not None and step > 0 and data is not None and data >= 0:
        # Loader workers do not run the batch's transfer to the device (Lightning's hooks).
        data = max(0.0, data - (_num(_get(per, "data_transfer")) or 0.0))
        if data / step >= DATA_WAIT_HIDDEN_FRACTION:
            needed = _safe(dataloader_workers_needed, data, step, current,
                           int(_num(_get(run, "micro_batches")) or 1))
            rec["num_workers_needed"] = needed
            cpus = _num(_get(run, "cpus_per_rank"))
            cap = max(1, math.floor(cpus)) if cpus is not None and cpus > 0 else None
            rec["num_workers"] = needed if cap is None or needed is None else min(needed, cap)
        else:
            rec["num_workers"] = current

    rec["critical_batch_size"] = critical_batch_size(run)
    return rec


# --------------------------------------------------------------------------- gradient noise scale

#: Sampled steps the gradient noise scale must rest on before it caps a batch: the
#: estimate of a few steps is noise (3 samples once put the critical batch at 677 after 60).
GNS_MIN_SAMPLES = 10


def critical_batch_size(run: Mapping[str, Any] | None) -> float | None:
    """The critical (global) batch size: ``run.gradient_noise.B_simple`` when positive and
    estimated from at least :data:`GNS_MIN_SAMPLES` sampled steps; else None."""
    gns = _get(run, "gradient_noise")
    b_simple, samples = _num(_get(gns, "B_simple")), _num(_get(gns, "samples"))
    if b_simple is None or b_simple <= 0 or samples is None or samples < GNS_MIN_SAMPLES:
        return None
    return b_simple



class GradientNoiseScale:
    """The simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (critical batch size).

    McCandlish et al. 2018, *An Empirical Model of Large-Batch Training*, appendix A.1:
    from the squared norm of one rank's gradient (batch b) and of the all-reduced mean
    gradient (batch B = G b), two unbiased estimates

    - ``|G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b)``
    - ``S = tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)``

    each smoothed by an exponential moving average with Adam's bias correction
    (``ema / (1 - beta^n)``) *before* dividing (the ratio of noisy estimates is biased).
    Updates with non-finite norms (e.g. AMP overflow steps) are skipped.

    >>> gns = GradientNoiseScale()
    >>> gns.update(local_sq_norm=2.0, global_sq_norm=1.5, local_batch=32, global_batch=64)
    >>> gns.value  # |G|^2 = 1.0, S = 0.5 / (1/64) = 32
    32.0
    """

    def __init__(self, beta: float = 0.95) -> None:
        beta = _check(beta, "beta")
        if beta >= 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self._ema_grad_sq = 0.0
        self._ema_trace = 0.0
        self._samples = 0

    def update(self, local_sq_norm: float, global_sq_norm: float, local_batch: int,
               global_batch: int) -> None:
        """Add one step's estimate. Batches in samples; requires global_batch > local_batch."""
        b = _check(local_batch, "local_batch", strict=True)
        big_b = _check(global_batch, "global_batch", strict=True)
        if big_b <= b:
            raise ValueError("global_batch must be larger than local_batch (needs >= 2 "
                             f"ranks), got local_batch={local_batch!r}, "
                             f"global_batch={global_batch!r}")
        small_sq, big_sq = _num(local_sq_norm), _num(global_sq_norm)
        if small_sq is None or big_sq is None:
            return
        grad_sq = (big_b * big_sq - b * small_sq) / (big_b - b)
        trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big_b)
        self._ema_grad_sq = self.beta * self._ema_grad_sq + (1.0 - self.beta) * grad_sq
        self._ema_trace = self.beta * self._ema_trace + (1.0 - self.beta) * trace
        self._samples += 1

    def _corrected(self, ema: float) -> float | None:
        if self._samples == 0:
            return None
        return ema / (1.0 - self.beta ** self._samples)

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed unbiased estimate of |G|^2 (squared norm of the true gradient)."""
        return self._corrected(self._ema_grad_sq)

    @property
    def trace_sigma(self) -> float | None:
        """Smoothed unbiased estimate of tr(Sigma) (per-sample gradient variance)."""
        return self._corrected(self._ema_trace)

    @property
    def samples(self) -> int:
        """Number of updates folded in."""
        return self._samples

    @property
    def value(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 in samples; None before an update or if |G|^2 <= 0."""
        grad_sq, trace = self.grad_sq_norm, self.trace_sigma
        if grad_sq is None or trace is None or grad_sq <= 0.0:
            return None
        return trace / grad_sq

    def to_dict(self) -> dict:
        """``{"B_simple", "grad_sq_norm", "trace_sigma", "samples"}`` for run.gradient_noise."""
        return {"B_simple": self.value, "grad_sq_norm": self.grad_sq_norm,
                "trace_sigma": self.trace_sigma, "samples": self._samples}
