"""Figures for the dtprofile summary (matplotlib, Agg, no pyplot).

Pure functions: a summary (or a history of interval summaries) in, a matplotlib
``Figure`` out; :func:`figure_to_array` turns a figure into an HWC ``uint8`` RGB array
(what ``SummaryWriter.add_image(..., dataformats="HWC")`` takes).

matplotlib is optional: it is imported lazily, and :func:`available` says whether it can
be. Figures are built with ``matplotlib.figure.Figure`` and an Agg canvas, never with
``pyplot``, so they need no display, touch no global figure manager and leak nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._values import parse_finite

if TYPE_CHECKING:  # both are imported where they are used: matplotlib is optional
    import numpy
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "available",
    "speedup_figure",
    "breakdown_figure",
    "figure_to_array",
    "render_speedup",
    "render_breakdown",
    "BREAKDOWN_PARTS",
]

# Stacked parts of the step, bottom to top: (key in per_step_ms, legend label, colour).
# "other" is what remains of the measured step after the named parts.
BREAKDOWN_PARTS: tuple[tuple[str, str, str], ...] = (
    ("forward", "forward", "#4C72B0"),
    ("backward", "backward", "#55A868"),
    ("optimizer", "optimizer", "#8172B2"),
    ("compute", "compute (unsplit)", "#64B5CD"),
    ("data_wait", "data wait", "#DD8452"),
    ("comm_exposed", "exposed comm", "#C44E52"),
    ("comm_peer_wait", "waiting for a slower rank", "#937860"),
    ("other", "other", "#BBBBBB"),
)

_DPI = 100


def available() -> bool:
    """Whether matplotlib can be imported (the images need it; it is optional).

    Returns:
        True when it can.
    """
    try:
        import matplotlib  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def _new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _message(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#555555", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def speedup_figure(summary: Mapping[str, Any]) -> Figure:
    """Projected speedup against the number of devices.

    Three curves on log-log axes: linear (ideal), the paper's Amdahl model
    (``G * alpha(G)``) and dtprofile's refined projection, with the measured world size
    marked.

    Args:
        summary: A summary dict (its ``projection``, ``world_size`` and ``ratios``).

    Returns:
        A matplotlib Figure; a message panel when there is no projection.

    Example:
        ``figure_to_array(speedup_figure(summary))`` is :func:`render_speedup`.
    """
    fig = _new_figure(6.4, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    proj: Any = summary.get("projection") if isinstance(summary, Mapping) else None  # a Mapping past the check
    gpus_raw = proj.get("gpus") if isinstance(proj, Mapping) else None
    if not isinstance(gpus_raw, Sequence) or not gpus_raw:
        _message(ax, "no projection in this summary")
        fig.tight_layout()
        return fig

    def series(key: str) -> tuple[list[float], list[float]]:
        vals = proj.get(key)
        xs: list[float] = []
        ys: list[float] = []
        if not isinstance(vals, Sequence):
            return xs, ys
        for g, v in zip(gpus_raw, vals, strict=False):
            gx, vy = parse_finite(g), parse_finite(v)
            if gx is not None and vy is not None and gx > 0 and vy > 0:
                xs.append(gx)
                ys.append(vy)
        return xs, ys

    gpus = [g for g in (parse_finite(x) for x in gpus_raw) if g is not None and g > 0]
    if gpus:
        ax.plot(gpus, gpus, linestyle="--", color="#888888", label="linear")
    xs, ys = series("speedup_paper")
    if xs:
        ax.plot(xs, ys, marker="o", color="#DD8452", label="paper: G·α(G)")
    xs, ys = series("speedup")
    if xs:
        ax.plot(xs, ys, marker="s", color="#4C72B0", label="refined model")
    ws = parse_finite(summary.get("world_size"))
    if ws is not None and ws >= 1:
        ax.axvline(ws, color="#55A868", linestyle=":", linewidth=1.2, label=f"measured ({int(ws)})")
    if gpus and max(gpus) / min(gpus) >= 4:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted(set(gpus)))
    ax.set_xlabel("devices G")
    ax.set_ylabel("speedup over 1 device")
    scaling = proj.get("scaling") or "?"
    bw = parse_finite(proj.get("bandwidth_GBps"))
    src = proj.get("bandwidth_source") or "?"
    bw_txt = f"{bw:.3g} GB/s ({src})" if bw is not None else f"bandwidth {src}"
    ratios = found if isinstance(found := summary.get("ratios"), Mapping) else {}
    r_o = parse_finite(ratios.get("R_O"))
    r_txt = f", R_O = {r_o:.3g}" if r_o is not None else ""
    ax.set_title(f"Projected speedup ({scaling} scaling, {bw_txt}{r_txt})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def _parts(per_step: Mapping[str, Any]) -> dict[str, float]:
    """Split one per_step_ms record into stacked parts (ms, all >= 0) that add up to
    the step.

    The step is compute + overhead. Overhead splits into data wait, exposed
    communication and other idle time; compute into forward, backward and optimizer. The
    phase times are measured separately from compute (= step - overhead) and may not
    add up to it: when they fall short the rest is "other"; when they exceed it (e.g. a
    backward slowed by the communication it overlaps) they are scaled down to their
    share of compute, so the stack never claims more time than the step took.
    """
    out = {key: 0.0 for key, _, _ in BREAKDOWN_PARTS}
    step = parse_finite(per_step.get("step"))
    data = max(0.0, parse_finite(per_step.get("data_wait")) or 0.0)
    comm = max(0.0, parse_finite(per_step.get("comm_exposed")) or 0.0)
    overhead = parse_finite(per_step.get("overhead"))
    overhead = data + comm if overhead is None else max(0.0, overhead)
    compute = parse_finite(per_step.get("compute"))
    if compute is None:
        compute = max(0.0, step - overhead) if step is not None else 0.0
    compute = max(0.0, compute)
    peer_wait = max(0.0, parse_finite(per_step.get("comm_peer_wait")) or 0.0)
    out["data_wait"] = data
    out["comm_exposed"] = comm
    out["comm_peer_wait"] = peer_wait
    other = max(0.0, overhead - data - comm - peer_wait)
    phases = {k: max(0.0, parse_finite(per_step.get(k)) or 0.0) for k in ("forward", "backward", "optimizer")}
    total = sum(phases.values())
    if total <= 0.0:
        out["compute"] = compute
    elif total <= compute:
        out.update(phases)
        other += compute - total
    else:
        scale = compute / total
        out.update({k: v * scale for k, v in phases.items()})
    if step is not None:
        other += max(0.0, step - sum(out.values()) - other)
    out["other"] = other
    return out


def breakdown_figure(history: Iterable[tuple[int, Mapping[str, Any]]]) -> Figure:
    """Stacked per-step time breakdown over the log intervals seen so far.

    The stack is forward, backward, optimizer (or the unsplit compute), data wait, exposed
    communication, waiting for a slower rank and the unexplained rest of the step; the
    measured step time is drawn on top as a line.

    Args:
        history: ``(global_step, per_step_ms)`` pairs, oldest first.

    Returns:
        A matplotlib Figure: one stacked bar for one interval, an area for several, a
        message panel for none.

    Example:
        ``breakdown_figure([(50, {"step": 95.0, "compute": 62.0, "overhead": 33.0})])``
    """
    hist = [(int(s), p) for s, p in history if isinstance(p, Mapping)]
    fig = _new_figure(6.4, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    if not hist:
        _message(ax, "no intervals logged yet")
        fig.tight_layout()
        return fig
    steps = [s for s, _ in hist]
    parts = [_parts(p) for _, p in hist]
    used = [(k, lbl, c) for k, lbl, c in BREAKDOWN_PARTS if any(p[k] > 0 for p in parts)]
    totals = [parse_finite(p.get("step")) for _, p in hist]
    if len(hist) == 1:
        # One interval: a single stacked bar reads better than a zero-width area.
        bottom = 0.0
        for key, label, colour in used:
            v = parts[0][key]
            ax.bar([0], [v], bottom=[bottom], color=colour, label=label, width=0.5)
            bottom += v
        ax.set_xticks([0])
        ax.set_xticklabels([f"step {steps[0]}"])
        ax.set_xlim(-1, 1)
    else:
        if used:
            ax.stackplot(
                steps,
                *[[p[k] for p in parts] for k, _, _ in used],
                labels=[lbl for _, lbl, _ in used],
                colors=[c for _, _, c in used],
                alpha=0.85,
            )
        pts = [(s, t) for s, t in zip(steps, totals, strict=False) if t is not None]
        if pts:
            ax.plot([s for s, _ in pts], [t for _, t in pts], color="black", linewidth=1.2, label="step")
        ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms per optimizer step (average)")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-step time breakdown over the log intervals", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # Top of the stack first in the legend, like the picture.
        ax.legend(
            handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0
        )
    fig.tight_layout()
    return fig


def figure_to_array(fig: Figure) -> numpy.ndarray:
    """A figure drawn with Agg, as what ``SummaryWriter.add_image(..., dataformats="HWC")`` takes.

    Args:
        fig: A matplotlib Figure.

    Returns:
        An RGB ``uint8`` array of shape (H, W, 3).
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[..., :3], dtype=np.uint8)


def render_speedup(summary: Mapping[str, Any]) -> numpy.ndarray:
    """:func:`speedup_figure` drawn to an HWC ``uint8`` array (:func:`figure_to_array`).

    Args:
        summary: A summary dict.

    Returns:
        The image.
    """
    return figure_to_array(speedup_figure(summary))


def render_breakdown(history: Iterable[tuple[int, Mapping[str, Any]]]) -> numpy.ndarray:
    """:func:`breakdown_figure` drawn to an HWC ``uint8`` array (:func:`figure_to_array`).

    Args:
        history: ``(global_step, per_step_ms)`` pairs, oldest first.

    Returns:
        The image.
    """
    return figure_to_array(breakdown_figure(history))
