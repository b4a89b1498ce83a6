"""Timing FSDP communication: FSDP2 (``fully_shard``), HSDP and FSDP1.

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
(:class:`_TimedDist`) that times calls on the registered replicate groups and passes
everything else straight through.

FSDP1 (``FullyShardedDataParallel``) issues all of its collectives that way: the
all-gather in ``torch.distributed.fsdp._flat_param``, the reduce-scatter (and the
all-reduce of ``NO_SHARD`` and ``HYBRID_SHARD``) in ``_runtime_utils``. The same proxy,
put in those two modules for the instances' process groups, times them. Its waits for
a gather on GPUs are stream waits with nothing to wrap: there only the tail after
backward compute counts as exposed.

>>> import dtprofile.capture.fsdp as f
>>> f.is_fsdp(__import__("torch").nn.Linear(2, 2))
False
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

from .records import REPLICA_ALL_REDUCE

__all__ = ["is_fsdp", "fsdp_param_groups", "replicate_group", "instrument", "FSDPInstrumentation"]


def _fsdp_module_class() -> type[FSDPModule] | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # a torch without FSDP2
        return None
    return FSDPModule


def is_fsdp(module: Any) -> bool:
    """True when ``module`` or one of its submodules was given to ``fully_shard`` or
    wrapped in FSDP1's ``FullyShardedDataParallel``."""
    cls = _fsdp_module_class()
    if not isinstance(module, torch.nn.Module):
        return False
    return any((cls is not None and isinstance(m, cls)) or _is_fsdp1(m) for m in module.modules())


def _is_fsdp1(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # a torch without FSDP
        return False
    return isinstance(module, FullyShardedDataParallel)


def fsdp1_states(module: torch.nn.Module) -> list[Any]:
    """Every FSDP1 (``FullyShardedDataParallel``) instance under ``module`` that holds
    parameters (a flat parameter), in module order."""
    return [m for m in module.modules() if _is_fsdp1(m) and getattr(m, "_handle", None) is not None]


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


def _timed_call(
    recorder: Any, kind: str, nbytes: int, call: Callable[[], Any], reduce: tuple[Any, ...] | None = None
) -> Any:
    """Run one collective with its start and end marked for ``recorder``.

    ``recorder.collective_start(kind, nbytes)`` returns an interval (or None while not
    profiling); the end is marked when the call returns if it ran synchronously, else in
    the returned work's future callback.
    """
    interval = recorder.collective_start(kind, nbytes, reduce) if recorder is not None else None
    try:
        work = call()
    except BaseException:
        if interval is not None:  # its end must come, or the step would wait for it forever
            recorder.collective_end(interval, None, failed=True)
        raise
    if interval is not None:
        recorder.collective_end(interval, work)
    return work


class _TimedComm:
    """Delegates to FSDP's comm object; marks each call's start and end."""

    kind = ""

    def __init__(self, inner: Any, recorder: Any) -> None:
        self.inner = inner
        self.recorder = recorder

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(size, dtype=dtype, device=device)
        return tensor

    def _timed(self, nbytes: int, call: Callable[[], Any], reduce: tuple[Any, ...] | None = None) -> Any:
        return _timed_call(self.recorder, self.kind, nbytes, call, reduce)


class TimedAllGather(_TimedComm):
    """FSDP's all-gather, timed: output bytes = the unit's full (padded) parameters."""

    kind = "all_gather"

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return self._timed(_nbytes(output_tensor), lambda: self.inner(output_tensor, input_tensor, group, async_op))


class TimedReduceScatter(_TimedComm):
    """FSDP's reduce-scatter, timed: input bytes = the unit's full (padded) gradients.

    On sampled steps the recorder also takes the squared norm of the input (this rank's
    gradient) and of the output (its shard of the reduced one): the gradient noise scale.
    """

    kind = "reduce_scatter"

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        return self._timed(
            _nbytes(input_tensor),
            lambda: self.inner(output_tensor, input_tensor, group, op, async_op),
            (input_tensor, output_tensor, op, group),
        )


def _group_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``group`` of a ``torch.distributed`` collective call (third positional)."""
    return kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)


def _wire_bytes(nbytes: int, group: Any) -> int:
    """A group of one rank (a 1 x N mesh) puts nothing on the wire."""
    return nbytes if group is None or group.size() > 1 else 0


def _all_reduce_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """An in-place all-reduce's ``(input, output, op, group)`` for the noise sample."""
    tensor = args[0] if args else kwargs["tensor"]
    op = kwargs["op"] if "op" in kwargs else (args[1] if len(args) > 1 else None)
    return tensor, tensor, op, _group_arg(args, kwargs)


# For each proxied function: the kind, its bytes from (args, kwargs), and what it hands
# the noise sample (None: no sample). The bytes are the full tensor's: an all-gather's
# output, a reduce-scatter's input, an all-reduce's buffer.
def _first_nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    first = args[0] if args else next(iter(kwargs.values()))
    return sum(_nbytes(t) for t in first) if isinstance(first, (list, tuple)) else _nbytes(first)


def _second_nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return _nbytes(args[1] if len(args) > 1 else kwargs["input"])


FSDP2_COLLECTIVES = {"all_reduce": (REPLICA_ALL_REDUCE, _first_nbytes, _all_reduce_sample)}
FSDP1_GATHERS = {
    "all_gather": ("all_gather", _first_nbytes, None),
    "all_gather_into_tensor": ("all_gather", _first_nbytes, None),
}
FSDP1_REDUCTIONS = {
    "reduce_scatter_single": ("reduce_scatter", _second_nbytes, None),
    "reduce_scatter_tensor": ("reduce_scatter", _second_nbytes, None),
    "all_reduce": (REPLICA_ALL_REDUCE, _first_nbytes, None),
}


class _TimedDist:
    """``torch.distributed`` as one FSDP module sees it, some collectives timed.

    FSDP issues some collectives with plain ``dist.*`` calls, not through replaceable
    objects: HSDP's all-reduce across replicas (FSDP2), and every collective of FSDP1.
    While a profiler watches such a model, the name ``dist`` in that FSDP module points
    here. On the wire nothing changes: a call of a function in ``functions`` on a
    registered process group is the same call, with its start and end marked on the
    current stream (FSDP's communication stream on GPUs). Calls on other groups and
    every other attribute go to ``torch.distributed`` itself.
    """

    def __init__(self, dist_module: Any, functions: dict[str, tuple[Any, ...]]) -> None:
        self._dist = dist_module
        self._functions = functions
        self.recorders: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, recorder)

    def __getattr__(self, name: str) -> Any:
        original = getattr(self._dist, name)
        spec = self._functions.get(name)
        if spec is None:
            return original
        kind, size, sample = spec

        def timed(*args: Any, **kwargs: Any) -> Any:
            group = _group_arg(args, kwargs)
            entry = self.recorders.get(id(group))
            if entry is None or entry[0] is not group:
                return original(*args, **kwargs)
            # In place: an input's norm is taken before the call, the output's after.
            return _timed_call(
                entry[1],
                kind,
                _wire_bytes(size(args, kwargs), group),
                lambda: original(*args, **kwargs),
                sample(args, kwargs) if sample is not None else None,
            )

        return timed


