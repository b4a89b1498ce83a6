"""Every private PyTorch API dtprofile relies on, in one place.

A torch upgrade that moves one of these breaks dtprofile here and nowhere else; each
function degrades (returns None, False, or does nothing) rather than raising, and says
what it reads. FSDP's own collective objects, which dtprofile wraps in place, are the
one exception: :mod:`dtprofile.capture.fsdp` is wholly about them.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable

import torch

__all__ = [
    "compiled_module", "ddp_comm_hooks", "ddp_logged_comm_hook", "ddp_prepare_for_backward",
    "ddp_reduces_plainly", "default_store", "driven_optimizer", "eager",
    "grad_scaler_class", "in_backward", "inert_hook", "join_block_open", "module_hook",
    "optimizer_steps_running", "patch_ddp_buffer_sync", "queue_autograd_callback", "watch_ddp_joins",
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
    frame, count = sys._getframe(1), 0
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            count += 1
        frame = frame.f_back
    return count or None


def grad_scaler_class() -> type | None:
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
    while (not hasattr(optimizer, "_optimizer_step_pre_hooks") and seen < 8
           and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


# ---------------------------------------------------------------- torch.compile
def compiled_module(module: Any) -> bool:
    """Whether ``module`` is compiled (``torch.compile(m)``'s wrapper, or ``m.compile()``)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def eager(hook: Callable) -> Callable:
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
    return torch.compiler.disable(hook)


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

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple:
        return (_inert, ())


_EagerModuleHook: type | None = None


def module_hook(fn: Callable) -> _ModuleHook:
    """A :class:`_ModuleHook` of ``fn``, its call kept out of compiled graphs as :func:`eager` does."""
    global _EagerModuleHook
    if "torch._dynamo" not in sys.modules:
        return _ModuleHook(fn)
    if _EagerModuleHook is None:
        _EagerModuleHook = type("_EagerModuleHook", (_ModuleHook,),
                                {"__slots__": (), "__call__": torch.compiler.disable(_ModuleHook.__call__)})
    return _EagerModuleHook(fn)


# ---------------------------------------------------------------- DistributedDataParallel
def ddp_reduces_plainly(ddp: Any) -> bool:
    """Whether DDP reduces every pass the plain way: each forward with
    ``require_backward_grad_sync`` prepares the reducer, every parameter has a gradient
    (no unused-parameter search, no static graph or delayed all-reduce), no mixed
    precision, no Join context, no Python reducer. Only then can a pass skip DDP's
    reduction and have it done by hand with the same result."""
    return not (getattr(ddp, "find_unused_parameters", True) or getattr(ddp, "static_graph", True)
                or getattr(ddp, "_delay_all_reduce_all_params", True)
                or getattr(ddp, "mixed_precision", None) is not None
                or getattr(getattr(ddp, "_join_config", None), "enable", True)
                or getattr(ddp, "_use_python_reducer", True)
                or not hasattr(ddp, "require_backward_grad_sync")
                or not hasattr(ddp, "require_forward_param_sync")
                or _sparse_or_complex(ddp))


def _sparse_or_complex(ddp: Any) -> bool:
    """Whether some gradient is sparse (``Embedding(sparse=True)``: DDP reduces it apart)
    or complex: neither is flattened and summed with the others."""
    if any(p.is_complex() for p in ddp.parameters()):
        return True
    return any(getattr(m, "sparse", False) for m in ddp.modules()
               if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)))


def ddp_prepare_for_backward(ddp: Any) -> None:
    """What DDP's forward does when its pass reduces (``_post_forward``): arm the reducer."""
    ddp.reducer.prepare_for_backward([])


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


def patch_ddp_buffer_sync(ddp: Any, wrap: Callable[[Callable[[], Any]], Callable[[], Any]]
                          ) -> Callable[[], Any] | None:
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

        def marked_post_hook(is_last_joiner: bool) -> None:
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
    return any(type(o).__name__ == "_DDPJoinHook" and not getattr(o, _JOIN_ENDED, False)
               for o in gc.get_referrers(ddp))


# ---------------------------------------------------------------- torch.distributed
def default_store() -> object | None:
    """The default process group's store, or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def allgather_with_timeout(group: Any, out: list[torch.Tensor], tensor: torch.Tensor, timeout: Any) -> object:
    """``all_gather`` on ``group`` asynchronously, failing after ``timeout`` (a timedelta);
    the group's own ``all_gather`` cannot take a timeout, the process group's method can.
    Raises ImportError/AttributeError/TypeError on a torch without it."""
    from torch._C._distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.timeout = timeout
    return group.allgather([out], [tensor], opts)
