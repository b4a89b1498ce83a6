"""The DeviceMesh a model's DTensor parameters live on: its dimensions and their roles.

:func:`find_mesh` reads a model's DTensor parameters (``parallelize_module``'s and
FSDP2's) and tells, for each dimension of their mesh, which parallelism uses it: "tp"
(parameters sharded by tensor parallelism), "fsdp" (FSDP2 shards on it), "dp"
(parameters replicated on it: data parallel, HSDP's replicas), or "unknown". The
collective timer (:mod:`.collectives`) labels each collective with the dimension whose
process group it runs on.

>>> from dtprofile.capture.mesh import find_mesh
>>> find_mesh(__import__("torch").nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

__all__ = ["MeshDim", "MeshInfo", "find_mesh", "group_name"]


@dataclasses.dataclass
class MeshDim:
    """One dimension of the mesh, from this rank's side.

    ``role``: "tp" (parameters sharded on it by tensor parallelism: ``Shard`` placements
    not FSDP's), "fsdp" (FSDP2 shards its parameters on it), "dp" (parameters replicated
    on it: data parallel, HSDP's replicas), or "unknown" (no parameter placed on it).
    """

    index: int
    name: str | None
    size: int
    role: str
    group_name: str
    ranks: list[int]
    group: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """The dimension's name, else ``dim<index>``."""
        return self.name if self.name else f"dim{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "label": self.label,
            "size": self.size,
            "role": self.role,
            "group_name": self.group_name,
            "ranks": list(self.ranks),
        }


@dataclasses.dataclass
class MeshInfo:
    """The DeviceMesh a model's DTensor parameters live on (:func:`find_mesh`).

    ``dims`` follow the root mesh's dimensions; a dimension some parameters live on that
    is not one of the root's (a flattened one) comes after them. ``fsdp``: some module is
    FSDP2's; ``parameters``: how many DTensor parameters were read.
    """

    device_type: str
    shape: list[int]
    dim_names: list[str] | None
    dims: list[MeshDim]
    parameters: int
    fsdp: bool
    mesh: Any = dataclasses.field(default=None, repr=False, compare=False)
    model_ref: Any = dataclasses.field(default=None, repr=False, compare=False)

    def dim(self, key: int | str) -> MeshDim | None:
        """A dimension by index or name (None: not one of these)."""
        for d in self.dims:
            if d.index == key or d.name == key or d.label == key:
                return d
        return None

    @property
    def roles(self) -> dict[str, str]:
        """Each dimension's label -> role."""
        return {d.label: d.role for d in self.dims}

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "shape": list(self.shape),
            "dim_names": list(self.dim_names) if self.dim_names is not None else None,
            "dims": [d.to_dict() for d in self.dims],
            "parameters": self.parameters,
            "fsdp": self.fsdp,
        }


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch without DTensor
        return None
    return DTensor


def group_name(group: Any) -> str:
    """A process group's name ("" when it has none)."""
    return str(getattr(group, "group_name", "") or "")


def _fsdp_groups(model: torch.nn.Module) -> tuple[bool, set[str], set[str]]:
    """Whether ``model`` holds FSDP2 modules; the names of the groups they shard over and
    of those they replicate over (HSDP)."""
    from .fsdp import fsdp_param_groups

    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:
        return False, set(), set()
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    shard: set[str] = set()
    replicate: set[str] = set()
    if not fsdp:
        return False, shard, replicate
    for group in fsdp_param_groups(model):
        info = getattr(group, "mesh_info", None)
        for attr, names in (("shard_process_group", shard), ("replicate_process_group", replicate)):
            pg = getattr(info, attr, None)
            if pg is not None:
                names.add(group_name(pg))
    return True, shard, replicate


def find_mesh(model: Any) -> MeshInfo | None:
    """The DeviceMesh of ``model``'s DTensor parameters, its dimensions and their roles;
    None when no parameter is a DTensor (a plain, DDP or FSDP1 model) or torch has no
    DTensor.

    A dimension is "fsdp" where FSDP2 shards (its parameter groups' shard process group),
    "dp" where HSDP replicates or every parameter is ``Replicate``, "tp" where some
    parameter is sharded otherwise (``parallelize_module``'s ``Shard`` placements).
    """
    DTensor = _dtensor_class()
    if DTensor is None or not isinstance(model, torch.nn.Module):
        return None
    params: list[Any] = [p for p in model.parameters() if isinstance(p, DTensor)]  # (DTensor parameters)
    if not params:
        return None
    from torch.distributed.tensor import Replicate, Shard

    fsdp, fsdp_shard, fsdp_replicate = _fsdp_groups(model)
    first = params[0].device_mesh
    get_root = getattr(first, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else first
    dims: list[MeshDim] = []
    by_name: dict[str, MeshDim] = {}

    def add(mesh: Any, i: int) -> MeshDim:
        group = mesh.get_group(i)
        name = group_name(group)
        if name in by_name:
            return by_name[name]
        names = mesh.mesh_dim_names
        try:
            ranks = sorted(int(r) for r in torch.distributed.get_process_group_ranks(group))
        except Exception:
            ranks = []
        dim = MeshDim(
            index=len(dims),
            name=names[i] if names else None,
            size=int(mesh.size(i)),
            role="unknown",
            group_name=name,
            ranks=ranks,
            group=group,
        )
        dims.append(dim)
        by_name[name] = dim
        return dim

    for i in range(root.ndim):
        add(root, i)
    sharded: set[str] = set()
    replicated: set[str] = set()
    for p in params:
        mesh = p.device_mesh
        for i, placement in enumerate(p.placements):
            dim = add(mesh, i)
            if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
                if dim.group_name not in fsdp_shard:
                    sharded.add(dim.group_name)
            elif isinstance(placement, Replicate):
                replicated.add(dim.group_name)
    for dim in dims:
        if dim.group_name in fsdp_shard:
            dim.role = "fsdp"
        elif dim.group_name in sharded:
            dim.role = "tp"
        elif dim.group_name in fsdp_replicate or dim.group_name in replicated:
            dim.role = "dp"
    names = root.mesh_dim_names
    return MeshInfo(
        device_type=str(root.device_type),
        shape=[int(s) for s in root.shape],
        dim_names=list(names) if names else None,
        dims=dims,
        parameters=len(params),
        fsdp=fsdp,
        mesh=root,
        model_ref=weakref.ref(model),
    )
