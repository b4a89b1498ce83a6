"""GPU telemetry through NVML (the ``pynvml`` module of ``nvidia-ml-py``), optional.

One :class:`TelemetrySampler` per rank watches that rank's own GPU from a daemon thread,
at a bounded rate (every :data:`DEFAULT_INTERVAL_S` seconds), into fixed-size ring
buffers; the training thread never calls NVML during a step. The summary's
``run.telemetry`` holds the medians per metric (:meth:`TelemetrySampler.summary`).

Sampled, each call guarded on its own (a metric whose call raises is dropped with its
reason in ``metrics_dropped``; the others go on):

============================  =====================================================
key (median over samples)     NVML call
============================  =====================================================
``gpu_util_percent``          ``nvmlDeviceGetUtilizationRates().gpu`` (share of the
                              sample period a kernel was running)
``mem_util_percent``          ``nvmlDeviceGetUtilizationRates().memory``
``memory_used_bytes``         ``nvmlDeviceGetMemoryInfo().used`` (device-wide: all
                              processes, CUDA contexts, allocator cache)
``power_w``                   ``nvmlDeviceGetPowerUsage`` (mW)
``sm_clock_mhz``              ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``
``temperature_c``             ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``
``pcie_tx_GBps`` / ``rx``     ``nvmlDeviceGetPcieThroughput`` (KB/s over 20 ms)
``nvlink_tx_GBps`` / ``rx``   field values ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX``
                              (KiB counters, scope UINT_MAX = all links), as rates
                              between consecutive samples
clock event reasons           ``nvmlDeviceGetCurrentClocksEventReasons`` (older
                              drivers: ``...ClocksThrottleReasons``), a bit mask
============================  =====================================================

Read once: ``memory_total_bytes``, ``sm_clock_max_mhz`` (``nvmlDeviceGetMaxClockInfo``),
``power_limit_w`` (``nvmlDeviceGetEnforcedPowerLimit``).

Throttling: ``clock_event_reasons`` is the share of samples in which each reason bit was
set. A *limiting* reason (power cap, thermal, hardware slowdown, power brake, sync boost)
set in at least half the samples while the median SM clock is below
:data:`THROTTLE_CLOCK_RATIO` of its maximum makes ``throttled`` true and lists it in
``throttle_reasons`` (otherwise that list is empty: a power-capped GPU still at full
clock is not a straggler).

Which GPU: the rank's CUDA device is mapped to its NVML device by UUID
(``torch.cuda.get_device_properties(i).uuid``); failing that, through
``CUDA_VISIBLE_DEVICES`` (ordinals or ``GPU-`` UUID prefixes); failing that, the CUDA
index itself.

Without NVML, without a GPU, or on a CPU run: no thread, no error, and the summary says
``{"available": false, "reason": ...}``. An unexpected error inside the sampler warns
once and stops the sampler; training never sees it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from . import console

__all__ = [
    "DEFAULT_INTERVAL_S",
    "RING_SIZE",
    "THROTTLE_CLOCK_RATIO",
    "CLOCK_EVENT_REASONS",
    "LIMITING_REASONS",
    "TelemetrySampler",
    "NvmlSession",
    "load_pynvml",
    "resolve_handle",
    "start_sampler",
    "unavailable",
    "field_value",
]

log = logging.getLogger(__name__)

#: Seconds between samples (NVML's utilisation counters cover 1/6 s to 1 s themselves).
DEFAULT_INTERVAL_S = 0.5
#: Samples kept per metric: the last ~17 minutes at the default rate.
RING_SIZE = 2048
#: Median SM clock below this share of its maximum, with a limiting reason set, is throttled.
THROTTLE_CLOCK_RATIO = 0.9
#: A limiting reason must be set in at least this share of the samples.
THROTTLE_MIN_SHARE = 0.5
_UINT_MAX = 0xFFFFFFFF

#: NVML clocks-event (formerly throttle) reason bits, by the name the summary uses.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
#: The reasons that mean the GPU runs slower than it could for the work it has.
LIMITING_REASONS: tuple[str, ...] = (
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)

# The per-rank figures that travel in the cross-rank gather (floats; nan = unknown).
RANK_KEYS: tuple[str, ...] = (
    "gpu_util_percent",
    "sm_clock_mhz",
    "sm_clock_ratio",
    "power_w",
    "temperature_c",
    "throttle_mask",
)


def unavailable(reason: str) -> dict[str, Any]:
    """The ``run.telemetry`` of a run without NVML telemetry."""
    return {"available": False, "reason": reason}


def load_pynvml() -> Any:
    """The ``pynvml`` module, or raise ImportError with the package to install."""
    try:
        import pynvml
    except Exception as exc:  # ImportError, or a broken install
        raise ImportError(f"pynvml not importable ({exc}); pip install nvidia-ml-py") from exc
    return pynvml


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def field_value(fv: Any) -> float | None:
    """A ``c_nvmlFieldValue_t``'s value as a float, or None when NVML returned an error."""
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    value = fv.value
    kind = getattr(fv, "valueType", 3)
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(kind, "ullVal")
    return float(getattr(value, attr))


