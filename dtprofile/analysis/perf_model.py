"""The performance model of data-parallel training: pure functions of plain numbers.

Zou, Chen et al., *Distributed Training Large-Scale Deep Architectures* (2017) model a
training step as computation ``T_C`` (parallelises) plus overhead ``T_O`` (does not:
gradient communication and I/O). This module holds

- the paper's Amdahl bound: :func:`alpha`, :func:`paper_r_o` and :func:`projected_speedup`;
- communication cost models: :func:`ring_allreduce_seconds`,
  :func:`two_level_allreduce_seconds`, :func:`parameter_server_seconds`, the
  parameter-server lemma :func:`min_parameter_servers` and its inverse for all-reduce,
  :func:`bandwidth_needed`;
- :func:`parse_bandwidth` for the ways people write link speeds.

"Model" elsewhere in dtprofile is the user's ``nn.Module``; this one is the performance
model. What reads a run summary lives beside it: :mod:`.phases` (the step split and its
refined projection), :mod:`.projection`, :mod:`.recommendations` and :mod:`.sizing`.

Units are in the names: ``*_ms`` milliseconds, ``*_seconds``/``*_s`` seconds, ``nbytes``
and ``*_bytes`` bytes, ``*_Bps`` and bandwidth arguments bytes per second, ``*_GBps``
1e9 bytes/s, ``*_Gbps`` 1e9 bits/s. No torch import: this module must stay importable and
testable without a training run.
"""

from __future__ import annotations

import math
import re

from .._values import is_number
from .checks import REL_EPS, ceil_ignoring_noise, check_gpus, check_number

__all__ = [
    "BANDWIDTH_UNIT_FORMS",
    "BITS_PER_BYTE",
    "GIGA",
    "LINK_PER",
    "alpha",
    "bandwidth_needed",
    "min_parameter_servers",
    "paper_r_o",
    "parameter_server_seconds",
    "parse_bandwidth",
    "projected_speedup",
    "ring_allreduce_seconds",
    "two_level_allreduce_seconds",
]

BITS_PER_BYTE = 8.0
#: Decimal giga (1e9): link speeds are quoted in Gbit/s and GB/s, never in powers of two.
GIGA = 1e9


# --------------------------------------------------------------------------- the paper


def alpha(r_o: float, gpus: float) -> float:
    """The paper's fraction of linear speedup on ``gpus`` devices (Amdahl's law).

    ``alpha = (1 + R_O) / (1 + G * R_O)``: one device takes ``T_C + T_O`` per global
    batch, G devices take ``T_C / G + T_O``.

    Args:
        r_o: The overhead ratio ``R_O = T_O / T_C`` (dimensionless, >= 0).
        gpus: The number of devices G (>= 1).

    Returns:
        The fraction of linear speedup, dimensionless, in (0, 1].

    Example:
        >>> alpha(0.25, 4)
        0.625
        >>> alpha(0.0, 64)
        1.0
    """
    r_o = check_number(r_o, "r_o")
    gpus = check_gpus(gpus)
    return (1.0 + r_o) / (1.0 + gpus * r_o)


def paper_r_o(r_o: float, measured_gpus: float = 1.0) -> float:
    """The paper's R_O for a run measured on ``measured_gpus`` ranks.

    The paper's derivation takes T_C as one device's compute for the whole global batch;
    a rank of a G_m-rank run computes 1/G_m of it, so ``R_O_paper = R_O / G_m``. A
    one-device run needs no change.

    Args:
        r_o: The per-rank overhead ratio T_O / T_C (>= 0).
        measured_gpus: The ranks G_m the run was measured on (>= 1).

    Returns:
        T_O over the global batch's compute on one device (dimensionless).

    Example:
        >>> paper_r_o(0.25, 8), paper_r_o(0.25)
        (0.03125, 0.25)
    """
    r_o = check_number(r_o, "r_o")
    return r_o / check_gpus(measured_gpus, "measured_gpus")


