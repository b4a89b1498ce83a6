"""The ``dtprofile`` command line: report, project, compare, demo.

    dtprofile report LOGDIR [--json | --markdown]
    dtprofile project LOGDIR --gpus 8,16,64 [--bandwidth 100Gbps] [--nodes N] [--bandwidth-per node|gpu]
                     [--scaling weak|strong] [--batch N] [--model allreduce|ps]
                     [--mesh dp=N,tp=M] [--gpus-per-node N] [--json]
    dtprofile compare BASELINE CANDIDATE [--json]
    dtprofile demo [--logdir DIR] [--world-size 2] [--steps N]

``report`` finds runs under LOGDIR: every ``dtprofile_summary.json`` (searched
recursively), or, where a run left no summary (still running, or killed), the TensorBoard
event files with ``dtprofile/`` scalars, from which it rebuilds a partial summary (the
latest breakdown, ratios, per-rank times, communication and projection; marked
``"complete": false, "source": "tensorboard_events"``). ``--json`` prints the summary
object for one run, and for several runs one object mapping each run's path (relative to
LOGDIR) to its summary.

Errors (nothing found, a malformed or foreign file, a bad option) are one line on stderr
and exit status 2; an unexpected failure is one line and status 1 (``--verbose`` shows
the traceback).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from . import demo
from .analysis.advice import json_safe
from .analysis.checks import parse_gpu_list
from .analysis.recommendations import parameter_server_plan
from .render import advice_markdown, format_comparison, format_parameter_servers, format_projection, format_report
from .runs import Run, RunError, find_runs
from .summary_file import SUMMARY_NAME

__all__ = [
    "main",
    "build_parser",
    "find_runs",
    "format_report",
    "format_projection",
    "format_comparison",
    "parse_gpus",
    "parse_bandwidth",
    "Run",
    "CLIError",
]

log = logging.getLogger(__name__)


# A user-facing error: printed as one line, exit status 2 (what finding runs raises, too).
CLIError = RunError


# --------------------------------------------------------------------------- parsing


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_gpus(text: str) -> list[int]:
    """The ``--gpus`` option: a comma-separated list of GPU counts.

    Args:
        text: ``"8,16,64"``.

    Returns:
        The counts, sorted, duplicates dropped.

    Raises:
        argparse.ArgumentTypeError: Not positive integers.

    Example:
        >>> parse_gpus("16, 8,8")
        [8, 16]
    """
    try:
        return parse_gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_bandwidth(text: str) -> float:
    """The ``--bandwidth`` option, by :func:`dtprofile.analysis.perf_model.parse_bandwidth`.

    Text always needs its unit, here as in ``link_bandwidth`` and
    ``DTPROFILE_LINK_BANDWIDTH``: ``100Gbps``, ``25 Gb/s``, ``12.5GB/s``, ``1gbit`` (the
    case of the b decides bits or bytes).

    Args:
        text: The option's value.

    Returns:
        Bytes per second.

    Raises:
        argparse.ArgumentTypeError: No unit, or not a positive bandwidth.

    Example:
        >>> parse_bandwidth("100Gbps")
        12500000000.0
    """
    try:
        from .analysis.perf_model import parse_bandwidth as model_parse
    except Exception as e:  # noqa: BLE001
        raise argparse.ArgumentTypeError(f"cannot parse bandwidths ({e})") from None
    try:
        return float(model_parse(str(text), name="--bandwidth"))
    except (ValueError, TypeError):
        from .analysis.perf_model import BANDWIDTH_UNIT_FORMS

        unit = " (it needs a unit)" if re.fullmatch(r"\s*[-+]?[0-9.eE+-]+\s*", str(text)) else ""
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be a positive number with a unit: {BANDWIDTH_UNIT_FORMS}; got {text!r}{unit}"
        ) from None


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (``what`` names it in the error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


# --------------------------------------------------------------------------- finding runs

# --------------------------------------------------------------------------- output


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(json_safe(obj), indent=2, allow_nan=False, default=str) + "\n")


# --------------------------------------------------------------------------- commands


def _runs_or_fail(logdir: str) -> tuple[list[Run], list[str]]:
    runs, errors = find_runs(logdir)
    if not runs:
        if errors:
            raise CLIError(errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more)")
        raise CLIError(
            f"{logdir}: no dtprofile run found (looked for {SUMMARY_NAME} and "
            "TensorBoard event files with dtprofile/ scalars)"
        )
    return runs, errors


def _report_errors(errors: list[str]) -> int:
    for e in errors:
        sys.stderr.write(f"dtprofile: error: {e}\n")
    return 2 if errors else 0


def cmd_report(args: argparse.Namespace) -> int:
    """``dtprofile report``: each run's report, summary JSON or Markdown; the exit status."""
    runs, errors = _runs_or_fail(args.logdir)
    if args.json:
        if len(runs) == 1:
            _print_json(runs[0].summary)
        else:
            _print_json({r.label(args.logdir): r.summary for r in runs})
    elif args.markdown:
        chunks = [
            (f"## {r.label(args.logdir)}\n\n" if len(runs) > 1 else "") + advice_markdown(r.summary).rstrip()
            for r in runs
        ]
        sys.stdout.write("\n\n".join(chunks) + "\n")
    else:
        chunks = []
        for r in runs:
            text = format_report(r.summary)
            if r.advice_markdown and not r.summary.get("advice"):
                text += "\n\nLast advice written to TensorBoard:\n" + r.advice_markdown.rstrip()
            if len(runs) > 1:
                text = f"== {r.label(args.logdir)} ==\n{text}"
            chunks.append(text)
        sys.stdout.write("\n\n".join(chunks) + "\n")
    return _report_errors(errors)


