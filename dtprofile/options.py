"""The profiler's options: defaults, validation and documentation, defined once.

:func:`dtprofile.profile`, :class:`dtprofile.DTProfileCallback` and the ``DTPROFILE_*``
environment variables all come from :class:`Options`: their keywords are its fields
(:func:`options_from_kwargs`), their variables its fields' names in capitals
(:func:`options_from_env`). Every error names the option and the values it accepts,
e.g.::

    ValueError: every_n_steps must be an integer >= 1, got 0
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from numbers import Integral, Real
from typing import Any, Final, Literal, cast

from .analysis.perf_model import LINK_PER, parse_bandwidth
from .analysis.phases import SCALING_MODES
from .analysis.projection import DEFAULT_PROJECT_GPUS

#: The value of an option that chooses for itself.
AUTO: Final = "auto"
#: ``probe_every``'s default: probe steps on a schedule of their own
#: (:func:`dtprofile.capture.schedule.probes`).
PROBE_AUTO: Final = AUTO
#: ``bucket_timing_every="auto"``: no communication hook where the probe steps time
#: communication alone, else every BUCKET_TIMING_EVERY_AUTO-th step (see the option).
BUCKET_TIMING_AUTO: Final = AUTO
BUCKET_TIMING_EVERY_AUTO = 20
#: ``backward_timing_every="auto"``: every BACKWARD_TIMING_EVERY_AUTO-th step, or less
#: often where the steps are short (see :func:`dtprofile.capture.schedule.auto_backward_every`).
BACKWARD_TIMING_AUTO: Final = AUTO
BACKWARD_TIMING_EVERY_AUTO = 10
#: What a step that times its passes costs the host beyond one that does not, in a loop
#: of fast steps: 20 us warm, 40-85 us when it comes once in 10 to 100 steps (its code
#: and data are cold by then), and a few us on the step before and the two after
#: (benchmarks/overhead.py's fast fake steps, 2-core machine).
TIMED_STEP_COST_S = 100e-6
#: ``backward_timing_every="auto"`` times passes on few enough steps that they cost the
#: run at most this share of its time, where the log interval allows (it takes one).
TIMED_STEPS_SHARE = 0.005
#: Earlier runs the intervals may pool (the history file keeps 64 of all jobs).
MAX_POOL_RUNS = 32

__all__ = [
    "Options",
    "DEFAULT_PROJECT_GPUS",
    "PROBE_AUTO",
    "BUCKET_TIMING_AUTO",
    "BACKWARD_TIMING_AUTO",
    "ENV_PREFIX",
    "OPTION_NAMES",
    "env_parser",
    "env_variables",
    "options_from_env",
    "options_from_kwargs",
    "options_signature",
]


def _int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        accepted = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{name} must be an integer {accepted}, got {value!r}")
    if maximum is not None and int(value) > maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r}")
    return int(value)


def _int_or_auto(name: str, value: Any, accepted: str, minimum: int = 0) -> int | Literal["auto"]:
    """``"auto"``, or ``value`` as an integer >= ``minimum``; else a one-line error naming ``accepted``."""
    if value == AUTO:
        return cast('Literal["auto"]', value)
    try:
        return _int(name, value, minimum)
    except ValueError:
        raise ValueError(f"{name} must be {accepted}, got {value!r}") from None


def _env_int_or_auto(var: str, raw: str) -> int | Literal["auto"]:
    return AUTO if raw.strip().lower() == AUTO else _env_int(var, raw)


def _env_text(var: str, raw: str) -> str:
    return raw.strip()


def _env_path(var: str, raw: str) -> str:
    return raw


def _env_int(var: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None


def _env_float(var: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{var} must be a number, got {raw!r}") from None


def _env_gpus(var: str, raw: str) -> tuple[int, ...]:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    try:
        return tuple(int(x) for x in items)
    except ValueError:
        raise ValueError(f"{var} must be a comma-separated list of integers like '1,2,4,8', got {raw!r}") from None


def _option(default: Any, doc: str, env: Callable[[str, str], Any]) -> Any:
    """An option: its default, its documentation, and how its ``DTPROFILE_*`` variable
    is read (text in, the option's value out; :class:`Options` validates it)."""
    return field(default=default, metadata={"doc": doc, "env": env})


@dataclass(frozen=True)
class Options:
    """The profiler's options: one definition, shared by :func:`dtprofile.profile`,
    :class:`dtprofile.DTProfileCallback` and the ``DTPROFILE_*`` environment variables
    (each option's variable is ``DTPROFILE_`` and its name in capitals, e.g.
    ``DTPROFILE_WARMUP_STEPS``). Validated at construction; every error names the
    option and the values it accepts.

    Example:
        >>> Options(warmup_steps=2, link_bandwidth="25Gbps").link_bandwidth_Bps
        3125000000.0
        >>> options_from_env({"DTPROFILE_PROJECT_GPUS": "8,16"})
        {'project_gpus': (8, 16)}
    """

    logdir: str | os.PathLike[str] | None = _option(
        None, "where TensorBoard events and dtprofile_summary.json go (None: no files)", _env_path
    )
    every_n_steps: int = _option(50, "log interval and window length, in optimizer steps", _env_int)
    warmup_steps: int = _option(5, "steps skipped before measuring (compilation, allocator warm-up)", _env_int)
    target_efficiency: float = _option(0.8, "the scaling efficiency the recommendations aim for, in (0, 1]", _env_float)
    link_bandwidth: float | str | None = _option(
        None,
        "the interconnect's bus bandwidth: a number of bytes/s, or a string with its unit like "
        "'25Gbps' or '12.5GB/s' (a string without one is refused); used for projections when this run "
        "cannot measure it",
        _env_text,
    )
    scaling: str | None = _option(
        None,
        "what the job keeps fixed when the GPU count changes: 'weak' (the per-device batch) or "
        "'strong' (the global batch); None (the default, a run cannot tell): projected as weak, and "
        "the report shows the strong answer beside it wherever the two lead to different decisions",
        _env_text,
    )
    project_gpus: Sequence[int] = _option(
        DEFAULT_PROJECT_GPUS, "the GPU counts to project to (a sorted tuple once constructed)", _env_gpus
    )
    probe_every: int | Literal["auto"] = _option(
        "auto",
        "under DDP, probe steps measure compute without communication's interference and "
        "communication alone: their passes skip DDP's reduction and reduce by hand after backward (or "
        "hold the reductions until backward ends where DDP's setup needs its own) ('auto', the default: "
        "the 2nd, 5th, 10th and 15th steps after warm-up, then every 50th; N: every Nth; 0: never)",
        _env_int_or_auto,
    )
    bucket_timing_every: int | Literal["auto"] = _option(
        "auto",
        "under DDP, how gradient communication is timed. 'auto' (the default): where DDP reduces "
        "the plain way (a search for unused parameters included) and probe steps run, no communication "
        "hook at all: DDP reduces with its own C++ "
        "all-reduce, the wait after backward is timed on every step, and communication's total and "
        "bandwidth come from the probe steps, which reduce by hand, alone; elsewhere as 20. N: a hook "
        "times each gradient bucket's reduction on every Nth step after warm-up (and the first 8), and "
        "only the wait after backward on the others (1: every step). 0: no hook and no probes: the wait "
        "after backward only (probe_every must then be 0)",
        _env_int_or_auto,
    )
    backward_timing_every: int | Literal["auto"] = _option(
        "auto",
        "without a process group (one process: no DDP or FSDP), forward's and backward's starts and "
        "ends are timed on every Nth step after warm-up (and the first 20; at least once per log interval), "
        "and the forward and backward figures come from those; every step's step time, data wait, optimizer "
        f"and compute are timed all the same. 'auto' (the default): every {BACKWARD_TIMING_EVERY_AUTO}th "
        f"step, or less often where steps are so short that timing 1 in {BACKWARD_TIMING_EVERY_AUTO} would "
        f"cost them more than {TIMED_STEPS_SHARE:.1%} (steps under about "
        f"{TIMED_STEP_COST_S / TIMED_STEPS_SHARE / BACKWARD_TIMING_EVERY_AUTO * 1e3:g} ms of host time, from "
        "the first 20 after warm-up); N: every Nth (1: every step). A backward inside "
        "optimizer.step(closure), and every backward under DDP and FSDP, is timed on every step",
        _env_int_or_auto,
    )
    gather_timeout_s: float = _option(
        60.0, "how long the cross-rank gather may wait for a rank, in seconds", _env_float
    )
    telemetry_interval_s: float | None = _option(
        None,
        "seconds between NVML samples of the GPU, on a thread of their own (None: every 0.5 s; "
        "0: no telemetry and no thread; else 0.05 to 3600)",
        _env_float,
    )
    link_bandwidth_per: str = _option(
        "node",
        "whose link link_bandwidth is when a projection spreads GPUs over nodes: 'node' (one "
        "link per node, shared by its GPUs) or 'gpu' (a NIC per GPU, as in rail-optimised clusters)",
        _env_text,
    )
    pool_runs: int = _option(
        8,
        "how many earlier runs of the same job in the logdir the intervals pool, so that they hold "
        "what moves from one run to the next as well as this run's own variation (0: this run alone; "
        f"at most {MAX_POOL_RUNS})",
        _env_int,
    )
    link_bandwidth_Bps: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # a frozen dataclass

        set_("every_n_steps", _int("every_n_steps", self.every_n_steps, 1))
        set_("pool_runs", _int("pool_runs", self.pool_runs, 0, MAX_POOL_RUNS))
        set_("warmup_steps", _int("warmup_steps", self.warmup_steps, 0))
        set_("probe_every", _int_or_auto("probe_every", self.probe_every, "'auto', 0 (no probes) or an integer >= 2"))
        set_(
            "backward_timing_every",
            _int_or_auto("backward_timing_every", self.backward_timing_every, "'auto' or an integer >= 1", minimum=1),
        )
        set_(
            "bucket_timing_every",
            _int_or_auto(
                "bucket_timing_every", self.bucket_timing_every, "'auto' or an integer >= 0 (0: no communication hook)"
            ),
        )
        if self.probe_every == 1:  # probe steps are compared with normal ones: some must be normal
            raise ValueError(
                "probe_every must be 'auto', 0 (no probes) or an integer >= 2 (every Nth "
                "step a probe, the others normal), got 1"
            )
        if self.probe_every == PROBE_AUTO and not self.bucket_timing_every:
            set_("probe_every", 0)  # no hook to hold the reductions in
        elif self.probe_every and not self.bucket_timing_every:  # probes hold reductions in the hook
            raise ValueError(
                "probe_every must be 0 when bucket_timing_every is 0 (a probe step holds "
                f"the reductions in dtprofile's communication hook), got {self.probe_every}"
            )
        eff = self.target_efficiency
        if isinstance(eff, bool) or not isinstance(eff, Real) or not (0.0 < float(eff) <= 1.0):
            raise ValueError(f"target_efficiency must be a number in (0, 1], got {eff!r}")
        set_("target_efficiency", float(eff))
        if self.link_bandwidth_per not in LINK_PER:
            raise ValueError(f"link_bandwidth_per must be one of {LINK_PER}, got {self.link_bandwidth_per!r}")
        if self.scaling is not None and self.scaling not in SCALING_MODES:
            raise ValueError(f"scaling must be one of {SCALING_MODES} or None (not said), got {self.scaling!r}")
        set_("project_gpus", _gpus(self.project_gpus))
        timeout = self.gather_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, Real)
            or not (0 < float(timeout) <= MAX_GATHER_TIMEOUT_S)
        ):
            raise ValueError(
                f"gather_timeout_s must be a positive number of seconds, at most "
                f"{MAX_GATHER_TIMEOUT_S:g} (a week), got {timeout!r}"
            )
        set_("gather_timeout_s", float(timeout))
        set_("telemetry_interval_s", _telemetry_interval(self.telemetry_interval_s))
        if self.link_bandwidth is not None:
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
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not (value == 0 or MIN_TELEMETRY_INTERVAL_S <= float(value) <= MAX_TELEMETRY_INTERVAL_S)
    ):
        raise ValueError(
            f"telemetry_interval_s must be None (every 0.5 s), 0 (no GPU telemetry) or a number of "
            f"seconds from {MIN_TELEMETRY_INTERVAL_S:g} to {MAX_TELEMETRY_INTERVAL_S:g}, got {value!r}"
        )
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


