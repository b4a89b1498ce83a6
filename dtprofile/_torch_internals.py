"""Every private PyTorch API dtprofile relies on, in one place.

A torch upgrade that moves one of these breaks dtprofile here and nowhere else; each
function degrades (returns None, False, or does nothing) rather than raising, and says
what it reads. FSDP's own collective objects, which dtprofile wraps in place, are the
one exception: :mod:`dtprofile.capture.fsdp` is wholly about them.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from types import FrameType

    from torch.amp.grad_scaler import GradScaler

__all__ = [
    "CompileWatch",
    "LeanHooks",
    "compiled_module",
    "ddp_comm_hooks",
    "ddp_logged_comm_hook",
    "ddp_output_tensors",
    "ddp_prepare_for_backward",
    "ddp_reduce_after_backward",
    "ddp_reduces_plainly",
    "default_store",
    "driven_optimizer",
    "eager",
    "grad_scaler_class",
    "in_backward",
    "inert_hook",
    "join_block_open",
    "module_hook",
    "optimizer_steps_running",
    "patch_ddp_buffer_sync",
    "queue_autograd_callback",
    "watch_ddp_joins",
]

_OPTIMIZER_FILE = os.path.join("torch", "optim", "optimizer.py")
_JOIN_ENDED = "_dtprofile_join_ended"  # set on a DDP join hook once its join() block has ended


# ---------------------------------------------------------------- autograd and optimizers
# (looked up once: the forward hooks ask on every pass)
_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True on a thread that is running an autograd backward pass."""
    return _graph_task_id is not None and _graph_task_id() != -1


def current_graph_task() -> int:
    """The id of the backward pass running on this thread (-1: none, or unknown)."""
    return _graph_task_id() if _graph_task_id is not None else -1


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward's graph is done (before DDP's own
    finalisation, which is queued later, waits for the reductions)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def optimizer_steps_running() -> int | None:
    """How many ``Optimizer.step`` calls this thread is inside (None: cannot tell).

    Counts torch's step wrapper (the one that runs the step hooks) on the stack; only
    asked when the hooks say a step is already running, to tell nesting from a step that
    raised.
    """
    frame: FrameType | None
    frame, count = sys._getframe(1), 0
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            count += 1
        frame = frame.f_back
    return count or None


def grad_scaler_class() -> type[GradScaler] | None:
    """``torch.amp.GradScaler`` (its subclasses inherit ``step``), or None."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except Exception:
        return None
    return GradScaler


def driven_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a wrapper drives, else ``optimizer`` itself.

    Wrappers such as Hugging Face Accelerate's ``AcceleratedOptimizer`` subclass
    ``torch.optim.Optimizer`` without running its ``__init__`` (no step hooks of their
    own) and call ``self.optimizer.step()`` only on the micro-batch that updates: the
    wrapped optimizer's hooks mark the real updates.
    """
    seen = 0
    while (
        not hasattr(optimizer, "_optimizer_step_pre_hooks")
        and seen < 8
        and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
    ):
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


# ---------------------------------------------------------------- torch.compile
def compiled_module(module: Any) -> bool:
    """Whether ``module`` is compiled (``torch.compile(m)``'s wrapper, or ``m.compile()``)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, kept out of ``torch.compile``'d graphs.

    A module compiled in place (``model.compile()``), or a compiled wrapper around the
    profiled module, runs its hooks inside the traced frame: TorchDynamo would trace
    into them and break the graph on the clock call, with a warning. A disabled
    function is run eagerly instead (~0.4 us a call). At the edges of the compiled
    frame that splits nothing; a profiled module called in the middle of a compiled
    function or parent module splits that graph at its hooks (profile the compiled
    parent instead). Without ``torch._dynamo`` loaded nothing is compiled, and importing
    it would cost a second.
    """
    if "torch._dynamo" not in sys.modules:
        return hook
    return cast("Callable[..., Any]", torch.compiler.disable(hook))  # (untyped in torch)


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a dtprofile hook becomes in a copied or saved module: nothing at all."""
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


class _ModuleHook:
    """A hook dtprofile puts on the user's module: it runs ``fn``, and in a copy of the
    module (``copy.deepcopy``: an EMA model, a teacher) or a pickled one
    (``torch.save(model)``) it becomes :func:`inert_hook`, so the copy is not profiled
    and the save does not fail on a local function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        # What the hook runs: a function, or what a subclass's own call reads (the pass hooks).
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[str, Any]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


_EagerModuleHook: type[_ModuleHook] | None = None