def _torch_uuid(cuda_index: int) -> str | None:
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:
        return None
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def resolve_handle(
    nvml: Any, cuda_index: int, *, uuid: str | None = None, visible: str | None = None
) -> tuple[Any, int | None, str]:
    """``(handle, nvml_index or None, how)`` for CUDA device ``cuda_index`` of this process.

    ``uuid`` (torch's device UUID) is tried first; then ``visible`` (the value of
    ``CUDA_VISIBLE_DEVICES``): an ordinal list maps position -> NVML index, a ``GPU-``
    list is matched by UUID prefix; then the CUDA index itself. Raises if nothing works.
    """
    if uuid:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            return handle, _index_of(nvml, handle), "uuid"
        except Exception as exc:
            log.debug("NVML: no device with UUID %s (%s)", uuid, exc)
    if visible is not None and visible.strip():
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if cuda_index >= len(entries):
            raise RuntimeError(f"CUDA device {cuda_index} is not in CUDA_VISIBLE_DEVICES={visible!r}")
        entry = entries[cuda_index]
        if entry.startswith(("GPU-", "MIG-")):
            for i in range(int(nvml.nvmlDeviceGetCount())):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                if _decode(nvml.nvmlDeviceGetUUID(handle)).startswith(entry):
                    return handle, i, "CUDA_VISIBLE_DEVICES uuid"
            return nvml.nvmlDeviceGetHandleByUUID(entry), None, "CUDA_VISIBLE_DEVICES uuid"
        index = int(entry)
        return nvml.nvmlDeviceGetHandleByIndex(index), index, "CUDA_VISIBLE_DEVICES"
    return nvml.nvmlDeviceGetHandleByIndex(cuda_index), cuda_index, "cuda index"


def _index_of(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetIndex(handle))
    except Exception:
        return None


