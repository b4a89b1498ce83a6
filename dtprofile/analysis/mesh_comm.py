"""The summary's communication per mesh dimension (``comm_by_dim``), from the ranks' rows.

Each rank's row carries its per-step means under the flat keys
:data:`dtprofile.mesh_keys.COLL_KEYS`; :func:`comm_by_dim` turns them into one
entry per mesh dimension: per kind of collective and per phase, the median over the
ranks of each figure (docs/summary.md).

>>> from dtprofile.mesh_keys import coll_key
>>> mesh = {"dims": [{"label": "tp", "size": 2, "role": "tp", "slot": "d0"}]}
>>> row = {coll_key("d0", "all_reduce", "forward", f): v
...        for f, v in (("count", 1.0), ("bytes", 4096.0), ("total_ms", 0.5), ("waited_ms", 0.25))}
>>> out = comm_by_dim([row, row], mesh)
>>> out["tp"]["total"]["count"], out["tp"]["kinds"]["all_reduce"]["phases"]["forward"]["waited_ms"]
(1.0, 0.25)
"""

from __future__ import annotations

from typing import Any

from .._values import finite, median
from ..mesh_keys import COLL_FIELDS, KINDS, PHASES, SLOTS, coll_key

__all__ = ["comm_by_dim"]


def _figures(rows: list[dict[str, Any]], slot: str, kinds: tuple[str, ...], phases: tuple[str, ...]) -> dict[str, Any]:
    """The medians over ``rows`` of each field summed over ``kinds`` x ``phases`` (each
    rank's sum first: the medians of parts do not add up)."""
    out: dict[str, Any] = {}
    for field in COLL_FIELDS:
        per_rank: list[float | None] = []
        for row in rows:
            values = [finite(row.get(coll_key(slot, k, p, field))) for k in kinds for p in phases]
            known = [v for v in values if v is not None]
            per_rank.append(sum(known) if known else None)
        out[field] = median(per_rank)
    return out


def _entry(rows: list[dict[str, Any]], slot: str, dim: dict[str, Any] | None) -> dict[str, Any] | None:
    """One dimension's entry (None: no collective on it)."""
    total = _figures(rows, slot, KINDS, PHASES)
    if not total["count"]:
        return None
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        figures = _figures(rows, slot, (kind,), PHASES)
        if not figures["count"]:
            continue
        phases = {}
        for phase in PHASES:
            part = _figures(rows, slot, (kind,), (phase,))
            if part["count"]:
                phases[phase] = part
        kinds[kind] = {**figures, "phases": phases}
    return {
        "size": dim.get("size") if dim else None,
        "role": dim.get("role") if dim else None,
        "total": total,
        "kinds": kinds,
    }


def comm_by_dim(rows: list[dict[str, Any]], mesh: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per mesh dimension (by its label; "other": groups outside the mesh's first
    dimensions), its collectives per step: ``{"size", "role", "total": {count, bytes,
    total_ms, waited_ms}, "kinds": {kind: {count, bytes, total_ms, waited_ms, "phases":
    {phase: {...}}}}}``, each figure the median over the ranks. None without a mesh, or
    when no rank counted a step.

    Args:
        rows: The ranks' rows (:func:`dtprofile.summary.rank_row`), with :data:`~dtprofile.mesh_keys.COLL_KEYS`.
        mesh: The summary's ``mesh`` (:meth:`dtprofile.capture.mesh_comm.MeshComm.mesh_dict`).

    Returns:
        The summary's ``comm_by_dim``.
    """
    if not mesh or not rows:
        return None
    by_slot = {d.get("slot"): d for d in mesh.get("dims") or [] if isinstance(d, dict)}
    out: dict[str, Any] = {}
    for slot in SLOTS:
        if not any(row.get(coll_key(slot, KINDS[0], PHASES[0], "count")) is not None for row in rows):
            continue  # (no rank measured: the keys are None)
        dim = by_slot.get(slot)
        entry = _entry(rows, slot, dim)
        if entry is not None:
            out[str(dim.get("label")) if dim else "other"] = entry
    return out if out or any(_counted(row) for row in rows) else None


def _counted(row: dict[str, Any]) -> bool:
    return row.get(coll_key(SLOTS[0], KINDS[0], PHASES[0], "count")) is not None
