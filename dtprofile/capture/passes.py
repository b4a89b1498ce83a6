"""The hooks on the profiled module and its backward pass, which feed the open step.

- forward pre/post hooks: forward time per micro-batch; the post hook registers a
  gradient hook on the outputs, which marks backward's start and queues an autograd
  callback that marks its end (autograd runs queued callbacks when the graph is done,
  before DDP's own finalisation waits for the reductions: the end of backward
  *compute*), and one more that runs after DDP's (the reductions waited for);
- evaluation (eval mode under no_grad) is left out of the step; a no-grad forward in
  train mode (reentrant checkpointing's first pass, a rollout) stays in it;
- activation checkpointing's recompute inside backward is backward's time.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import console
from .._patching import InstancePatch
from .._torch_internals import _ModuleHook, in_backward, queue_autograd_callback
from .clocks import Clock
from .data_wait import DataWait
from .parts import Parts, guarded
from .steps import MAX_PASSES_PER_STEP, StepTracker
from .tensors import iter_tensors

__all__ = ["PassHooks", "LeanPreHook", "TimedCall", "iter_tensors", "MAX_OUTPUT_TENSORS"]

MAX_OUTPUT_TENSORS = 32

# (looked up once: the lean pre-hook asks every step)
_grad_enabled = torch.is_grad_enabled


def _watched_outputs(output: Any) -> list[torch.Tensor]:
    """The outputs whose gradients mark backward's start: those that require grad, at most
    :data:`MAX_OUTPUT_TENSORS`, half from each end (the loss's input is usually first or last)."""
    if type(output) is torch.Tensor:  # the common case, without the walk
        return [output] if output.requires_grad else []
    tensors = [t for t in iter_tensors(output) if t.requires_grad]
    half = MAX_OUTPUT_TENSORS // 2
    return tensors if len(tensors) <= MAX_OUTPUT_TENSORS else tensors[:half] + tensors[-half:]


class LeanPreHook(_ModuleHook):
    """The forward pre-hook of a lane step that does not time its passes (:mod:`.lane`):
    it marks the start of the step's one training forward, and sends any other forward
    to :meth:`PassHooks.forward_pre_hook` after leaving the lane (which puts the full
    hooks back). Its own errors go to the part as the guard's do; the guard is left out
    for its cost, as is TorchDynamo's: the lane switches to it only while nothing is
    compiled, and back before anything is traced
    (:class:`~dtprofile._torch_internals.CompileWatch`).

    Args:
        passes: the pass hooks (held as ``fn``: a copy of the module gets
            :func:`~dtprofile._torch_internals.inert_hook` instead, as for every hook).
    """

    # (what the call reads, held directly: it runs on every step)
    __slots__ = ("_lane", "_steps", "_parts", "_timing", "_updates", "_clock")

    fn: PassHooks

    def __init__(self, passes: PassHooks) -> None:
        super().__init__(passes)
        self._steps, self._parts, self._timing = passes.steps, passes.parts, passes.timing
        self._lane, self._updates, self._clock = passes.steps.lane, passes.updates, passes.clock

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lane = self._lane
        try:
            if (
                lane.lean
                and lane.f0 is None
                and self._parts.measuring
                and self._timing.enabled
                and not self._steps.backward_reached
                and _grad_enabled()
                and module.training
            ):
                updates = self._updates
                if not updates.opt_depth:
                    lane.f0 = self._clock.mark()
                    return
                if updates.update_start_marked:  # inside the update, whose start is marked after it (Lightning's)
                    lane.f0 = self._clock.mark()
                    lane.forwards_in_update = 1
                    return
            self._steps.leave_lane()
        except Exception as exc:
            self._timing.fail(exc)
            return
        self.fn.forward_pre_hook(module, args, kwargs)


class TimedCall(InstancePatch):
    """Each call of ``owner.<name>`` marked as a forward pass of ``module``, as the module
    hooks would mark its call: for a framework that runs its model's step through a
    method rather than the module's call (Lightning's single-device
    ``strategy.training_step``). An instance attribute takes the method's place; the
    hooks are called directly, without a module call's machinery around them.

    Args:
        owner: the object whose method is timed.
        name: the method's name.
        module: the module the passes are of (its ``training`` flag tells evaluation).
        passes: the pass hooks.
    """

    def __init__(self, owner: Any, name: str, module: torch.nn.Module, passes: PassHooks) -> None:
        self.module = module
        self._pre, self._post = passes.forward_pre_hook, passes.forward_post_hook
        self._lane = passes.steps.lane
        self._lean_pre = LeanPreHook(passes)
        super().__init__(owner, name, self.call)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if self.retired:
            return self._inner(*args, **kwargs)
        module = self.module
        if self._lane.lean:  # a lane step that does not time its passes (see .lane)
            self._lean_pre(module, args, kwargs)
            if self._lane.lean:  # (it marked the forward's start: no end to mark)
                return self._inner(*args, **kwargs)
            # (else it left the lane and ran the full pre-hook)
        else:
            self._pre(module, args, kwargs)
        output = self._inner(*args, **kwargs)
        self._post(module, args, output)
        return output


class PassHooks:
    """Forward and backward marks of the profiled module, into ``steps.current``.

    Args:
        steps: the step tracker.
        data: the data wait (it holds the batch size).
        clock: where marks come from.
        parts: the profiler's parts (the guard reads them).

    ``updates`` (the :class:`~dtprofile.capture.updates.UpdateTracker`) is set by the
    owner: a forward may reveal that the last iteration's update was skipped.
    The per-device batch size (``data.batch_size``) is taken from the first forward's
    first batched tensor unless the loader said it first.
    """

    def __init__(self, steps: StepTracker, data: DataWait, clock: Clock, parts: Parts) -> None:
        self.steps = steps
        self.data = data
        self.clock = clock
        self.parts = parts
        self.timing = parts["timing"]
        self.updates: Any = None
        self.forward_open = False  # between a training forward's pre and post hooks
        self._dropped_pass = False  # the open forward was not recorded (MAX_PASSES_PER_STEP)
        # Whether gradients may be waited for after backward's graph is done (a process
        # group: DDP's or FSDP's finalisation, a loop's own reductions): then the moment
        # they are synced is marked in a callback queued after theirs; else backward's
        # compute end is that moment.
        self.synced_apart = True
        self._full_warned = False

    def in_training_pass(self) -> bool:
        """Inside a profiled forward that records gradients, or inside backward.

        FSDP gathers under ``no_grad`` even in a training forward, so grad mode alone
        cannot tell a training step from evaluation.
        """
        return self.forward_open or in_backward()

    def settled(self) -> bool:
        """No training forward is open or dropped: the lane's hooks (:mod:`.lane`) can
        take the next step's passes."""
        return not (self.forward_open or self._dropped_pass)

    def step_closed(self) -> None:
        """A forward that raised never closed: the next step starts clean."""
        self.forward_open = self._dropped_pass = False

    # ------------------------------------------------------------------ forward
    @guarded("timing")
    def forward_pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lane = self.steps.lane
        if (
            lane.open
            and lane.f0 is None
            and not self.steps.backward_reached
            and torch.is_grad_enabled()
            and getattr(module, "training", True)
            and not in_backward()
        ):
            # The steady lane's step (see .lane): its one training forward starts (inside
            # the update only where the framework marks the update's start after it); the
            # general path below would only append this mark and count it in the update.
            in_update = self.updates.opt_depth > 0
            if not in_update or self.updates.update_start_marked:
                lane.f0 = self.clock.mark()
                lane.forwards_in_update = int(in_update)
                self.forward_open = True
                return
        if in_backward():
            # Activation checkpointing of the whole model recomputes its forward inside
            # backward: that is backward's time, not another forward.
            if torch.is_grad_enabled():
                self._recompute_in_backward()
            return
        steps = self.steps
        if not torch.is_grad_enabled():
            if not getattr(module, "training", True):
                # Evaluation inside the loop (model.eval(), no grad) is not part of a training
                # step. A no-grad forward in train mode (reentrant checkpointing, a rollout)
                # is, and stays in the step: the wait for data ends where it starts.
                if not steps.excluding:  # (inside Lightning's validation loop: evaluation for sure)
                    steps.current.eval_forwards += 1
                steps.exclude_start()
            else:
                self._no_grad_forward_starts()
            return
        updates = self.updates
        # (the skip check only when a backward of this step has synced: rarely)
        in_update = (
            updates.skipped_before_forward(steps.current)
            if steps.current.backward or steps.backward_seen
            else updates.opt_depth > 0
        )
        if self.data.batch_size is None:
            for tensor in iter_tensors((args, kwargs)):
                if tensor.dim() > 0:
                    self.data.batch_size = int(tensor.shape[0])
                    break
        step = steps.current
        if len(step.forward) >= MAX_PASSES_PER_STEP:
            self._step_full()
            return
        step.forward.append([self.clock.mark(), None])
        step.forwards_in_update += in_update
        self.forward_open = True

    @guarded("timing")
    def forward_post_hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        lane = self.steps.lane
        if (
            lane.open
            and lane.f0 is not None
            and lane.f1 is None
            and torch.is_grad_enabled()
            and not in_backward()
            and (not self.updates.opt_depth or self.updates.update_start_marked)
        ):
            lane.f1 = self.clock.mark()
            self.forward_open = False
            tensors = _watched_outputs(output)
            if tensors:
                if lane.times_backward:
                    self._watch_backward(tensors)  # (its marks go to the lane as well)
                else:
                    # Its backward goes untimed: the data wait so far is the step's before the sync.
                    lane.at_sync = (lane.data_wait_s, lane.fetches, lane.data_transfer_s)
                return
            # (no output needs a gradient: the general path below takes the step, ended)
        if in_backward():  # a recompute (and under checkpoint's early stop it never ends)
            return
        step = self.steps.current
        if not torch.is_grad_enabled():
            if not getattr(module, "training", True):
                self.steps.exclude_end()
            elif step.no_grad_forward is not None and step.no_grad_forward[1] is None:
                step.no_grad_forward[1] = self.clock.mark()
            return
        if not step.forward or self._dropped_pass:
            self._dropped_pass = False
            return
        self.forward_open = False
        pair = step.forward[-1]
        if pair[1] is None:
            pair[1] = self.clock.mark()
        tensors = _watched_outputs(output)
        if tensors and not self._backward_untimed(step):
            self._watch_backward(tensors)

    def _watch_backward(self, tensors: list[torch.Tensor]) -> None:
        """Mark backward's start when the first of ``tensors`` gets its gradient."""
        if len(tensors) == 1:  # the common case, and the cheaper hook
            node = tensors[0].grad_fn
            if node is not None and not self.updates.sharded:
                # The node that takes the output's gradient, before it runs: the same
                # moment as a hook on the tensor, for half the cost of registering one.
                # Not under FSDP: autograd runs a node's hooks after its tensors' hooks,
                # and FSDP's pre-backward hook on the output must come after ours. (A DDP
                # probe's hook on the tensor comes first: its reduction keeps the compute's
                # end this pass marks, see NoSyncProbe._reduce.)
                node.register_prehook(self._backward_started)
            else:
                tensors[0].register_hook(self._backward_started)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_started, mode="any")

    @guarded("timing")
    def end_forward(self, output: Any) -> None:
        """End the open forward pass now; gradients of ``output`` mark backward's start.

        For loops whose module call also contains backward and the optimizer step
        (Lightning's manual optimization): call it just before backward.
        """
        self.forward_post_hook(None, (), output)

    def _no_grad_forward_starts(self) -> None:
        """A no-grad forward in train mode (reentrant checkpointing's first pass, a
        rollout): compute, so the step's gap ends at the first; kept as a candidate
        forward until its recompute, if any, shows up in backward (marks of its own,
        released when the next one starts, a fetch comes, or the step closes)."""
        step = self.steps.current
        if not step.forward and step.no_grad_start is None:
            step.no_grad_start = self.clock.mark()
        self.steps.drop_no_grad_forward(step)
        step.no_grad_forward = [self.clock.mark(), None]

    def _recompute_in_backward(self) -> None:
        """Reentrant checkpointing of the whole model: its output came from an autograd
        Function, so no hook saw backward start. It has started by now; and the no-grad
        pass before it was this micro-batch's forward."""
        step = self.steps.current
        if step.backward and step.backward[-1][1] is None:
            return  # a backward already open (non-reentrant: the outputs' hook saw it)
        span = step.no_grad_forward
        if span is not None and span[1] is not None and len(step.forward) < MAX_PASSES_PER_STEP:
            step.forward.append(span)
            step.no_grad_forward = None
        if self._backward_untimed(step):
            return
        self._backward_started(None)

    def _backward_untimed(self, step: Any) -> bool:
        """Whether this pass's backward goes untimed (then ``step.backward_untimed`` is set).

        Without a process group nothing waits for gradients after backward: its start and
        end are timed on a sample of the steps (``backward_timing_every``), since
        registering the hook on each step's new output is most of what timing them
        costs. A step still times it when the figures need its span: a pass inside
        ``optimizer.step(closure)`` (LBFGS, SAM: the update is what its span holds besides
        the passes), unless the framework marks where the update starts, after the
        closure (Lightning's).
        An untimed step counts its data wait up to now as before the sync, as a timed
        one does at backward's end (for a skipped update, what comes after is the next
        step's).
        """
        if step.times_backward or self.synced_apart:
            return False
        updates = self.updates
        if updates.opt_depth > 0 and not updates.update_start_marked:
            return False
        step.backward_untimed = True
        self._data_at_sync(step)
        return True

    def _step_full(self) -> None:
        """This step holds :data:`MAX_PASSES_PER_STEP` passes: the next is not recorded."""
        self._dropped_pass = True
        if not self._full_warned:
            self._full_warned = True
            console.warn(
                f"dtprofile: {MAX_PASSES_PER_STEP} forward passes with gradients and no optimizer step; "
                "further passes of this step are not timed (inference? run it under torch.no_grad() "
                "or torch.inference_mode())",
                stacklevel=4,
            )

    # ------------------------------------------------------------------ backward
    @guarded("timing")
    def _backward_started(self, grad: Any) -> None:
        lane = self.steps.lane
        # The lane's step: its one backward, after its forward ended (else, a backward
        # inside the forward, the general path takes the step).
        if lane.open and lane.times_backward and lane.b0 is None and lane.f1 is not None:
            lane.b0 = self.clock.mark()
            queue_autograd_callback(self._backward_finished)
            return
        if len(self.steps.current.backward) >= MAX_PASSES_PER_STEP:
            return
        self.steps.current.backward.append([self.clock.mark(), None, None])
        queue_autograd_callback(self._backward_finished)

    @guarded("timing")
    def _backward_finished(self) -> None:
        """End of backward compute: autograd's graph is done; DDP has not waited yet.

        Queued at backward start, this runs before DDP's finalisation (queued when the
        last bucket became ready). It queues one more callback, which runs after DDP's:
        that one marks the moment the reductions are waited for and copied back. (A
        probe step's reduction by hand may have marked the end first: that mark stays.)
        """
        lane = self.steps.lane
        if lane.open and lane.b0 is not None and lane.b1 is None:
            lane.b1 = self.clock.mark()
            if lane.synced:  # (DDP waits for the reductions next)
                queue_autograd_callback(self._backward_synced)
            else:  # (no process group: synced when computed)
                lane.at_sync = (lane.data_wait_s, lane.fetches, lane.data_transfer_s)
            return
        passes = self.steps.current.backward
        if passes and passes[-1][1] is None:
            passes[-1][1] = self.clock.mark()
            if not self.synced_apart:
                # Nothing waits for gradients after backward: synced when computed, one mark.
                self._synced(passes[-1][1])
                return
        queue_autograd_callback(self._backward_synced)

    @guarded("timing")
    def backward_compute_done(self) -> None:
        """Mark the open backward pass's compute as ended now, unless it is marked already."""
        passes = self.steps.current.backward
        if passes and passes[-1][1] is None:
            passes[-1][1] = self.clock.mark()

    @guarded("timing")
    def backward_waited(self) -> None:
        """The open backward pass's reductions were waited for now: its sync mark, if it
        has one already, moves here (a probe step's reduction, made by DDP's reducer after
        backward, can end after the pass's own sync callback ran)."""
        passes = self.steps.current.backward
        if passes and passes[-1][2] is not None and passes[-1][2] is not passes[-1][1]:
            earlier = passes[-1][2]
            passes[-1][2] = self.clock.mark()
            self.clock.release(earlier)

    @guarded("timing")
    def _backward_synced(self) -> None:
        mark = self.clock.mark()
        lane = self.steps.lane
        if lane.open and lane.b1 is not None and lane.b2 is None:
            lane.b2 = mark
            lane.at_sync = (lane.data_wait_s, lane.fetches, lane.data_transfer_s)
            return
        self._synced(mark)

    def _synced(self, mark: Any) -> None:
        step = self.steps.current
        step.backward[-1][2] = mark
        self._data_at_sync(step)

    @staticmethod
    def _data_at_sync(step: Any) -> None:
        step.data_wait_at_sync_s = step.data_wait_s
        step.fetches_at_sync = step.fetches
        step.data_transfer_at_sync_s = step.data_transfer_s
