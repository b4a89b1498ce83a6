"""What a summary says about the run besides the step averages: the device, the model's
sizes, the optimizer, the loader, how it communicates, the hardware and its telemetry.

Read once per summary from the engine's parts (never on the hot path); a log interval's
moving parts are copied on the training thread (:class:`RunState`) for a worker to read.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from .capture.steps import most_common, sizes_seen

__all__ = ["RunState", "Telemetry", "run_metadata", "optimizer_info", "cpus_per_rank", "ranks_per_host"]


class Telemetry:
    """Hardware discovery and the NVML sampler's lifetime (never raises)."""

    def __init__(self, device: torch.device, interval_s: float | None) -> None:
        self.device = device
        self.interval_s = interval_s
        self.sampler: Any = None  # dtprofile.nvml.TelemetrySampler while running
        self.reason = "not started"
        self.hardware: dict[str, Any] | None = None

    def start(self) -> None:
        """Peak-memory reset, hardware discovery and the NVML sampler."""
        from .hardware import discover_hardware
        from .nvml import start_sampler

        try:
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats(self.device)  # host-side counters: no sync
        except Exception:
            pass
        try:
            self.hardware = discover_hardware(self.device)
        except Exception as exc:
            self.hardware = {"error": f"{type(exc).__name__}: {exc}"}
        reason: str | None
        if self.interval_s == 0:
            self.sampler, reason = None, "turned off (telemetry_interval_s=0)"
        else:
            self.sampler, reason = start_sampler(self.device, interval_s=self.interval_s)
        self.reason = reason or "stopped"

    def steady_state(self) -> None:
        """Telemetry covers the steady state, like the steps. (The peak memory is not reset
        again here: the loop's own ``max_memory_allocated()`` would change under it.)"""
        if self.sampler is not None:
            self.sampler.reset()

    def stop(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.stop()
            except Exception:
                pass

    def vector(self) -> list[float]:
        """This rank's figures for the cross-rank gather."""
        from .nvml import RANK_KEYS, rank_vector

        try:
            return rank_vector(self.sampler.summary() if self.sampler is not None else None)
        except Exception:
            return [float("nan")] * len(RANK_KEYS)

    def summary(self, rank: int, rows: list[dict[str, Any]] | None) -> dict[str, Any]:
        """This rank's NVML medians, plus every rank's key figures when they were gathered."""
        from .nvml import RANK_KEYS, rank_entry, unavailable

        if self.sampler is None:
            return unavailable(self.reason)
        try:
            out: dict[str, Any] = self.sampler.summary(rank=rank)
            entries = []
            for row in rows or []:
                entry = rank_entry(int(row["rank"]), {k: row.get("telemetry_" + k) for k in RANK_KEYS})
                if entry is not None:
                    entries.append(entry)
            out["ranks_source"] = "gather" if entries else "local"
            if not entries:  # not gathered (one rank, or the gather failed): this rank only
                local = [None if math.isnan(v) else v for v in self.vector()]
                entries = [e for e in [rank_entry(rank, dict(zip(RANK_KEYS, local, strict=False)))] if e is not None]
            out["ranks"] = entries
            return out
        except Exception as exc:
            return unavailable(f"telemetry summary failed: {type(exc).__name__}: {exc}")


class RunState:
    """Copies, on the training thread, what the summary reads of the engine's moving parts.

    A log interval's summary is built on a worker thread while training goes on. What
    changes as it trains (the step counts, the loader's batch size, the communication's
    settings, the gradient noise, the disabled parts) and what only reads right between
    steps (the model's sizes: FSDP swaps a layer's sharded parameters for whole ones
    during its forward) are copied here at the interval's step close;
    :func:`run_metadata` reads the copy and only what stays put (the device, the
    optimizer's class, the hardware) or guards itself (the telemetry sampler).

    :meth:`take` costs a few microseconds: the model's sizes are counted again only
    when the optimizers hold state for more parameters than they did.

    Args:
        engine: the :class:`dtprofile.engine.Engine` whose parts are read (nothing changes).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._sizes: dict[str, Any] | None = None
        self._sizes_key: tuple[Any, ...] | None = None

    def sizes(self) -> dict[str, Any]:
        """The model's sizes (:func:`dtprofile.hardware.model_sizes`), counted again only
        when a module was attached or an optimizer's state grew (its first steps)."""
        engine = self.engine
        optimizers = engine.updates.optimizers
        key = (len(engine.modules), tuple(len(opt.state) for opt in optimizers))
        if self._sizes is None or key != self._sizes_key:
            from .hardware import model_sizes  # (here: an import statement costs microseconds each time)

            self._sizes, self._sizes_key = model_sizes(engine.modules, optimizers), key
        return self._sizes

    def take(self) -> dict[str, Any]:
        """The copy: plain values, small dicts and tuples that no other thread changes."""
        engine = self.engine
        steps, comm, data = engine.steps, engine.comm, engine.data
        return {
            "steps_total": steps.steps_seen,
            "steps_skipped_update": steps.steps_skipped_update,
            "steps_without_backward": steps.steps_without_backward,
            "steps_with_eval_forwards": steps.steps_with_eval_forwards,
            "data_wait_source": data.source,
            "comm_source": comm.comm_source,
            "comm_unmeasured": comm.unmeasured_reason(),
            "parts_disabled": {n: p.error for n, p in engine.parts.items() if p.error},
            "batch_size": data.batch_size,
            "num_workers": data.num_workers,
            "batch_bytes": data.batch_bytes,
            "sample_shapes_vary": data.sample_shapes_vary,
            "cpu_time": engine.cpu_time.sample(),
            "micro_batches_last": steps.micro_batches_last,
            "micro_batches_recent": tuple(steps.micro_batches_recent),
            "micro_batches_seen": dict(steps.micro_batches_seen),
            "sync_passes_recent": tuple(steps.sync_passes_recent),
            "gradient_noise": engine.noise.to_dict(),
            "ddp": dict(comm.ddp_config) if comm.ddp_config is not None else None,
            "fsdp": dict(comm.fsdp_config) if comm.fsdp_config is not None else None,
            "sizes": dict(self.sizes()),
            "mesh": engine.mesh.mesh_dict(),
            "pipeline": engine.pipeline.figures(),
            "mesh_comm": engine.mesh.row_values(),
        }


def run_metadata(
    engine: Any, rows: list[dict[str, Any]] | None = None, state: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything the summary says about the run besides the step averages.

    Args:
        engine: the :class:`dtprofile.engine.Engine` (its parts are read, nothing changes).
        rows: the ranks' gathered rows (their telemetry), when there are several.
        state: a :meth:`RunState.take` copy taken earlier on the training thread (a log
            interval's, read on another thread); None: read the engine now.
    """
    from .hardware import describe_device, memory_info, model_class

    if state is None:
        state = RunState(engine).take()
    sizes = state["sizes"]
    device_name, device_kind = describe_device(engine.device)
    # (measured once, on the first call that needs it: an interval's on the summaries' worker thread,
    # else the final summary's or a report's, on the thread that asks)
    handoff = engine.data.handoff.cost(state.get("batch_bytes"), state["num_workers"])
    return {
        "device": device_kind,
        "device_name": device_name,
        "backend": engine.backend,
        "world_size": engine.world_size,
        "steps_total": state["steps_total"],
        "steps_skipped_update": state["steps_skipped_update"],
        "steps_without_backward": state["steps_without_backward"],
        "steps_with_eval_forwards": state["steps_with_eval_forwards"],
        "data_wait_source": state["data_wait_source"],
        "comm_source": state["comm_source"] if state["comm_unmeasured"] is None else None,
        "comm_unmeasured": state["comm_unmeasured"],
        "mesh": state.get("mesh"),
        "pipeline": state.get("pipeline"),
        "timing": engine.clock.kind,
        "parts_disabled": state["parts_disabled"],
        "run": {
            "framework": engine.framework,
            "model_class": model_class(engine.modules[0]) if engine.modules else None,
            "optimizer": optimizer_info(engine.updates.primary),
            "batch_size": state["batch_size"],
            "micro_batches": (most_common(state["micro_batches_recent"]) or state["micro_batches_last"] or 1),
            "micro_batches_seen": sizes_seen(state["micro_batches_seen"]),
            "sync_passes": most_common(state["sync_passes_recent"]),
            "num_workers": state["num_workers"],
            "batch_bytes": state.get("batch_bytes"),
            "sample_shapes_vary": state.get("sample_shapes_vary"),
            "shm_copy_ms": handoff.copy_ms if handoff is not None else None,
            "shm_release_ms": handoff.release_ms if handoff is not None else None,
            "cpu_time": state.get("cpu_time"),
            "cpus_per_rank": cpus_per_rank(engine.world_size),
            "ranks_per_host": ranks_per_host(),
            "torch_threads": torch.get_num_threads(),
            **sizes,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device_kind == "cuda" else None,
            "memory": memory_info(engine.device, sizes),
            "gradient_noise": state["gradient_noise"],
            "ddp": state["ddp"],
            "fsdp": state["fsdp"],
            "hardware": dict(engine.telemetry.hardware or {}),
            "telemetry": engine.telemetry.summary(engine.rank, rows),
        },
    }


def optimizer_info(optimizer: Any) -> dict[str, Any] | None:
    """The step-bounding optimizer's class and whether it takes ``fused=`` / ``foreach=``
    (the advice names the user's own optimizer, not another)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(inner, torch.optim.Optimizer):
        # ZeRO steps this rank's shard with a local optimizer: that one is fused or not.
        return {**(optimizer_info(inner) or {}), "zero": True}
    cls = type(optimizer)
    module = cls.__module__
    # torch.optim.sgd.SGD is spelled torch.optim.SGD by its users.
    name = f"torch.optim.{cls.__qualname__}" if module.startswith("torch.optim.") else f"{module}.{cls.__qualname__}"
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    defaults = getattr(optimizer, "defaults", {}) or {}
    return {
        "class": name,
        "fused": "fused" in params,
        "foreach": "foreach" in params,
        "fused_on": bool(defaults.get("fused")),
        "foreach_on": bool(defaults.get("foreach")),
    }


def ranks_per_host() -> int | None:
    """Ranks on this host, as the launcher says (``LOCAL_WORLD_SIZE``: torchrun, Lightning,
    Accelerate); None when it does not."""
    try:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def cpus_per_rank(world_size: int) -> float:
    """CPUs this process may use, shared among the ranks of its node."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size if world_size > 0 else 1))
    return cpus / max(1, local)