def _parse_mesh(text: str) -> dict[str, int]:
    """``--mesh``'s value (:func:`dtprofile.analysis.mesh_plan.parse_mesh`), its error argparse's."""
    from .analysis.mesh_plan import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--mesh ")) from None


def _project_fn() -> Callable[..., Any]:
    try:
        from .analysis.projection import project_summary
    except Exception as e:  # noqa: BLE001
        raise CLIError(
            f"projection unavailable: dtprofile.analysis.projection.project_summary cannot be imported ({e})"
        ) from None
    return project_summary


def cmd_project(args: argparse.Namespace) -> int:
    """``dtprofile project``: each run's projection, as a table or JSON; the exit status."""
    runs, errors = _runs_or_fail(args.logdir)
    project = _project_fn()
    results = []
    for r in runs:
        options = found if isinstance(found := r.summary.get("options"), dict) else {}
        scaling = args.scaling or options.get("scaling") or "weak"
        mesh = args.mesh or {}
        gpus = sorted(set(args.gpus) | ({mesh["dp"]} if "dp" in mesh else set()))
        try:
            proj = project(
                r.summary,
                gpus=gpus,
                scaling=scaling,
                bandwidth=args.bandwidth,
                nodes=args.nodes,
                link_per=args.bandwidth_per,
                batch=args.batch,
                tp=mesh.get("tp"),
                gpus_per_node=args.gpus_per_node,
            )
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"{r.label(args.logdir)}: cannot project this run ({e})")
            continue
        if hasattr(proj, "to_dict"):
            proj = proj.to_dict()
        proj = dict(proj)
        if args.model == "ps":
            proj["parameter_servers"] = parameter_server_plan(r.summary, proj)
        results.append((r, proj))
    if not results:
        raise CLIError(errors[0])
    if args.json:
        if len(results) == 1:
            _print_json(results[0][1])
        else:
            _print_json({r.label(args.logdir): p for r, p in results})
    else:
        chunks = []
        for r, p in results:
            text = format_projection(p)
            if args.model == "ps":
                text += "\n\n" + format_parameter_servers(p["parameter_servers"])
            if len(results) > 1:
                text = f"== {r.label(args.logdir)} ==\n{text}"
            chunks.append(text)
        sys.stdout.write("\n\n".join(chunks) + "\n")
    return _report_errors(errors)


