"""Probe steps of a DDP model that reduce by hand: compute measured as without DDP.

:class:`NoSyncProbe` runs a probe's passes as under ``no_sync()`` and reduces their
gradients when the backward that produces them ends, as DDP would have: the step's
compute is then as on one device, and its communication is timed alone. Only a plain
pass is measured so (one forward, one backward from its outputs, nothing else on the
group between them), agreed by every rank; whatever the pass turns out to be, its
gradients are reduced once, where DDP would have reduced them, and every rank checks
that it holds the same result before the optimizer sees it. Where a probe cannot skip
DDP's reduction, probe steps hold the reductions in the timed hook instead
(:mod:`dtprofile.capture.ddp`).
"""

import struct
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from .. import console
from .._torch_internals import ddp_output_tensors, ddp_reduce_after_backward, module_hook, queue_autograd_callback
from .agree import StoreAgreement
from .records import PROBE_HOST
from .steps import probes

__all__ = [
    "NoSyncProbe",
    "solo_probe",
    "PROBE_CHUNKS_IN_FLIGHT",
    "PROBE_BYTES_IN_FLIGHT",
    "IRREGULAR_PROBES_MAX",
    "TURN_RANKS_MAX",
]

#: Probe windows that were not plain passes (agreed by the ranks) before probe steps stop
#: for the run: a loop's shape repeats, so the second one says it is the loop's.
IRREGULAR_PROBES_MAX = 2


class _Window:
    """A probe's passes: from its first forward to the end of the first backward that
    gives the model's parameters gradients (where DDP would have reduced them).

    Every training forward of the model in the window runs as under ``no_sync()``, so
    that the one reduction made at its end holds all of them, as DDP's would."""

    __slots__ = (
        "index",
        "forwards",
        "sequence",
        "outputs",
        "ready",
        "accumulated",
        "output_seen",
        "grad_only",
        "queued",
        "handles",
        "turn",
        "turn_missed",
        "turn_hook",
        "opened_s",
    )

    def __init__(self, index: int) -> None:
        self.index = index  # the run's probe windows before this one (the same on every rank)
        self.forwards = 0  # the model's training forwards in the window
        self.sequence: int | None = None  # the group's collectives count after the first forward
        self.outputs: list[Any] = []  # the last forward's outputs DDP's reducer searches from (in_reducer)
        self.ready: list[int] = []  # parameters whose gradients came, in order (in_reducer)
        self.accumulated = False  # a backward gave a parameter its gradient
        self.output_seen = False  # a backward started from the forward's outputs
        self.grad_only = False  # a backward through the outputs that gave no parameter a gradient
        self.queued = 0  # end-of-backward callbacks queued and not yet run
        self.handles: list[Any] = []  # the hooks on the parameters' gradient accumulation
        self.turn = False  # its passes run one rank at a time (solo_probe)
        self.turn_missed = False  # this rank stopped waiting for its turn (the rank before never finished)
        self.turn_hook: Any = None  # the wrapped module's pre-hook that waits for the turn
        self.opened_s = time.perf_counter()


