"""What the rules read: a summary's figures, pulled out once, None where missing."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..._values import finite, get
from ..mesh_plan import mesh_shape
from ..perf_model import BITS_PER_BYTE
from ..phases import phases_from_summary, step_parts_ms
from ..projection import ASSUMED_BANDWIDTH_NAME, project_summary
from ..recommendations import DEFAULT_TARGET_EFFICIENCY, recommend
from ..sizing import critical_batch_size
from ..summary_readers import overhead_ratio, world_size
from .thresholds import COMM_BOUND_FRACTION, DATA_BOUND_FRACTION, GAP_DATA_WAIT_FLOOR_MS
from .wording import fsdp_collectives

__all__ = ["Readings"]

#: The per-step figures (``per_step_ms``) a rule may read as attributes, in ms.
PER_STEP_FIGURES: tuple[str, ...] = (
    "step",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "comm_total",
    "comm_exposed",
    "compute",
    "overhead",
    "data_transfer",
    "comm_buffers",
)


class Readings:
    """The numbers the rules read, pulled out of a summary once, None where missing.

    The summary's ``projection`` and ``recommendations`` are used when present, and
    computed from the summary when not.

    Attributes:
        summary: The summary itself, for what no attribute holds.
        per_step, ratios, run_info, options: The summary's ``per_step_ms``, ``ratios``,
            ``run`` (how the run was set up) and ``options`` objects ({} when missing).
        step, data_wait, forward, backward, optimizer, comm_total, comm_exposed,
            compute, overhead, data_transfer, comm_buffers: ``per_step_ms`` figures (ms).
        world_size: The ranks measured (>= 1).
        target: The target efficiency.
        data_fraction, comm_fraction: Data wait and exposed communication as shares of
            the step.
        r_o: The overhead ratio T_O / T_C.
        projection, recommendations: The summary's, or computed.
        phases: The step split by how each part scales, or None.
        fsdp: ``run.fsdp`` when the model is sharded by FSDP, else None.
        comm_name, sync_name, hide_name: What the ranks communicate in, wait in, and
            what more compute per step hides, in a sentence's words.
        lightning: Whether the run was a Lightning Trainer's.
    """

    def __init__(self, summary: Mapping[str, Any]) -> None:
        self.summary = summary
        self.per_step = get(summary, "per_step_ms") or {}
        self.ratios = get(summary, "ratios") or {}
        self.run_info = get(summary, "run") or {}
        self.options = get(summary, "options") or {}
        self.device = get(summary, "device")
        self.world_size = world_size(summary)
        figures = {key: finite(get(self.per_step, key)) for key in PER_STEP_FIGURES}
        self.step: float | None = figures["step"]
        self.data_wait: float | None = figures["data_wait"]
        self.forward: float | None = figures["forward"]
        self.backward: float | None = figures["backward"]
        self.optimizer: float | None = figures["optimizer"]
        self.comm_total: float | None = figures["comm_total"]
        self.comm_exposed: float | None = figures["comm_exposed"]
        self.compute: float | None = figures["compute"]
        self.overhead: float | None = figures["overhead"]
        self.data_transfer: float | None = figures["data_transfer"]
        self.comm_buffers: float | None = figures["comm_buffers"]
        self.target = finite(get(self.options, "target_efficiency")) or DEFAULT_TARGET_EFFICIENCY
        self.data_fraction = finite(get(self.ratios, "data_fraction"))
        if self.data_fraction is None:
            self.data_fraction = self._share(self.data_wait)
        self.comm_fraction = finite(get(self.ratios, "comm_fraction"))
        if self.comm_fraction is None:
            self.comm_fraction = self._share(self.comm_exposed)
        self.r_o = overhead_ratio(summary)
        self.batch_size = finite(get(self.run_info, "batch_size"))
        self.micro_batches = finite(get(self.run_info, "micro_batches")) or 1.0
        self.projection = get(summary, "projection")
        if not isinstance(self.projection, Mapping) or "gpus" not in self.projection:
            self.projection = project_summary(summary)
        self.recommendations = get(summary, "recommendations")
        if not isinstance(self.recommendations, Mapping):
            self.recommendations = recommend(summary, self.projection)
        self.phases = phases_from_summary(summary)
        # A DeviceMesh with tensor parallelism: its dimensions' figures (None without one).
        self.mesh = mesh_shape(summary)
        # What the projection's G counts: GPUs, or a mesh's data-parallel replicas.
        self.g_unit = "GPUs" if self.mesh is None else f"replicas of {self.mesh.per_replica} GPUs"
        self.g_now = self.world_size if self.mesh is None else self.mesh.replicas  # (the seed's G now)
        if self.mesh is not None and self.comm_exposed is not None:
            # The data-parallel part of the exposed communication (DDP's, across replicas): the
            # mesh's own dimensions and the pipeline's waits are their rules'.
            mesh_waits = self.mesh.tp_comm_waited_ms + self.mesh.pp_wait_ms + (self.mesh.dp_comm_waited_ms or 0.0)
            self.comm_exposed = max(0.0, self.comm_exposed - mesh_waits)
            self.comm_fraction = self._share(self.comm_exposed)
        # A sharded model (FSDP2) communicates by all-gather and reduce-scatter (HSDP and
        # FSDP's replicate: all-reduce across replicas as well).
        self.fsdp = get(self.run_info, "fsdp") if get(summary, "comm_source") == "fsdp" else None
        self.comm_name = fsdp_collectives(self.fsdp) if self.fsdp is not None else "the gradient all-reduce"
        # What every rank waits in for the others, in a sentence's words.
        self.sync_name = "FSDP's collectives" if self.fsdp is not None else "the all-reduce"
        self.hide_name = self.sync_name  # what more compute per step hides
        if self.fsdp is None and (finite(get(get(self.run_info, "ddp"), "buffer_broadcast_bytes")) or 0) > 0:
            self.sync_name = "DDP's buffer broadcast before forward and the all-reduce"
        # Lightning users change the Trainer's and the strategy's arguments, not the loop;
        # Hugging Face Trainer users change TrainingArguments; Accelerate users the
        # Accelerator's and its launcher's.
        framework = get(self.run_info, "framework")
        self.lightning = framework == "lightning"
        self.hf_trainer = framework == "transformers"
        self.accelerate = framework in ("accelerate", "transformers")

    def _share(self, part: float | None) -> float | None:
        if part is None or self.step is None or self.step <= 0:
            return None
        share = part / self.step
        return share if math.isfinite(share) else None

    @property
    def pooled(self) -> bool:
        """The intervals pool earlier runs of the job (``uncertainty.pooled_runs``)."""
        return (finite(get(get(self.summary, "uncertainty"), "pooled_runs")) or 0) > 0

    def decided(self, ratio: str, point: float | None) -> float | None:
        """The share a verdict reads: this run's ``point``, or, where earlier runs of the job
        were pooled, the middle of the pooled interval (the job's, which its runs share: one
        run's point would flip the verdict between runs of one job)."""
        span = self.span(ratio) if self.pooled and self.mesh is None else None
        if span is None or finite(span[0]) is None:
            return point
        return (float(span[0]) + float(span[1])) / 2

    @property
    def comm_bound(self) -> bool:
        """Exposed communication is at least :data:`COMM_BOUND_FRACTION` of the step (this
        run's, or its job's where runs were pooled: :meth:`decided`)."""
        share = self.decided("comm_fraction", self.comm_fraction)
        return share is not None and share >= COMM_BOUND_FRACTION

    @property
    def data_bound(self) -> bool:
        """Data wait is at least :data:`DATA_BOUND_FRACTION` of the step (:meth:`decided`),
        and not only the framework's dispatch between steps (:data:`GAP_DATA_WAIT_FLOOR_MS`)."""
        share = self.decided("data_fraction", self.data_fraction)
        if share is None or share < DATA_BOUND_FRACTION:
            return False
        return not self._dispatch_only()

    @property
    def data_bound_within_noise(self) -> bool:
        """Data wait under :data:`DATA_BOUND_FRACTION` of the step, but its interval reaches
        it (and it is not only the framework's dispatch)."""
        return (
            not self.data_bound
            and self.data_fraction is not None
            and self.reaches("data_fraction", DATA_BOUND_FRACTION)
            and not self._dispatch_only()
        )

    def _dispatch_only(self) -> bool:
        """The gap before forward is too short to be more than the framework's dispatch."""
        gap = get(self.summary, "data_wait_source") == "gap"
        return gap and self.data_wait is not None and self.data_wait < GAP_DATA_WAIT_FLOOR_MS

    def span(self, ratio: str) -> list[Any] | None:
        """The interval of ``ratios[ratio]`` within the run's noise (``uncertainty``), or None."""
        span = get(get(get(self.summary, "uncertainty"), "ratios"), ratio)
        if not isinstance(span, list) or len(span) != 2 or finite(span[1]) is None:
            return None
        return span

    def reaches(self, ratio: str, threshold: float) -> bool:
        """Whether ``ratios[ratio]``'s interval reaches ``threshold`` (False without one)."""
        span = self.span(ratio)
        return span is not None and span[1] >= threshold

    def critical_per_device(self) -> int | None:
        """The critical (global) batch size as a per-device, per-micro-batch batch."""
        critical = finite(get(self.recommendations, "critical_batch_size"))
        if critical is None:
            critical = critical_batch_size(self.run_info)
        if critical is None or critical <= 0:
            return None
        return max(1, math.floor(critical / (self.world_size * self.micro_batches)))

    def batch_step_ms(self, factor: float) -> dict[str, float] | None:
        """The step at ``factor`` x the per-device batch, same devices (phases.step_parts_ms)."""
        if self.phases is None:
            return None
        return step_parts_ms(self.phases, factor, self.comm_total or 0.0, interference_ms=self.phases.interference_ms)

    def bandwidth_note(self) -> str:
        """The projection's link speed and where it came from, for a title."""
        source = get(self.projection, "bandwidth_source")
        gbps = (finite(get(self.projection, "bandwidth_GBps")) or 0.0) * BITS_PER_BYTE
        if source == "assumed":
            return f"assumed {ASSUMED_BANDWIDTH_NAME}: nothing measured or set"
        return f"{gbps:.3g} Gbit/s, {source}"

    def projected(self, gpus: Any, key: str) -> float | None:
        """The projection's ``key`` at device count ``gpus``, or None."""
        projected_gpus = get(self.projection, "gpus") or []
        values = get(self.projection, key)
        if gpus not in projected_gpus or not isinstance(values, list):
            return None
        i = projected_gpus.index(gpus)
        return finite(values[i]) if i < len(values) else None

    def largest_projected_gpus(self) -> Any:
        """The largest device count with a projected efficiency, or None."""
        projected_gpus = get(self.projection, "gpus") or []
        known = [g for g in projected_gpus if self.projected(g, "efficiency") is not None]
        return max(known) if known else None