def _collectives_module() -> Any:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def _fsdp1_modules() -> tuple[Any, Any]:
    """FSDP1's modules that call the collectives: the all-gather's, the reductions'."""
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    return _flat_param, _runtime_utils


def _fsdp1_replicates(state: Any) -> bool:
    """NO_SHARD: every rank holds the whole model and all-reduces the gradients."""
    from torch.distributed.fsdp import ShardingStrategy

    return getattr(state, "sharding_strategy", None) == ShardingStrategy.NO_SHARD


def _time_collectives(module: Any, functions: dict[str, tuple[Any, ...]], group: Any, recorder: Any) -> None:
    """Route ``module``'s ``dist.<functions>`` calls on ``group`` to ``recorder``."""
    if not isinstance(module.dist, _TimedDist):
        module.dist = _TimedDist(module.dist, functions)
    module.dist.recorders[id(group)] = (group, recorder)


def _untime_collectives(module: Any, group: Any, recorder: Any) -> None:
    """Undo :func:`_time_collectives`; the proxy goes once nothing is timed."""
    proxy = module.dist
    if not isinstance(proxy, _TimedDist):
        return
    entry = proxy.recorders.get(id(group))
    if entry is not None and entry[1] is recorder:
        del proxy.recorders[id(group)]
    if not proxy.recorders:
        module.dist = proxy._dist


def _timed_wait(original: Callable[[], Any], recorder: Any) -> Callable[[], Any]:
    """``wait_for_unshard`` with its span marked on the compute stream."""

    @functools.wraps(original)
    def wait_for_unshard() -> Any:
        span = recorder.wait_start()
        try:
            return original()
        finally:
            if span is not None:
                recorder.wait_end(span)

    wait_for_unshard._dtprofile = True  # type: ignore[attr-defined]
    return wait_for_unshard


def _is_timed_wait(fn: Any) -> bool:
    """One of ours, left on a group by a profiler that never stopped."""
    return getattr(fn, "_dtprofile", False)