class NoSyncProbe:
    """Probe steps that measure compute exactly as a step without DDP: each pass that
    would reduce runs as under ``no_sync()``, and its gradients are all-reduced by hand
    at the end of its backward, before anything else sees them.

    Holding the reductions (:meth:`TimedHook._probe`) keeps communication from
    overlapping backward, but not DDP's own CPU work during it: copying each gradient
    into its bucket, dividing it, gloo's reductions on the same cores. On a CPU that
    work can double backward, and a one-device run does none of it. Here backward runs
    with DDP's reducer idle, as on one device; the reduction then happens whole, timed
    as exposed communication.

    The gradients are those DDP would produce: scaled by the group's size as DDP's
    reducer scales them (by the reciprocal as it copies, or divided where a gradient is
    a view of its bucket) and summed, in chunks laid out as DDP's buckets after it
    rebuilt them (:func:`_buckets`: bit-identical at any world size; before that, chunks
    of DDP's bucket size, equal up to the order of the floating-point sum). Used
    only where DDP reduces every pass the plain way
    (:func:`~dtprofile._torch_internals.ddp_reduces_plainly`), with DDP's own all-reduce
    or dtprofile's default hook (no user hook to reproduce). The flag DDP reads is
    restored after every forward, also one that raises.

    A model that searches for unused parameters (``find_unused_parameters``, with DDP's
    own all-reduce) is reduced by DDP's reducer itself after backward instead
    (:func:`~dtprofile._torch_internals.ddp_reduce_after_backward`, ``in_reducer``): the
    reducer records which parameters each backward used, also under ``no_sync()``, and
    only its own reduction clears that record, which the next step's reduction reads.

    **Which passes, and what every rank agrees.** A window opens at a synchronising
    training forward on :func:`~dtprofile.capture.schedule.probes`' schedule, counted
    among those forwards from a start every rank made (:meth:`start`), so it opens at
    the same forward on every rank. It closes at the end of the first backward that
    gives a parameter its gradient, where DDP would have reduced; a backward that gives
    none (``torch.autograd.grad`` through the outputs, a gradient penalty's first pass)
    leaves it open. There the ranks meet on the store (:class:`~.agree.StoreAgreement`,
    never on the job's process group): the window was a probe only if on every rank it
    held one forward, one backward from its outputs, no ``autograd.grad`` through them
    and no collective on the group between them. Either way its gradients are reduced
    then; a window that was not a probe is left out of the figures, and the second one
    stops probe steps for the run, with one warning that says why.

    **The safety net.** After each window's reduction, before the optimizer can see the
    gradients, the ranks confirm on the store that they hold the same ones (two sums of
    them); if not, the gradients are all-reduced again as DDP does, which makes them the
    same on every rank, and probe steps stop for the run, with a warning.

    Args:
        ddp: the DistributedDataParallel model.
        recorder: the :class:`~dtprofile.capture.comm.CommRecorder` (its ``end`` and
            ``blocking_start`` time the reduction).
        options: the run's options (``warmup_steps``, ``probe_every``,
            ``gather_timeout_s``: how long a rank waits for the others at a meeting).
        store: the job's store the ranks meet on (``torch.distributed``'s default store).
    """

    def __init__(self, ddp: Any, recorder: Any, options: Any, store: Any, by_reciprocal: bool = True) -> None:
        self.ddp = ddp
        self.recorder = recorder
        self.options = options
        # As the ordinary steps scale the gradients: DDP's own reducer (by the reciprocal;
        # also dtprofile's hook in its stead), or a timed allreduce_hook of the user's, which
        # divides (False).
        self.by_reciprocal = by_reciprocal
        self._group = getattr(ddp, "process_group", None) or dist.group.WORLD
        self._size = dist.get_world_size(self._group)
        self._agreement = StoreAgreement(
            store, str(getattr(self._group, "group_name", "")), self._size, float(options.gather_timeout_s)
        )  # (named at the start)
        self._suppressed = False  # this forward runs as under no_sync()
        self._started = False  # every rank started profiling (probes may run)
        self._passes = 0  # synchronising training forwards since the start
        self._windows = 0  # probe windows opened since the start
        self._window: _Window | None = None  # the open one
        self._irregular = 0  # windows that were not plain passes (agreed)
        # Probe steps whose passes run one rank at a time (solo_probe): only on CPU ranks of
        # a gloo group, and only once a probe was agreed plain (a loop that waits for the
        # other ranks inside its passes would keep a turn waiting).
        self._probe_steps = 0  # probe steps opened since the start
        self._turn_ranks, self._rank = _turn_group(self._group) if _on_cpu(_reduced_params(ddp)) else (0, 0)
        self._plain_pass_s: float | None = None  # the last plain probe window's length on this rank
        self._turns_off = False  # a rank missed its turn: no more turns
        self.stopped: str | None = None  # why probe steps stopped for the run (None: they did not)
        self._params = _reduced_params(ddp)
        # DDP's reducer makes the probe's reduction after backward where the model searches
        # for unused parameters (see the docstring).
        self.in_reducer = bool(getattr(ddp, "find_unused_parameters", False))
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
        # A backward inside DDP's forward (a training step run as the module's call) would
        # skip a probe's reduction altogether: one parameter's gradient accumulation is
        # watched during each synchronising forward.
        self._in_forward = False
        self._backward_seen = False
        # DDP's reducer is armed: a synchronising forward ran that was no probe's, and no
        # backward since (one parameter's gradient accumulation tells: the one watched).
        self._armed = False
        self._pending = False  # a probe came due in the middle of a step: the next step's first pass
        self._step = -1  # the step (steps_seen) of the last synchronising forward
        self._probe_step = -1  # the probe step under way: its later passes are probes too
        self.disabled = False
        self._removed = False  # the profiler stopped (the hooks go once no window is open)
        self.compiled = False  # its hooks were traced into a compiled forward
        self._handles = [
            ddp.register_forward_pre_hook(self._forward_pre),
            ddp.register_forward_hook(self._forward_post, always_call=True),
        ]
        watched = self._params[0] if self._params else None
        if watched is not None and hasattr(watched, "register_post_accumulate_grad_hook"):
            self._handles.append(watched.register_post_accumulate_grad_hook(self._grad_accumulated))

    def start(self, every_rank: bool, start_key: str | None = None) -> None:
        """The profiler started; ``every_rank``: on every rank of the group (one verdict
        for all, made under the store key ``start_key``, which names this run's meetings),
        so that probes may run."""
        self._started = every_rank
        self._passes = 0
        if start_key is not None:
            self._agreement.name(start_key)

    def due(self) -> bool:
        """Whether the next synchronising training forward opens a probe's window (what
        :meth:`_forward_pre` decides, and the steady lane asks at a close)."""
        return (
            not self.disabled
            and self._started
            and self._window is None
            and (self._pending or probes(self._passes, self.options.warmup_steps, self.options.probe_every))
        )

    @property
    def window_open(self) -> bool:
        """A probe's passes are under way (their reduction is still to come)."""
        return self._window is not None

    def remove(self) -> None:
        """No more probes. A window under way keeps its hooks until its reduction, which
        needs them: a forward after this one and before that backward still runs as the
        window's (else DDP would reduce that backward too)."""
        self.disabled = self._removed = True
        self._restore()
        if self._window is None:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    # ------------------------------------------------------------------ forward
    def _forward_pre(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Traced into a compiled DDP forward: DDP's flag would be a guard, and a probe a
            # recompilation. Probe steps of a compiled model hold the reductions instead.
            self.compiled = True
            return
        ddp = self.ddp
        try:
            if self.disabled and self._window is None:
                return
            if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
                return
            self._in_forward, self._backward_seen = True, False
            window = self._window
            step = self.recorder.steps.steps_seen
            first, self._step = step != self._step, step  # the step's first synchronising forward
            if window is None:
                due = self.due()  # (this pass, before it is counted)
                self._passes += 1
                continues = self._probe_step == step and not self.disabled
                if self._armed or not ((due and first) or continues):
                    # A probe step's passes all run as probes, from its first on: one due in
                    # the middle of a step waits for the next step's first pass. (Armed by an
                    # earlier forward whose backward has not come, DDP reduces the next
                    # backward whatever this pass does: it cannot be a probe's either.)
                    self._pending = due and not continues
                    self._armed = True
                    return
                self._pending = False
                self._probe_step = step
                if getattr(getattr(ddp, "_join_config", None), "enable", True):
                    # A join() (uneven inputs) shadows DDP's own reductions for the ranks that
                    # ran out, not one made by hand: from now on probes hold the reductions.
                    self.recorder.lost_probes_by_hand()
                    return
                window = self._open(first)
            else:
                self._passes += 1
            window.forwards += 1
            ddp.require_backward_grad_sync = False
            self._suppressed = True
        except Exception:  # a probe never breaks training: this pass is an ordinary one
            self._restore()

    def _open(self, first: bool) -> _Window:
        """A probe's window opens (``first``: its step's first): watch every parameter's
        gradient accumulation until the backward that produces them ends (on the probe
        steps only: they are few)."""
        window = self._window = _Window(self._windows)
        self._windows += 1
        for index, param in enumerate(self._params):
            window.handles.append(
                param.register_post_accumulate_grad_hook(lambda _param, index=index: self._accumulated(window, index))
            )
        if first:
            window.turn = (
                self._turn_ranks > 0
                and self._plain_pass_s is not None
                and not self._turns_off
                and solo_probe(self._probe_steps)
            )
            self._probe_steps += 1
            if window.turn:
                try:
                    self.recorder.steps.current.alone = True
                except Exception:
                    pass
            inner = getattr(self.ddp, "module", None)
            if window.turn and self._rank > 0 and isinstance(inner, torch.nn.Module):
                # On the wrapped module: it runs after DDP's own collectives before forward
                # (the buffers' broadcast), which every rank makes first. A copy of the
                # module (an EMA model) gets an inert hook.
                window.turn_hook = inner.register_forward_pre_hook(module_hook(lambda m, a: self._take_turn(window)))
        return window

    def _take_turn(self, window: _Window) -> None:
        """A window whose passes run alone: wait until the rank before this one has
        finished its backward (on the store), so that on a host the ranks share each
        computes with the others idle; how much faster than beside them is what sharing
        the host costs. The wait is exposed time of the step, not its compute.

        The wait is bounded (this rank's place times four plain windows' length, plus a
        second): a loop that waits for the other ranks inside its passes would keep it
        waiting, and the other ranks waiting for it. A turn missed so ends turns for the
        run, and its step is left out."""
        hook, window.turn_hook = window.turn_hook, None
        if hook is not None:
            hook.remove()
        recorder = self.recorder
        wait = None
        try:
            if recorder.active:
                wait = _start(recorder, 0, PROBE_HOST)
        except Exception:
            wait = None
        timeout_s = min(float(self.options.gather_timeout_s), 1.0 + 4.0 * self._rank * (self._plain_pass_s or 0.0))
        window.turn_missed = not self._agreement.wait(f"{window.index}/turn{self._rank - 1}", timeout_s)
        if wait is not None:
            recorder.end(wait)

    def _grad_accumulated(self, param: Any) -> None:
        if self._in_forward:
            self._backward_seen = True
        else:
            self._armed = False  # (a backward: DDP's reducer reduced it)

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._in_forward:
            self._in_forward = False
            if self._backward_seen:
                self._backward_inside_forward()
        if not self._suppressed:
            return
        self._restore()
        ddp = self.ddp
        ddp.require_forward_param_sync = True  # as after a pass that reduces (buffers next forward)
        window = self._window
        if window is None:
            return
        if window.forwards == 1:
            window.sequence = _sequence_number(self._group)  # (after DDP's own broadcast of the buffers)
        if self.in_reducer:
            window.outputs = ddp_output_tensors(ddp, output)  # (DDP searches from its last forward's)
        from .passes import _watched_outputs  # (one definition of "the outputs backward starts from")

        tensors = _watched_outputs(output) if output is not None else []
        started = lambda grad: self._output_grad(window)  # noqa: E731
        if len(tensors) == 1:
            tensors[0].register_hook(started)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any")

    def _backward_inside_forward(self) -> None:
        self.disabled = True
        try:
            self.recorder.lost_probes_by_hand()
        except Exception as exc:
            self.recorder.parts["comm"].fail(exc)
        window = self._window
        if window is not None and window.accumulated:
            # This probe's backward ran unsynchronised inside the forward and its update
            # is done: nothing can reduce it now. (The first synchronising forward, never
            # a probe, normally reveals the pattern first.)
            console.warn(
                "dtprofile: a probe step's backward ran inside DDP's forward, so its gradients were not "
                "all-reduced; further probe steps hold DDP's reductions instead",
                stacklevel=2,
            )

    def _restore(self) -> None:
        if self._suppressed:
            self._suppressed = False
            self.ddp.require_backward_grad_sync = True

    # ------------------------------------------------------------------ backward
    def _output_grad(self, window: _Window) -> None:
        """A backward reached the window's outputs: its end decides (never guarded: the
        window's gradients must be reduced whatever happens to the profiler)."""
        if window is self._window:
            window.output_seen = True
            self._queue_end(window)

    def _accumulated(self, window: _Window, index: int) -> None:
        """A parameter got its gradient in the window's backward (what DDP's own hook on it
        would have marked ready then)."""
        if window is not self._window:
            return
        if self.in_reducer:
            window.ready.append(index)
        window.accumulated = True
        if not window.queued:  # (a backward that did not start from the outputs)
            self._queue_end(window)

    def _queue_end(self, window: _Window) -> None:
        window.queued += 1
        queue_autograd_callback(lambda: self._backward_ended(window))

    def _backward_ended(self, window: _Window) -> None:
        """A backward that reached the window ended. One that gave no parameter a gradient
        (``autograd.grad``) leaves the window open; the first that did closes it, once no
        outer backward (reentrant checkpointing) is still running."""
        if window is not self._window:
            return
        window.queued -= 1
        if not window.accumulated:
            window.grad_only = True
            return
        if window.queued > 0:
            return
        self._close(window)

    def _close(self, window: _Window) -> None:
        """The window's backward is done: the ranks agree whether it was a plain pass, then
        its gradients are reduced (by hand, or by DDP's reducer) and checked."""
        self._window = None
        for handle in window.handles:
            handle.remove()
        if self._removed:
            self._remove_hooks()
        recorder = self.recorder
        timed = recorder is not None and recorder.active
        host = None
        if timed:
            try:
                recorder.backward_compute_done()  # (the pass hooks keep the first mark)
                # What the step waits for besides the wire: the slowest rank (the meeting),
                # the copies and the checks. Exposed, so none of it is the probe's compute.
                host = _start(recorder, 0, PROBE_HOST)
            except Exception:
                timed = False
        reason = self._irregularity(window)
        pass_s = time.perf_counter() - window.opened_s
        if window.turn:
            self._end_turn(window)
        # The meeting also starts the reduction together on every rank, so that its
        # interval times the communication alone, not this rank's lead over the slowest.
        irregular = self._agreement.any_flag(f"{window.index}/shape", reason is not None)
        if irregular is None:
            reason = f"a rank did not reach a probe step's meeting within {self.options.gather_timeout_s:g} s"
        probe = irregular is False
        if window.turn:
            self._agreement.forget(f"{window.index}/turn{self._rank}")  # (every rank is past its turn)
            missed = self._agreement.any_flag(f"{window.index}/turns", window.turn_missed)
            if missed is not False:
                self._turns_off = True
                probe = False  # (not alone after all: left out, not held against the loop)
        elif probe:
            self._plain_pass_s = pass_s
        if timed:
            try:
                step = recorder.steps.current
                step.reduced_by_hand = True
                step.irregular = step.irregular or not probe
            except Exception:
                timed = False
        timed = timed and probe
        if self.in_reducer:
            self._reduce_in_reducer(window, timed, host)
        else:
            self._reduce_by_hand(window.index if probe else None, timed)
            self._confirm(window.index)
            if host is not None:
                recorder.end(host)
        if irregular is not False:
            self._not_a_probe(reason or "another rank's pass was not a plain one", irregular is None)

    def _end_turn(self, window: _Window) -> None:
        """This rank's passes of a window that takes turns are done: the next rank's turn."""
        hook, window.turn_hook = window.turn_hook, None
        if hook is not None:  # (the forward never reached the wrapped module)
            hook.remove()
        self._agreement.signal(f"{window.index}/turn{self._rank}")

    def _irregularity(self, window: _Window) -> str | None:
        """Why the window was not a plain pass on this rank (None: it was)."""
        if window.forwards > 1:
            return (
                "the model ran two or more training forwards before one backward (siamese, GAN or consistency losses)"
            )
        if window.grad_only:
            return "torch.autograd.grad ran through the model's outputs before backward (a gradient penalty)"
        if not window.output_seen:
            return "a backward gave the model's parameters gradients without starting from its outputs"
        sequence = _sequence_number(self._group)
        if sequence is None or window.sequence is None or sequence != window.sequence:
            return "the loop made a collective on the model's process group between its forward and backward"
        return None

    def _not_a_probe(self, reason: str, now: bool) -> None:
        """A window the ranks agreed was not a plain pass (``now``: or could not agree):
        left out of the figures; the second such window stops probe steps for the run."""
        self._irregular += 1
        if now or self._irregular >= IRREGULAR_PROBES_MAX:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        """Probe steps stop for the run (every rank decides it at the same meeting)."""
        if self.stopped is not None:
            return
        self.stopped = reason
        self.disabled = True
        try:
            self.recorder.ddp_config["probes_stopped"] = reason  # (the summary's probes_stopped)
        except Exception:
            pass
        console.warn(
            f"dtprofile: probe steps stopped: {reason}. DDP now reduces every step as it does without "
            "dtprofile, and T_C is each step less its measured overhead (data wait and the wait after "
            "backward), which includes what communication slows compute",
            stacklevel=2,
        )

    # ------------------------------------------------------------------ the reduction
    def _reduce_by_hand(self, window: int | None, timed: bool = False) -> None:
        """All-reduce the gradients as DDP would have, in DDP's buckets (:func:`_chunks`).

        ``window``: the probe window whose reduction this is (None: a reduction that is
        no probe's, untimed); ``timed``: this rank records it. Each chunk's collective is
        timed from its launch to its end, so that the step's communication (their union)
        leaves out the copies into and out of the chunks, which DDP makes during backward
        and in its finalisation, not on the wire. Between a chunk's copy and its launch
        onto an idle wire the ranks meet (on the store), so that the interval does not
        hold a rank's lead over the slowest either.
        """
        recorder, params, group = self.recorder, self._params, self._group
        if not params:
            return
        sampled: tuple[list[Any], list[Any]] | None = None
        if timed:
            try:
                sampled = ([], []) if recorder.noise.sampling_probe() else None
            except Exception:
                sampled = None
        views = bool(getattr(self.ddp, "gradient_as_bucket_view", False))
        # Small chunks several at a time, as DDP keeps several buckets in flight (each one
        # alone would wait out the link's latency); large ones one after another, which a
        # shaped or congested link carries at its rate (two large flows at once may not).
        in_flight: deque[Any] = deque()
        last = None
        chunks = _chunks(params, int(getattr(self.ddp, "bucket_bytes_cap", 0) or 25 * 2**20), _buckets(self.ddp))
        for number, chunk in enumerate(chunks):
            chunk_bytes = sum(g.numel() * g.element_size() for g in chunk)
            while in_flight and (
                len(in_flight) >= PROBE_CHUNKS_IN_FLIGHT
                or chunk_bytes + sum(r.nbytes for r in in_flight) > PROBE_BYTES_IN_FLIGHT
            ):
                sampled = in_flight.popleft().copy_back(recorder, sampled)
            flat = _scaled_copy(chunk, self._size, views, self.by_reciprocal)
            sampled = _sample(sampled, 0, flat)  # |g|^2 of this rank's chunk (scaled by the group's size)
            if window is not None and not in_flight:
                self._agreement.any_flag(f"{window}/chunk{number}", False)
            interval = _start(recorder, chunk_bytes) if timed else None
            last = _ChunkReduction(chunk, flat, dist.all_reduce(flat, group=group, async_op=True), interval)
            in_flight.append(last)
        while in_flight:
            sampled = in_flight.popleft().copy_back(recorder, sampled)
        if sampled is not None and last is not None and last.interval is not None:
            recorder.probe_reduced(last.interval, *sampled, 1.0 / self._size)

    def _reduce_in_reducer(self, window: _Window, timed: bool, host: Any) -> None:
        """The window's reduction, made now by DDP's reducer (``in_reducer``), timed from
        its launch to the end of DDP's finalisation (a callback queued after it ends the
        intervals and checks the result): the copies into and out of the buckets are in it."""
        recorder = self.recorder
        local_sq = None
        if timed:
            try:
                if recorder.noise.sampling_probe():
                    local_sq = _grads_sq(self._params)  # (scaled as the by-hand chunks are, below)
            except Exception:
                local_sq = None
        interval = _start(recorder, self._grad_bytes) if timed else None
        ddp_reduce_after_backward(self.ddp, window.outputs, window.ready)
        queue_autograd_callback(lambda: self._reduced_in_reducer(window.index, interval, host, local_sq))

    def _reduced_in_reducer(self, index: int, interval: Any, host: Any, local_sq: Any) -> None:
        """DDP's finalisation of a window's reduction has returned: check the result, end
        its intervals (and move the pass's sync mark here, should it have come first)."""
        self._confirm(index)
        recorder = self.recorder
        try:
            if interval is not None:
                recorder.end(interval)
                if local_sq is not None:
                    reduced_sq = _grads_sq(self._params)
                    if reduced_sq is not None:
                        scale = 1.0 / self._size
                        recorder.probe_reduced(interval, [local_sq * scale * scale], [reduced_sq], scale)
            if host is not None:
                recorder.end(host)
                recorder.backward_waited()
        except Exception as exc:
            recorder.parts["comm"].fail(exc)

    def _confirm(self, index: int) -> None:
        """The safety net: every rank holds the same reduced gradients, or they are reduced
        again as DDP does (the same on every rank: the ranks agreed) and probes stop."""
        same = self._agreement.same_value(f"{index}/grads", _fingerprint(self._params))
        if same:
            return
        if same is None:
            self._stop(f"a rank did not reach a probe step's check within {self.options.gather_timeout_s:g} s")
            return
        self._reduce_by_hand(None)
        try:
            step = self.recorder.steps.current
            step.reduced_by_hand, step.irregular = False, True  # (not a figure to keep)
        except Exception:
            pass
        self._stop(
            "the ranks held different gradients after a probe step's reduction (reduced again as DDP "
            "does); please report it"
        )


def _grads_sq(params: list[Any]) -> Any:
    """|g|^2 of the parameters' gradients together (those that have one), as a 0-dim
    tensor; None when there are none or it cannot be taken."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    try:
        return torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()
    except Exception:
        return None


class _ChunkReduction:
    """One chunk's all-reduce by hand: the gradients, their flat copy, the collective, and
    its interval (None: not timed)."""

    __slots__ = ("grads", "flat", "work", "interval", "nbytes")

    def __init__(self, grads: list[torch.Tensor], flat: torch.Tensor, work: Any, interval: Any) -> None:
        self.grads, self.flat, self.work, self.interval = grads, flat, work, interval
        self.nbytes = flat.numel() * flat.element_size()

    def copy_back(self, recorder: Any, sampled: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """Wait for the sum, end the interval, copy the result into the gradients; the
        gradient-noise sample with the mean's chunk added (None: not sampled)."""
        from torch._utils import _unflatten_dense_tensors

        self.work.wait()
        if self.interval is not None:
            recorder.end(self.interval)
        sampled = _sample(sampled, 1, self.flat)
        for target, reduced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads), strict=False):
            target.copy_(reduced)
        return sampled


