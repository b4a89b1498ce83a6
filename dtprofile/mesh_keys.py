"""A mesh's collectives in a rank's row: one definition of the flat keys, torch-free.

The collective timer (:mod:`dtprofile.capture.collectives`) counts per mesh dimension,
kind and phase; each rank's row (:func:`dtprofile.summary.rank_row`, gathered as a
fixed-length vector by :mod:`dtprofile.gather`) carries the per-step means under
:data:`COLL_KEYS`, which the summary's ``comm_by_dim``
(:mod:`dtprofile.analysis.mesh_comm`) reads back.

>>> coll_key("d0", "all_reduce", "forward", "count")
'coll_d0_all_reduce_forward_count'
>>> len(COLL_KEYS)
240
"""

from __future__ import annotations

__all__ = ["COLL_FIELDS", "COLL_KEYS", "KINDS", "MAX_MESH_SLOTS", "PHASES", "SLOTS", "coll_key"]

#: Kinds of collective, as the timer names them.
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Where a collective was launched: inside autograd's backward, the model's training
#: forward, or elsewhere (the update, evaluation).
PHASES: tuple[str, ...] = ("forward", "backward", "other")
#: Mesh dimensions with keys of their own in a rank's row; further dimensions and groups
#: outside the mesh share the slot "other" (the row is gathered: its length is fixed).
MAX_MESH_SLOTS = 3
SLOTS: tuple[str, ...] = (*(f"d{i}" for i in range(MAX_MESH_SLOTS)), "other")
#: Per (slot, kind, phase), the per-step means a rank's row carries.
COLL_FIELDS: tuple[str, ...] = ("count", "bytes", "total_ms", "waited_ms")


def coll_key(slot: str, kind: str, phase: str, field: str) -> str:
    """The row's key of one figure: ``coll_<slot>_<kind>_<phase>_<field>``."""
    return f"coll_{slot}_{kind}_{phase}_{field}"


#: Every per-dimension key of a rank's row (:data:`SLOTS` x kinds x phases x fields).
COLL_KEYS: tuple[str, ...] = tuple(
    coll_key(slot, kind, phase, field) for slot in SLOTS for kind in KINDS for phase in PHASES for field in COLL_FIELDS
)