def module_hook(fn: Callable[..., Any]) -> _ModuleHook:
    """A :class:`_ModuleHook` of ``fn``, its call kept out of compiled graphs as :func:`eager` does."""
    global _EagerModuleHook
    if "torch._dynamo" not in sys.modules:
        return _ModuleHook(fn)
    if _EagerModuleHook is None:
        _EagerModuleHook = type(
            "_EagerModuleHook",
            (_ModuleHook,),
            {"__slots__": (), "__call__": torch.compiler.disable(_ModuleHook.__call__)},
        )
    return _EagerModuleHook(fn)


def _compile_callbacks() -> Any:
    """TorchDynamo's handler of the callbacks it runs as each compilation starts, before
    it traces (None: Dynamo not loaded, or a torch without it)."""
    module = sys.modules.get("torch._dynamo.callback")
    handler = getattr(module, "callback_handler", None)
    ok = callable(getattr(handler, "register_start_callback", None)) and callable(
        getattr(handler, "remove_start_callback", None)
    )
    return handler if ok else None


def _frames_compiled() -> bool:
    """Whether TorchDynamo has compiled a frame in this process (its counters)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    frames = counters.get("frames") if isinstance(counters, dict) else None
    return bool(frames and frames.get("total"))


class CompileWatch:
    """dtprofile's per-step hooks, plain until TorchDynamo compiles something, then kept
    out of compiled graphs (:func:`eager`) for good.

    A hook that a compiled frame would trace (a module compiled in place, a compiled
    function that calls the profiled module or steps the optimizer) must run under
    ``torch.compiler.disable``, whose wrapper costs each call about 0.4 us. Nothing can
    trace a hook before Dynamo compiles a frame: until then the hooks stay plain, and a
    callback Dynamo runs as each compilation starts, before it traces, puts the
    disabled ones in their places (the same keys of the same hook dicts), after the
    ``on_compile`` callbacks ran. Where that callback cannot be registered (a torch
    without it) or a frame was compiled already, hooks go in disabled at once; while
    Dynamo is not loaded they go in plain (loading it would cost a second).
    """

    def __init__(self) -> None:
        self.compiled = False
        self.on_compile: list[Callable[[], None]] = []
        self._slots: list[tuple[Any, int, Callable[..., Any]]] = []  # (hook dict's weakref, key, plain hook)
        self._handler: Any = None

    @property
    def watching(self) -> bool:
        """Whether a compilation's start will be seen before it traces anything."""
        return self._handler is not None and not self.compiled

    def add(self, handle: Any, hook: Callable[..., Any], compiled: bool = False) -> None:
        """``hook``, registered as ``handle`` (a ``RemovableHandle``), plain while nothing
        compiles.

        ``compiled``: the hook is on a compiled module (:func:`compiled_module`), and so
        eager at once: Dynamo intercepts the frames its call runs before it starts a
        compilation of its own, the hooks' among them.
        """
        slot = (handle.hooks_dict_ref, handle.id, hook)
        self._slots.append(slot)
        if compiled or self.compiled:
            self._make_eager(slot)
        if self.compiled or self._handler is not None or "torch._dynamo" not in sys.modules:
            return
        handler = _compile_callbacks()
        if handler is None or _frames_compiled():
            self._compiling()
            return
        handler.register_start_callback(self._started)
        self._handler = handler

    def close(self) -> None:
        """No more watching (the hooks are being removed)."""
        if self._handler is not None:
            try:
                self._handler.remove_start_callback(self._started)
            except Exception:  # (already gone)
                pass
            self._handler = None
        self._slots.clear()
        self.on_compile.clear()

    def _started(self, args: Any = None) -> None:
        self._compiling()

    def _compiling(self) -> None:
        if self.compiled:
            return
        self.compiled = True
        for callback in self.on_compile:
            callback()
        for slot in self._slots:
            self._make_eager(slot)

    @staticmethod
    def _make_eager(slot: tuple[Any, int, Callable[..., Any]]) -> None:
        ref, key, hook = slot
        hooks = ref()
        if hooks is not None and hooks.get(key) is hook:
            hooks[key] = module_hook(hook.fn) if isinstance(hook, _ModuleHook) else torch.compiler.disable(hook)


@dataclasses.dataclass
class _LeanEntry:
    """One hook :class:`LeanHooks` switches: its dict (a weakref), its key, its full and
    lean versions (None: taken out), and the keys after it while it is out."""

    ref: Any
    key: int
    full: Callable[..., Any]
    lean: Callable[..., Any] | None
    after: list[Any] = dataclasses.field(default_factory=list)