def _one_run(path: str, name: str) -> Run:
    runs, _ = _runs_or_fail(path)
    if len(runs) > 1:
        labels = ", ".join(r.label(path) for r in runs[:3]) + (", ..." if len(runs) > 3 else "")
        raise CLIError(f"{name} {path}: {len(runs)} runs found ({labels}); point at one run's directory")
    return runs[0]


def cmd_compare(args: argparse.Namespace) -> int:
    """``dtprofile compare``: two runs side by side, as text or JSON; the exit status."""
    from .analysis.compare import compare_summaries

    base = _one_run(args.baseline, "BASELINE")
    cand = _one_run(args.candidate, "CANDIDATE")
    result = compare_summaries(base.summary, cand.summary)
    if args.json:
        _print_json({"baseline": base.path, "candidate": cand.path, **result})
    else:
        sys.stdout.write(format_comparison(result, args.baseline, args.candidate) + "\n")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``dtprofile demo``: :func:`dtprofile.demo.run` with the options checked first."""
    try:
        if args.logdir:  # "" writes no logs
            demo.check_logdir(args.logdir)
    except ValueError as e:
        raise CLIError(f"--logdir: {e}") from None
    cpus = max(2, os.cpu_count() or 1)
    if args.world_size > cpus:  # each rank is a training process: more would only thrash
        raise CLIError(f"--world-size must be between 1 and {cpus} (this machine's CPUs), got {args.world_size}")
    return demo.run(
        logdir=args.logdir,
        world_size=args.world_size,
        steps=args.steps,
        every_n_steps=args.every_n_steps,
        warmup_steps=args.warmup_steps,
        timeout_s=args.timeout,
    )


# --------------------------------------------------------------------------- main


def _version() -> str:
    # The code's own version, as the summaries it writes carry it: pyproject.toml's, read
    # from a checkout (an editable install's metadata keeps the one it was installed at),
    # else the installed distribution's (dtprofile/__init__.py).
    from . import __version__

    return str(__version__)


_VERBOSE_HELP = "log details (and tracebacks of unexpected errors) to stderr"


def _verbose_parent() -> argparse.ArgumentParser:
    """-v/--verbose for each subcommand, so that it may follow the command as well.

    Its default is SUPPRESS: a subcommand given no -v leaves the value the main parser
    set (``dtprofile -v report X`` stays verbose)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The ``dtprofile`` command's parser: one-line usage errors with exit status 2.

    Returns:
        The parser; each subcommand sets ``func``, the command to run.

    Example:
        >>> build_parser().parse_args(["project", "runs", "--gpus", "8,16"]).gpus
        [8, 16]
    """
    p = _Parser(
        prog="dtprofile",
        description="Why adding GPUs does not make your PyTorch training proportionally "
        "faster: read a profiled run, project it to other cluster shapes, or "
        "run a built-in demo.",
    )
    p.add_argument("--version", action="version", version=f"dtprofile {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    verbose = [_verbose_parent()]

    _add_report(sub, verbose)
    _add_project(sub, verbose)
    _add_compare(sub, verbose)
    _add_demo(sub, verbose)
    return p


def _add_report(sub: Any, verbose: list[argparse.ArgumentParser]) -> None:
    """``dtprofile report``'s arguments."""
    r = sub.add_parser(
        "report",
        parents=verbose,
        help="print the breakdown, advice and projection of a profiled run",
        description="Find dtprofile runs under LOGDIR (every dtprofile_summary.json, "
        "searched recursively; where a run has no summary, its TensorBoard "
        "event files) and print each run's report.",
    )
    r.add_argument("logdir", metavar="LOGDIR", help="a log directory (searched recursively) or a summary file")
    fmt_group = r.add_mutually_exclusive_group()
    fmt_group.add_argument(
        "--json",
        action="store_true",
        help="print the summary JSON instead: the object for one run; for "
        "several, one object mapping each run's path to its summary",
    )
    fmt_group.add_argument(
        "--markdown",
        action="store_true",
        help="print the report as Markdown (the text TensorBoard shows), to paste into an issue or a pull request",
    )
    r.set_defaults(func=cmd_report)


