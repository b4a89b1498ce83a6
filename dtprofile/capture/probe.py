"""Probe steps of a DDP model that reduce by hand: compute measured as without DDP.

:class:`NoSyncProbe` runs a probe step's passes as under ``no_sync()`` and all-reduces
their gradients by hand when backward ends, as DDP would have: the step's compute is
then as on one device, and its communication is timed alone. On CPU ranks some probes
also run their passes one rank at a time (:func:`solo_probe`), which shows what sharing
a host costs their compute. Where a probe cannot skip DDP's reduction, probe steps hold
the reductions in the timed hook instead (:mod:`dtprofile.capture.ddp`).
"""

from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import console
from .._torch_internals import (ddp_output_tensors, ddp_prepare_for_backward, ddp_reduce_after_backward, module_hook,
                                queue_autograd_callback)
from .records import PROBE_HOST
from .steps import probes

__all__ = ["NoSyncProbe", "solo_probe", "PROBE_CHUNKS_IN_FLIGHT", "PROBE_BYTES_IN_FLIGHT", "TURN_RANKS_MAX"]


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

    The gradients are those DDP would produce: divided by the group's size and summed,
    in chunks of DDP's bucket size (bit-identical with two ranks; with more, equal up
    to the order of the floating-point sum). Used only where DDP reduces every pass the
    plain way (:func:`~dtprofile._torch_internals.ddp_reduces_plainly`), with DDP's own
    all-reduce or dtprofile's default hook (no user hook to reproduce). The flag DDP
    reads is restored after every forward, also one that raises.

    A model that searches for unused parameters (``find_unused_parameters``, with DDP's
    own all-reduce) is reduced by DDP's reducer itself after backward instead
    (:func:`~dtprofile._torch_internals.ddp_reduce_after_backward`, ``in_reducer``): the
    reducer records which parameters each backward used, also under ``no_sync()``, and
    only its own reduction clears that record, which the next step's reduction reads
    (a parameter no rank used keeps its gradient untouched). By hand, a parameter the
    probe used but no rank used in the next step would get a gradient of zeros.

    A probe adds collectives, so which passes are probes must be the same on every rank
    whatever happens to one rank's profiler: they are counted here, among the training
    forwards that synchronise (DDP needs the same sequence of them on every rank), from
    a start every rank made (:meth:`start`), on :func:`~dtprofile.capture.schedule.probes`'
    schedule.

    Args:
        ddp: the DistributedDataParallel model.
        recorder: the :class:`~dtprofile.capture.comm.CommRecorder` (its ``end`` and
            ``blocking_start`` time the reduction).
        options: the run's options (``warmup_steps``, ``probe_every``).
    """

    def __init__(self, ddp: Any, recorder: Any, options: Any, scale_by_reciprocal: bool = False) -> None:
        self.ddp = ddp
        self.recorder = recorder
        self.options = options
        # How the ordinary steps scale each gradient before the sum: DDP's own reducer
        # multiplies a gradient it copies by 1 / size (and divides one that is a view of
        # its bucket); allreduce_hook (dtprofile's default hook) divides.
        self.scale_by_reciprocal = scale_by_reciprocal
        self._suppressed = False  # this forward runs as under no_sync()
        self._due = 0  # passes whose reduction is due at their backward's end
        self._started = False  # every rank started profiling (probes may run)
        self._passes = 0  # synchronising training forwards since the start
        self._params = _reduced_params(ddp)
        # DDP's reducer makes the probe's reduction after backward where the model searches
        # for unused parameters (see the docstring): the gradients' bytes, and the
        # parameters whose gradients the open probe's backward produced, in order.
        self.in_reducer = bool(getattr(ddp, "find_unused_parameters", False))
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
        self._ready: list[int] = []
        self._ready_handles: list[Any] = []
        # A backward inside DDP's forward (a training step run as the module's call) would
        # skip a probe's reduction altogether: one parameter's gradient accumulation is
        # watched during each synchronising forward.
        self._in_forward = False
        self._backward_seen = False
        self.disabled = False
        self.compiled = False  # its hooks were traced into a compiled forward
        # Probes whose passes run one rank at a time (see _take_turn): the same probes, and
        # the same number of one-element collectives in each, on every rank.
        self._probes_made = 0
        self._turn_ranks, self._rank = _turn_group(ddp) if self._params else (0, 0)
        self._turns_due = 0  # this pass's meetings still to make at its backward's end
        # While a pass waits for the ranks before it (a CPU's passes): the wrapped module's
        # pre-hook that waits, registered for that pass only (no call on other forwards).
        self._turn_hook: Any = None
        self._handles = [ddp.register_forward_pre_hook(self._forward_pre),
                         ddp.register_forward_hook(self._forward_post, always_call=True)]
        watched = self._params[0] if self._params else None
        if watched is not None and hasattr(watched, "register_post_accumulate_grad_hook"):
            self._handles.append(watched.register_post_accumulate_grad_hook(self._grad_accumulated))

    def start(self, every_rank: bool) -> None:
        """The profiler started; ``every_rank``: on every rank of the group (one verdict
        for all), so that probes may run."""
        self._started = every_rank
        self._passes = 0

    def due(self) -> bool:
        """Whether the next synchronising training forward runs as a probe's (what
        :meth:`_forward_pre` decides, and the steady lane asks at a close)."""
        return (not self.disabled and self._started
                and probes(self._passes, self.options.warmup_steps, self.options.probe_every))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._drop_turn_hook()
        # (The hooks that note a probe's ready parameters stay until its reduction, which
        # needs all of them, drops them: they exist only while such a pass is under way.)
        self._restore()

    def _forward_pre(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Traced into a compiled DDP forward: DDP's flag would be a guard, and a probe a
            # recompilation. Probe steps of a compiled model hold the reductions instead.
            self.compiled = True
            return
        ddp = self.ddp
        try:
            if self.disabled or not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
                return
            self._in_forward, self._backward_seen = True, False
            due = self.due()  # (this pass, before it is counted)
            self._passes += 1
            if not due:
                return
            if getattr(getattr(ddp, "_join_config", None), "enable", True):
                # A join() (uneven inputs) shadows DDP's own reductions for the ranks that
                # ran out, not one made by hand: from now on probes hold the reductions.
                self.recorder.lost_probes_by_hand()
                return
            ddp.require_backward_grad_sync = False
            self._suppressed = True
            if self.in_reducer:
                self._watch_ready()
            alone = self._turn_ranks and solo_probe(self._probes_made)
            self._probes_made += 1
            if alone:
                self._turns_due = self._turn_ranks
                inner = getattr(ddp, "module", None)
                if _on_cpu(self._params) and isinstance(inner, torch.nn.Module):
                    # On the wrapped module: it runs after DDP's own collectives before
                    # forward (the buffers' broadcast), which every rank makes first. A copy
                    # of the module (an EMA model) gets an inert hook.
                    self._turn_hook = inner.register_forward_pre_hook(module_hook(self._take_turn))
        except Exception:  # a probe never breaks training: this step is an ordinary one
            self._turns_due = 0
            self._drop_turn_hook()
            self._drop_ready_hooks()
            self._restore()

    def _watch_ready(self) -> None:
        """Note the reducer's index of each parameter whose gradient this probe's backward
        produces, in order (what DDP's own hook on it would have marked ready then)."""
        self._drop_ready_hooks()  # (a probe's forward whose backward never ran)
        ready: list[int] = []
        self._ready = ready
        # (one hook a parameter, on the probe steps only: they are few)
        for index, param in enumerate(self._params):
            self._ready_handles.append(param.register_post_accumulate_grad_hook(
                lambda _param, index=index: ready.append(index)))

    def _drop_ready_hooks(self) -> None:
        while self._ready_handles:
            self._ready_handles.pop().remove()

    def _take_turn(self, module: Any, args: Any) -> None:
        """A probe whose passes run alone: wait until every rank before this one has
        finished its backward (one meeting each), so that on a host the ranks share, each
        computes with the others idle; how much faster than beside them is what sharing
        the host costs. The wait is exposed time of the step, not its compute."""
        self._drop_turn_hook()
        recorder = self.recorder
        wait = None
        try:
            if recorder is not None and recorder.active:
                recorder.steps.current.alone = True
                wait = _start(recorder, 0, PROBE_HOST)
        except Exception:
            wait = None
        self._meet(self._rank)
        if wait is not None:
            recorder.end(wait)

    def _drop_turn_hook(self) -> None:
        if self._turn_hook is not None:
            self._turn_hook.remove()
            self._turn_hook = None

    def _meet(self, times: int) -> None:
        """``times`` of the probe's one-element meetings (the same count on every rank)."""
        times = min(times, self._turns_due)
        self._turns_due -= times
        group = getattr(self.ddp, "process_group", None) or dist.group.WORLD
        for _ in range(times):
            dist.all_reduce(torch.zeros(1, device=self._params[0].device), group=group)

    def _grad_accumulated(self, param: Any) -> None:
        if self._in_forward:
            self._backward_seen = True

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
        from .passes import _watched_outputs  # (one definition of "the outputs backward starts from")

        tensors = _watched_outputs(output) if output is not None else []
        if not tensors:  # no backward will start from here: let DDP reduce this pass after all
            self._drop_turn_hook()
            self._drop_ready_hooks()
            self._meet(self._turns_due)
            ddp_prepare_for_backward(ddp, output)
            return
        self._due += 1
        started = (self._started_for((ddp_output_tensors(ddp, output), self._ready)) if self.in_reducer
                   else self._backward_started)
        if len(tensors) == 1:
            tensors[0].register_hook(started)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any")

    def _backward_inside_forward(self) -> None:
        self.disabled = True
        try:
            self.recorder.lost_probes_by_hand()
        except Exception as exc:
            self.recorder.parts["comm"].fail(exc)
        if self._suppressed:
            # This probe's backward ran unsynchronised inside the forward and its update
            # is done: nothing can reduce it now. (The first synchronising forward, never
            # a probe, normally reveals the pattern first.)
            console.warn("dtprofile: a probe step's backward ran inside DDP's forward, so its gradients were not "
                         "all-reduced; further probe steps hold DDP's reductions instead", stacklevel=2)

    def _restore(self) -> None:
        if self._suppressed:
            self._suppressed = False
            self.ddp.require_backward_grad_sync = True

    def _backward_started(self, grad: Any) -> None:
        # Never guarded: the pass's gradients must be reduced whatever happens to the profiler.
        queue_autograd_callback(self._reduce)

    def _started_for(self, due: tuple) -> Callable[[Any], None]:
        """The hook at backward's start of a pass whose reduction DDP's reducer makes
        (``due``: what it needs of the pass, held until its backward ends)."""

        def started(grad: Any) -> None:
            queue_autograd_callback(lambda: self._reduce(due))

        return started

    def _reduce(self, due: tuple | None = None) -> None:
        """Backward is done: mark its compute's end (the pass hooks keep the first mark),
        then all-reduce the gradients as DDP would have (``due``: the pass's outputs and
        the parameters whose gradients its backward produced, where DDP's reducer does).

        Each chunk's collective is timed from its launch to its end, so that the step's
        communication (their union) leaves out the copies into and out of the chunks,
        which DDP makes during backward and in its finalisation, not on the wire.
        """
        if self._due <= 0:
            return
        self._due -= 1
        recorder = self.recorder
        params = self._params
        if not params:
            return
        group = getattr(self.ddp, "process_group", None)
        if group is None:
            group = dist.group.WORLD
        timed = recorder is not None and recorder.active
        try:
            recorder.steps.current.reduced_by_hand = True  # the step is a probe
            if timed:
                recorder.backward_compute_done()
        except Exception:
            timed = False
        # What the step waits for besides the wire: the slowest rank (below), the copies
        # and the norms. Exposed, so none of it is counted as the probe's compute.
        host = _start(recorder, 0, PROBE_HOST) if timed else None
        self._drop_turn_hook()
        self._meet(self._turns_due)  # a probe whose passes ran alone: the ranks after this one
        if due is not None:
            self._reduce_in_reducer(group, timed, host, *due)
            return
        sampled = None
        if timed:
            try:
                sampled = ([], []) if recorder.noise.sampling_probe() else None
            except Exception:
                sampled = None
        # Small chunks several at a time, as DDP keeps several buckets in flight (each one
        # alone would wait out the link's latency); large ones one after another, which a
        # shaped or congested link carries at its rate (two large flows at once may not).
        in_flight: deque = deque()
        last = None
        for chunk in _chunks(params, int(getattr(self.ddp, "bucket_bytes_cap", 0) or 25 * 2**20)):
            chunk_bytes = sum(g.numel() * g.element_size() for g in chunk)
            while in_flight and (len(in_flight) >= PROBE_CHUNKS_IN_FLIGHT
                                 or chunk_bytes + sum(r.nbytes for r in in_flight) > PROBE_BYTES_IN_FLIGHT):
                sampled = in_flight.popleft().copy_back(recorder, sampled)
            grads, flat = _divided_copy(chunk, group, self.scale_by_reciprocal)
            sampled = _sample(sampled, 0, flat)  # |g|^2 of this rank's chunk (divided by the group's size)
            if not in_flight:
                # Nothing on the wire: the ranks meet (one element; every rank that skipped
                # DDP's reduction, and the same chunks on each, so never unmatched) just
                # before the launch, so that the interval times the communication alone,
                # not also this rank's lead over the slowest in the backward or the copies.
                dist.all_reduce(torch.zeros(1, device=flat.device), group=group)
            interval = _start(recorder, chunk_bytes) if timed else None
            last = _ChunkReduction(grads, flat, dist.all_reduce(flat, group=group, async_op=True), interval)
            in_flight.append(last)
        while in_flight:
            sampled = in_flight.popleft().copy_back(recorder, sampled)
        if sampled is not None and last is not None and last.interval is not None:
            recorder.probe_reduced(last.interval, *sampled, 1.0 / group.size())
        if host is not None:
            recorder.end(host)

    def _reduce_in_reducer(self, group: Any, timed: bool, host: Any, outputs: list, ready: list[int]) -> None:
        """The pass's reduction, made now by DDP's reducer (``in_reducer``), timed from its
        launch to the end of DDP's finalisation (a callback queued after it ends the
        intervals): the copies into and out of the buckets are in it."""
        recorder = self.recorder
        self._drop_ready_hooks()
        local_sq = None
        if timed:
            try:
                if recorder.noise.sampling_probe():
                    local_sq = _grads_sq(self._params)  # (scaled as the by-hand chunks are, below)
            except Exception:
                local_sq = None
        # The ranks meet just before the launch, as by hand (every rank's probe does).
        dist.all_reduce(torch.zeros(1, device=self._params[0].device), group=group)
        interval = _start(recorder, self._grad_bytes) if timed else None
        ddp_reduce_after_backward(self.ddp, outputs, ready)
        if timed:
            scale = 1.0 / group.size()
            queue_autograd_callback(lambda: self._reduced_in_reducer(interval, host, local_sq, scale))

    def _reduced_in_reducer(self, interval: Any, host: Any, local_sq: Any, scale: float) -> None:
        """DDP's finalisation of a probe's reduction has returned: end its intervals (and
        move the pass's sync mark here, should it have come first)."""
        recorder = self.recorder
        try:
            if interval is not None:
                recorder.end(interval)
                if local_sq is not None:
                    reduced_sq = _grads_sq(self._params)
                    if reduced_sq is not None:
                        recorder.probe_reduced(interval, [local_sq * scale * scale], [reduced_sq], scale)
            if host is not None:
                recorder.end(host)
            recorder.backward_waited()
        except Exception as exc:
            recorder.parts["comm"].fail(exc)


def _grads_sq(params: list) -> Any:
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

    def copy_back(self, recorder: Any, sampled: tuple | None) -> tuple | None:
        """Wait for the sum, end the interval, copy the result into the gradients; the
        gradient-noise sample with the mean's chunk added (None: not sampled)."""
        from torch._utils import _unflatten_dense_tensors

        self.work.wait()
        if self.interval is not None:
            recorder.end(self.interval)
        sampled = _sample(sampled, 1, self.flat)
        for target, reduced in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
            target.copy_(reduced)
        return sampled


#: Ranks at most for probes whose passes run one rank at a time (such a probe step takes
#: about that many times its passes' compute).
TURN_RANKS_MAX = 8
#: The 2nd and 4th probe, then every 8th, run their passes one rank at a time.
SOLO_PROBE_FIRST = (1, 3)
SOLO_PROBE_EVERY = 8


def solo_probe(probe_index: int) -> bool:
    """Whether the probe ``probe_index`` (0: the run's first) runs its passes one rank at
    a time; the others run them together, as every other step does.

    >>> [i for i in range(40) if solo_probe(i)]
    [1, 3, 11, 19, 27, 35]
    """
    return probe_index in SOLO_PROBE_FIRST or (probe_index > 3 and probe_index % SOLO_PROBE_EVERY == 3)


def _turn_group(ddp: Any) -> tuple[int, int]:
    """(ranks, this rank's place) for probes that take turns: the group's size where it is
    a gloo group of 2 to TURN_RANKS_MAX ranks, else 0 (every rank decides the same)."""
    try:
        group = getattr(ddp, "process_group", None) or dist.group.WORLD
        size = dist.get_world_size(group)
        if dist.get_backend(group) != "gloo" or not 2 <= size <= TURN_RANKS_MAX:
            return 0, 0
        return size, dist.get_rank(group)
    except Exception:
        return 0, 0


def _on_cpu(params: list) -> bool:
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


def _chunks(params: list, chunk_bytes: int) -> list[list[torch.Tensor]]:
    """The parameters' gradients in groups of at most ``chunk_bytes`` (one dtype and device
    each); a missing gradient takes part as zeros and stays missing."""
    chunks: list[list[torch.Tensor]] = []
    fill = 0
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        size = grad.numel() * grad.element_size()
        last = chunks[-1] if chunks else None
        if last is None or grad.dtype != last[0].dtype or grad.device != last[0].device or fill + size > chunk_bytes:
            chunks.append([])
            fill = 0
        chunks[-1].append(grad)
        fill += size
    return chunks


def _divided_copy(grads: list[torch.Tensor], group: Any, by_reciprocal: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``grads`` and one flat copy of them divided by the group's size before the sum, as
    the ordinary steps do (``by_reciprocal``: multiplied by 1 / size, as DDP's reducer
    does; else divided, as ``allreduce_hook`` does; the two can differ in the last bit)."""
    from torch._utils import _flatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    if by_reciprocal:
        flat.mul_(1.0 / group.size())
    else:
        flat.div_(group.size())
    return grads, flat


def _sample(sampled: tuple | None, which: int, flat: torch.Tensor) -> tuple | None:
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


def _reduced_params(ddp: Any) -> list:
    """The parameters DDP reduces: those with gradients, less the ones it was told to
    ignore (``_set_params_and_buffers_to_ignore_for_model``)."""
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        params = list(ddp.parameters())
    return [p for p in params if p.requires_grad]
