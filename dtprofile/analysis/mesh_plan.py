"""A DeviceMesh job seen as the seed sees a job: data-parallel replicas of a model that
tensor parallelism spreads over a few devices each.

The seed's G is the number of replicas: T_C, T_O and R_O keep their meaning per replica,
and the projection grows the data-parallel dimension with the tensor-parallel degree
fixed. A tensor-parallel group's communication (its activations' all-reduces, all-gathers
and reduce-scatters, inside forward and backward) is a cost of every step that more
replicas do not change; it grows with the per-replica batch, as the activations do.

:func:`mesh_shape` reads the mesh from the summary (``mesh``, ``comm_by_dim``, both
framework-free); :func:`replica_view` is the summary as one replica's figures, the
projection's input; :func:`tp_what_if` changes the tensor-parallel degree.

Example:
    >>> s = {"world_size": 8, "mesh": {"dims": [{"label": "dp", "size": 4, "role": "fsdp"},
    ...                                         {"label": "tp", "size": 2, "role": "tp"}]},
    ...      "comm_by_dim": {"tp": {"role": "tp", "total": {"waited_ms": 3.0, "total_ms": 5.0,
    ...                                                    "bytes": 4096, "count": 2}}}}
    >>> shape = mesh_shape(s)
    >>> shape.replicas, shape.tp, shape.tp_comm_waited_ms, shape.crosses_nodes(tp=2, gpus_per_node=8)
    (4, 2, 3.0, False)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from .._values import finite, get
from .checks import check_gpus

__all__ = [
    "DATA_ROLES",
    "TP_ROLES",
    "MeshShape",
    "mesh_shape",
    "parse_mesh",
    "replica_view",
    "ring_share",
    "tp_what_if",
]

#: Mesh roles whose dimension holds replicas of the model (its data-parallel degree).
DATA_ROLES = ("dp", "fsdp", "replicate", "shard")
#: Mesh roles that split each replica's layers over devices.
TP_ROLES = ("tp",)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A mesh job's degrees and its per-step communication per kind of dimension.

    Attributes:
        world: The ranks.
        tp: The tensor-parallel degree (the product of the ``tp`` dimensions' sizes).
        replicas: ``world / tp``: the data-parallel replicas, the seed's G.
        tp_stride: The rank distance between neighbours of a tensor-parallel group (the
            product of the sizes of the dimensions after it: 1 when it is innermost).
        tp_labels: The tensor-parallel dimensions' names.
        tp_comm_waited_ms: What each step waited for the tensor-parallel collectives.
        tp_comm_total_ms: Their launch to the end of their wait, per step.
        tp_comm_bytes: Their bytes per step.
        tp_kinds: The kinds of collective they were (all-reduce only: no sequence parallel).
        pp: A pipeline's stage count (1: none): each replica's layers spread over ``pp``
            ranks as well (:mod:`dtprofile.analysis.pipeline_plan`).
        pp_wait_ms: What each step waited for its pipeline neighbours (the bubble and the
            transfers): like the tensor-parallel waits, a cost more replicas do not shrink.
        dp_comm_waited_ms: What each step waited for the data-parallel dimensions' collectives
            (FSDP2's all-gathers and reduce-scatters); None when none were timed there.
        dp_comm_total_ms: Those collectives' time per step.
        dp_comm_bytes: Their bytes per step.
    """

    world: int
    tp: int
    replicas: int
    tp_stride: int = 1
    tp_labels: tuple[str, ...] = ()
    tp_comm_waited_ms: float = 0.0
    tp_comm_total_ms: float = 0.0
    tp_comm_bytes: float = 0.0
    tp_kinds: tuple[str, ...] = ()
    dp_comm_waited_ms: float | None = None
    dp_comm_total_ms: float | None = None
    dp_comm_bytes: float | None = None
    pp: int = 1
    pp_wait_ms: float = 0.0

    @property
    def per_replica(self) -> int:
        """The GPUs each replica takes: the tensor-parallel degree times the pipeline's stages."""
        return self.tp * self.pp

    def crosses_nodes(self, tp: int | None = None, gpus_per_node: int | None = None) -> bool:
        """Whether a tensor-parallel group of ``tp`` devices (default: the run's) spans
        more than one node of ``gpus_per_node`` (False when that is unknown)."""
        degree = self.tp if tp is None else tp
        if not gpus_per_node or degree <= 1:
            return False
        return (degree - 1) * self.tp_stride + 1 > gpus_per_node


