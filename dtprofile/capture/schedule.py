"""Which steps do what: the schedules of the sampled steps.

Step numbers are the same on every rank, so every rank samples the same steps: probe
steps (compute and communication each alone), steps that time each gradient bucket, and,
without a process group, steps that time forward's and backward's starts and ends.
Pure functions of the step number, the warm-up and the option; the step tracker
(:mod:`.steps`) asks them as each step opens.
"""

from __future__ import annotations

import math
from typing import Literal

from ..options import (
    BACKWARD_TIMING_EVERY_AUTO,
    BUCKET_TIMING_AUTO,
    BUCKET_TIMING_EVERY_AUTO,
    PROBE_AUTO,
    TIMED_STEP_COST_S,
    TIMED_STEPS_SHARE,
)

__all__ = [
    "BUCKET_TIMING_FIRST",
    "BACKWARD_TIMING_FIRST",
    "PROBE_FIRST",
    "PROBE_EVERY_AUTO",
    "auto_backward_every",
    "next_timed_backward",
    "probes",
    "times_backward",
    "times_buckets",
]

#: Steps right after warm-up whose buckets are all timed, so that a short run has
#: communication totals too (then every ``bucket_timing_every``-th step).
BUCKET_TIMING_FIRST = 8
#: Steps right after warm-up whose backward is timed, without a process group (then
#: every ``backward_timing_every``-th step).
BACKWARD_TIMING_FIRST = 20
#: ``probe_every="auto"``: probe steps this many steps after warm-up (normal steps
#: between them), so that a short run has compute measured alone too, then every
#: PROBE_EVERY_AUTO-th. A probe step loses the overlap of communication with backward:
#: that once in 50 steps.
PROBE_FIRST = (1, 4, 9, 14)
PROBE_EVERY_AUTO = 50


def times_buckets(step_index: int, warmup_steps: int, every: int | Literal["auto"]) -> bool:
    """Whether step ``step_index`` times each gradient bucket's reduction.

    The first :data:`BUCKET_TIMING_FIRST` steps after warm-up and every ``every``-th
    after them; step numbers are the same on every rank, so all ranks time the same
    steps. The other steps time only the wait after backward (see
    :mod:`dtprofile.capture.ddp`).

    ``every`` 0: no step does; ``"auto"``: every
    :data:`~dtprofile.options.BUCKET_TIMING_EVERY_AUTO`-th (where a hook is registered).

    >>> [i for i in range(40) if times_buckets(i, warmup_steps=5, every=10)]
    [5, 6, 7, 8, 9, 10, 11, 12, 15, 25, 35]
    """
    if every == BUCKET_TIMING_AUTO:
        every = BUCKET_TIMING_EVERY_AUTO
    after = step_index - warmup_steps
    return every > 0 and after >= 0 and (after < BUCKET_TIMING_FIRST or after % every == 0)


def times_backward(step_index: int, warmup_steps: int, every: int) -> bool:
    """Whether step ``step_index`` times backward's start and end, where nothing waits for
    gradients after backward (no process group; with one, every step does).

    The warm-up, the first :data:`BACKWARD_TIMING_FIRST` steps after it and every
    ``every``-th after them (``backward_timing_every``).

    >>> [i for i in range(60) if not times_backward(i, warmup_steps=5, every=10)][:12]
    [26, 27, 28, 29, 30, 31, 32, 33, 34, 36, 37, 38]
    """
    after = step_index - warmup_steps
    return after < BACKWARD_TIMING_FIRST or after % every == 0


def auto_backward_every(step_s: float) -> int:
    """``backward_timing_every="auto"`` for steps of ``step_s`` seconds on the host:
    every :data:`~dtprofile.options.BACKWARD_TIMING_EVERY_AUTO`-th step, or less often
    where that would cost the run more than
    :data:`~dtprofile.options.TIMED_STEPS_SHARE` of its time.

    >>> auto_backward_every(0.05), auto_backward_every(0.002), auto_backward_every(150e-6)
    (10, 10, 134)
    """
    if not step_s > 0:  # (no figure: the default)
        return BACKWARD_TIMING_EVERY_AUTO
    # (less a rounding error's worth: at 2 ms the quotient is 10.000000000000002)
    return max(BACKWARD_TIMING_EVERY_AUTO, math.ceil(TIMED_STEP_COST_S / (TIMED_STEPS_SHARE * step_s) - 1e-9))


def next_timed_backward(step_index: int, warmup_steps: int, every: int) -> int:
    """The first step from ``step_index`` on for which :func:`times_backward` is true.

    >>> next_timed_backward(31, warmup_steps=5, every=10), next_timed_backward(35, 5, 10)
    (35, 35)
    """
    after = step_index - warmup_steps
    if after < BACKWARD_TIMING_FIRST:
        return step_index
    return step_index + (-after) % every


def probes(step_index: int, warmup_steps: int, every: int | Literal["auto"]) -> bool:
    """Whether step ``step_index`` is a probe step (``probe_every``: ``every``).

    Step numbers are the same on every rank, so all ranks probe the same steps.

    >>> [i for i in range(120) if probes(i, warmup_steps=5, every="auto")]
    [6, 9, 14, 19, 55, 105]
    >>> [i for i in range(20) if probes(i, warmup_steps=5, every=4)]
    [5, 9, 13, 17]
    """
    after = step_index - warmup_steps
    if after < 0 or not every:
        return False
    if every == PROBE_AUTO:
        return after in PROBE_FIRST or (after > 0 and after % PROBE_EVERY_AUTO == 0)
    return after % every == 0
