"""Gradient-noise sampling: the local and the reduced gradient's squared norms.

On sampled steps the communication recorder asks for |g|^2 of this rank's gradient
before it is reduced and |G|^2 of the mean after (read lazily: no device sync), and
:class:`~dtprofile.analysis.sizing.GradientNoiseScale` turns the pairs into the gradient noise
scale (the critical batch size). DDP: every :data:`GNS_EVERY`-th synchronising step, from
the buckets. A sharded model (FSDP) knows only its shard of the mean: its samples ride
in the cross-rank gathers (:meth:`NoiseSampler.shard_vector`) and are combined there.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from .capture.clocks import LazyScalar
from .capture.records import REPLICA_ALL_REDUCE, CommInterval, PendingStep

__all__ = ["NoiseSampler", "GNS_EVERY", "SHARD_SAMPLE_SLOTS", "SHARD_SAMPLE_KEYS"]

log = logging.getLogger(__name__)

# Gradient-noise samples: every Nth synchronising step (a norm of each bucket).
GNS_EVERY = 10
# A sharded model's samples kept for the gathers: two, so that a rank whose device lags
# a step behind at one gather still matches the others at the next.
SHARD_SAMPLE_SLOTS = 2
#: What a rank's gathered vector carries of its sharded samples, in order.
SHARD_SAMPLE_KEYS: tuple[str, ...] = tuple(
    f"shard_sample_{i}_{k}" for i in range(SHARD_SAMPLE_SLOTS) for k in ("step", "local_sq", "shard_sq")
)


def _mean_scale(op: Any, group: Any) -> float | None:
    """What scales a reduction's output to the mean's: AVG 1, SUM 1/size, others None."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        size: int = group.size()
        return 1.0 / size
    return None


def _sq_norm(tensor: torch.Tensor, scale: float = 1.0) -> LazyScalar:
    if scale == 1.0:
        return LazyScalar(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32) ** 2)
    return LazyScalar((torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32) * scale) ** 2)


