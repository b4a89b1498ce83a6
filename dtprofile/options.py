"""The profiler's options, validated once at construction.

Every error names the argument and the values it accepts, e.g.::

    ValueError: every_n_steps must be an integer >= 1, got 0
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from numbers import Integral, Real
from typing import Any, Sequence

__all__ = ["Options", "DEFAULT_PROJECT_GPUS"]

DEFAULT_PROJECT_GPUS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
SCALING_MODES = ("weak", "strong")
LINK_PER = ("node", "gpu")  # (dtprofile.model.LINK_PER: the model is not imported with the options)


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Options:
    """Options shared by ``dtprofile.profile`` and the Lightning callback.

    - ``logdir``: where TensorBoard events and ``dtprofile_summary.json`` go (None: no files).
    - ``every_n_steps``: log interval and window length, in optimizer steps.
    - ``warmup_steps``: steps skipped before measuring (compilation, allocator warm-up).
    - ``target_efficiency``: the scaling efficiency the recommendations aim for, in (0, 1].
    - ``link_bandwidth``: the interconnect's bus bandwidth: a number of bytes/s, or a
      string with its unit like "25Gbps" or "12.5GB/s" (a string without one is refused);
      used for projections when this run cannot measure it.
    - ``link_bandwidth_per``: whose link ``link_bandwidth`` is when a projection spreads
      GPUs over nodes: "node" (the default: one link per node, shared by its GPUs) or
      "gpu" (a NIC per GPU, as in rail-optimised clusters).
    - ``scaling``: "weak" (per-device batch fixed) or "strong" (global batch fixed).
    - ``project_gpus``: the GPU counts to project to.
    - ``probe_every``: every Nth step, hold the all-reduce until backward ends to measure
      compute and communication each alone (0 = never, the default; at least 2).
    - ``gather_timeout_s``: how long the cross-rank gather may wait for a rank.
    - ``telemetry_interval_s``: seconds between NVML samples of the GPU, taken on a thread
      of their own (None: every 0.5 s; 0: no telemetry and no thread; else 0.05 to 3600).
    """

    logdir: str | os.PathLike[str] | None = None  # a str once constructed
    every_n_steps: int = 50
    warmup_steps: int = 5
    target_efficiency: float = 0.8
    link_bandwidth: float | str | None = None
    link_bandwidth_per: str = "node"
    scaling: str = "weak"
    project_gpus: Sequence[int] = DEFAULT_PROJECT_GPUS  # a sorted tuple once constructed
    probe_every: int = 0
    gather_timeout_s: float = 60.0
    telemetry_interval_s: float | None = None
    link_bandwidth_Bps: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("every_n_steps", _int("every_n_steps", self.every_n_steps, 1))
        set_("warmup_steps", _int("warmup_steps", self.warmup_steps, 0))
        set_("probe_every", _int("probe_every", self.probe_every, 0))
        if self.probe_every == 1:  # probe steps are compared with normal ones: some must be normal
            raise ValueError("probe_every must be 0 (no probes) or an integer >= 2 (every Nth step "
                             "a probe, the others normal), got 1")
        eff = self.target_efficiency
        if isinstance(eff, bool) or not isinstance(eff, Real) or not (0.0 < float(eff) <= 1.0):
            raise ValueError(f"target_efficiency must be a number in (0, 1], got {eff!r}")
        set_("target_efficiency", float(eff))
        if self.link_bandwidth_per not in LINK_PER:
            raise ValueError(f"link_bandwidth_per must be one of {LINK_PER}, got {self.link_bandwidth_per!r}")
        if self.scaling not in SCALING_MODES:
            raise ValueError(f"scaling must be one of {SCALING_MODES}, got {self.scaling!r}")
        set_("project_gpus", _gpus(self.project_gpus))
        timeout = self.gather_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, Real)
                or not (0 < float(timeout) <= MAX_GATHER_TIMEOUT_S)):
            raise ValueError(f"gather_timeout_s must be a positive number of seconds, at most "
                             f"{MAX_GATHER_TIMEOUT_S:g} (a week), got {timeout!r}")
        set_("gather_timeout_s", float(timeout))
        set_("telemetry_interval_s", _telemetry_interval(self.telemetry_interval_s))
        if self.link_bandwidth is not None:
            from .model import parse_bandwidth

            set_("link_bandwidth_Bps", float(parse_bandwidth(self.link_bandwidth, name="link_bandwidth")))
        if self.logdir is not None:
            set_("logdir", _logdir(self.logdir))

    def to_dict(self) -> dict[str, Any]:
        """The options as the summary records them (``options`` object)."""
        d = asdict(self)
        d.pop("link_bandwidth")
        d.pop("logdir")
        d["project_gpus"] = list(self.project_gpus)
        return d


#: The gather's timeout goes to gloo in milliseconds (a C int on some paths): 1e20 s overflowed.
MAX_GATHER_TIMEOUT_S = 7 * 24 * 3600.0


#: NVML is read off the training thread, but each sample costs host time (42 ms on one
#: VM): a floor keeps the rate bounded.
MIN_TELEMETRY_INTERVAL_S = 0.05
MAX_TELEMETRY_INTERVAL_S = 3600.0


def _telemetry_interval(value: Any) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, Real)
            or not (value == 0 or MIN_TELEMETRY_INTERVAL_S <= float(value) <= MAX_TELEMETRY_INTERVAL_S)):
        raise ValueError(f"telemetry_interval_s must be None (every 0.5 s), 0 (no GPU telemetry) or a number of "
                         f"seconds from {MIN_TELEMETRY_INTERVAL_S:g} to {MAX_TELEMETRY_INTERVAL_S:g}, got {value!r}")
    return float(value) if value != 0 else 0.0  # not -0.0 in the summary


def _gpus(value: Any) -> tuple[int, ...]:
    message = f"project_gpus must be a non-empty sequence of integers >= 1, got {value!r}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(message)
    if any(isinstance(g, bool) or not isinstance(g, Integral) or g < 1 for g in value):
        raise ValueError(message)
    return tuple(sorted(set(int(g) for g in value)))


def _logdir(value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"logdir must be a directory path (str or os.PathLike) or None, got {value!r}")
    path = os.fspath(value)
    if not path:  # "" would put the summary in the working directory, the events under ./runs
        raise ValueError("logdir must be a directory path or None (no files), got ''")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"logdir must be a directory, but {path!r} is a file")
    probe = path
    while probe and not os.path.exists(probe):  # the nearest existing ancestor must be writable
        parent = os.path.dirname(probe)
        probe = parent if parent != probe else ""
    if probe and not os.path.isdir(probe):
        raise ValueError(f"logdir must be a directory path, but {probe!r} in {path!r} is a file")
    # os.access says yes to root everywhere; a read-only mount still refuses root.
    if not os.access(probe or ".", os.W_OK) or _read_only_mount(probe or "."):
        raise ValueError(f"logdir must be writable, but {path!r} is not")
    return path


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows): os.access has answered
        return False