#: Ranks at most for probes whose passes run one rank at a time (such a probe step takes
#: about that many times its passes' compute).
TURN_RANKS_MAX = 8
#: The 2nd and 4th probe step, then every 8th, run their passes one rank at a time (once
#: a probe was agreed plain).
SOLO_PROBE_FIRST = (1, 3)
SOLO_PROBE_EVERY = 8


def solo_probe(probe_index: int) -> bool:
    """Whether the probe step ``probe_index`` (0: the run's first) runs its passes one rank
    at a time; the others run them together, as every other step does.

    >>> [i for i in range(40) if solo_probe(i)]
    [1, 3, 11, 19, 27, 35]
    """
    return probe_index in SOLO_PROBE_FIRST or (probe_index > 3 and probe_index % SOLO_PROBE_EVERY == 3)


def _turn_group(group: Any) -> tuple[int, int]:
    """(ranks, this rank's place) for probes that take turns: the group's size where it is
    a gloo group of 2 to TURN_RANKS_MAX ranks, else 0 (every rank decides the same)."""
    try:
        size = dist.get_world_size(group)
        if dist.get_backend(group) != "gloo" or not 2 <= size <= TURN_RANKS_MAX:
            return 0, 0
        return size, dist.get_rank(group)
    except Exception:
        return 0, 0