class NvmlSession:
    """``nvmlInit`` / ``nvmlShutdown`` around the handle of one CUDA device.

    Raises on construction when NVML or the device is missing; ``close()`` never raises.
    """

    def __init__(self, cuda_index: int, nvml: Any = None) -> None:
        self.nvml = nvml if nvml is not None else load_pynvml()
        self.nvml.nvmlInit()
        self._open = True
        try:
            self.handle, self.index, self.how = resolve_handle(
                self.nvml, cuda_index, uuid=_torch_uuid(cuda_index), visible=os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        except Exception:
            self.close()
            raise
        self.cuda_index = cuda_index

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass

    def name(self) -> str | None:
        try:
            return _decode(self.nvml.nvmlDeviceGetName(self.handle))
        except Exception:
            return None


class _Metric:
    """One guarded NVML read that yields one or more named figures per sample."""

    __slots__ = ("name", "read", "alive")

    def __init__(self, name: str, read: Callable[[], dict[str, Any] | None]) -> None:
        self.name = name
        self.read = read
        self.alive = True


class TelemetrySampler:
    """Samples one GPU through NVML on a daemon thread; medians on demand.

    ``session`` is an open :class:`NvmlSession` (the sampler closes it when it stops).
    Use :meth:`start` / :meth:`stop`, or :meth:`sample_once` to sample on the calling
    thread (tests). Memory is bounded: ``ring_size`` floats per metric plus one counter
    per clock-event reason.
    """

    def __init__(self, session: NvmlSession, *, interval_s: float | None = None, ring_size: int = RING_SIZE) -> None:
        self.session = session
        self.nvml = session.nvml
        self.handle = session.handle
        self.interval_s = DEFAULT_INTERVAL_S if interval_s is None else float(interval_s)
        self.ring_size = ring_size
        self.available = True
        self.error: str | None = None
        self.dropped: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples = 0
        self._rings: dict[str, deque[float]] = {}
        self._reason_counts: dict[str, int] = {}
        self._reason_samples = 0
        self._nvlink_last: tuple[float, float, float] | None = None  # (t, tx KiB, rx KiB)
        self.static = self._read_static()
        self._metrics = self._build_metrics()

    # ------------------------------------------------------------------ setup
    def _read_static(self) -> dict[str, Any]:
        nvml, h = self.nvml, self.handle
        out: dict[str, Any] = {
            "device_name": self.session.name(),
            "nvml_index": self.session.index,
            "nvml_match": self.session.how,
        }
        reads: dict[str, Callable[[], Any]] = {
            "memory_total_bytes": lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            "sm_clock_max_mhz": lambda: float(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)),
            "power_limit_w": lambda: float(nvml.nvmlDeviceGetEnforcedPowerLimit(h)) / 1e3,
        }
        for key, read in reads.items():
            try:
                out[key] = read()
            except Exception as exc:
                out[key] = None
                self.dropped[key] = _err(exc)
        return out

    def _build_metrics(self) -> list[_Metric]:
        nvml, h = self.nvml, self.handle

        def utilization() -> dict[str, Any]:
            rates = nvml.nvmlDeviceGetUtilizationRates(h)
            return {"gpu_util_percent": float(rates.gpu), "mem_util_percent": float(rates.memory)}

        new_fn: Callable[[Any], int] | None = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        old_fn: Callable[[Any], int] | None = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

        def reasons_fn(handle: Any) -> int:
            # pynvml always defines the new name; a driver older than 535 lacks the symbol
            # and raises NVMLError_FunctionNotFound at call time: use the old name then.
            if new_fn is not None:
                try:
                    return new_fn(handle)
                except Exception:
                    if old_fn is None:
                        raise
            # (neither name: calling None raises, and the metric is dropped as any failing one)
            return cast("Callable[[Any], int]", old_fn)(handle)

        def pcie() -> dict[str, Any]:  # KB/s (1000 bytes) over a 20 ms window
            tx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)
            rx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)
            return {"pcie_tx_GBps": float(tx) * 1e3 / 1e9, "pcie_rx_GBps": float(rx) * 1e3 / 1e9}

        specs: list[tuple[str, Callable[[], dict[str, Any] | None]]] = [
            ("utilization", utilization),
            ("memory_used", lambda: {"memory_used_bytes": float(nvml.nvmlDeviceGetMemoryInfo(h).used)}),
            ("power", lambda: {"power_w": float(nvml.nvmlDeviceGetPowerUsage(h)) / 1e3}),
            ("sm_clock", lambda: {"sm_clock_mhz": float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))}),
            (
                "temperature",
                lambda: {"temperature_c": float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))},
            ),
            ("clock_event_reasons", lambda: {"clock_event_reasons": int(reasons_fn(h))}),
            ("pcie_throughput", pcie),
            ("nvlink_throughput", self._nvlink_rates),
        ]
        return [_Metric(name, read) for name, read in specs]

    def _nvlink_rates(self) -> dict[str, Any] | None:
        """TX and RX GB/s since the previous sample, from the all-links KiB counters."""
        nvml = self.nvml
        ids = [
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _UINT_MAX),
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _UINT_MAX),
        ]
        values = nvml.nvmlDeviceGetFieldValues(self.handle, ids)
        tx, rx = field_value(values[0]), field_value(values[1])
        if tx is None or rx is None:
            raise RuntimeError("NVLink throughput fields not supported (no NVLink?)")
        now = time.monotonic()
        last, self._nvlink_last = self._nvlink_last, (now, tx, rx)
        if last is None or now <= last[0]:
            return None
        dt = now - last[0]
        return {
            "nvlink_tx_GBps": max(0.0, tx - last[1]) * 1024 / dt / 1e9,
            "nvlink_rx_GBps": max(0.0, rx - last[2]) * 1024 / dt / 1e9,
        }

    # ------------------------------------------------------------------ sampling
    def sample_once(self) -> None:
        """One sample of every live metric; a metric whose call raises is dropped for good."""
        values: dict[str, float] = {}
        for metric in self._metrics:
            if not metric.alive:
                continue
            try:
                got = metric.read()
            except Exception as exc:
                metric.alive = False
                self.dropped[metric.name] = _err(exc)
                log.debug("dtprofile NVML metric %s dropped", metric.name, exc_info=exc)
                continue
            if got:
                values.update(got)
        with self._lock:
            self._samples += 1
            mask = values.pop("clock_event_reasons", None)
            if mask is not None:
                self._reason_samples += 1
                for name, bit in CLOCK_EVENT_REASONS.items():
                    if int(mask) & bit:
                        self._reason_counts[name] = self._reason_counts.get(name, 0) + 1
            for key, value in values.items():
                ring = self._rings.get(key)
                if ring is None:
                    ring = self._rings[key] = deque(maxlen=self.ring_size)
                ring.append(float(value))

    def _run(self) -> None:
        try:
            while True:
                self.sample_once()
                if not any(m.alive for m in self._metrics):
                    log.debug("dtprofile NVML sampler: every metric dropped, stopping")
                    return
                if self._stop.wait(self.interval_s):
                    return
        except Exception as exc:  # never into training: warn once, stop sampling
            self.error = _err(exc)
            console.warn(f"dtprofile: GPU telemetry stopped after an internal error ({self.error}); training continues")

    def start(self) -> TelemetrySampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dtprofile-nvml", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def reset(self) -> None:
        """Forget the samples so far (the engine calls it when warm-up ends)."""
        with self._lock:
            for ring in self._rings.values():
                ring.clear()
            self._samples = 0
            self._reason_counts.clear()
            self._reason_samples = 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waits at most ``timeout_s``) and close NVML. Never raises."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if thread is None or not thread.is_alive():
            if self._samples == 0 and self.available:  # a run shorter than one interval still gets a reading
                try:
                    self.sample_once()
                except Exception:
                    pass
            self.session.close()

    # ------------------------------------------------------------------ summaries
    def _snapshot(self) -> tuple[dict[str, float], dict[str, int], int, int]:
        with self._lock:
            medians = {
                k: float(np.median(np.fromiter(r, dtype=float, count=len(r)))) for k, r in self._rings.items() if r
            }
            return medians, dict(self._reason_counts), self._reason_samples, self._samples

    def summary(self, rank: int | None = None) -> dict[str, Any]:
        """``run.telemetry`` for this rank: medians per metric, throttling, what was dropped."""
        med, reasons, reason_samples, samples = self._snapshot()
        out: dict[str, Any] = {"available": True, "source": "nvml", "rank": rank, "interval_s": self.interval_s}
        out.update(self.static)
        for key in (
            "gpu_util_percent",
            "mem_util_percent",
            "memory_used_bytes",
            "power_w",
            "sm_clock_mhz",
            "temperature_c",
            "pcie_tx_GBps",
            "pcie_rx_GBps",
            "nvlink_tx_GBps",
            "nvlink_rx_GBps",
        ):
            out[key] = med.get(key)
        out["samples"] = samples
        clock, clock_max = out["sm_clock_mhz"], out.get("sm_clock_max_mhz")
        out["sm_clock_ratio"] = clock / clock_max if clock is not None and clock_max else None
        shares = {name: count / reason_samples for name, count in sorted(reasons.items())} if reason_samples else {}
        out["clock_event_reasons"] = shares if reason_samples else None
        limiting = [n for n in LIMITING_REASONS if shares.get(n, 0.0) >= THROTTLE_MIN_SHARE]
        slow_clock = out["sm_clock_ratio"] is None or out["sm_clock_ratio"] < THROTTLE_CLOCK_RATIO
        throttled = bool(limiting) and slow_clock
        out["throttled"] = throttled if reason_samples else None
        out["throttle_reasons"] = limiting if throttled else []
        out["metrics_dropped"] = dict(self.dropped)
        if self.error:
            out["error"] = self.error
        return out

    def rank_vector(self) -> list[float]:
        """This rank's :data:`RANK_KEYS` as floats for the cross-rank gather (nan = unknown)."""
        return rank_vector(self.summary())