def projected_speedup(r_o: float, gpus: float) -> float:
    """The paper's projected speedup ``G * alpha = G (1 + R_O) / (1 + G R_O)``.

    Args:
        r_o: The overhead ratio T_O / T_C (>= 0).
        gpus: The number of devices G (>= 1).

    Returns:
        The speedup over one device, dimensionless; bounded by ``(1 + R_O) / R_O``
        however many devices.

    Example:
        >>> projected_speedup(0.25, 4)
        2.5
    """
    return float(gpus) * alpha(r_o, gpus)


# --------------------------------------------------------------------------- cost models


#: Whose network link a bandwidth is under the two-level model: each node's (its GPUs
#: share it) or each GPU's (a NIC per GPU).
LINK_PER: tuple[str, ...] = ("node", "gpu")


def ring_allreduce_seconds(nbytes: float, gpus: float, bus_bandwidth: float, latency: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``gpus`` ranks.

    ``T = 2 (G - 1) / G * S / B + 2 (G - 1) * latency``. G = 1 costs nothing.

    Args:
        nbytes: The bytes S each rank reduces.
        gpus: The ranks G (>= 1).
        bus_bandwidth: B in bytes/s: nccl-tests' busbw, the per-link rate a ring sustains.
        latency: Seconds per ring step.

    Returns:
        Seconds for one all-reduce.

    Example:
        >>> ring_allreduce_seconds(1e9, 4, 1e9)
        1.5
        >>> ring_allreduce_seconds(1e9, 1, 1e9)
        0.0
    """
    nbytes = check_number(nbytes, "nbytes")
    gpus = check_gpus(gpus)
    bus_bandwidth = check_number(bus_bandwidth, "bus_bandwidth", strict=True, allow_inf=True)
    latency = check_number(latency, "latency")
    steps = 2.0 * (gpus - 1.0)
    return steps / gpus * nbytes / bus_bandwidth + steps * latency


def two_level_allreduce_seconds(
    nbytes: float,
    nodes: float,
    gpus_per_node: float,
    intra_bandwidth: float,
    inter_bandwidth: float,
    latency: float = 0.0,
    link_per: str = "node",
) -> float:
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

    Args:
        nbytes: The bytes S each rank reduces.
        nodes: The nodes n (>= 1).
        gpus_per_node: The GPUs g in each node (>= 1).
        intra_bandwidth: Bytes/s inside a node (NVLink, PCIe).
        inter_bandwidth: Bytes/s of one network link between nodes.
        latency: Seconds per hop.
        link_per: ``"node"`` or ``"gpu"``: whose link ``inter_bandwidth`` is.

    Returns:
        Seconds for one all-reduce.

    Example:
        >>> round(two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9), 6)  # 0.14 + 0.64
        0.78
        >>> round(two_level_allreduce_seconds(8e9, 2, 8, 100e9, 12.5e9, link_per="gpu"), 6)  # 0.14 + 0.08
        0.22
    """
    if link_per not in LINK_PER:
        raise ValueError(f"link_per must be one of {LINK_PER}, got {link_per!r}")
    nbytes = check_number(nbytes, "nbytes")
    nodes = check_number(nodes, "nodes", minimum=1.0)
    gpus_per_node = check_number(gpus_per_node, "gpus_per_node", minimum=1.0)
    intra_bandwidth = check_number(intra_bandwidth, "intra_bandwidth", strict=True, allow_inf=True)
    inter_bandwidth = check_number(inter_bandwidth, "inter_bandwidth", strict=True, allow_inf=True)
    latency = check_number(latency, "latency")
    g, n = gpus_per_node, nodes
    intra = 2.0 * (g - 1.0) / g * nbytes / intra_bandwidth
    inter = 2.0 * (n - 1.0) / n * (nbytes / (g if link_per == "gpu" else 1.0)) / inter_bandwidth
    return intra + inter + 2.0 * ((g - 1.0) + (n - 1.0)) * latency


def parameter_server_seconds(
    nbytes: float, gpus: float, num_servers: float, server_bandwidth: float, worker_bandwidth: float | None = None
) -> float:
    """Seconds per step to push gradients and pull parameters through parameter servers.

    Every worker sends S bytes and receives S bytes: the servers move ``2 S G`` bytes
    spread over ``N_ps`` servers of ``B_ps`` bytes/s each; each worker moves ``2 S`` over
    its own link ``B_w``. ``T = max(2 S G / (N_ps B_ps), 2 S / B_w)``.

    Args:
        nbytes: The gradient (and parameter) bytes S per worker.
        gpus: The workers G (>= 1).
        num_servers: The servers N_ps (>= 1).
        server_bandwidth: B_ps, bytes/s of each server's link.
        worker_bandwidth: B_w, bytes/s of each worker's link; None: not a limit (the
            paper's model).

    Returns:
        Seconds per step.

    Example:
        >>> parameter_server_seconds(1e8, 8, 4, 1e9)
        0.4
        >>> parameter_server_seconds(1e8, 8, 16, 1e9, worker_bandwidth=1e9)
        0.2
    """
    nbytes = check_number(nbytes, "nbytes")
    gpus = check_gpus(gpus)
    num_servers = check_number(num_servers, "num_servers", minimum=1.0)
    server_bandwidth = check_number(server_bandwidth, "server_bandwidth", strict=True, allow_inf=True)
    server_side = 2.0 * nbytes * gpus / (num_servers * server_bandwidth)
    if worker_bandwidth is None:
        return server_side
    worker_bandwidth = check_number(worker_bandwidth, "worker_bandwidth", strict=True, allow_inf=True)
    return max(server_side, 2.0 * nbytes / worker_bandwidth)


def min_parameter_servers(
    nbytes: float, gpus: float, server_bandwidth: float, compute_seconds: float, imbalance: float = 1.0
) -> int:
    """The paper's lemma: servers needed to hide parameter-server traffic under compute.

    ``N_ps = ceil(imbalance * 2 S G / (B_ps T_C))``.

    Args:
        nbytes: The parameter bytes S.
        gpus: The workers G (>= 1).
        server_bandwidth: B_ps, bytes/s per server (> 0).
        compute_seconds: T_C, seconds of computation per step (> 0).
        imbalance: Largest shard / mean shard (>= 1; uneven sharding needs more servers).

    Returns:
        The number of servers, at least 1.

    Example:
        >>> min_parameter_servers(180e6, 8, 1.25e8, 0.25)
        93
        >>> min_parameter_servers(1e8, 4, 1e9, 0.2, imbalance=1.5)
        6
    """
    nbytes = check_number(nbytes, "nbytes")
    gpus = check_gpus(gpus)
    server_bandwidth = check_number(server_bandwidth, "server_bandwidth", strict=True)
    compute_seconds = check_number(compute_seconds, "compute_seconds", strict=True)
    imbalance = check_number(imbalance, "imbalance", minimum=1.0)
    needed = imbalance * 2.0 * nbytes * gpus / server_bandwidth / compute_seconds
    return max(1, ceil_ignoring_noise(needed))


def bandwidth_needed(
    nbytes: float,
    gpus: float,
    compute_seconds: float,
    target_efficiency: float,
    other_overhead_seconds: float = 0.0,
    hideable_seconds: float = 0.0,
    latency: float = 0.0,
    ideal_seconds: float | None = None,
    fixed_seconds: float = 0.0,
) -> float:
    """Ring bus bandwidth (bytes/s) at which the projected efficiency reaches a target at G.

    The step at G devices is ``base + max(0, T_ring(B) - hideable)`` with
    ``base = compute_seconds + other_overhead_seconds`` (everything but communication)
    and ``hideable`` the communication backward can hide. Efficiency is
    ``ideal / step``; ``ideal`` defaults to ``base`` (weak scaling: the step without
    communication is the one-device step). For strong scaling pass
    ``ideal_seconds = step(1) / G``. Solving ``step <= ideal / target``:

    ``B = 2 (G-1)/G * S / (hideable + ideal/target - base - 2 (G-1) latency - fixed)``

    with ``fixed_seconds`` the all-reduce's time that no bandwidth changes (see
    :func:`dtprofile.analysis.projection.project_summary`'s ``fixed_comm_ms``).

    Args:
        nbytes: The gradient bytes S all-reduced per step.
        gpus: The devices G (>= 1).
        compute_seconds: Seconds of the step that are not communication.
        target_efficiency: The efficiency to reach, in (0, 1].
        other_overhead_seconds: Further seconds of the step that are not communication.
        hideable_seconds: Seconds of communication backward can hide.
        latency: Seconds per ring step.
        ideal_seconds: The step at perfect scaling; None: ``base`` (weak scaling).
        fixed_seconds: Seconds of the all-reduce that no bandwidth changes.

    Returns:
        Bytes/s; 0.0 when no communication is needed (G = 1 or S = 0) and ``math.inf``
        when no bandwidth reaches the target (latency alone, or the non-communication
        part of the step, already misses it).

    Example:
        >>> round(bandwidth_needed(180e6, 8, 0.25, 0.8) / 1e9, 6)  # GB/s, i.e. ~40 Gbit/s
        5.04
        >>> bandwidth_needed(1e9, 1, 0.1, 0.8)
        0.0
    """
    nbytes = check_number(nbytes, "nbytes")
    gpus = check_gpus(gpus)
    compute_seconds = check_number(compute_seconds, "compute_seconds")
    target_efficiency = check_number(target_efficiency, "target_efficiency", strict=True)
    if target_efficiency > 1.0:
        raise ValueError(f"target_efficiency must be in (0, 1], got {target_efficiency!r}")
    other_overhead_seconds = check_number(other_overhead_seconds, "other_overhead_seconds")
    hideable_seconds = check_number(hideable_seconds, "hideable_seconds")
    latency = check_number(latency, "latency")
    fixed_seconds = check_number(fixed_seconds, "fixed_seconds")
    base = compute_seconds + other_overhead_seconds
    ideal = base if ideal_seconds is None else check_number(ideal_seconds, "ideal_seconds")
    if base > ideal / target_efficiency * (1 + REL_EPS):
        return math.inf  # even with no exposed communication the step misses the target
    if gpus == 1.0 or nbytes == 0.0:
        return 0.0
    available = hideable_seconds + ideal / target_efficiency - base - 2.0 * (gpus - 1.0) * latency - fixed_seconds
    if available <= 0.0:
        return math.inf
    return 2.0 * (gpus - 1.0) / gpus * nbytes / available


# --------------------------------------------------------------------------- bandwidth parsing

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH_RE = re.compile(
    r"^\s*(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"
    r"(?P<prefix>[kKmMgGtT]?)(?P<unit>[A-Za-z/]*)\s*$"
)
_BIT_UNITS_ANY_CASE = {"bit", "bits", "bit/s", "bits/s", "bitps"}
_BIT_UNITS = {"b", "bps", "b/s"}
_BYTE_UNITS = {"B", "Bps", "B/s"}
_BYTE_UNITS_ANY_CASE = {"byte", "bytes", "byte/s", "bytes/s"}
#: The written forms of a bandwidth, for error messages (the CLI's and the options').
BANDWIDTH_UNIT_FORMS = "'25Gbps', '400Gb/s', '10 Gbit/s' (bits) or '100GB/s', '12.5GBps' (bytes), prefix k, M, G or T"
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

    Args:
        value: Bytes/s as a number, or a string with a unit.
        name: What the value is, for the error message.

    Returns:
        Bytes per second.

    Example:
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

    if is_number(value):
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
        per_unit = 1.0 / BITS_PER_BYTE
    elif unit in _BYTE_UNITS or unit.lower() in _BYTE_UNITS_ANY_CASE:
        per_unit = 1.0
    else:
        raise fail()
    result = number * _PREFIXES[prefix.lower()] * per_unit
    if not math.isfinite(result) or result <= 0.0:
        raise fail()
    return result