def _on_cpu(params: list[Any]) -> bool:
    # A GPU's passes queue work and return: a host-side turn would not keep them apart.
    return bool(params) and params[0].device.type == "cpu"


def _start(recorder: Any, nbytes: int, kind: str = "all_reduce") -> Any:
    try:
        return recorder.blocking_start(kind, nbytes)
    except Exception:
        return None


#: A probe step's all-reduce by hand keeps at most this many chunks (DDP's bucket size
#: each), and this many bytes, in flight (a chunk larger than that goes alone): the
#: copies' memory stays bounded on the host (on a GPU the host does not wait for the
#: device, so up to the gradients' size may be allocated).
PROBE_CHUNKS_IN_FLIGHT = 4
PROBE_BYTES_IN_FLIGHT = 4 * 2**20


def _buckets(ddp: Any) -> list[list[int]] | None:
    """DDP's buckets as it has rebuilt them after its first backward: the indices of the
    parameters in each, in the order DDP lays them out and launches them (None: not
    rebuilt yet, or this torch does not say). Chunks laid out as DDP's buckets are sum as
    DDP's do, element for element, at any world size."""
    try:
        data = ddp._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return None
        text = data.get("rebuilt_per_bucket_param_indices")
        return [[int(i) for i in bucket.split()] for bucket in text.split(",")] if text else None
    except Exception:
        return None