class LeanHooks:
    """Switches some of dtprofile's hooks between their full and lean versions, in place.

    Each hook's entry in its hook dict (keyed by its handle's id: a module's
    ``_forward_pre_hooks`` and ``_forward_hooks``) keeps its key and place and changes its
    function, or, for a dict torch reads as a snapshot before calling them (a module's),
    is taken out and put back where it was (a hook registered after it runs after it
    again). torch reads a module's post-hooks once forward returns, so a switch to the
    full hooks inside the lean pre-hook takes effect for that same call. With no hook
    added it is a flag the lane's timed call reads (Lightning's). Switches only while
    ``watch`` sees any compilation start before it traces (and then switches back, for
    good), and the module is not compiled in place.

    Args:
        module: the profiled module.
        watch: the run's :class:`CompileWatch`.
    """

    def __init__(self, module: torch.nn.Module, watch: CompileWatch) -> None:
        self.module, self.watch = module, watch
        self._entries: list[_LeanEntry] = []
        self.is_lean = False

    def add(self, handle: Any, lean: Callable[..., Any] | None) -> None:
        """The hook registered as ``handle`` becomes ``lean`` while lean (None: taken out,
        only where torch reads the dict as a snapshot)."""
        hooks = handle.hooks_dict_ref()
        self._entries.append(_LeanEntry(handle.hooks_dict_ref, handle.id, hooks[handle.id], lean))

    def usable(self) -> bool:
        """Whether nothing compiled can hold the hooks it traced."""
        return self.watch.watching and not compiled_module(self.module)

    def lean(self) -> bool:
        """The lean hooks; False (nothing changed) when that cannot be done now."""
        if self.is_lean or not self.usable():
            return False
        # (Plain loops: a comprehension or generator is a call of its own, and this runs
        # after every step that times its passes.)
        for entry in self._entries:
            hooks = entry.ref()
            if hooks is None or hooks.get(entry.key) is not entry.full:
                return False  # (removed, or not ours any more)
        for entry in self._entries:
            hooks = entry.ref()
            if entry.lean is None:
                keys = list(hooks)
                entry.after = keys[keys.index(entry.key) + 1 :]
                del hooks[entry.key]
            else:
                hooks[entry.key] = entry.lean
        self.is_lean = True
        return True

    def full(self) -> None:
        """The full hooks back, in their places (nothing for those removed)."""
        if not self.is_lean:
            return
        self.is_lean = False
        for entry in self._entries:
            hooks = entry.ref()
            if hooks is None:
                continue
            if entry.lean is not None:
                if hooks.get(entry.key) is entry.lean:
                    hooks[entry.key] = entry.full
            elif entry.key not in hooks:  # (else put back already)
                hooks[entry.key] = entry.full
                for later in entry.after:
                    if later in hooks:
                        hooks.move_to_end(later)
                entry.after = []


# ---------------------------------------------------------------- DistributedDataParallel
def ddp_reduces_plainly(ddp: Any, unused_search: bool = False) -> bool:
    """Whether DDP reduces every pass the plain way: each forward with
    ``require_backward_grad_sync`` prepares the reducer, every parameter has a gradient
    (no unused-parameter search, no static graph or delayed all-reduce), no mixed
    precision, no Join context, no Python reducer. Only then can a pass skip DDP's
    reduction and have it done by hand with the same result.

    ``unused_search``: a search for unused parameters (``find_unused_parameters``) is
    allowed too, where the reducer can be driven after backward
    (:func:`ddp_reduce_after_backward`): only DDP's own reducer knows which parameters a
    pass used, so only it can make such a pass's reduction afterwards.
    """
    if getattr(ddp, "find_unused_parameters", True) and not (
        unused_search and callable(getattr(getattr(ddp, "reducer", None), "_autograd_hook", None))
    ):
        return False
    return not (
        getattr(ddp, "static_graph", True)
        or getattr(ddp, "_delay_all_reduce_all_params", True)
        or getattr(ddp, "mixed_precision", None) is not None
        or getattr(getattr(ddp, "_join_config", None), "enable", True)
        or getattr(ddp, "_use_python_reducer", True)
        or not hasattr(ddp, "require_backward_grad_sync")
        or not hasattr(ddp, "require_forward_param_sync")
        or _sparse_or_complex(ddp)
    )


def _sparse_or_complex(ddp: Any) -> bool:
    """Whether some gradient is sparse (``Embedding(sparse=True)``: DDP reduces it apart)
    or complex: neither is flattened and summed with the others."""
    if any(p.is_complex() for p in ddp.parameters()):
        return True
    return any(
        getattr(m, "sparse", False) for m in ddp.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
    )


