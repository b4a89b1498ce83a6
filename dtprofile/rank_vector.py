"""What each rank sends the gather: its row of figures as one fixed-length vector, and that
vector on the wire.

:data:`VECTOR_KEYS` names the entries (:data:`STEP_KEYS`, the rank's step figures; its NVML
figures; a sharded model's gradient-noise samples); :func:`pack` and :func:`unpack` turn a
row into a vector and back (None as NaN). On the wire (:func:`_encode`) a vector is
sparse: most entries are NaN (the mesh's collectives without a DeviceMesh, the probes
between probe steps), and only those present travel. :mod:`dtprofile.gather` moves the
bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .analysis.uncertainty import BLOCK_KEYS, PROBE_KEYS
from .capture.windows import FIELDS
from .mesh_keys import COLL_KEYS
from .noise import SHARD_SAMPLE_KEYS
from .nvml import RANK_KEYS

__all__ = ["STEP_KEYS", "VECTOR_KEYS", "pack", "shard_samples_of", "unpack"]

# A vector on the wire: its length (uint32), a bitmask of the entries present (not NaN;
# bit i of byte i // 8), then the present entries' float64. Most of a vector is NaN (the
# mesh's collectives without a DeviceMesh, the probes between probe steps): 384 float64
# are 3,072 bytes dense, a plain DDP rank's 285 (29 entries present). Each blob says its own
# size, so the ``all`` key (the blobs one after another) needs no separate length prefix.
_HEADER = struct.Struct("<I")


def _encode(values: Sequence[float]) -> bytes:
    """One vector, sparse: its length, the bitmask of its non-NaN entries, their float64.

    Example:
        >>> blob = _encode([1.0, float("nan"), 3.0])
        >>> len(blob), _decode(blob, 1)
        (21, [[1.0, nan, 3.0]])
    """
    dense = np.asarray(values, dtype=np.float64)
    present = ~np.isnan(dense)
    mask = np.packbits(present, bitorder="little")
    return _HEADER.pack(dense.size) + mask.tobytes() + dense[present].tobytes()


def _decode_one(blob: bytes, offset: int = 0) -> tuple[list[float], int]:
    """The vector encoded at ``offset`` of ``blob``, and the offset just past it."""
    (size,) = _HEADER.unpack_from(blob, offset)
    start = offset + _HEADER.size
    mask_end = start + (size + 7) // 8
    present = np.unpackbits(np.frombuffer(blob, np.uint8, mask_end - start, start), count=size, bitorder="little")
    present = present.astype(bool)
    end = mask_end + 8 * int(present.sum())
    if end > len(blob):
        raise ValueError("a gathered vector is cut short")
    dense = np.full(size, np.nan)
    dense[present] = np.frombuffer(blob, np.float64, (end - mask_end) // 8, mask_end)
    return dense.tolist(), end


def _decode(blob: bytes, count: int) -> list[list[float]]:
    """``count`` vectors of one length from their blobs one after another (:func:`_encode`)."""
    blob = bytes(blob)
    vectors: list[list[float]] = []
    offset = 0
    try:
        while offset < len(blob) and len(vectors) < count:
            vector, offset = _decode_one(blob, offset)
            vectors.append(vector)
    except (struct.error, ValueError):
        pass  # (reported below: what was read does not add up)
    if count <= 0 or len(vectors) != count or offset != len(blob) or len({len(v) for v in vectors}) != 1:
        raise ValueError(
            f"{len(blob)} bytes do not split into {count} vectors of one length (dtprofile versions differ?)"
        )
    return vectors


#: A rank's step figures, in the order its gathered vector carries them.
STEP_KEYS: tuple[str, ...] = (
    "rank",
    "steps",
    *FIELDS,
    "probe_steps",
    "probe_step",
    "probe_compute",
    "probe_comm",
    "step_all",
    "comm_timed_steps",
    "probe_passes",
    "probe_forward",
    "probe_backward",
    "probe_optimizer",
    "alone_steps",
    "alone_passes",
    "backward_timed_steps",
    "pipeline_stage",
    "pipeline_wait",
    *BLOCK_KEYS,
    *PROBE_KEYS,
    *COLL_KEYS,
)
#: The whole vector: the step figures, the rank's NVML figures
#: (:data:`dtprofile.nvml.RANK_KEYS`), and a sharded model's last gradient-noise samples.
VECTOR_KEYS: tuple[str, ...] = STEP_KEYS + tuple("telemetry_" + k for k in RANK_KEYS) + SHARD_SAMPLE_KEYS
_SHARD_OFFSET = len(VECTOR_KEYS) - len(SHARD_SAMPLE_KEYS)


def pack(row: dict[str, Any], telemetry: list[float], shard_samples: list[float]) -> list[float]:
    """One rank's vector: its row of step figures (None as NaN), telemetry and samples."""
    return (
        [float("nan") if row[k] is None else float(row[k]) for k in STEP_KEYS] + list(telemetry) + list(shard_samples)
    )


def unpack(vectors: list[list[float]]) -> list[dict[str, Any]]:
    """Each rank's row (NaN back to None) from the gathered vectors."""
    rows = []
    for vec in vectors:
        row: dict[str, Any] = {k: (None if math.isnan(v) else v) for k, v in zip(VECTOR_KEYS, vec, strict=False)}
        row["rank"] = int(row["rank"])
        row["steps"] = int(row["steps"] or 0)
        rows.append(row)
    return rows


def shard_samples_of(vectors: list[list[float]] | None) -> list[list[float]] | None:
    """Each rank's gradient-noise samples from the gathered vectors."""
    return None if vectors is None else [vec[_SHARD_OFFSET:] for vec in vectors]
