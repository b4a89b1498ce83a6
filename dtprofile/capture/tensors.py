"""The tensors inside a batch or a module's inputs and outputs, and their bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["iter_tensors", "sample_shapes", "tensor_bytes"]


def iter_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in a module's inputs or outputs: in tuples, lists, dicts (Hugging
    Face's ``ModelOutput`` is one) and dataclasses, four levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item, depth + 1)
    elif depth < 4 and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), depth + 1)


def sample_shapes(obj: Any) -> tuple[tuple[int, ...], ...]:
    """Each tensor's shape in ``obj`` less its first (batch) dimension: what differs between
    batches of variable-length sequences and not between a full batch and a ragged last one.

    >>> sample_shapes({"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.int64)]})
    ((8,), ())
    """
    return tuple(tuple(t.shape[1:]) for t in iter_tensors(obj))


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj``: a batch's, which a DataLoader worker copies into
    shared memory to hand it over (counted after a framework moved it to the device too,
    the same bytes).

    >>> tensor_bytes({"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.int64)], "id": "a"})
    160
    """
    return sum(t.nelement() * t.element_size() for t in iter_tensors(obj))