def ddp_output_tensors(ddp: Any, output: Any) -> list[Any]:
    """The tensors of a forward's ``output`` from which DDP's reducer searches the graph
    for unused parameters (``_post_forward``); none where it does not search."""
    if not getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
        return []
    from torch.nn.parallel.distributed import _find_tensors

    return list(_find_tensors(output))


def ddp_prepare_for_backward(ddp: Any, output: Any = None) -> None:
    """What DDP's forward does when its pass reduces (``_post_forward``): arm the reducer
    (with the pass's ``output``, where it searches for unused parameters)."""
    ddp.reducer.prepare_for_backward(ddp_output_tensors(ddp, output))


def ddp_reduce_after_backward(ddp: Any, outputs: list[Any], ready: list[int]) -> None:
    """Have DDP's reducer reduce a pass that ran as under ``no_sync()``, as it would have
    during that pass's backward, with the same result.

    The reducer is armed as DDP's forward arms it (``outputs``: the pass's
    :func:`ddp_output_tensors`, from which it finds the unused parameters and marks them
    ready), then each parameter whose gradient the backward produced is marked ready
    (``ready``: indices into the reducer's parameters, in the order they came). It
    launches each bucket in order as it fills, and queues its finalisation (the wait,
    the copy into the gradients, the reset of its record of the used parameters) as a
    final callback of the running backward: this must run inside one.
    """
    reducer = ddp.reducer
    reducer.prepare_for_forward()  # (DDP counts its synchronising passes there)
    reducer.prepare_for_backward(outputs)
    for index in ready:
        reducer._autograd_hook(index)


def ddp_comm_hooks(ddp: Any) -> list[tuple[Any, Any]]:
    """The ``(hook, state)`` pairs given to ``register_comm_hook`` (DDP keeps them in
    ``_comm_hooks``)."""
    return list(getattr(ddp, "_comm_hooks", None) or [])


def ddp_logged_comm_hook(ddp: Any) -> bool:
    """Whether DDP's logging data names a comm hook (a builtin hook leaves only that)."""
    try:
        return bool(ddp._get_ddp_logging_data().get("comm_hook"))
    except Exception:
        return False


def patch_ddp_buffer_sync(ddp: Any, wrap: Callable[[Callable[[], Any]], Callable[[], Any]]) -> Callable[[], Any] | None:
    """Replace DDP's ``_sync_buffers`` (its buffer broadcast before each forward) on this
    instance with ``wrap(original)``; the function that puts it back, or None when this
    torch has no such method or another profiler patched it already."""
    if not callable(getattr(ddp, "_sync_buffers", None)) or "_sync_buffers" in vars(ddp):
        return None
    patched = wrap(ddp._sync_buffers)
    ddp._sync_buffers = patched
    return lambda: vars(ddp).get("_sync_buffers") is patched and vars(ddp).pop("_sync_buffers")


def watch_ddp_joins(ddp: Any) -> Callable[[], Any] | None:
    """Mark the join hooks of every ``ddp.join()`` made from now on once the block ends
    (their post-hook runs when every rank has joined); the function that stops it."""
    make_hook = getattr(ddp, "join_hook", None)
    if make_hook is None:
        return None

    def join_hook(**kwargs: Any) -> Any:
        hook = make_hook(**kwargs)
        post_hook = hook.post_hook

        def marked_post_hook(is_last_joiner: bool) -> Any:
            setattr(hook, _JOIN_ENDED, True)
            return post_hook(is_last_joiner)

        hook.post_hook = marked_post_hook
        return hook

    ddp.join_hook = join_hook
    return lambda: ddp.__dict__.pop("join_hook", None)


def join_block_open(ddp: Any) -> bool:
    """Whether a ``join()`` block of ``ddp`` is open: its ``Join`` is alive.

    The join config stays enabled after the ``with`` block ends, so it does not tell;
    the ``Join`` object, whose hook holds the model, lives only as long as the block
    (looked up only when the config says a join was made). A join made while watched
    (:func:`watch_ddp_joins`) says when its block ended; one made before is taken as open.
    """
    config = getattr(ddp, "_join_config", None) if ddp is not None else None
    if not getattr(config, "enable", False):
        return False
    return any(type(o).__name__ == "_DDPJoinHook" and not getattr(o, _JOIN_ENDED, False) for o in gc.get_referrers(ddp))


# ---------------------------------------------------------------- torch.distributed
def default_store() -> torch.distributed.Store | None:
    """The default process group's store, or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
