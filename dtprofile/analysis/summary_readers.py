"""Figures of a run summary that the projection, the recommendations and the advice all read.

Each reader takes a summary (``docs/summary.md``) and treats a missing, null or
non-finite figure as not measured, as :mod:`dtprofile._values` does.

Example:
    >>> s = {"world_size": 4, "grad_bytes": None, "run": {"param_bytes": 8e6},
    ...      "per_step_ms": {"overhead": 5.0, "compute": 20.0}}
    >>> world_size(s), comm_bytes_per_step(s), overhead_ratio(s), buffer_broadcast_ms(s)
    (4, 8000000.0, 0.25, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._values import finite, get, parse_finite

__all__ = ["buffer_broadcast_ms", "comm_bytes_per_step", "headline_metrics", "overhead_ratio", "world_size"]


def comm_bytes_per_step(summary: Mapping[str, Any]) -> float | None:
    """Bytes communicated per step, as the cost models take them.

    Args:
        summary: A run summary.

    Returns:
        ``grad_bytes``, else the trainable (else all) parameters' bytes from ``run``;
        None when none of them is a positive number.
    """
    run_info = get(summary, "run")
    for value in (get(summary, "grad_bytes"), get(run_info, "trainable_param_bytes"), get(run_info, "param_bytes")):
        value = finite(value)
        if value is not None and value > 0:
            return value
    return None


def world_size(summary: Mapping[str, Any]) -> int:
    """The ranks the run was measured on: ``world_size`` when it is at least 1, else 1.

    Args:
        summary: A run summary.

    Returns:
        The number of ranks, an int >= 1.
    """
    ws = finite(get(summary, "world_size"))
    return int(ws) if ws is not None and ws >= 1 else 1


def overhead_ratio(summary: Mapping[str, Any]) -> float | None:
    """The measured overhead ratio R_O = T_O / T_C (per rank).

    Args:
        summary: A run summary.

    Returns:
        ``ratios.R_O``, else ``per_step_ms.overhead / per_step_ms.compute``; None when
        neither is known or the ratio is not a finite number >= 0.
    """
    r_o = finite(get(get(summary, "ratios"), "R_O"))
    if r_o is None:
        per_step = get(summary, "per_step_ms")
        overhead, compute = finite(get(per_step, "overhead")), finite(get(per_step, "compute"))
        if overhead is not None and compute is not None and compute > 0:
            r_o = overhead / compute
    # A compute time of ~0 (a denormal) makes R_O overflow: no meaningful ratio then.
    return r_o if r_o is not None and 0 <= r_o < math.inf else None


def buffer_broadcast_ms(summary: Mapping[str, Any]) -> float:
    """DDP's buffer broadcast before each forward, as measured (ms per step; 0 when unknown).

    Args:
        summary: A run summary.

    Returns:
        ``per_step_ms.comm_buffers``, at least 0.
    """
    return max(0.0, finite(get(get(summary, "per_step_ms"), "comm_buffers")) or 0.0)


def headline_metrics(summary: dict[str, Any] | None) -> dict[str, float]:
    """The headline figures the framework integrations hand to the trainer's other reporters
    (Lightning's ``callback_metrics`` and loggers, the Transformers Trainer's logs).

    - ``dtprofile/R_O``: the overhead ratio T_O / T_C;
    - ``dtprofile/alpha_at_target``: the paper's alpha(G) = (1 + R) / (1 + G R) with
      R = R_O / (ranks measured), the overhead over the global batch's compute on one
      device (``projection.R_O_paper``), at
      G = the recommended GPU count (the largest projected G whose projected efficiency
      meets ``target_efficiency``); when there is no recommendation, at the largest
      projected G;
    - ``dtprofile/recommended_gpus``: that G.
    """
    if not isinstance(summary, dict):
        return {}
    out: dict[str, float] = {}
    r_o = parse_finite((summary.get("ratios") or {}).get("R_O"))
    if r_o is not None:
        out["dtprofile/R_O"] = r_o
    projection = summary.get("projection") or {}
    gpus = list(projection.get("gpus") or [])
    alphas = list(projection.get("alpha_paper") or [])
    if gpus:
        g: Any = (summary.get("recommendations") or {}).get("gpus")
        if g not in gpus:
            g = max(gpus)
        index = gpus.index(g)
        a = parse_finite(alphas[index]) if index < len(alphas) else None
        if a is None and r_o is not None:
            from .perf_model import alpha, paper_r_o

            a = parse_finite(alpha(paper_r_o(r_o, summary.get("world_size") or 1), g))
        if a is not None:
            out["dtprofile/alpha_at_target"] = a
            out["dtprofile/recommended_gpus"] = float(g)
    return out