def _add_project(sub: Any, verbose: list[argparse.ArgumentParser]) -> None:
    """``dtprofile project``'s arguments."""
    j = sub.add_parser(
        "project",
        parents=verbose,
        help="project a profiled run to other GPU counts and links",
        description="Project a profiled run's step time, speedup and efficiency to other "
        "GPU counts (the paper's Amdahl model and dtprofile's refined model).",
    )
    j.add_argument("logdir", metavar="LOGDIR", help="a log directory (searched recursively) or a summary file")
    j.add_argument(
        "--gpus",
        type=parse_gpus,
        default=[1, 2, 4, 8, 16, 32, 64],
        metavar="LIST",
        help="GPU counts, comma-separated (default 1,2,...,64)",
    )
    j.add_argument(
        "--bandwidth",
        type=parse_bandwidth,
        default=None,
        metavar="BW",
        help="link bandwidth with its unit, e.g. 100Gbps or 12.5GB/s (default: what the run measured or discovered)",
    )
    j.add_argument(
        "--nodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="nodes the GPUs are spread over, at most N: each G evenly over the "
        "most nodes up to N that G divides (8 GPUs with --nodes 3: 2 nodes of 4; "
        "the table shows the split); two-level all-reduce: inside each node "
        "(NVLink/PCIe when discovered, else an assumed 25 GB/s), then across "
        "nodes over the --bandwidth link, which is each node's and shared by "
        "its GPUs unless --bandwidth-per gpu",
    )
    j.add_argument(
        "--bandwidth-per",
        choices=("node", "gpu"),
        default=None,
        dest="bandwidth_per",
        help="with --nodes, whose link --bandwidth is: node (one link per node, its "
        "GPUs share it: more GPUs per node never make the step cheaper) or gpu "
        "(a NIC per GPU, rail-optimised clusters); default: the run's "
        "link_bandwidth_per, else node",
    )
    j.add_argument(
        "--scaling",
        choices=("weak", "strong"),
        default=None,
        help="weak: per-device batch fixed; strong: global batch fixed (default: the run's setting, else weak)",
    )
    j.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        metavar="N",
        help="what if the per-device batch were N: forward, backward and the data wait "
        "scale with it (default: the run's)",
    )
    j.add_argument(
        "--model",
        choices=("allreduce", "ps"),
        default="allreduce",
        help="allreduce: the step, speedup and efficiency at each G (the job's own "
        "gradient exchange); ps: also the parameter servers the paper's lemma needs "
        "at each G, were the job to push its gradients to servers",
    )
    j.add_argument(
        "--mesh",
        type=_parse_mesh,
        default=None,
        metavar="dp=N,tp=M",
        help="for a run on a DeviceMesh with tensor parallelism: G counts data-parallel replicas; "
        "tp=M projects at another tensor-parallel degree (each device's compute and gradients "
        "scale by the run's degree over M, the activations' collectives by their ring traffic), "
        "dp=N adds N replicas to the GPU counts",
    )
    j.add_argument(
        "--gpus-per-node",
        type=_positive_int,
        default=None,
        dest="gpus_per_node",
        metavar="N",
        help="with --mesh: GPUs per node, to tell whether a tensor-parallel group spans nodes "
        "(then its collectives cross the inter-node link); default: the run's LOCAL_WORLD_SIZE",
    )
    j.add_argument("--json", action="store_true", help="print the projection object as JSON")
    j.set_defaults(func=cmd_project)