# ---------------------------------------------------------------- derived from Options
ENV_PREFIX = "DTPROFILE_"
#: The options, in their order of definition (the keywords of profile() and the callback).
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options) if f.init)


def env_variables() -> dict[str, str]:
    """Each option's environment variable: ``{"DTPROFILE_WARMUP_STEPS": "warmup_steps", ...}``."""
    return {ENV_PREFIX + name.upper(): name for name in OPTION_NAMES}


def env_parser(name: str) -> Callable[[str, str], Any]:
    """How option ``name``'s variable is read: ``parse(variable, text) -> value``."""
    parse: Callable[[str, str], Any] = {f.name: f for f in fields(Options)}[name].metadata["env"]
    return parse


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Option keywords from ``DTPROFILE_*`` environment variables.

    Unset or empty variables keep the default. A bad value raises a one-line
    ``ValueError`` naming the variable, e.g.
    ``DTPROFILE_EVERY_N_STEPS='ten': every_n_steps must be ...``.

    Args:
        environ: the variables (default: ``os.environ``).

    Returns:
        The keywords for :class:`Options` (or profile(), or the callback).
    """
    env = os.environ if environ is None else environ
    by_name = {f.name: f for f in fields(Options)}
    kwargs: dict[str, Any] = {}
    for var, name in env_variables().items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        value = by_name[name].metadata["env"](var, raw)
        try:
            Options(**{name: value})  # check this one value now, so the error names the variable
        except ValueError as exc:
            raise ValueError(f"{var}={raw!r}: {exc}") from None
        kwargs[name] = value
    return kwargs


def options_from_kwargs(caller: str, kwargs: Mapping[str, Any], **defaults: Any) -> Options:
    """:class:`Options` from a caller's keywords, an unknown keyword named in one line.

    Args:
        caller: what the keywords were given to, for the message (``"profile()"``).
        kwargs: the keywords.
        **defaults: the caller's own defaults for options it does not take from Options.

    Returns:
        The validated options.
    """
    unknown = [k for k in kwargs if k not in OPTION_NAMES]
    if unknown:
        raise TypeError(f"{caller} got an unexpected option {unknown[0]!r}; the options are: {', '.join(OPTION_NAMES)}")
    return Options(**{**defaults, **kwargs})


def options_signature(before: Sequence[inspect.Parameter] = (), **defaults: Any) -> inspect.Signature:
    """A signature with ``before`` and then every option as a keyword-only parameter
    (its default: ``defaults`` where given, else the option's), for ``help()`` and IDEs
    of the functions that take the options as ``**kwargs``."""
    params = list(before)
    for f in fields(Options):
        if f.init:
            params.append(
                inspect.Parameter(
                    f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(f.name, f.default), annotation=f.type
                )
            )
    return inspect.Signature(params)


def options_doc() -> str:
    """Every option with its default and documentation, one bullet each (for docstrings)."""
    return "\n".join(
        f"- ``{f.name}`` (default ``{f.default!r}``): {f.metadata['doc']}." for f in fields(Options) if f.init
    )


# The options' documentation, once: appended from the fields to the class's docstring.
Options.__doc__ = f"{(Options.__doc__ or '').rstrip()}\n\n    The options:\n\n" + "\n".join(
    f"    {line}" for line in options_doc().splitlines()
)
