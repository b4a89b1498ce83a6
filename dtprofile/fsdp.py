"""Timing FSDP2 (``torch.distributed.fsdp.fully_shard``) communication.

A sharded model does not all-reduce gradient buckets. Each ``fully_shard`` unit
(an FSDP *parameter group*) puts two collectives on the wire per step:

- **all-gather** of its parameters before its forward (and again before its backward
  when ``reshard_after_forward`` freed them): every rank sends its shard and receives
  the full parameters (output bytes = the unit's padded parameter bytes);
- **reduce-scatter** of its gradients after its backward: every rank sends the full
  gradient and keeps the summed shard (input bytes = the unit's padded gradient bytes).

FSDP2 issues both through replaceable objects on each parameter group
(``set_custom_all_gather`` / ``set_custom_reduce_scatter`` are the public setters).
:func:`instrument` wraps whatever object is there with one that marks the collective's
start and end on the current stream (FSDP's all-gather or reduce-scatter stream on
GPUs) and delegates everything else, so the bytes on the wire and the buffers are
FSDP's own. It also wraps each group's ``wait_for_unshard``: that is where the compute
stream waits for the all-gather (and copies the gathered parameters out), so its span
on the compute timeline is communication the step could not hide.

What counts as exposed is therefore measured, not assumed: a collective that blocks the
host (gloo without ``async_op``, the CPU case) is exposed for all of its time; on GPUs
the compute stream's waits are, plus whatever communication runs past the end of
backward compute (the last reduce-scatters, which FSDP waits for in its final
backward callback). HSDP's extra all-reduce across replicas is not routed through these
objects and is not timed.

>>> import dtprofile.fsdp as f
>>> f.is_fsdp(__import__("torch").nn.Linear(2, 2))
False
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["is_fsdp", "fsdp_param_groups", "instrument", "FSDPInstrumentation"]


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # a torch without FSDP2
        return None
    return FSDPModule


def is_fsdp(module: Any) -> bool:
    """True when ``module`` or one of its submodules was given to ``fully_shard``."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(module, torch.nn.Module):
        return False
    return any(isinstance(m, cls) for m in module.modules())


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """Every FSDP2 parameter group under ``module``, each once, in module order."""
    cls = _fsdp_module_class()
    groups: list[Any] = []
    seen: set[int] = set()
    if cls is None:
        return groups
    for m in module.modules():
        if not isinstance(m, cls):
            continue
        state = m._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", ()):
            if id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
    return groups


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _TimedComm:
    """Delegates to FSDP's comm object; marks each call's start and end.

    ``engine.collective_start(kind, nbytes)`` returns an interval (or None while not
    profiling); the end is marked when the call returns if it ran synchronously, else in
    the returned work's future callback.
    """

    kind = ""

    def __init__(self, inner: Any, engine: Any) -> None:
        self.inner = inner
        self.engine = engine

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _timed(self, nbytes: int, call: Callable[[], Any], reduce: tuple | None = None) -> Any:
        engine = self.engine
        interval = engine.collective_start(self.kind, nbytes, reduce) if engine is not None else None
        try:
            work = call()
        except BaseException:
            if interval is not None:  # its end must come, or the step would wait for it forever
                engine.collective_end(interval, None, failed=True)
            raise
        if interval is not None:
            engine.collective_end(interval, work)
        return work


class TimedAllGather(_TimedComm):
    """FSDP's all-gather, timed: output bytes = the unit's full (padded) parameters."""

    kind = "all_gather"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        return self._timed(_nbytes(output_tensor),
                           lambda: self.inner(output_tensor, input_tensor, group, async_op))


class TimedReduceScatter(_TimedComm):
    """FSDP's reduce-scatter, timed: input bytes = the unit's full (padded) gradients.

    On sampled steps the engine also takes the squared norm of the input (this rank's
    gradient) and of the output (its shard of the reduced one): the gradient noise scale.
    """

    kind = "reduce_scatter"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Any:
        return self._timed(_nbytes(input_tensor),
                           lambda: self.inner(output_tensor, input_tensor, group, op, async_op),
                           (input_tensor, output_tensor, op, group))


def _timed_wait(original: Callable[[], Any], engine: Any) -> Callable[[], Any]:
    """``wait_for_unshard`` with its span marked on the compute stream."""

    @functools.wraps(original)
    def wait_for_unshard() -> Any:
        span = engine.wait_start()
        try:
            return original()
        finally:
            if span is not None:
                engine.wait_end(span)

    wait_for_unshard._dtprofile = True  # type: ignore[attr-defined]
    return wait_for_unshard


def _is_timed_wait(fn: Any) -> bool:
    """One of ours, left on a group by a profiler that never stopped."""
    return getattr(fn, "_dtprofile", False)


class FSDPInstrumentation:
    """What :func:`instrument` changed on the parameter groups; :meth:`remove` undoes it."""

    def __init__(self, groups: list[Any]) -> None:
        self.groups = groups
        self._restore: list[tuple[Any, str, Any]] = []

    def install(self, engine: Any) -> None:
        for group in self.groups:
            for attr, wrapper in (("_all_gather_comm", TimedAllGather),
                                  ("_reduce_scatter_comm", TimedReduceScatter)):
                inner = getattr(group, attr)
                if isinstance(inner, _TimedComm):  # left by a profiler that never stopped
                    inner = inner.inner
                self._restore.append((group, attr, inner))
                setattr(group, attr, wrapper(inner, engine))
            # An instance attribute shadows the method; removing it restores the method.
            if _is_timed_wait(vars(group).get("wait_for_unshard")):
                del group.wait_for_unshard
            if "wait_for_unshard" not in vars(group):
                group.wait_for_unshard = _timed_wait(group.wait_for_unshard, engine)
                self._restore.append((group, "wait_for_unshard", None))

    def remove(self) -> None:
        """Put FSDP's own comm objects and method back (safe to call twice)."""
        for group, attr, inner in reversed(self._restore):
            if inner is None:
                vars(group).pop(attr, None)
                continue
            current = getattr(group, attr, None)
            if isinstance(current, _TimedComm) and current.inner is inner:
                setattr(group, attr, inner)  # else the user set their own since: keep it
        self._restore.clear()


def instrument(module: torch.nn.Module, engine: Any) -> FSDPInstrumentation:
    """Time every FSDP2 collective under ``module`` for ``engine``; returns the handle."""
    handle = FSDPInstrumentation(fsdp_param_groups(module))
    handle.install(engine)
    return handle