class NoiseSampler:
    """Which steps are sampled, the samples themselves, and the running estimate.

    Args:
        steps: the step tracker (its step count and open step decide the sampling).
        data: the data wait (it holds the per-device batch size).
        world_size: ranks in the run.
        every_n_steps: the log interval (a sharded model samples once per interval).
    """

    def __init__(self, steps: Any, data: Any, world_size: int, every_n_steps: int) -> None:
        from .analysis.sizing import GradientNoiseScale

        self.steps = steps
        self.data = data
        self.world_size = world_size
        self.every_n_steps = every_n_steps
        self.gns: GradientNoiseScale | None = GradientNoiseScale()
        self.shard_copies = 1  # ranks holding each gradient shard (HSDP: the replicas)
        self._shard_samples: deque[tuple[float, float, float]] = deque(maxlen=SHARD_SAMPLE_SLOTS)
        self._shard_samples_used = -1.0  # the last sampled step already in the noise scale
        # The last sampled reduce-scatter: (output's data_ptr, scale or None, interval), for
        # the HSDP all-reduce of that output across replicas.
        self._scattered: tuple[int, float | None, CommInterval] | None = None

    def to_dict(self) -> dict[str, Any] | None:
        """The estimate for the summary, or None before there is one."""
        if self.gns is None or self.gns.value is None:
            return None
        return self.gns.to_dict()

    # ------------------------------------------------------------------ when
    def _one_batch_step(self) -> bool:
        # Accumulated buckets are not one batch's gradient.
        return self.data.batch_size is not None and len(self.steps.current.forward) == 1

    def sampling_buckets(self) -> bool:
        """Whether this step's DDP buckets are sampled."""
        return self.world_size > 1 and self._one_batch_step() and self.steps.steps_seen % GNS_EVERY == 0

    def sampling_probe(self) -> bool:
        """Whether this probe step's all-reduce by hand is sampled (every probe step that
        reduces one batch: they are few, and the only DDP steps sampled without a hook)."""
        return self.world_size > 1 and self._one_batch_step()

    def sampling_shards(self) -> bool:
        """FSDP: one sampled step per log interval (the combine rides on its gather)."""
        return self._one_batch_step() and self.steps.steps_seen % self.every_n_steps == 0

    # ------------------------------------------------------------------ take
    def sample_bucket(self, interval: CommInterval, buffer: torch.Tensor) -> None:
        """|g|^2 of a DDP bucket before its reduction."""
        interval.local_sq = _sq_norm(buffer)

    def sample_by_hand(
        self, interval: CommInterval, local_sq: list[torch.Tensor], reduced_sq: list[torch.Tensor], local_scale: float
    ) -> None:
        """A gradient all-reduced by hand in chunks: each chunk's |g|^2 before the
        reduction (``local_scale`` times this rank's gradient) and after it (the mean's),
        as 0-dim tensors (read lazily: no device sync)."""
        interval.local_sq = LazyScalar(torch.stack(local_sq).sum() / (local_scale * local_scale))
        interval.global_sq = LazyScalar(torch.stack(reduced_sq).sum())

    def sample_reduced(self, interval: CommInterval, reduced: Any) -> None:
        """|G|^2 of a DDP bucket's reduction (the future's value)."""
        if isinstance(reduced, (list, tuple)):
            reduced = reduced[0]
        interval.global_sq = _sq_norm(reduced)

    def sample_shard_input(
        self, interval: CommInterval, inp: torch.Tensor, out: torch.Tensor, op: Any, group: Any
    ) -> None:
        """|g|^2 of this rank's full gradient now; its reduced shard's when the call returns.

        FSDP reduces with AVG (the shard is the mean gradient's) or with SUM after
        dividing the input by a factor (the shard over the group size is the mean's, on
        the same scale as the input: the factor cancels in the noise scale). Other
        reductions (a custom divide factor) are not sampled.

        HSDP all-reduces each reduce-scatter's output across replicas: the sample then
        pairs the reduce-scatter's input with the all-reduce's output (its scale is both
        reductions'). Without sharding the all-reduce's input is the full gradient.
        """
        scale = _mean_scale(op, group)
        if interval.kind == REPLICA_ALL_REDUCE:
            scattered, self._scattered = self._scattered, None
            if scattered is not None and scattered[0] == inp.data_ptr():
                rs_scale, rs = scattered[1], scattered[2]
                local_sq, rs.local_sq, rs.global_sq = rs.local_sq, None, None  # not the mean's shard yet
                if scale is not None and rs_scale is not None and local_sq is not None:
                    interval.local_sq = local_sq
                    interval.reduced = (out, scale * rs_scale)
                return
        elif interval.kind == "reduce_scatter":
            self._scattered = (out.data_ptr(), scale, interval)
        if scale is None:
            return
        interval.local_sq = _sq_norm(inp)
        interval.reduced = (out, scale)

    def sample_shard_output(self, interval: CommInterval) -> None:
        """The reduced shard's |G|^2, once a synchronous collective returned."""
        if interval.reduced is not None:
            out, scale = interval.reduced
            interval.reduced = None
            interval.global_sq = _sq_norm(out, scale)

    # ------------------------------------------------------------------ estimate
    def step_done(self, step: PendingStep) -> None:
        """A step's record was made: add its samples to the estimate (never raises: an
        estimate is never worth losing the timings for)."""
        try:
            self._sample_step(step)
        except Exception as exc:
            self.gns = None
            log.debug("dtprofile: gradient noise estimate dropped: %r", exc)

    def _sample_step(self, step: PendingStep) -> None:
        if not step.comm or self.gns is None or step.skipped or len(step.backward) != 1:
            return
        if any(c.sharded for c in step.comm):
            self._keep_shard_sample(step)
            return
        # DDP's buckets, or a probe step's all-reduce by hand (not DDP's buffer broadcast).
        buckets = [c for c in step.comm if c.bucket or c.global_sq is not None]
        local = [c.local_sq for c in buckets]
        reduced = [c.global_sq for c in buckets]
        if not buckets or any(x is None for x in local + reduced):
            return
        local_values = [x.value() for x in local]
        reduced_values = [x.value() for x in reduced]
        if any(v is None for v in local_values + reduced_values):
            return
        # The default hook averages, so the reduced buffer is the mean gradient over
        # world_size * batch_size samples; the local buffer is this rank's mean.
        batch = self.data.batch_size
        self.gns.update(sum(local_values), sum(reduced_values), batch, batch * self.world_size)

    def _keep_shard_sample(self, step: PendingStep) -> None:
        """A sharded step's noise sample, kept until every rank's shard is gathered.

        This rank knows its full gradient's |g|^2 but only its shard of the mean
        gradient; the shards' squares add up to the mean's only across ranks, so the
        sample rides in the next gathers (:meth:`combine`).
        """
        sampled = [c for c in step.comm if c.local_sq is not None]
        if not sampled or any(c.global_sq is None for c in sampled):
            return
        local = [c.local_sq.value() for c in sampled]
        shard = [c.global_sq.value() for c in sampled]
        if any(v is None for v in local + shard):
            return
        self._shard_samples.append((float(step.index), sum(local), sum(shard)))

    def shard_vector(self) -> list[float]:
        """This rank's kept sharded samples, for the gather (:data:`SHARD_SAMPLE_KEYS`)."""
        nan = float("nan")
        slots = list(self._shard_samples) + [(nan, nan, nan)] * (SHARD_SAMPLE_SLOTS - len(self._shard_samples))
        return [v for slot in slots for v in slot]

    def combine(self, shard_vectors: list[list[float]] | None) -> None:
        """Update the noise scale with every sampled step that all ranks' vectors carry
        (each rank's :meth:`shard_vector`, as gathered)."""
        batch = self.data.batch_size
        if not shard_vectors or len(shard_vectors) != self.world_size or self.gns is None or batch is None:
            return
        per_rank = []
        for slots in shard_vectors:
            per_rank.append(
                {slots[i]: (slots[i + 1], slots[i + 2]) for i in range(0, len(slots), 3) if not math.isnan(slots[i])}
            )
        common = sorted(set.intersection(*(set(r) for r in per_rank)))
        for index in common:
            if index <= self._shard_samples_used:
                continue
            local = [r[index][0] for r in per_rank]
            shard = [r[index][1] for r in per_rank]
            if any(math.isnan(v) for v in local + shard):
                continue
            # The mean gradient's |G|^2 is the sum of its shards' (each held by every
            # replica: HSDP counts it once per replica); each rank's local gradient is
            # one batch's: their mean is the small-batch estimate.
            self.gns.update(sum(local) / len(local), sum(shard) / self.shard_copies, batch, batch * self.world_size)
            self._shard_samples_used = index