class FSDPInstrumentation:
    """What :func:`instrument` changed on the parameter groups; :meth:`remove` undoes it."""

    def __init__(self, groups: list[Any], fsdp1_states: list[Any] | None = None) -> None:
        self.groups = groups
        self.fsdp1_states = fsdp1_states or []
        self._restore: list[tuple[Any, str, Any]] = []
        self._proxied: list[tuple[Any, Any]] = []  # (FSDP module, process group) timed by a _TimedDist
        self._engine: Any = None
        self.replicas = 1  # how many ranks hold each gradient shard

    @property
    def api(self) -> str:
        """Which FSDP the model uses: "FSDP2" (``fully_shard``) or "FSDP1"."""
        return "FSDP1" if self.fsdp1_states and not self.groups else "FSDP2"

    @property
    def units(self) -> int:
        """FSDP units: FSDP2 parameter groups and FSDP1 instances with parameters."""
        return len(self.groups) + len(self.fsdp1_states)

    def _proxy(self, module: Any, functions: dict[str, tuple[Any, ...]], group: Any) -> None:
        if group is not None and all(m is not module or g is not group for m, g in self._proxied):
            self._proxied.append((module, group))
            _time_collectives(module, functions, group, self._engine)

    def install(self, recorder: Any) -> None:
        self._engine = recorder
        for state in self.fsdp1_states:
            flat_param_module, runtime_module = _fsdp1_modules()
            self._proxy(flat_param_module, FSDP1_GATHERS, state.process_group)
            self._proxy(runtime_module, FSDP1_REDUCTIONS, state.process_group)
            inter_node = getattr(state, "_inter_node_pg", None)  # HYBRID_SHARD's replicas
            self._proxy(runtime_module, FSDP1_REDUCTIONS, inter_node)
            if _fsdp1_replicates(state):
                self.replicas = max(self.replicas, state.process_group.size())
            elif inter_node is not None:
                self.replicas = max(self.replicas, inter_node.size())
        for group in self.groups:
            replicas = replicate_group(group)
            if replicas is not None and replicas.size() > 1:  # a group of one all-reduces nothing
                self._proxy(_collectives_module(), FSDP2_COLLECTIVES, replicas)
                self.replicas = max(self.replicas, replicas.size())
            for attr, wrapper in (("_all_gather_comm", TimedAllGather), ("_reduce_scatter_comm", TimedReduceScatter)):
                inner = getattr(group, attr)
                if isinstance(inner, _TimedComm):  # left by a profiler that never stopped
                    inner = inner.inner
                self._restore.append((group, attr, inner))
                setattr(group, attr, wrapper(inner, recorder))
            # An instance attribute shadows the method; removing it restores the method.
            if _is_timed_wait(vars(group).get("wait_for_unshard")):
                del group.wait_for_unshard
            if "wait_for_unshard" not in vars(group) and _gathers(group):
                group.wait_for_unshard = _timed_wait(group.wait_for_unshard, recorder)
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
        for module, group in self._proxied:
            _untime_collectives(module, group, self._engine)
        self._proxied.clear()


def unsupported_reason(groups: list[Any]) -> str | None:
    """Why these parameter groups cannot be timed (None: they can).

    Older FSDP2 (``torch.distributed._composable.fsdp``) called the collectives
    directly, with no comm object on the group to wrap.
    """
    for group in groups:
        missing = [a for a in ("_all_gather_comm", "_reduce_scatter_comm") if not hasattr(group, a)]
        if missing:
            return (
                f"this torch's FSDP2 ({torch.__version__}) has no {' / '.join(missing)} on its parameter "
                "groups (FSDPModule.set_custom_all_gather came later): dtprofile cannot time its collectives"
            )
    return None


class TimedByAnother(RuntimeError):
    """Another running profiler already times these collectives (one profiler per model)."""


def _timed_by_another(groups: list[Any], states: list[Any], recorder: Any) -> bool:
    """Whether a running profiler other than ``recorder`` times any of these collectives."""

    def other(e: Any) -> bool:
        return e is not None and e is not recorder and bool(getattr(e, "active", False))

    for group in groups:
        if any(
            isinstance(c, _TimedComm) and other(c.recorder)
            for c in (getattr(group, a, None) for a in ("_all_gather_comm", "_reduce_scatter_comm"))
        ):
            return True
    if states:
        pgs = {id(s.process_group) for s in states}
        for mod in _fsdp1_modules():
            proxy = mod.dist
            if isinstance(proxy, _TimedDist) and any(
                key in pgs and other(e) for key, (_, e) in proxy.recorders.items()
            ):
                return True
    return False


def instrument(module: torch.nn.Module, recorder: Any) -> FSDPInstrumentation:
    """Time every FSDP collective under ``module`` for ``recorder``; returns the handle.

    Raises ``NotImplementedError`` (with :func:`unsupported_reason`) on an FSDP2 that
    has no comm objects to wrap, and :class:`TimedByAnother` when another running
    profiler times them; nothing is changed then.
    """
    groups = fsdp_param_groups(module)
    reason = unsupported_reason(groups)
    if reason is not None:
        raise NotImplementedError(reason)
    states = fsdp1_states(module)
    if _timed_by_another(groups, states, recorder):
        raise TimedByAnother("another profiler is already timing this model's FSDP collectives")
    handle = FSDPInstrumentation(groups, states)
    handle.install(recorder)
    return handle
