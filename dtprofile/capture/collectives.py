"""Tensor-parallel and 2-D mesh communication: the DeviceMesh, and every collective timed.

A model parallelized with DTensor (``parallelize_module`` with ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``loss_parallel``; FSDP2's parameters are
DTensors too) communicates inside forward and backward: the activations' all-reduces,
all-gathers and reduce-scatters. DDP's hook and FSDP's comm objects never see them.
:mod:`.mesh` finds the mesh (:func:`~dtprofile.capture.mesh.find_mesh`, importable
from here too); this module times those collectives per mesh dimension, kind and phase
(:class:`CollectiveTimer`).

How DTensor communicates (torch 2.13)
-------------------------------------
Every redistribution (``_redistribute.redistribute_local_tensor`` and the placements'
``_reduce_value``, ``_to_replicate_tensor``, ``_reduce_shard_value``; in forward, in
backward through ``Redistribute.backward``, and inside sharding propagation) calls the
functional collectives of ``torch.distributed._functional_collectives`` (``funcol``),
and each of those calls the op ``torch.ops._c10d_functional.<op>`` by its name at call
time. The op launches the collective asynchronously (gloo and NCCL alike) and returns
its output, which ``funcol`` wraps in an ``AsyncCollectiveTensor``; the wait is
``wait_tensor`` at the output's first use (``AsyncCollectiveTensor.trigger_wait``, which
calls ``funcol.wait_tensor``, which calls ``torch.ops._c10d_functional.wait_tensor``).
The backward formulas of the ops themselves (``all_reduce_backward`` ...) call
``torch.ops._c10d_functional.<op>`` the same way. Redistributing a shard from one tensor
dimension to another on a GPU calls ``torch.ops._dtensor.shard_dim_alltoall`` (blocking;
on CPUs ``funcol.all_gather_single`` instead).

The hook, and why
-----------------
:class:`CollectiveTimer` replaces each collective's ``OpOverloadPacket`` on the
``torch.ops._c10d_functional`` namespace (and ``_c10d_functional_autograd``,
``_dtensor.shard_dim_alltoall``) by a subclass whose call marks the launch and registers
the output, and ``wait_tensor``'s by one that marks the wait's start and end: every
Python caller (``funcol``'s entry points, the ops' backward formulas, DTensor's
all-to-all) resolves the name at call time, so one attribute per op sees them all, on
gloo and NCCL, and costs one Python call per collective and per wait, nothing per other
op. The packets keep the original's overloads (``.default`` is the same ``OpOverload``),
hash and compare equal to it, and are ``OpOverloadPacket`` instances (TorchDynamo puts
them in its graphs as the ops they are); :meth:`~CollectiveTimer.remove` puts the
originals back.

The hooks compared (torch 2.13, CPU, gloo, 2 cores; measured for issue 48's first slice).
Each one's own cost, a stand-in collective and its wait (``aten.neg``, ``aten.clone``)
called through it with the same recording work, best of 25 batches of 2000: none 4.1 us;
``funcol`` entry points +3.8 us; these packets +4.5 us; ``torch.library`` kernels +10.4
us; a ``TorchDispatchMode`` +13 us, and +3.9 us on every other op of the step. On a
2-rank TP MLP (64 -> 256 -> 64, batch 16: two all-reduces a step, 3.4 ms of the training
thread's CPU and 8 ms of wall a step), 12 interleaved rounds of 40 steps a variant: the
first three within the run's noise (+/-0.3 ms a step), the dispatch mode +0.7 ms of CPU
a step (+20%), ``CommDebugMode`` +6.3 ms (+190%). What each sees:

- ``funcol``'s Python entry points (``funcol.all_reduce`` ..., and ``funcol.wait_tensor``,
  which ``AsyncCollectiveTensor`` calls): every wait, but not the ops' own backward
  formulas (they call the ops), nor ``shard_dim_alltoall`` (imported by name); it must
  resolve each kind of group argument (mesh and dimension, ranks, names) itself;
- ``torch.library`` Python kernels at ``ADInplaceOrView`` on the ops: C++ callers too,
  but not the waits an ``AsyncCollectiveTensor`` makes inside its own dispatch (the key
  is excluded there: one wait of the MLP's two), and a Python kernel behind the
  dispatcher costs twice a Python call;
- a ``TorchDispatchMode`` (what ``CommDebugMode`` is): the launches, not those waits
  (below the mode), and a cost on every op; on sampled steps only it misses the others;
- process-group hooks: ``ProcessGroupNCCL``'s completion hook is NCCL's alone, and the
  ops call the C++ ``ProcessGroup`` directly (nothing in Python to wrap).

The packets see every launch and every wait at the cost of a Python call: the cheapest
complete hook. The default phase watches the model's forward with two hooks (+4 us a
forward); :meth:`~CollectiveTimer.begin_step` and :meth:`~CollectiveTimer.end_step` cost
1 us together.

What it does not see: C++ callers of the ops, and collectives in a ``torch.compile``'d
graph lowered by AOTAutograd or Inductor (they call the overloads; the "eager" backend's
graphs call the packets, and are timed). Tracing passes straight through (a FakeTensor
is not a collective to time), and a graph that holds a packet after :meth:`remove`
calls the op itself. ``c10d=True`` also times the
``torch.distributed`` calls (``dist.all_gather_single``, ``dist.reduce_scatter_tensor``
...) made on the mesh's own process groups, FSDP2's among them.

Timing
------
A collective's *total* runs from its launch to the end of its (last) wait; *waited* is
the time the call and the wait held the caller (launching a functional collective holds
it too: on gloo the buffer is copied and the work queued on the host). On the host
clock (``time.perf_counter``) both are the training thread's; on a
:class:`~dtprofile.capture.clocks.CudaEventClock` each mark is an event on the current
stream, so *waited* is the compute stream's stall for the
collective and *total* its launch to the stream's release, with no synchronisation:
those marks are read at a later :meth:`~CollectiveTimer.poll` once the device passed
them. A blocking collective (``c10d`` without ``async_op``, ``shard_dim_alltoall``) is
waited for throughout; an asynchronous ``c10d`` call's end is marked in its future's
callback, and its *waited* is unknown (0).

Per step the figures are bounded counters: per (mesh dimension, kind, phase) a count,
bytes, total and waited milliseconds. Bytes are the full tensor's, as
:mod:`.fsdp` counts them: an all-reduce's or broadcast's buffer, an all-gather's output,
a reduce-scatter's input, an all-to-all's input. The phase is the caller's
``phase_of()`` at the launch, by default "backward" inside an autograd backward,
"forward" inside a forward of the model that records gradients (its forward hooks: a
``Redistribute`` runs under ``no_grad`` inside ``autograd.Function.forward``, so grad
mode alone would not tell), else "forward" when grad mode is on, else "other".

An internal error warns once, disables the timer (the packets pass straight through
until :meth:`~CollectiveTimer.remove`) and never reaches the training loop.

>>> from dtprofile.capture.collectives import find_mesh
>>> find_mesh(__import__("torch").nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import collections
import inspect
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch._ops import OpOverloadPacket

from .._torch_internals import in_backward
from ..mesh_keys import KINDS, PHASES

# The mesh's part lives in .mesh; its names stay importable from here.
from .mesh import MeshDim, MeshInfo, find_mesh, group_name

__all__ = [
    "KINDS",
    "PHASES",
    "MeshDim",
    "MeshInfo",
    "find_mesh",
    "CollectiveListener",
    "CollectiveTimer",
    "figures_rows",
    "installed_timer",
]


#: Completed collectives a step holds for a device clock before the rest count without times.
MAX_RECORDS_PER_STEP = 4096
#: Steps a device clock may leave unread; an older one is dropped (counted in ``dropped_steps``).
MAX_PENDING_STEPS = 16
#: Distinct groups outside the mesh named apart; more share the label "other".
MAX_OTHER_GROUPS = 8


# ---------------------------------------------------------------------------- the ops
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first(args: tuple[Any, ...]) -> int:
    return _nbytes(args[0])


def _first_list(args: tuple[Any, ...]) -> int:
    return sum(_nbytes(t) for t in args[0])


def _gathered(args: tuple[Any, ...]) -> int:  # an all-gather's output: the input times the group's size
    return _nbytes(args[0]) * int(args[1])


def _gathered_list(args: tuple[Any, ...]) -> int:
    return sum(_nbytes(t) for t in args[0]) * int(args[1])


# (namespace, op) -> (kind, bytes from the positional arguments, blocking)
_FUNCTIONAL_OPS: dict[tuple[str, str], tuple[str, Callable[[tuple[Any, ...]], int], bool]] = {
    ("_c10d_functional", "all_reduce"): ("all_reduce", _first, False),
    ("_c10d_functional", "all_reduce_"): ("all_reduce", _first, False),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", _first_list, False),
    ("_c10d_functional", "all_reduce_coalesced_"): ("all_reduce", _first_list, False),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", _gathered, False),
    ("_c10d_functional", "all_gather_into_tensor_out"): ("all_gather", _gathered, False),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", _gathered_list, False),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", _first, False),
    ("_c10d_functional", "reduce_scatter_tensor_out"): ("reduce_scatter", _first, False),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", _first_list, False),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", _first, False),
    ("_c10d_functional", "broadcast"): ("broadcast", _first, False),
    ("_c10d_functional", "broadcast_"): ("broadcast", _first, False),
    ("_c10d_functional_autograd", "all_gather_into_tensor"): ("all_gather", _gathered, False),
    ("_c10d_functional_autograd", "reduce_scatter_tensor"): ("reduce_scatter", _first, False),
    ("_c10d_functional_autograd", "all_to_all_single"): ("all_to_all", _first, False),
    ("_dtensor", "shard_dim_alltoall"): ("all_to_all", _first, True),
}
_WAIT_OP = ("_c10d_functional", "wait_tensor")


def _c10d_bytes_first(args: tuple[Any, ...], kwargs: dict[Any, Any], names: tuple[Any, ...]) -> int:
    t = args[0] if args else kwargs[names[0]]
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else _nbytes(t)


def _c10d_bytes_second(args: tuple[Any, ...], kwargs: dict[Any, Any], names: tuple[Any, ...]) -> int:
    t = args[1] if len(args) > 1 else kwargs[names[1]]
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else _nbytes(t)


# torch.distributed function -> (kind, its bytes); only calls on the mesh's groups are timed.
_C10D_FUNCTIONS: dict[str, tuple[str, Callable[..., Any]]] = {
    "all_reduce": ("all_reduce", _c10d_bytes_first),
    "all_gather_into_tensor": ("all_gather", _c10d_bytes_first),  # the output
    "all_gather_single": ("all_gather", _c10d_bytes_first),
    "all_gather": ("all_gather", _c10d_bytes_first),
    "reduce_scatter_tensor": ("reduce_scatter", _c10d_bytes_second),  # the input
    "reduce_scatter_single": ("reduce_scatter", _c10d_bytes_second),
    "reduce_scatter": ("reduce_scatter", _c10d_bytes_second),
    "all_to_all_single": ("all_to_all", _c10d_bytes_second),
    "broadcast": ("broadcast", _c10d_bytes_first),
}


def _timeable(args: tuple[Any, ...]) -> bool:
    """The op's (first) input is a real tensor of eager code: not a FakeTensor, a
    FunctionalTensor or a proxy (tracing passes straight through)."""
    t = args[0] if args else None
    if isinstance(t, (list, tuple)):
        t = t[0] if t else None
    return type(t) is torch.Tensor or type(t).__name__ == "AsyncCollectiveTensor"


class _TimedPacket(OpOverloadPacket):
    """An op's packet whose call goes through the timer. Everything else is the
    original's: its overloads (the same ``OpOverload`` objects), its hash, and equality."""

    def __init__(self, original: OpOverloadPacket, timer: CollectiveTimer, spec: Any) -> None:
        for name in original.overloads():  # (each cached on the original first: shared, not rebuilt)
            getattr(original, name)
        self.__dict__.update(original.__dict__)
        self._dtprofile_original = original
        self._dtprofile_timer: CollectiveTimer | None = timer
        self._dtprofile_spec = spec
        # What the original's call does: the op itself, unless it must look for script
        # objects first (then its own call, which does).
        plain = type(original) is OpOverloadPacket and not getattr(original, "_has_torchbind_op_overload", True)
        self._dtprofile_call = original._op if plain else original

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        timer = self._dtprofile_timer
        if timer is None or not timer.measuring:
            return self._dtprofile_call(*args, **kwargs)
        return timer._call(self, args, kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._dtprofile_original

    def __hash__(self) -> int:
        return hash(self._dtprofile_original)

    def __reduce__(self) -> Any:  # a pickled graph holds the op itself
        return self._dtprofile_original.__reduce__()

    def __deepcopy__(self, memo: Any = None) -> Any:
        return self


class _TimedWait(_TimedPacket):
    """``wait_tensor``'s packet: only waits for collectives the timer saw launched are timed."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        timer = self._dtprofile_timer
        if timer is None or not timer._pending:
            return self._dtprofile_call(*args, **kwargs)
        return timer._wait(self, args, kwargs)


class _TimedFunction:
    """A ``torch.distributed`` collective whose calls on the mesh's groups are timed."""

    def __init__(
        self, original: Callable[..., Any], timer: CollectiveTimer, kind: str, size: Callable[..., Any]
    ) -> None:
        self.original = original
        self.timer: CollectiveTimer | None = timer
        self.kind, self.size = kind, size
        params = list(inspect.signature(original).parameters)
        self.names = tuple(params)
        self.group_at = params.index("group") if "group" in params else -1
        self.async_at = params.index("async_op") if "async_op" in params else -1
        self.__wrapped__ = original
        self.__name__ = getattr(original, "__name__", "collective")
        self.__qualname__ = getattr(original, "__qualname__", self.__name__)
        self.__doc__ = getattr(original, "__doc__", None)
        self.__module__ = getattr(original, "__module__", None) or __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        timer = self.timer
        if timer is None or not timer.measuring:
            return self.original(*args, **kwargs)
        at = self.group_at
        group = kwargs.get("group") if "group" in kwargs else (args[at] if 0 <= at < len(args) else None)
        if group is None or id(group) not in timer._c10d_groups:
            return self.original(*args, **kwargs)
        return timer._c10d_call(self, group, args, kwargs)


_lock = threading.Lock()
_installed: CollectiveTimer | None = None


def installed_timer() -> CollectiveTimer | None:
    """The timer whose packets are in place now (one per process), else None."""
    return _installed


# ---------------------------------------------------------------------------- the timer
class CollectiveListener(Protocol):
    """What a :class:`CollectiveTimer` tells its ``listener`` of each functional
    collective, on the thread that runs it. Tokens and spans are the listener's own
    (None: it keeps nothing of this one); the timer hands them back as they were."""

    def launched(self, nbytes: int) -> Any:
        """A collective of ``nbytes`` launches now: its token."""

    def wait_began(self) -> Any:
        """The caller starts waiting for a collective now: a span."""

    def wait_ended(self, span: Any) -> None:
        """The wait of ``span`` ended now (or raised)."""

    def completed(self, token: Any, span: Any) -> None:
        """The collective of ``token`` completed with the wait of ``span`` (its last)."""


class _ForwardWatch:
    """Forward hooks on the model: how many of its training forwards are open."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.depth = 0
        self._saved: list[bool] = []
        # (first of the pre-hooks: FSDP's root gathers its parameters in one)
        self._handles = [
            model.register_forward_pre_hook(self._pre, prepend=True),
            model.register_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: Any, args: Any) -> None:
        training = torch.is_grad_enabled()
        self._saved.append(training)
        if training:
            self.depth += 1

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if self._saved and self._saved.pop():
            self.depth -= 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.depth = 0
        self._saved.clear()


class CollectiveTimer:
    """Times every functional collective (DTensor's) per mesh dimension, kind and phase.

    Args:
        mesh_info: the mesh (:func:`find_mesh`); its dimensions label the groups (others
            are "other", or ``group:<name>`` for the first few). None: every group is
            labelled by its name.
        clock: where marks come from (:mod:`.clocks`): ``HostClock`` by default.
        phase_of: ``() -> str`` called at each launch (by default: "backward" inside
            autograd's backward, "forward" inside the model's training forward or under
            grad mode, else "other").
        model: whose forward the default phase watches (by default ``mesh_info``'s).
        c10d: also time ``torch.distributed``'s collectives on the mesh's process groups
            (FSDP2's all-gathers and reduce-scatters, for instance).
        listener: told of each functional collective (DTensor's) as it launches, as each
            of its waits begins and ends, and when it completes (:class:`CollectiveListener`):
            the profiler's step record takes its spans from there. Not of ``c10d`` calls.

    Use: :meth:`install` once, :meth:`begin_step` and :meth:`end_step` around each step
    (collectives outside a step pass straight through), :meth:`remove` at the end.
    """

    def __init__(
        self,
        mesh_info: MeshInfo | None = None,
        clock: Any = None,
        phase_of: Callable[[], str] | None = None,
        model: torch.nn.Module | None = None,
        c10d: bool = False,
        listener: CollectiveListener | None = None,
    ) -> None:
        if clock is None:
            from .clocks import HostClock

            clock = HostClock()
        self.mesh_info = mesh_info
        self.clock = clock
        self._mark = clock.mark
        # A host clock's marks are known at once: a collective is folded when its wait ends.
        self._immediate = getattr(clock, "kind", None) == "perf_counter"
        self._model = (
            model
            if model is not None
            else (mesh_info.model_ref() if mesh_info is not None and mesh_info.model_ref is not None else None)
        )
        self._watch: _ForwardWatch | None = None
        self._phase_of = phase_of if phase_of is not None else self._default_phase
        self.c10d = c10d
        self.listener = listener
        self.enabled = True
        self.error: str | None = None
        self.measuring = False  # between begin_step and end_step, while enabled
        self.installed = False
        self.step_index = -1
        self._labels: dict[Any, str] = {}
        self._c10d_groups: dict[int, Any] = {}
        if mesh_info is not None:
            for d in mesh_info.dims:
                self._labels[d.group_name] = d.label
                if d.group is not None:
                    self._labels[d.group] = d.label
                    self._c10d_groups[id(d.group)] = d.group
        self._others = 0
        self._restore: list[Callable[[], None]] = []
        self._packets: list[_TimedPacket] = []
        self._functions: list[_TimedFunction] = []
        # The open step: counters by (label, kind, phase) -> [count, bytes, total_ms, waited_ms];
        # collectives launched and not yet waited for, by their output's data pointer.
        self._counters: dict[tuple[Any, ...], list[Any]] = {}
        self._pending: dict[int, list[Any]] = {}
        self._records: list[tuple[Any, ...]] = []  # completed collectives' marks (device clocks)
        self._overflow: dict[tuple[Any, ...], list[Any]] = {}
        self._unwaited = 0
        self._done_async: collections.deque[Any] = collections.deque()  # c10d futures' ends (any thread)
        self._held: collections.deque[Any] = collections.deque()  # device clocks: closed steps not yet read
        self.dropped_steps = 0

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> bool:
        """Put the timed packets (and ``c10d`` functions) in place; False (with a warning)
        when another timer has them, or when this torch has nothing to wrap."""
        global _installed
        if self.installed:
            return True
        if not self.enabled:
            return False
        with _lock:
            if _installed is not None and _installed is not self:
                warnings.warn(
                    "dtprofile: another CollectiveTimer is already timing this process's collectives; "
                    "this one stays off",
                    stacklevel=2,
                )
                return False
            try:
                self._install()
            except Exception as exc:
                self._undo()
                self._fail(exc)
                return False
            _installed = self
        self.installed = True
        return True

    def _install(self) -> None:
        import torch.distributed._functional_collectives  # noqa: F401  (the ops' Python parts)

        if self._model is not None and self._phase_of == self._default_phase:
            self._watch = _ForwardWatch(self._model)
            self._restore.append(self._watch.remove)
        for (ns_name, op_name), spec in [*_FUNCTIONAL_OPS.items(), (_WAIT_OP, None)]:
            namespace = getattr(torch.ops, ns_name)
            had = op_name in vars(namespace)
            try:
                original = getattr(namespace, op_name)
            except (AttributeError, RuntimeError):  # not in this torch
                continue
            if isinstance(original, _TimedPacket):  # left by a timer that never removed them
                original = original._dtprofile_original
            packet = (_TimedWait if spec is None else _TimedPacket)(original, self, spec)
            setattr(namespace, op_name, packet)
            self._packets.append(packet)
            self._restore.append(self._putter(namespace, op_name, packet, original, had))
        if self.c10d:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d

            for name, (kind, size) in _C10D_FUNCTIONS.items():
                for module in (dist, distributed_c10d):
                    original = getattr(module, name, None)
                    if original is None:
                        continue
                    if isinstance(original, _TimedFunction):
                        original = original.original
                    function = _TimedFunction(original, self, kind, size)
                    setattr(module, name, function)
                    self._functions.append(function)
                    self._restore.append(self._putter(module, name, function, original, True))

    @staticmethod
    def _putter(owner: Any, name: str, mine: Any, original: Any, had: bool) -> Callable[[], None]:
        def put_back() -> None:
            if vars(owner).get(name) is not mine:
                return  # replaced since: ours passes straight through (its timer is cleared)
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        return put_back

    def _undo(self) -> None:
        for packet in self._packets:
            packet._dtprofile_timer = None
        for function in self._functions:
            function.timer = None
        for put_back in reversed(self._restore):
            try:
                put_back()
            except Exception:
                pass
        self._restore.clear()
        self._packets.clear()
        self._functions.clear()
        self._watch = None

    def remove(self) -> None:
        """Put back every packet, function and hook as it was (safe to call twice)."""
        global _installed
        self.measuring = False
        with _lock:
            self._undo()
            if _installed is self:
                _installed = None
        self.installed = False
        self._pending.clear()

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """A step starts: its collectives are counted from now."""
        if not self.enabled or not self.installed:
            return
        try:
            self.step_index += 1
            self._counters = {}
            self._overflow = {}
            self._records = []
            self._pending.clear()
            self._unwaited = 0
            self._drain_async()
            self.measuring = True
        except Exception as exc:
            self._fail(exc)

    def end_step(self) -> dict[str, Any] | None:
        """The step ends: its figures (:meth:`_figures`) on a host clock; None on a device
        clock (its figures come from :meth:`poll`, in order, once the device passed its
        marks; a step without collectives at once if none is waiting) or while off."""
        if not self.measuring:
            return None
        self.measuring = False
        try:
            self._drain_async()
            for rec in self._pending.values():  # launched and never waited for: count and bytes only
                if rec[4] > 0:
                    rec[4] = 0
                    self._unwaited += 1
                    self._count_only(rec[0], rec[1])
            self._pending.clear()
            step = (self.step_index, self._counters, self._records, self._unwaited, self._overflow)
            self._counters, self._records, self._overflow = {}, [], {}
            if self._immediate or (not step[2] and not self._held):
                return self._figures(*step)
            if len(self._held) >= MAX_PENDING_STEPS:
                self._release(self._held.popleft()[2])
                self.dropped_steps += 1
            self._held.append(step)
            return None
        except Exception as exc:
            self._fail(exc)
            return None

    def poll(self) -> list[dict[str, Any]]:
        """Closed steps whose device marks are now known, oldest first (a host clock has
        none: :meth:`end_step` returned them)."""
        out: list[dict[str, Any]] = []
        try:
            clock = self.clock
            while self._held:
                index, counters, records, unwaited, overflow = self._held[0]
                if not all(clock.ready(r[2]) and all(clock.ready(b) for _, b in r[3]) for r in records):
                    break
                self._held.popleft()
                for key, nbytes, start, waits in records:
                    end = waits[-1][1]
                    waited = sum(clock.elapsed_ms(a, b) for a, b in waits)
                    self._add(counters, key, nbytes, clock.elapsed_ms(start, end), waited)
                self._release(records)
                out.append(self._figures(index, counters, [], unwaited, overflow))
        except Exception as exc:
            self._fail(exc)
        return out

    def _release(self, records: list[Any]) -> None:
        release = self.clock.release
        seen: set[int] = set()
        for _, _, start, waits in records:
            for mark in (start, *(m for pair in waits for m in pair)):
                if id(mark) not in seen:
                    seen.add(id(mark))
                    release(mark)

    # ------------------------------------------------------------------ the hot path
    def _default_phase(self) -> str:
        if in_backward():
            return "backward"
        watch = self._watch
        if watch is not None and watch.depth > 0:
            return "forward"
        return "forward" if torch.is_grad_enabled() else "other"

    def _label(self, group: Any) -> str:
        label = self._labels.get(group)
        if label is None:
            if self._others < MAX_OTHER_GROUPS:
                self._others += 1
                label = f"group:{group if isinstance(group, str) else group_name(group)}"
            else:
                label = "other"
            self._labels[group] = label
        return label

    def _call(self, packet: _TimedPacket, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
        """A functional collective's launch (its own errors are the training's: they pass)."""
        call = packet._dtprofile_call
        listener = self.listener
        token = span = None
        try:
            if not args or (type(args[0]) is not torch.Tensor and not _timeable(args)):
                return call(*args, **kwargs)
            kind, size, blocking = packet._dtprofile_spec
            nbytes = size(args)
            if listener is not None:
                token = listener.launched(nbytes)
                # The caller waits in the call itself too: throughout for a blocking one; for an
                # asynchronous one while it launches (gloo copies the buffer and queues the work
                # on the host: not the caller's compute).
                if token is not None:
                    span = listener.wait_began()
            start = self._mark()
        except Exception as exc:
            self._fail(exc)
            return call(*args, **kwargs)
        try:
            out = call(*args, **kwargs)
        finally:
            if span is not None:  # (also when the call raised: the step must not wait for the span's end)
                self._listen_end(span, token if blocking else None)
        try:
            group = kwargs["group_name"] if "group_name" in kwargs else args[-1]
            label = self._labels.get(group) or self._label(group)
            key = (label, kind, self._phase_of())
            end = self._mark()
            waited: Any = end - start if self._immediate else [(start, end)]  # (the call: the launch's wait)
            if blocking:
                self._complete(key, nbytes, start, end, waited)
            elif type(out) is torch.Tensor:
                self._pending[out.data_ptr()] = [key, nbytes, start, waited, 1, token]
            else:  # coalesced: one collective, complete when its last output was waited for
                rec = [key, nbytes, start, waited, len(out), token]
                pending = self._pending
                for t in out:
                    pending[t.data_ptr()] = rec
        except Exception as exc:
            self._fail(exc)
        return out

    def _listen_end(self, span: Any, token: Any) -> None:
        """The listener's wait ``span`` ends now, and the collective of ``token`` with it
        when ``token`` is not None (never raises)."""
        try:
            listener = self.listener
            if listener is not None:
                listener.wait_ended(span)
                if token is not None:
                    listener.completed(token, span)
        except Exception as exc:
            self._fail(exc)

    def _wait(self, packet: _TimedPacket, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
        """``wait_tensor``: the wait of a collective launched in this step, timed."""
        call = packet._dtprofile_call
        span = None
        try:
            t = args[0] if args else kwargs.get("tensor")
            rec = self._pending.pop(t.data_ptr(), None) if type(t) is torch.Tensor else None
            if rec is None:
                return call(*args, **kwargs)
            listener = self.listener
            if listener is not None and rec[5] is not None:
                span = listener.wait_began()
            before = self._mark()
        except Exception as exc:
            self._fail(exc)
            return call(*args, **kwargs)
        try:
            out = call(*args, **kwargs)
        finally:
            if span is not None:  # (its collective completes at its last wait)
                self._listen_end(span, rec[5] if rec[4] == 1 else None)
        try:
            after = self._mark()
            rec[4] -= 1
            if self._immediate:
                rec[3] += after - before
            else:
                rec[3].append((before, after))
            if rec[4] == 0:
                self._complete(rec[0], rec[1], rec[2], after, rec[3])
        except Exception as exc:
            self._fail(exc)
        return out

    def _c10d_call(self, function: _TimedFunction, group: Any, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
        """A ``torch.distributed`` collective on one of the mesh's groups."""
        original = function.original
        try:
            at = function.async_at
            async_op = kwargs.get("async_op") if "async_op" in kwargs else (args[at] if 0 <= at < len(args) else False)
            key = (self._label(group), function.kind, self._phase_of())
            nbytes = function.size(args, kwargs, function.names)
            start = self._mark()
        except Exception as exc:
            self._fail(exc)
            return original(*args, **kwargs)
        work = original(*args, **kwargs)
        try:
            if not async_op or work is None:
                end = self._mark()
                self._complete(key, nbytes, start, end, end - start if self._immediate else [(start, end)])
            else:
                done = self._done_async
                mark = self._mark
                # (gloo runs the callback on its own thread: only an append there)
                work.get_future().then(lambda fut: done.append((key, nbytes, start, mark())))
        except Exception as exc:
            self._fail(exc)
        return work

    def _drain_async(self) -> None:
        done = self._done_async
        while done:
            key, nbytes, start, end = done.popleft()
            self._complete(key, nbytes, start, end, 0.0 if self._immediate else [(end, end)])

    def _complete(self, key: tuple[Any, ...], nbytes: int, start: Any, end: Any, waited: Any) -> None:
        """A collective is done: its ``waited`` is seconds on a host clock, else the
        (start, end) marks of its waits."""
        if self._immediate:
            c = self._counters.get(key)
            if c is None:
                self._counters[key] = [1, nbytes, (end - start) * 1e3, waited * 1e3]
            else:
                c[0] += 1
                c[1] += nbytes
                c[2] += (end - start) * 1e3
                c[3] += waited * 1e3
        elif len(self._records) < MAX_RECORDS_PER_STEP:
            self._records.append((key, nbytes, start, waited))
        else:
            self._count_only(key, nbytes)
            self._release([(key, nbytes, start, waited)])

    @staticmethod
    def _add(counters: dict[Any, Any], key: tuple[Any, ...], nbytes: int, total_ms: float, waited_ms: float) -> None:
        c = counters.get(key)
        if c is None:
            counters[key] = [1, nbytes, total_ms, waited_ms]
        else:
            c[0] += 1
            c[1] += nbytes
            c[2] += total_ms
            c[3] += waited_ms

    def _count_only(self, key: tuple[Any, ...], nbytes: int) -> None:
        c = self._overflow.get(key)
        if c is None:
            self._overflow[key] = [1, nbytes]
        else:
            c[0] += 1
            c[1] += nbytes

    # ------------------------------------------------------------------ figures
    def _figures(
        self, index: int, counters: dict[Any, Any], records: list[Any], unwaited: int, overflow: dict[Any, Any]
    ) -> dict[str, Any]:
        """One step's figures: ``{"step", "by_dim": {label: {kind: {phase: {count, bytes,
        total_ms, waited_ms}}}}, "totals": {label: {count, bytes, total_ms, waited_ms}},
        "untimed": {label: {kind: {phase: {count, bytes}}}} (never waited for, or past the
        step's record limit), "unwaited"}``."""
        by_dim: dict[str, dict[str, Any]] = {}
        totals: dict[str, dict[str, Any]] = {}
        for (label, kind, phase), (count, nbytes, total_ms, waited_ms) in counters.items():
            by_dim.setdefault(label, {}).setdefault(kind, {})[phase] = {
                "count": count,
                "bytes": nbytes,
                "total_ms": total_ms,
                "waited_ms": waited_ms,
            }
            t = totals.setdefault(label, {"count": 0, "bytes": 0, "total_ms": 0.0, "waited_ms": 0.0})
            t["count"] += count
            t["bytes"] += nbytes
            t["total_ms"] += total_ms
            t["waited_ms"] += waited_ms
        untimed: dict[str, dict[str, Any]] = {}
        for (label, kind, phase), (count, nbytes) in overflow.items():
            untimed.setdefault(label, {}).setdefault(kind, {})[phase] = {"count": count, "bytes": nbytes}
        return {"step": index, "by_dim": by_dim, "totals": totals, "untimed": untimed, "unwaited": unwaited}

    # ------------------------------------------------------------------ failure
    def _fail(self, exc: BaseException) -> None:
        """Warn once, stop timing (the packets pass through); never raises."""
        self.measuring = False
        if not self.enabled:
            return
        self.enabled = False
        self.error = f"{type(exc).__name__}: {exc}"
        self._pending.clear()
        try:
            warnings.warn(
                f"dtprofile: collective timing disabled after an internal error ({self.error}); training continues",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception:
            pass


def figures_rows(figures: dict[Any, Any]) -> Iterable[dict[str, Any]]:
    """A step's figures (:meth:`CollectiveTimer.end_step`) as flat rows: ``{"dim", "kind",
    "phase", "count", "bytes", "total_ms", "waited_ms"}``."""
    for label, kinds in figures.get("by_dim", {}).items():
        for kind, phases in kinds.items():
            for phase, c in phases.items():
                yield {"dim": label, "kind": kind, "phase": phase, **c}