def _chunks(params: list[Any], chunk_bytes: int, buckets: list[list[int]] | None = None) -> list[list[torch.Tensor]]:
    """The parameters' gradients in DDP's ``buckets`` (:func:`_buckets`), or else in groups
    of at most ``chunk_bytes`` (one dtype and device each); a missing gradient takes part
    as zeros and stays missing."""
    if buckets is not None and sorted(i for bucket in buckets for i in bucket) == list(range(len(params))):
        return [[_grad_or_zeros(params[i]) for i in bucket] for bucket in buckets if bucket]
    chunks: list[list[torch.Tensor]] = []
    fill = 0
    for p in params:
        grad = _grad_or_zeros(p)
        size = grad.numel() * grad.element_size()
        last = chunks[-1] if chunks else None
        if last is None or grad.dtype != last[0].dtype or grad.device != last[0].device or fill + size > chunk_bytes:
            chunks.append([])
            fill = 0
        chunks[-1].append(grad)
        fill += size
    return chunks


def _grad_or_zeros(param: Any) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _scaled_copy(grads: list[torch.Tensor], size: int, views: bool, by_reciprocal: bool = True) -> torch.Tensor:
    """One flat copy of ``grads`` scaled by the group's ``size`` before the sum, as DDP's
    reducer scales each: multiplied by 1 / size as it copies a gradient into its bucket,
    divided where the gradient is already a view of the bucket (``views``: the model has
    ``gradient_as_bucket_view``; such a gradient has a base). The two differ in the last
    bit for sizes that are not powers of two. ``by_reciprocal`` False: all divided, as
    ``allreduce_hook`` divides its bucket."""
    from torch._utils import _flatten_dense_tensors

    flat: torch.Tensor = _flatten_dense_tensors(grads)
    in_bucket = [not by_reciprocal or (views and g._base is not None) for g in grads]
    if not any(in_bucket):
        return flat.mul_(1.0 / size)
    if all(in_bucket):
        return flat.div_(size)
    offset = 0
    for grad, divided in zip(grads, in_bucket, strict=False):
        part = flat.narrow(0, offset, grad.numel())
        part.div_(size) if divided else part.mul_(1.0 / size)
        offset += grad.numel()
    return flat


