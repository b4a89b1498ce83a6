"""How one DDP model's gradient communication is timed: the choice and the switch.

Three ways, chosen when the profiler attaches (:meth:`DDPAttachment.attach`):

- **no hook** (the default where it can): DDP keeps its own C++ all-reduce; each step
  times the wait after backward, and probe steps reduce by hand (:class:`NoSyncProbe`;
  with a search for unused parameters, DDP's reducer reduces them after backward),
  which times communication alone. A Python hook would cost every bucket a call into
  Python and, on a CPU, a pass of its own to divide the bucket;
- **dtprofile's hook** (:class:`TimedHook`): where probe steps cannot skip DDP's
  reduction (a static graph, mixed precision, a compiled forward, backward inside the
  forward), or with ``bucket_timing_every`` > 0; a
  ``TimedHook`` the user registered is used as is;
- **the wait only**: a hook of the user's that dtprofile cannot time: one warning; DDP
  reduces through it, and each step times the wait after backward as with no hook, but
  there are no probe steps, so no total, overlap or bandwidth;
- **not at all**: a model another running profiler already times: one warning, and
  communication is reported unmeasured.

When probe steps turn out unable to reduce by hand mid-run, the hook takes over at the
next step's close (:meth:`DDPAttachment.lost_probes_by_hand`). The intervals themselves
go through the :class:`~dtprofile.capture.comm.CommRecorder`'s one record path.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from .._torch_internals import compiled_module, ddp_reduces_plainly, default_store, eager, patch_ddp_buffer_sync
from ..options import BUCKET_TIMING_AUTO
from .ddp import NoSyncProbe, TimedHook, find_timed_hook, other_hook, timed_buffer_sync, wire_bytes
from .parts import guarded

__all__ = ["DDPAttachment"]

log = logging.getLogger(__name__)


class DDPAttachment:
    """The DDP model a :class:`~dtprofile.capture.comm.CommRecorder` times, and how.

    Args:
        recorder: the recorder; its ``ddp``, ``ddp_config`` and ``comm_source`` are set here.

    A one-rank DDP model gets no communication hook; ``time_one_rank`` (class attribute
    of the recorder) gives it one all the same, so that the hook's code can be checked on
    a machine with a single GPU (benchmarks/gpu_check.py).
    """

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.parts = recorder.parts  # (the guard reads them)
        self.timed_hook: TimedHook | None = None
        self.untimed_hook = False  # a hook of the user's that dtprofile cannot time
        self.probe_by_hand: NoSyncProbe | None = None  # no hook: probe steps reduce by hand
        self._switch_to_hook = False  # register dtprofile's hook at the next step's close
        self._syncing_passes: list[Any] = []  # no hook: the forward hook that counts syncing passes
        self._grad_bytes = 0  # no hook: the bytes each syncing backward reduces
        self._undo: list[Callable[[], Any]] = []

    @property
    def holds_probes(self) -> bool:
        """Probe steps hold DDP's reductions in the timed hook (where no
        :class:`NoSyncProbe` makes its own probe steps)."""
        return self.timed_hook is not None and self.probe_by_hand is None

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time ``ddp``'s gradient communication the cheapest way that measures it (see the
        module's docstring): no hook where probe steps can skip DDP's reduction, else a
        :class:`TimedHook` (re-used when one is registered already); a hook of the
        user's that dtprofile cannot time gets one warning, and its wait after backward
        is timed as with no hook."""
        recorder = self.recorder
        if self.timed_hook is not None:
            return
        recorder.ddp = ddp
        recorder.ddp_config = {
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            # DDP keeps int(bucket_cap_mb * 2**20) bytes: 0.01 comes back as 0.0099993.
            "bucket_cap_mb": round(getattr(ddp, "bucket_bytes_cap", 0) / 2**20, 4) or None,
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "compiled_inside": compiled_module(getattr(ddp, "module", None)),
        }
        if recorder.world_size < 2 and not recorder.time_one_rank:
            return  # a one-rank all-reduce moves nothing: no hook, and nothing it would cost
        try:
            hook, other = find_timed_hook(ddp)
            if hook is None and not other and self._hook_free(ddp):
                self._attach_without_hook(ddp)
                return
            if hook is None and other:
                self.untimed_hook = True
                recorder.warn_untimed_hook()
                self._attach_without_hook(ddp, probes=False)
                return
            if hook is not None and hook.recorder is not recorder and getattr(hook.recorder, "active", False):
                recorder.taken_by_another()  # the hook times for one profiler: the one that has it
                return
            self._time_buffer_sync(ddp)
            self._attach_hook(ddp, hook)
            timed_hook = cast(TimedHook, self.timed_hook)  # (set by _attach_hook)
            if timed_hook._default and self._can_skip_sync(ddp):
                self.probe_by_hand = NoSyncProbe(
                    ddp, recorder, recorder.steps.options, default_store(), by_reciprocal=timed_hook.by_reciprocal
                )
                self._undo.append(self.probe_by_hand.remove)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _attach_hook(self, ddp: torch.nn.parallel.DistributedDataParallel, hook: TimedHook | None) -> None:
        """Time through ``hook``, or a :class:`TimedHook` registered now (None)."""
        if hook is None:
            hook = TimedHook()
            # In DDP's own all-reduce's stead: its arithmetic. (A gradient that is already a
            # view of its bucket, gradient_as_bucket_view without set_to_none, DDP divides:
            # the last bit can differ there at sizes that are not powers of two.)
            hook.by_reciprocal = True
            # The model's own group (allreduce_hook with no state would reduce over WORLD).
            ddp.register_comm_hook(getattr(ddp, "process_group", None), hook)
        hook.reduces_in_finalize = bool(
            getattr(ddp, "static_graph", False) or getattr(ddp, "_delay_all_reduce_all_params", False)
        )
        recorder = self.recorder
        hook.recorder = recorder
        self.timed_hook = hook
        recorder.comm_source = "user" if hook.user_supplied else "dtprofile"
        recorder.ddp_config["comm_hook"] = hook.hook_name
        recorder.ddp_config["compressed_16bit"] = hook.wire_itemsize == 2

    def _attach_without_hook(self, ddp: torch.nn.parallel.DistributedDataParallel, probes: bool = True) -> None:
        """DDP keeps its own all-reduce (:meth:`_hook_free`), or a hook of the user's
        (``probes`` False); probe steps reduce by hand unless ``bucket_timing_every`` is 0
        or there is such a hook (a probe could not reproduce its reduction)."""
        recorder = self.recorder
        owner = _HOOK_FREE_OWNERS.get(ddp)
        if owner is not None and owner is not recorder and owner.active:
            recorder.taken_by_another()
            return
        self._time_buffer_sync(ddp)
        self._count_syncing_passes(ddp)
        if probes and recorder.steps.options.bucket_timing_every == BUCKET_TIMING_AUTO:
            # Communication alone, on the probe steps: the all-reduce by hand after backward.
            self.probe_by_hand = NoSyncProbe(ddp, recorder, recorder.steps.options, default_store())
            self._undo.append(self.probe_by_hand.remove)
            recorder.comm_source = "ddp_probe"
        _HOOK_FREE_OWNERS[ddp] = recorder
        self._undo.append(lambda: _release_owner(ddp, recorder))

    def _hook_free(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Whether DDP keeps its own C++ all-reduce (no hook): ``bucket_timing_every`` 0,
        or ``"auto"`` where probe steps can reduce by hand (:class:`NoSyncProbe`) and so
        time communication alone.

        A Python hook costs every bucket a call into Python and, on the CPU, a pass of its
        own to divide the bucket (DDP divides while it copies gradients in): with many
        small buckets that is a fifth of a short step. Without one, only the wait after
        backward is timed on ordinary steps, which needs no call per bucket.
        """
        options = self.recorder.steps.options
        if options.bucket_timing_every == 0:
            return True
        return (
            options.bucket_timing_every == BUCKET_TIMING_AUTO
            and options.probe_every != 0
            and self._can_skip_sync(ddp, unused_search=True)
        )

    def _can_skip_sync(self, ddp: torch.nn.parallel.DistributedDataParallel, unused_search: bool = False) -> bool:
        """Whether probe steps may run DDP's passes as under ``no_sync()`` and reduce by hand
        (:class:`NoSyncProbe`): DDP reduces the plain way, outside a compiled forward, and
        backward runs after the forward, not inside it. ``unused_search``: also a model
        that searches for unused parameters, whose probes DDP's reducer reduces (with
        DDP's own all-reduce only: no hook)."""
        recorder = self.recorder
        return (
            ddp_reduces_plainly(ddp, unused_search)
            and not recorder.ddp_config["compiled_inside"]
            and not recorder.backward_in_forward
            and default_store() is not None
        )

    def every_rank_started(self, every_rank: bool, start_key: str | None = None) -> None:
        """The profiler started, on every rank or not (one verdict for all ranks, made under
        the store key ``start_key``, which names the probes' meetings). Probes that reduce
        by hand need every rank and that key; without them, dtprofile's hook times the
        buckets (a hook on some ranks only makes the same collectives)."""
        if self.probe_by_hand is not None:
            if (
                start_key is None
                and every_rank
                and self.recorder.ddp is not None
                and _group_size(self.recorder.ddp) == 1
            ):
                start_key = f"dtprofile/one-rank/{os.getpid()}/{next(_ONE_RANK_STARTS)}"  # (no one to meet)
            every_rank = every_rank and start_key is not None
            self.probe_by_hand.start(every_rank, start_key)
            if not every_rank:
                self.lost_probes_by_hand()

    def lost_probes_by_hand(self) -> None:
        """Probe steps cannot skip DDP's reduction on this model after all (a backward ran
        inside DDP's forward, the forward is compiled and the probe's hooks were traced
        away, or a join() began): from the next step on, probe steps hold the reductions
        in dtprofile's hook, registered then if there is none, which also times the buckets."""
        if self.probe_by_hand is not None:
            self.probe_by_hand.disabled = True
            self.probe_by_hand = None
            # At the step's close, when no backward is under way.
            self._switch_to_hook = self.timed_hook is None

    def lane_takes_steps(self) -> bool:
        """Whether the steady lane (:mod:`.lane`) may close the open step and take the next:
        DDP reduces with its own all-reduce, counted by its bytes after each forward (or
        there is no DDP model to time; or through a hook of the user's, whose wait is timed
        the same way), no switch to the hook is due at this close, and the next
        synchronising forward is no probe's. (Anything else that records communication
        reads the open step, which leaves the lane first.)"""
        if self.timed_hook is not None or self._switch_to_hook:
            return False
        probe = self.probe_by_hand
        return probe is None or not (probe.compiled or probe.due() or probe.window_open)

    def step_closed(self, step: Any) -> None:
        """A step closed: a probe that reduced nothing by hand is an ordinary step, and the
        hook takes over where probes can no longer reduce by hand."""
        by_hand = self.probe_by_hand
        if by_hand is not None or self._switch_to_hook:
            step.probe = step.reduced_by_hand  # the probe steps NoSyncProbe chose and made
        if by_hand is not None and by_hand.compiled:
            self.lost_probes_by_hand()
        if self._switch_to_hook:
            self._use_hook_now()

    def _use_hook_now(self) -> None:
        self._switch_to_hook = False
        try:
            while self._syncing_passes:
                self._syncing_passes.pop().remove()
            self._attach_hook(self.recorder.ddp, None)
            log.debug(
                "dtprofile: DDP's buckets are timed through dtprofile's hook from step %d on",
                self.recorder.steps.steps_seen,
            )
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _count_syncing_passes(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """No hook of dtprofile's (:meth:`_hook_free`): DDP reduces with its own C++
        all-reduce, or through a hook of the user's.

        After each of DDP's training forwards that will reduce in backward (outside
        ``no_sync()``) the step gets one untimed interval holding every gradient's bytes
        on the wire (in the steady lane, the bytes; the interval if the step leaves it),
        so that the pass hooks' wait after that backward counts as exposed communication.
        """
        name, wire_itemsize = other_hook(ddp) if self.untimed_hook else (None, None)
        self._grad_bytes = sum(wire_bytes(p, wire_itemsize) for p in ddp.parameters() if p.requires_grad)
        handle = ddp.register_forward_hook(self._ddp_forward_done)
        self._syncing_passes.append(handle)
        self._undo.append(handle.remove)
        self.recorder.comm_source = "ddp_exposed"
        self.recorder.ddp_config["comm_hook"] = name
        if self.untimed_hook:
            self.recorder.ddp_config["compressed_16bit"] = wire_itemsize == 2

    @guarded("comm")
    def _ddp_forward_done(self, module: Any, args: Any, output: Any) -> None:
        recorder = self.recorder
        if not (
            torch.is_grad_enabled()
            and getattr(module, "require_backward_grad_sync", True)
            and not recorder.steps.excluding
        ):
            return
        recorder.untimed_reduction(self._grad_bytes)

    def _time_buffer_sync(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time DDP's buffer broadcast before each forward (see :func:`timed_buffer_sync`)."""
        recorder = self.recorder
        undo = patch_ddp_buffer_sync(ddp, lambda original: eager(timed_buffer_sync(ddp, original, recorder)))
        if undo is None:
            return  # another torch, or another profiler's
        if getattr(ddp, "broadcast_buffers", True) and getattr(ddp, "modules_buffers", None):
            recorder.ddp_config["buffer_broadcast_bytes"] = sum(
                b.numel() * b.element_size() for b in ddp.modules_buffers
            )
        else:
            recorder.ddp_config["buffer_broadcast_bytes"] = 0
        self._undo.append(undo)

    def detach(self) -> None:
        """Put back what was patched; DDP's hook passes straight through from now on."""
        while self._undo:
            self._undo.pop()()
        if self.timed_hook is not None:
            self.timed_hook.recorder = None
            self.timed_hook.release_held()


#: The recorder that times each DDP model without a hook (one per model); nothing is
#: stored on the model itself.
_HOOK_FREE_OWNERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


#: Starts of profilers of a one-rank group in this process (their meetings' names).
_ONE_RANK_STARTS = itertools.count()


def _group_size(ddp: Any) -> int:
    try:
        return dist.get_world_size(getattr(ddp, "process_group", None) or dist.group.WORLD)
    except Exception:
        return 0


def _release_owner(ddp: Any, recorder: Any) -> None:
    if _HOOK_FREE_OWNERS.get(ddp) is recorder:
        del _HOOK_FREE_OWNERS[ddp]
