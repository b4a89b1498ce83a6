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
backward callback).

HSDP (``fully_shard`` on a 2-D mesh) and FSDP's ``replicate`` add a third collective:
the **all-reduce across replicas** of each unit's reduced gradient shard (the whole
gradient when nothing is sharded). FSDP issues it with a plain ``dist.all_reduce`` on
the replicate group, not through a replaceable object, so while a profiler watches
such a model the name ``dist`` in FSDP's collectives module points at a proxy
(:class:`_ReplicaDist`) that times calls on the registered replicate groups and passes
everything else straight through.

>>> import dtprofile.fsdp as f
>>> f.is_fsdp(__import__("torch").nn.Linear(2, 2))
False
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .recorder import REPLICA_ALL_REDUCE

__all__ = ["is_fsdp", "fsdp_param_groups", "replicate_group", "instrument", "FSDPInstrumentation"]


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
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # torch before per-parameter meshes (pytorch#173509): one group or None
            single = getattr(state, "_fsdp_param_group", None)
            found = [single] if single is not None else []
        for group in found:
            if id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
    return groups


def replicate_group(group: Any) -> Any:
    """The process group a parameter group all-reduces across replicas in, else None.

    HSDP and FSDP's ``replicate`` describe their mesh with a ``DDPMeshInfo``; plain
    ``fully_shard`` has no replicas.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
    except Exception:  # a torch without this layout: nothing to time
        return None
    mesh_info = getattr(group, "mesh_info", None)
    return mesh_info.replicate_process_group if isinstance(mesh_info, DDPMeshInfo) else None


def _gathers(group: Any) -> bool:
    """True when the group's parameters are sharded over more than one rank.

    Unsharded (``replicate``, or a shard dimension of size 1), ``wait_for_unshard`` only
    copies the parameters locally: nothing to wait for on the wire.
    """
    mesh_info = getattr(group, "mesh_info", None)
    return getattr(mesh_info, "shard_mesh_size", 1) > 1


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _timed_call(engine: Any, kind: str, nbytes: int, call: Callable[[], Any],
                reduce: tuple | None = None) -> Any:
    """Run one collective with its start and end marked for ``engine``.

    ``engine.collective_start(kind, nbytes)`` returns an interval (or None while not
    profiling); the end is marked when the call returns if it ran synchronously, else in
    the returned work's future callback.
    """
    interval = engine.collective_start(kind, nbytes, reduce) if engine is not None else None
    try:
        work = call()
    except BaseException:
        if interval is not None:  # its end must come, or the step would wait for it forever
            engine.collective_end(interval, None, failed=True)
        raise
    if interval is not None:
        engine.collective_end(interval, work)
    return work


class _TimedComm:
    """Delegates to FSDP's comm object; marks each call's start and end."""

    kind = ""

    def __init__(self, inner: Any, engine: Any) -> None:
        self.inner = inner
        self.engine = engine

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def _timed(self, nbytes: int, call: Callable[[], Any], reduce: tuple | None = None) -> Any:
        return _timed_call(self.engine, self.kind, nbytes, call, reduce)


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


class _ReplicaDist:
    """``torch.distributed`` as FSDP's collectives module sees it, all-reduce timed.

    On the wire nothing changes: a call on a registered replicate group is the same
    ``all_reduce`` (in place, on the current stream: FSDP's all-reduce stream on GPUs),
    with its start and end marked. Calls on other groups and every other attribute go
    to ``torch.distributed`` itself.
    """

    def __init__(self, dist_module: Any) -> None:
        self._dist = dist_module
        self.engines: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op

        def call() -> Any:
            return self._dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

        entry = self.engines.get(id(group))
        if entry is None or entry[0] is not group:
            return call()
        # In place: the input's norm is taken before the call, the output's after. A
        # group of one rank (a 1 x N mesh) puts nothing on the wire.
        nbytes = _nbytes(tensor) if group.size() > 1 else 0
        return _timed_call(entry[1], REPLICA_ALL_REDUCE, nbytes, call, (tensor, tensor, op, group))


def _collectives_module() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def _time_replica_all_reduce(group: Any, engine: Any) -> None:
    """Route FSDP's all-reduces on ``group`` (a replicate group) to ``engine``."""
    module = _collectives_module()
    if not isinstance(module.dist, _ReplicaDist):
        module.dist = _ReplicaDist(module.dist)
    module.dist.engines[id(group)] = (group, engine)


def _untime_replica_all_reduce(group: Any, engine: Any) -> None:
    """Undo :func:`_time_replica_all_reduce`; the proxy goes once nothing is timed."""
    module = _collectives_module()
    proxy = module.dist
    if not isinstance(proxy, _ReplicaDist):
        return
    entry = proxy.engines.get(id(group))
    if entry is not None and entry[1] is engine:
        del proxy.engines[id(group)]
    if not proxy.engines:
        module.dist = proxy._dist


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
        self._replica_groups: list[Any] = []  # the process groups whose all-reduce is timed
        self._engine: Any = None

    @property
    def replicas(self) -> int:
        """How many ranks hold each gradient shard (1 without an all-reduce across replicas)."""
        return max([1] + [g.size() for g in self._replica_groups])

    def install(self, engine: Any) -> None:
        self._engine = engine
        for group in self.groups:
            replicas = replicate_group(group)
            if replicas is not None and all(replicas is not g for g in self._replica_groups):
                self._replica_groups.append(replicas)
                _time_replica_all_reduce(replicas, engine)
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
            if "wait_for_unshard" not in vars(group) and _gathers(group):
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
        for replicas in self._replica_groups:
            _untime_replica_all_reduce(replicas, self._engine)
        self._replica_groups.clear()


def unsupported_reason(groups: list[Any]) -> str | None:
    """Why these parameter groups cannot be timed (None: they can).

    Older FSDP2 (``torch.distributed._composable.fsdp``) called the collectives
    directly, with no comm object on the group to wrap.
    """
    for group in groups:
        missing = [a for a in ("_all_gather_comm", "_reduce_scatter_comm") if not hasattr(group, a)]
        if missing:
            return (f"this torch's FSDP2 ({torch.__version__}) has no {' / '.join(missing)} on its parameter "
                    "groups (FSDPModule.set_custom_all_gather came later): dtprofile cannot time its collectives")
    return None


def instrument(module: torch.nn.Module, engine: Any) -> FSDPInstrumentation:
    """Time every FSDP2 collective under ``module`` for ``engine``; returns the handle.

    Raises ``NotImplementedError`` (with :func:`unsupported_reason`) on an FSDP2 that
    has no comm objects to wrap; nothing is changed then.
    """
    groups = fsdp_param_groups(module)
    reason = unsupported_reason(groups)
    if reason is not None:
        raise NotImplementedError(reason)
    handle = FSDPInstrumentation(groups)
    handle.install(engine)
    return handle