def rank_vector(telemetry: dict[str, Any] | None) -> list[float]:
    """:data:`RANK_KEYS` of a telemetry summary as floats (nan where unknown)."""
    nan = float("nan")
    if not telemetry or not telemetry.get("available"):
        return [nan] * len(RANK_KEYS)
    out = []
    for key in RANK_KEYS:
        if key == "throttle_mask":
            if telemetry.get("throttled") is None:
                out.append(nan)
            else:
                out.append(float(sum(CLOCK_EVENT_REASONS[n] for n in telemetry.get("throttle_reasons") or [])))
        else:
            value = telemetry.get(key)
            out.append(nan if value is None else float(value))
    return out


def rank_entry(rank: int, values: dict[str, Any]) -> dict[str, Any] | None:
    """A ``run.telemetry.ranks`` entry from gathered :data:`RANK_KEYS` values (None = unknown)."""
    if all(values.get(k) is None for k in RANK_KEYS):
        return None
    entry: dict[str, Any] = {"rank": rank}
    for key in RANK_KEYS[:-1]:
        entry[key] = values.get(key)
    mask = values.get("throttle_mask")
    if mask is None:
        entry["throttled"], entry["throttle_reasons"] = None, []
    else:
        names = [n for n, bit in CLOCK_EVENT_REASONS.items() if int(mask) & bit]
        entry["throttled"], entry["throttle_reasons"] = bool(names), names
    return entry


def start_sampler(
    device: Any, *, nvml: Any = None, interval_s: float | None = None
) -> tuple[TelemetrySampler | None, str | None]:
    """``(sampler, None)`` with its thread running for ``device``, or ``(None, reason)``.

    Never raises. A CPU device, a missing ``pynvml``, an NVML that does not initialise
    (no driver) or a device NVML cannot find give a reason and no thread.
    """
    if getattr(device, "type", None) != "cuda":
        return None, f"device is {getattr(device, 'type', device)}, not cuda"
    index = device.index
    if index is None:
        try:
            import torch

            index = torch.cuda.current_device()
        except Exception:
            index = 0
    try:
        session = NvmlSession(int(index), nvml=nvml)
    except ImportError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"NVML unavailable for cuda:{index} ({_err(exc)})"
    try:
        sampler = TelemetrySampler(session, interval_s=interval_s)
        return sampler.start(), None
    except Exception as exc:
        session.close()
        return None, f"NVML sampler could not start ({_err(exc)})"