def _add_compare(sub: Any, verbose: list[argparse.ArgumentParser]) -> None:
    """``dtprofile compare``'s arguments."""
    c = sub.add_parser(
        "compare",
        parents=verbose,
        help="two runs side by side: the change in each phase, throughput, advice",
        description="Compare a run before a change (BASELINE) with one after (CANDIDATE): each "
        "phase, the ratios, throughput in samples/s, which advice the change resolved, "
        "and, when the GPU count changed, the baseline's projection against the "
        "measured speedup.",
    )
    c.add_argument("baseline", metavar="BASELINE", help="a run's directory or dtprofile_summary.json")
    c.add_argument("candidate", metavar="CANDIDATE", help="the other run, the same way")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(func=cmd_compare)


def _add_demo(sub: Any, verbose: list[argparse.ArgumentParser]) -> None:
    """``dtprofile demo``'s arguments."""
    d = sub.add_parser(
        "demo",
        parents=verbose,
        help="run a small profiled DDP training on the CPU and print its report",
        description="Train a small model with DDP on the CPU (gloo, localhost) with a "
        "deliberately slow dataset, profile it with dtprofile, print the "
        "report and write TensorBoard logs.",
    )
    d.add_argument(
        "--logdir",
        default=demo.DEFAULT_LOGDIR,
        help=f"where the TensorBoard logs and summary go (default {demo.DEFAULT_LOGDIR})",
    )
    d.add_argument(
        "--world-size",
        type=_positive_int,
        default=2,
        metavar="N",
        help="processes (ranks); 1 runs in this process without DDP (default 2)",
    )
    d.add_argument(
        "--steps", type=_positive_int, default=120, metavar="N", help="optimizer steps to train (default 120)"
    )
    d.add_argument(
        "--every-n-steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="log interval in steps (default: about a quarter of the steps)",
    )
    d.add_argument(
        "--warmup-steps",
        type=_nonnegative_int,
        default=None,
        metavar="N",
        help="steps skipped before measuring (default 5, fewer for short runs)",
    )
    d.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="SECONDS",
        help="stop the demo's processes after this long (default 300)",
    )
    d.set_defaults(func=cmd_demo)


#: Options whose bad value may start with "-" and a digit ("-5Gbps"): argparse takes such
#: a word for an option (it knows only bare numbers like -5 as negative) and says no more
#: than "expected one argument".
_SIGNED_VALUE_OPTIONS: tuple[str, ...] = ("--bandwidth",)


def _attach_signed_values(argv: Sequence[str]) -> list[str]:
    """``--bandwidth -5Gbps`` -> ``--bandwidth=-5Gbps``, so that the value reaches its
    type and gets the message any other invalid bandwidth gets. Nothing after ``--``."""
    out: list[str] = []
    for word in argv:
        if out and out[-1] in _SIGNED_VALUE_OPTIONS and "--" not in out and re.match(r"-[0-9.]", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dtprofile`` command.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status: 0 done, 2 a user-facing error (one line on stderr), 1 an
        unexpected one, 130 interrupted.
    """
    for stream in (sys.stdout, sys.stderr):
        try:  # a terminal that is not UTF-8 gets "?" for the report's x, alpha, arrows
            cast(io.TextIOWrapper, stream).reconfigure(errors="replace")  # else AttributeError
        except (AttributeError, ValueError, OSError):
            pass
    parser = build_parser()
    try:
        args = parser.parse_args(_attach_signed_values(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help, --version, or a one-line usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        sys.stderr.write(f"dtprofile: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("dtprofile: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `dtprofile report runs | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - never a traceback unless asked
        if args.verbose:
            log.exception("unexpected error")
        sys.stderr.write(f"dtprofile: error: unexpected {type(e).__name__}: {e} (run with --verbose for details)\n")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
