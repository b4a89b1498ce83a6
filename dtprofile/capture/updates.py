"""Where a training step ends: the optimizer's update, or an update that did not come.

The step-bounding optimizer's step hooks mark the update and close the step. A step
also ends without an update when a loss scaler skipped it (told by the scaler itself,
:mod:`.scaler`, or, without one, inferred from gradients zeroed after an un-stepped
backward), when the framework says so (Lightning), or, with several optimizers per batch,
at the batch's end.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import console
from .._torch_internals import optimizer_steps_running
from .clocks import Clock
from .parts import Parts, guarded
from .records import PendingStep
from .steps import MAX_PASSES_PER_STEP, StepTracker

__all__ = ["UpdateTracker", "SKIP_ALTERNATION_LIMIT", "FORWARDLESS_STEPS_TO_WARN"]

log = logging.getLogger(__name__)

#: Inferred skipped updates, each followed by a real step, this many times in a row: the
#: loop's own structure (backward, zero_grad, backward, step), not a loss scaler.
SKIP_ALTERNATION_LIMIT = 3
#: Consecutive optimizer steps with no forward of the profiled model before a warning
#: (one such step is a profile started between forward and step).
FORWARDLESS_STEPS_TO_WARN = 3


class UpdateTracker:
    """The optimizers' step hooks, and every way a step ends without an update.

    Args:
        steps: the step tracker.
        clock: where marks come from.
        parts: the profiler's parts (the guard reads them).

    Set by integrations at construction time (see :class:`dtprofile.engine.Engine`):
    ``steps_end_at_batch`` (a step per batch in which any optimizer stepped: Lightning's
    manual optimization), ``steps_need_backward`` (an optimizer step after forwards
    without backward is a skipped batch: Lightning's automatic optimization) and
    ``update_start_marked`` (the framework calls :meth:`update_starts` after the work
    it runs inside ``optimizer.step`` before the update: Lightning's closure).
    """

    def __init__(self, steps: StepTracker, clock: Clock, parts: Parts) -> None:
        self.steps = steps
        self.clock = clock
        self.parts = parts
        self.timing = parts["timing"]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.primary: torch.optim.Optimizer | None = None  # its steps end the training steps
        self.steps_end_at_batch = False
        self.steps_need_backward = False
        self.update_start_marked = False
        self.sharded = False  # FSDP's pass that did not reduce looks like cleared gradients
        self.opt_start: Any = None
        self.opt_depth = 0
        self._updated_in_batch = False
        self._updates_by_optimizer: dict[int, int] = {}  # id(optimizer) -> completed step() calls
        self._step_wrappers_counted: bool | None = None
        self._steps_without_forward = 0  # consecutive; -1 once warned
        self._backward_unseen_warned = False
        # Skips inferred from zeroed gradients (plain loops without a scaler). Armed by the
        # first real update (a loop whose optimizer never fires its step hooks is not
        # skipping); switched off when they alternate with real steps, which is a loop that
        # zeroes the gradients between two backward passes of one step, or once a loss
        # scaler speaks for itself.
        self.infer_skips = True
        self._updates_seen = 0
        # For each step in a row that had inferred skips: was each of them counted.
        self._inferred_run: list[list[bool]] = []
        self._inferred_since_update: list[bool] = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer attached marks step boundaries; others add optimizer time."""
        self.optimizers.append(optimizer)
        if self.primary is None:
            self.primary = optimizer

    @property
    def update_pending(self) -> bool:
        """An optimizer step was announced (:meth:`mark_optimizer_start`) but has not run."""
        return self.opt_start is not None and self.opt_depth == 0

    def settled(self) -> bool:
        """No update is running or announced, no inferred skip waits for the next real
        step, and the model's forwards are seen: the next step's update can close it in
        the lane (:mod:`.lane`)."""
        return not (
            self.opt_depth
            or self.opt_start is not None
            or self._inferred_since_update
            or self._inferred_run
            or self._steps_without_forward > 0
        )

    def _release_opt_start(self) -> None:
        if self.opt_start is not None:
            self.clock.release(self.opt_start)
            self.opt_start = None

    def _ran_backward(self) -> bool:
        step = self.steps.current
        # An untimed backward is taken to have run, unless the framework announces each
        # one (Lightning: a batch it skipped announces none).
        return (
            bool(step.backward) or step.backward_announced or (step.backward_untimed and not self.steps_need_backward)
        )

    # ------------------------------------------------------------------ the optimizer's hooks
    # The two hooks run on every step: each checks its part and turns its errors into
    # Part.fail itself, as @guarded would, without the guard's call.
    def pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not (self.parts.measuring and self.timing.enabled):
            return
        try:
            # A subclass whose step() calls super().step() runs the hooks twice, nested:
            # only the outermost pair is the optimizer step.
            if self._step_wrappers_counted is None:  # whether this torch's step wrapper can be found
                self._step_wrappers_counted = optimizer_steps_running() is not None
            if self.opt_depth:
                self._settle_opt_depth(inside=1)
            self.opt_depth += 1
            # Keep a start already announced by mark_optimizer_start (Lightning's mixed
            # precision unscales and checks the gradients between the two).
            if self.opt_depth == 1 and self.opt_start is None:
                self.opt_start = self.clock.mark()
        except Exception as exc:
            self.timing.fail(exc)

    def post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not (self.parts.measuring and self.timing.enabled):
            return
        try:
            depth = self.opt_depth - 1
            if depth > 0:
                self.opt_depth = depth
                return
            self.opt_depth = 0
            counts = self._updates_by_optimizer
            key = id(optimizer)
            counts[key] = counts.get(key, 0) + 1
            start, end = self.opt_start, self.clock.mark()
            self.opt_start = None
            if start is None:
                return
            if self.steps_end_at_batch or optimizer is not self.primary:
                self.steps.current.extra_optimizer.append((start, end))
                self._updated_in_batch = True
                return
            lane = self.steps.lane
            if (
                lane.open
                and self._steps_without_forward <= 0
                and (lane.backward_announced or not self.steps_need_backward)
                and lane.close(start, end)
            ):
                self._updates_seen += 1  # (no skips inferred: the lane opens only without them)
                return
            pair = (start, end)
            current = self.steps.current
            current.optimizer = pair
            if not current.forward or self._steps_without_forward:  # (else nothing to note)
                self._note_forward_seen(bool(current.forward))
            if current.forward and not self._ran_backward():
                if self.steps_need_backward:
                    # Lightning in full precision still steps the optimizer after
                    # training_step returned None: a skipped batch, not a step's work.
                    self.steps.close_without_backward(pair[1])
                    return
                if len(current.forward) < MAX_PASSES_PER_STEP:  # (a full step's later passes go unrecorded)
                    self._warn_backward_unseen()
            self.steps.close_step(pair[1])
            self._updates_seen += 1
            if self._inferred_since_update or self._inferred_run:
                self._note_update()
        except Exception as exc:
            self.timing.fail(exc)

    def _settle_opt_depth(self, inside: int = 0) -> None:
        """Drop optimizer steps that raised after their pre hook (the loop caught it, e.g.
        an OOM): their post hook never came, so their depth and start mark are stale.
        ``inside``: step wrappers on the stack that are not among them (the caller's own)."""
        if not self.opt_depth:
            return
        running = optimizer_steps_running()
        if running is None and inside == 0 and self._step_wrappers_counted:
            running = 0
        if running is not None and running - inside < self.opt_depth:
            self.opt_depth = max(0, running - inside)
            if self.opt_depth == 0:
                self._release_opt_start()

    def optimizer_updates(self, optimizer: Any) -> int | None:
        """Completed ``step()`` calls of ``optimizer`` while profiling; None: not one of
        this profiler's optimizers (or not measuring)."""
        if not self.parts.active or not any(o is optimizer for o in self.optimizers):
            return None
        return self._updates_by_optimizer.get(id(optimizer), 0)

    # ------------------------------------------------------------------ steps that did not update
    @guarded("timing")
    def scaler_stepped(self, optimizer: Any, updated: bool) -> None:
        """A loss scaler's ``step(optimizer)`` returned (see :mod:`dtprofile.capture.scaler`).

        From the first one on, the scaler says which updates it skipped, and the
        gradients' state is no longer read for that. ``updated`` False: the scaler found
        inf/NaN gradients and skipped the primary optimizer's update, so the step ends
        here, counted in ``steps_skipped_update``. (With ``steps_end_at_batch`` the
        batch's end decides, in :meth:`end_batch`.)
        """
        if optimizer is not self.primary:
            return
        self.infer_skips = False
        if updated or self.steps_end_at_batch or self.opt_depth > 0:
            return  # (inside a running step: a scaler stepped from an optimizer's own step)
        self.end_step_without_update()

    @guarded("timing")
    def end_step_without_update(self) -> None:
        """End the current step now although no optimizer step ran.

        For frameworks that know an update was skipped (Lightning: the optimizer step was
        due but ``torch.amp.GradScaler`` found inf/NaN gradients and did not call
        ``optimizer.step()``). The step counts in ``steps_total`` and
        ``steps_skipped_update`` but not in the averages: it did all the work of a step
        and updated nothing.

        A step with no backward at all is a batch the training code chose to skip
        (Lightning: ``training_step`` returned None): it counts in
        ``steps_without_backward`` instead, and stays out of the averages as well.
        """
        self._release_opt_start()
        self.opt_depth = 0
        if not self._ran_backward():
            self.steps.close_without_backward(self.clock.mark())
        else:
            self.steps.close_step(self.clock.mark(), skipped=True)

    @guarded("timing")
    def end_batch(self) -> None:
        """A training batch ended (with ``steps_end_at_batch``): if any optimizer stepped
        in it, the step ends now; a batch that stepped none is a micro-batch of the next
        step, or, when an update was announced and did not run, a skipped update.

        For loops whose step is a batch of several optimizers' steps (Lightning's manual
        optimization: a GAN's generator and discriminator).
        """
        if self._updated_in_batch:
            self._updated_in_batch = False
            self._release_opt_start()
            self.steps.close_step(self.clock.mark())
        elif self.update_pending:
            self.end_step_without_update()

    @guarded("timing")
    def announce_backward(self) -> None:
        """The framework is about to run a backward in this step (Lightning's
        ``on_before_backward``): the step is not a skipped batch even if no hook on the
        forward's outputs sees that backward (a ``backward()`` override on another loss)."""
        lane = self.steps.lane
        (lane if lane.open else self.steps.current).backward_announced = True

    @guarded("timing")
    def mark_optimizer_start(self) -> None:
        """The optimizer's update begins now, unless ``optimizer.step`` is already running.

        For frameworks that run the closure (forward and backward) before calling
        ``optimizer.step`` (Lightning's mixed precision): call it after the closure. Inside
        a running step the step's own start holds: its passes are taken out of it.
        """
        if self.opt_depth > 0:
            return
        self._release_opt_start()
        self.opt_start = self.clock.mark()

    @guarded("timing")
    def update_starts(self) -> None:
        """The update itself begins now, inside ``optimizer.step`` or before it.

        For frameworks that run other work in the step before the update (Lightning's
        closure: ``training_step``, backward, the ``on_before_optimizer_step`` hooks and
        gradient clipping, inside ``optimizer.step`` or, in mixed precision, just before
        it): the optimizer phase starts here, and the work before it is forward, backward
        and other compute.
        """
        self._release_opt_start()
        self.opt_start = self.clock.mark()

    # ------------------------------------------------------------------ inferred skips
    def skipped_before_forward(self, step: PendingStep) -> bool:
        """At a training forward: close ``step`` as skipped if its last backward's update
        never came and the gradients were zeroed (a loss scaler without a voice of its
        own). Returns whether this forward runs inside ``optimizer.step`` (a closure)."""
        in_update = self.opt_depth > 0
        backward_done = (step.backward[-1][2] is not None) if step.backward else self.steps.backward_seen
        if (
            self.infer_skips
            and self._updates_seen
            and backward_done
            and self._last_pass_reduced(step)
            and self._grads_cleared()
        ):
            if in_update:  # (a step that raised may have left its depth behind)
                self._settle_opt_depth()
                in_update = self.opt_depth > 0
            # ... unless this is a closure's forward inside optimizer.step (LBFGS, SAM): it
            # re-evaluates the batch of a step still open, and zeroes the gradients itself.
            if not in_update:
                self._end_skipped_at_sync(step)
        return in_update

    def _last_pass_reduced(self, step: PendingStep) -> bool:
        """Whether the last backward pass reduced gradients, as an update's pass does.

        Asked of sharded models only: FSDP2 holds the gradients of a pass that did not
        reduce (accumulation under ``set_requires_gradient_sync(False)``) outside the
        sharded ``.grad``, which then looks cleared, as after a skipped update.
        """
        return not self.sharded or step.reduced_pass == len(step.backward)

    def _grads_cleared(self) -> bool:
        """True when no parameter of the primary optimizer holds a gradient.

        Only asked after a backward in the same step; between accumulated micro-batches
        the first parameter already has one, so this returns at once.
        """
        if self.primary is None:
            return False
        for group in self.primary.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    return False
        return True

    def _end_skipped_at_sync(self, step: PendingStep) -> None:
        """Close ``step`` as skipped where its last backward synced (an untimed one: now);
        the rest is the next step's."""
        carry_s = step.data_wait_s - step.data_wait_at_sync_s
        carry_transfer_s = step.data_transfer_s - step.data_transfer_at_sync_s
        carry_fetches = step.fetches - step.fetches_at_sync
        step.data_wait_s -= carry_s
        step.data_transfer_s -= carry_transfer_s
        step.fetches -= carry_fetches
        self._release_opt_start()
        counted_before = self.steps.steps_skipped_update
        if step.backward:
            self.steps.close_step(step.backward[-1][2], skipped=True, ends_now=False)
        else:
            self.steps.close_step(self.clock.mark(), skipped=True)
        current = self.steps.current
        current.data_wait_s += carry_s
        current.data_transfer_s += carry_transfer_s
        current.fetches += carry_fetches
        self._inferred_since_update.append(self.steps.steps_skipped_update > counted_before)

    def _note_update(self) -> None:
        """A real optimizer step closed (counted by the caller) after skips were inferred:
        stop inferring them on an alternating pattern."""
        inferred = self._inferred_since_update
        if not inferred:
            if self._inferred_run:
                self._inferred_run.clear()
            return
        self._inferred_since_update = []
        self._inferred_run.append(inferred)
        if len(self._inferred_run) >= SKIP_ALTERNATION_LIMIT:
            # Each of those steps was counted as several (skipped parts and a stepped one):
            # count them once, and keep their parts out of the averages and the warm-up.
            self.infer_skips = False
            self.steps.steps_skipped_update -= sum(sum(step) for step in self._inferred_run)
            self.steps.take_back(sum(len(step) for step in self._inferred_run))
            log.info(
                "dtprofile: every step zeroes the gradients between two backward passes; "
                "not counting those as skipped updates"
            )

    # ------------------------------------------------------------------ warnings
    def _note_forward_seen(self, seen: bool) -> None:
        """Warn once when the profiled model's forward has not run in 3 steps in a row: the
        loop calls another module (a copy, an EMA model, the unwrapped one under DDP), so
        forward and backward read 0 and all compute lands in 'other'."""
        if self._steps_without_forward < 0:
            return
        self._steps_without_forward = 0 if seen else self._steps_without_forward + 1
        if self._steps_without_forward >= FORWARDLESS_STEPS_TO_WARN:
            self._steps_without_forward = -1
            console.warn(
                "dtprofile: the profiled model's forward has not run in the last "
                f"{FORWARDLESS_STEPS_TO_WARN} optimizer steps, so forward and backward read 0 and "
                "their time counts as 'other' compute: pass dtprofile.profile() the module your "
                "loop calls (the DDP/FSDP wrapper or the compiled module, not a copy)",
                stacklevel=4,
            )

    def _warn_backward_unseen(self) -> None:
        """A step with a forward and an update, but no backward through the forward's
        outputs: the loss came from tensors dtprofile cannot follow."""
        if self._backward_unseen_warned:
            return
        self._backward_unseen_warned = True
        console.warn(
            "dtprofile: the model's forward ran but no backward pass reached its outputs, so backward "
            "is counted with 'other' compute; dtprofile follows the tensors a forward returns in "
            "tuples, lists, dicts and dataclasses: return the loss's input in one of them",
            stacklevel=4,
        )