def _entries(summary: Mapping[str, Any], roles: tuple[str, ...]) -> list[Mapping[str, Any]]:
    by_dim = get(summary, "comm_by_dim")
    if not isinstance(by_dim, Mapping):
        return []
    return [e for e in by_dim.values() if isinstance(e, Mapping) and e.get("role") in roles]


def _sum(entries: list[Mapping[str, Any]], field: str) -> float | None:
    values = [finite(get(get(e, "total"), field)) for e in entries]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def mesh_shape(summary: Mapping[str, Any]) -> MeshShape | None:
    """The run's mesh as degrees and per-step communication; None for a run without a
    tensor-parallel dimension of 2 or more and without a pipeline of 2 or more stages (its
    G is its world size, as always).

    Args:
        summary: A run summary with ``mesh`` (and ``comm_by_dim`` where timed).

    Returns:
        The shape, or None.
    """
    dims = get(get(summary, "mesh"), "dims")
    dims = dims if isinstance(dims, list) else []
    sizes = [int(finite(get(d, "size")) or 1) for d in dims]
    roles = [get(d, "role") for d in dims]
    tp_at = [i for i, role in enumerate(roles) if role in TP_ROLES]
    tp = math.prod(sizes[i] for i in tp_at)
    pipe = get(summary, "pipeline")
    # The ranks a replica's pipeline takes: its group (an interleaved schedule holds several
    # stages a rank), else its stages.
    pp = int(finite(get(pipe, "group_size")) or finite(get(pipe, "stages")) or 1)
    if tp * pp < 2:
        return None
    world = int(finite(get(summary, "world_size")) or math.prod(sizes))
    stride = math.prod(sizes[max(tp_at) + 1 :]) if tp_at else 1
    tp_entries, dp_entries = _entries(summary, TP_ROLES), _entries(summary, DATA_ROLES)
    kinds = sorted({k for e in tp_entries for k in (get(e, "kinds") or {})})
    tp_waited = _sum(tp_entries, "waited_ms") or 0.0
    exposed = finite(get(get(summary, "per_step_ms"), "comm_exposed")) or 0.0
    return MeshShape(
        world=world,
        tp=tp,
        replicas=max(1, world // (tp * pp)),
        tp_stride=stride,
        tp_labels=tuple(str(get(dims[i], "label") or get(dims[i], "name")) for i in tp_at),
        tp_comm_waited_ms=tp_waited,
        tp_comm_total_ms=_sum(tp_entries, "total_ms") or 0.0,
        tp_comm_bytes=_sum(tp_entries, "bytes") or 0.0,
        tp_kinds=tuple(kinds),
        dp_comm_waited_ms=_sum(dp_entries, "waited_ms"),
        dp_comm_total_ms=_sum(dp_entries, "total_ms"),
        dp_comm_bytes=_sum(dp_entries, "bytes"),
        pp=pp,
        pp_wait_ms=_pipeline_wait_ms(pipe, exposed, tp_waited, _sum(dp_entries, "waited_ms")) if pp > 1 else 0.0,
    )


def _pipeline_wait_ms(pipe: Any, exposed: float, tp_waited: float, dp_waited: float | None) -> float:
    """What a step waited for its pipeline neighbours: as the schedule's waits were timed
    (``pipeline.wait_ms``), else the exposed communication the mesh's dimensions leave."""
    timed = finite(get(pipe, "wait_ms"))
    if timed is not None:
        return min(timed, exposed) if exposed else timed
    return max(0.0, exposed - tp_waited - (dp_waited or 0.0))


def ring_share(degree: float) -> float:
    """A ring collective's traffic per device over the buffer, 2 (n - 1) / n (0 for n = 1)."""
    return 0.0 if degree <= 1 else 2.0 * (degree - 1.0) / degree


def _dp_bytes(summary: Mapping[str, Any]) -> float | None:
    """Bytes each rank reduces per step across replicas, as an all-reduce: DDP's gradients
    or FSDP's collectives' all-reduce equivalent (``grad_bytes``), else the rank's own
    trainable parameters (a tensor-parallel shard's gradients, were replicas added)."""
    for value in (get(summary, "grad_bytes"), get(get(summary, "run"), "local_trainable_param_bytes")):
        number = finite(value)
        if number is not None and number > 0:
            return number
    return None


def replica_view(summary: Mapping[str, Any], shape: MeshShape) -> dict[str, Any]:
    """The summary as the projection reads a data-parallel job's: ``world_size`` the
    replicas, ``grad_bytes`` what crosses replicas, and ``comm_total`` / ``comm_exposed``
    the data-parallel dimensions' alone (the tensor-parallel waits are the step's
    ``mesh_tp_comm_ms``, apart).

    Args:
        summary: A run summary with a mesh (:func:`mesh_shape` not None).
        shape: Its shape.

    Returns:
        A shallow copy with those keys replaced.
    """
    per_step = dict(get(summary, "per_step_ms") or {})
    if shape.dp_comm_total_ms is not None:
        per_step["comm_total"] = shape.dp_comm_total_ms
        per_step["comm_exposed"] = shape.dp_comm_waited_ms
    else:
        # No collective timed across replicas (DDP's, if any, stays in the summary's own
        # figures less the tensor-parallel waits).
        exposed = finite(per_step.get("comm_exposed"))
        total = finite(per_step.get("comm_total"))
        waited = shape.tp_comm_waited_ms + shape.pp_wait_ms
        per_step["comm_exposed"] = None if exposed is None else max(0.0, exposed - waited)
        per_step["comm_total"] = None if total is None else max(0.0, total - shape.tp_comm_total_ms - shape.pp_wait_ms)
    nbytes = _dp_bytes(summary)
    view = dict(summary)
    view.update(world_size=shape.replicas, grad_bytes=nbytes, per_step_ms=per_step, mesh=None)
    # The bandwidth across replicas: their own collectives' (the summary's came from every
    # collective of the step, the tensor-parallel ones among them); none without them.
    total = finite(per_step.get("comm_total"))
    algbw = nbytes / (total / 1e3) / 1e9 if nbytes and total and shape.replicas > 1 else None
    view.update(
        algbw_GBps=algbw,
        busbw_GBps=None if algbw is None else algbw * ring_share(shape.replicas),
    )
    return view


def tp_what_if(shape: MeshShape, tp: int, tp_link_factor: float = 1.0) -> tuple[float, float]:
    """(compute factor, tensor-parallel communication factor) at another degree ``tp``: each
    device's share of the layers' work is ``shape.tp / tp`` of the run's; the activations'
    ring collectives move ``ring_share(tp) / ring_share(shape.tp)`` of the run's bytes per
    device, over a link ``tp_link_factor`` times slower (a group across nodes).

    Example:
        >>> shape = MeshShape(world=8, tp=2, replicas=4)
        >>> tp_what_if(shape, 4)
        (0.5, 1.5)
        >>> tp_what_if(shape, 1)
        (2.0, 0.0)
    """
    check_gpus(tp, "tp")
    compute = shape.tp / tp
    base = ring_share(shape.tp)
    comm = (ring_share(tp) / base if base else 0.0) * tp_link_factor
    return compute, comm


_MESH_ITEM = re.compile(r"^\s*([a-z_]+)\s*=\s*(\d+)\s*$")


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=8,tp=4"`` -> ``{"dp": 8, "tp": 4}``: the what-if mesh of ``dtprofile project
    --mesh``, by role (``dp`` for every data-parallel dimension together, ``tp``).

    Raises:
        ValueError: One line naming ``--mesh`` and the accepted form.

    Example:
        >>> parse_mesh("dp=8, tp=4")
        {'dp': 8, 'tp': 4}
    """
    out: dict[str, int] = {}
    for item in str(text).split(","):
        match = _MESH_ITEM.match(item)
        if not match or match.group(1) not in ("dp", "tp") or int(match.group(2)) < 1 or match.group(1) in out:
            raise ValueError(
                f"--mesh must be dp=N,tp=M (each once, integers >= 1; either may be left out), got {text!r}"
            )
        out[match.group(1)] = int(match.group(2))
    return out