def _fingerprint(params: list[Any]) -> bytes:
    """Two sums of the parameters' gradients (all of them, and each weighted by its
    place), exact bytes: the same on two ranks only if their gradients are, short of a
    coincidence. A missing gradient counts as its own mark. Each gradient is summed in
    float32, in place (a float64 sum would copy it first, on the CPU); the same bytes
    always sum the same, which is all the comparison needs."""
    sums = []
    for param in params:
        grad = param.grad
        sums.append(None if grad is None else grad.sum(dtype=torch.float32))
    present = [s for s in sums if s is not None]
    values = iter(torch.stack([s.double() for s in present]).cpu().tolist() if present else [])
    total = weighted = 0.0
    missing = 0
    for place, value in enumerate(sums, start=1):
        if value is None:
            missing += place
            continue
        value = next(values)
        total += value
        weighted += place * value
    return struct.pack("<ddq", total, weighted, missing)


def _sequence_number(group: Any) -> int | None:
    """How many collectives the process group has made (None: this torch cannot tell)."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:
        return None


def _sample(sampled: tuple[Any, ...] | None, which: int, flat: torch.Tensor) -> tuple[Any, ...] | None:
    """``sampled`` with |flat|^2 added to its list ``which`` (0: before the sum, 1: after);
    None when not sampling, or when the norm cannot be taken (the sample is dropped, the
    reduction goes on)."""
    if sampled is None:
        return None
    try:
        sampled[which].append(torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2)
    except Exception:
        return None
    return sampled


def _reduced_params(ddp: Any) -> list[Any]:
    """The parameters DDP reduces: those with gradients, less the ones it was told to
    ignore (``_set_params_and_buffers_to_ignore_for_model``)."""
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        params = list(ddp.parameters())
    return [p for p in params if p.requires_grad]
