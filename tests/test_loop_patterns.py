"""The pattern matrix: dtprofile never changes what a DDP training loop computes.

Rows: common shapes of DDP training loops (tests/pattern_workers.py's ``PATTERNS``):
a plain step, a gradient penalty (``autograd.grad(create_graph=True)``), ``autograd.grad``
for logging, collectives of the loop's own between forward and backward (a token count, a
logged loss), two forwards before one backward (siamese: plain, with BatchNorm, with
``gradient_as_bucket_view``), a GAN (G and D each DDP, D's step inside G's; G profiled, or
D), a train-mode forward without backward, two backward passes, ``retain_graph=True``,
LBFGS with a closure, two DDP models with one profiled, ``autograd.backward`` on several
roots, gradient accumulation with and without ``no_sync()``, ``find_unused_parameters``
with a head used on some steps, and ``static_graph=True``.

Columns: the unprofiled reference; the same again ("repeat": the harness must reproduce
itself); ``profile(model, opt, warmup_steps=2)`` with its defaults; with
``bucket_timing_every=20``; with ``probe_every=0``; with ``probe_every=3`` (many probe
steps, where dtprofile skips DDP's reduction and reduces the gradients itself).

Every cell of one world size runs in one launch (the same processes, the same seed, data
that differ by rank and step), 22 optimizer steps of a tiny model. On each rank, every
gradient right before each ``optimizer.step`` (after each closure's backward for LBFGS),
the final weights and buffers, and every logged value must be bitwise identical to the
unprofiled run's, and no cell may raise or hang. One assertion lists every failing cell and
how it failed. A cell that kills its process (gloo aborts on a collective mismatch) or
hangs is recorded as such and the remaining cells run in a fresh launch, after the
pattern's reference again.

Also: 3 ranks (plain and ``static_graph=True``; the sum of three ranks' gradients depends
on the order of the additions), and Lightning (``strategy="ddp"``, ``self.log(...,
sync_dist=True)``, a torchmetrics metric computed in ``training_step``) with and without
``DTProfileCallback``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pattern_workers as pw
import pytest
from distributed import free_port, run_ranks

HERE = Path(__file__).resolve().parent
#: One launch's deadline (a cell that hangs past the process group's timeout).
LAUNCH_TIMEOUT_S = 150
#: All launches of one matrix together; what is left after that is reported as not run.
MATRIX_BUDGET_S = 400
LIGHTNING_TIMEOUT_S = 240

REFERENCE = "unprofiled"
#: The configurations that run probe steps, and which patterns they must probe (a plain
#: pass on every rank) and must never probe (docs/measured.md, "What a probe never
#: changes"); a train-mode forward without backward is probed on the steps it is not in.
PROBING_CONFIGS = ("defaults", "bucket_timing_20", "probe_every_3")
PROBED = {
    "plain",
    "two_backwards",
    "retain_graph",
    "lbfgs_closure",
    "two_models_one_profiled",
    "backward_several_roots",
    "accumulation",
    "accumulation_no_sync",
    "find_unused_parameters",
    "static_graph",
}
NOT_PROBED = {
    "gradient_penalty",
    "grad_for_logging",
    "token_count_all_reduce",
    "loss_all_reduce_for_logging",
    "siamese",
    "siamese_bn",
    "siamese_bucket_view",
    "gan_profile_G",
    "gan_profile_D",
}


# --------------------------------------------------------------------------- running
def _read(outdir: Path, world: int) -> list[dict]:
    """Per rank: (pattern, config) -> its records ("start", "end", "abandoned")."""
    per_rank = []
    for r in range(world):
        records: dict = {}
        path = outdir / f"rank{r}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut by a kill
                    continue
                records.setdefault((rec["pattern"], rec["config"]), {})[rec["event"]] = rec
        per_rank.append(records)
    return per_rank


def _clean(error: str, n: int = 200) -> str:
    """An error message without gloo's source paths, cut to ``n`` characters."""
    return re.sub(r"\[/\S+?\] ", "", error).split(" This is typically caused")[0][:n]


def _short(exc: BaseException) -> str:
    """The launcher's error in a line: its first line, and gloo's complaint if it aborted."""
    lines = str(exc).splitlines()
    what = [ln.split("what():", 1)[1].strip() for ln in lines if "what():" in ln]
    if what:
        what = [what[0].split("] ", 1)[-1]]
    return f"{type(exc).__name__}: " + _clean(" | ".join(lines[:1] + what), 300)


def run_matrix(world: int, cells: list[tuple[str, str]], root: Path) -> tuple[list[dict], dict]:
    """Run ``cells`` in order on ``world`` ranks, in as few launches as the failures allow.

    Returns (records, lost): each record is one cell's per-rank "end" results with the launch
    it ran in; ``lost`` maps a cell that crashed, hung or never ran to why.
    """
    todo = list(cells)
    done: list[dict] = []
    lost: dict[tuple[str, str], str] = {}
    t_end = time.monotonic() + MATRIX_BUDGET_S
    launch = 0
    no_reference: set[str] = set()  # patterns whose unprofiled run itself crashed or hung
    while todo:
        left = t_end - time.monotonic()
        if left < 10:
            for cell in todo:
                lost.setdefault(cell, "not run: the matrix's time budget was spent on earlier failures")
            break
        outdir = root / f"world{world}-launch{launch}"
        outdir.mkdir(parents=True)
        error = None
        try:
            run_ranks(
                pw.pattern_matrix,
                world,
                {"cells": [list(c) for c in todo], "outdir": str(outdir)},
                timeout_s=min(LAUNCH_TIMEOUT_S, left),
            )
        except (TimeoutError, RuntimeError) as exc:
            error = exc
        records = _read(outdir, world)
        consumed = 0
        for cell in todo:
            ends = [rec.get(cell, {}).get("end") for rec in records]
            started = any(cell in rec for rec in records)
            if all(e is not None for e in ends):
                done.append({"cell": cell, "launch": launch, "ranks": ends})
                consumed += 1
                continue
            if started:
                how = "hang" if isinstance(error, TimeoutError) else "crash"
                ended = [r for r, e in enumerate(ends) if e is not None]
                peers = "; ".join(
                    f"rank {r} raised {_clean(ends[r]['error'], 120)!r}" for r in ended if ends[r]["error"]
                )
                lost[cell] = f"{how} ({_short(error) if error else 'the ranks abandoned it'})" + (
                    f"; {peers}" if peers else ""
                )
                if cell[1] == REFERENCE:
                    no_reference.add(cell[0])
                consumed += 1
            break
        if error is not None and consumed == len(todo) and all(c not in lost for c in todo):  # (after the last)
            lost[("(every cell)", f"launch {launch}")] = f"the ranks failed after their last cell ({_short(error)})"
        if consumed == 0:  # nothing started: the launch itself failed
            for cell in todo:
                lost.setdefault(cell, f"not run: the launch failed before any cell ({_short(error) if error else '?'})")
            break
        todo = todo[consumed:]
        launch += 1
        # The next launch starts with the pattern's reference again (the same processes).
        if todo and todo[0][1] != REFERENCE and todo[0][0] not in no_reference:
            todo.insert(0, (todo[0][0], REFERENCE))
    return done, lost


# --------------------------------------------------------------------------- comparing
def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(ref: list[dict], got: list[dict]) -> list[str]:
    """How ``got`` (per-rank results) differs from ``ref`` (the unprofiled run's)."""
    problems = []
    errors = {r: g["error"] for r, g in enumerate(got) if g["error"]}
    if errors:
        for r, err in errors.items():
            timed_out = got[r]["seconds"] >= 0.9 * pw.PG_TIMEOUT_S
            problems.append(
                f"rank {r} raised{' after %.0f s (a hang)' % got[r]['seconds'] if timed_out else ''}: {_clean(err)}"
            )
        return problems
    first_grad = {}
    for r, (a, b) in enumerate(zip(ref, got, strict=False)):
        k = _first_difference(a["grads"], b["grads"])
        if k is not None:
            first_grad[r] = k
    if first_grad:
        k = min(first_grad.values())
        r = min(rr for rr, kk in first_grad.items() if kk == k)
        a, b = ref[r], got[r]
        if k >= len(b["grads"]) or k >= len(a["grads"]):
            problems.append(f"{len(b['grads'])} gradient records on rank {r}, unprofiled {len(a['grads'])}")
        else:
            label = b["grads"][k].split(":")[0]
            n_diff = sum(x != y for x, y in zip(a["grads"], b["grads"], strict=False))
            across = {g["grads"][k] for g in got if k < len(g["grads"])}
            ref_across = {g["grads"][k] for g in ref}
            agree = (
                "ranks disagree with each other (not reduced)"
                if len(across) > 1 and len(ref_across) == 1
                else "ranks agree with each other"
                if len(across) == 1
                else "ranks differ as unprofiled"
            )
            problems.append(
                f"grads differ at step {k} ('{label}', rank(s) {sorted(first_grad)}; |g|^2 {b['norms'][k]:.9g} vs "
                f"{a['norms'][k]:.9g} unprofiled; {agree}; {n_diff} of {len(a['grads'])} records differ)"
            )
    differ = [r for r, (a, b) in enumerate(zip(ref, got, strict=False)) if a["weights"] != b["weights"]]
    if differ:
        problems.append(f"final weights differ on rank(s) {differ}")
    for r, (a, b) in enumerate(zip(ref, got, strict=False)):
        k = _first_difference(a["logs"], b["logs"])
        if k is not None:
            x = a["logs"][k] if k < len(a["logs"]) else None
            y = b["logs"][k] if k < len(b["logs"]) else None
            problems.append(f"logged value #{k} differs on rank {r}: {y!r} vs {x!r} unprofiled")
            break
    return problems


def judge(world: int, patterns: list[str], configs: list[str], done: list[dict], lost: dict) -> tuple[list, list, str]:
    """(failures, harness problems, a table of probe steps per cell)."""
    refs = {(d["launch"], d["cell"][0]): d["ranks"] for d in done if d["cell"][1] == REFERENCE}
    failures, harness = [], []
    for cell, why in lost.items():
        unprofiled = pw.CONFIGS.get(cell[1], {}) is None
        (harness if unprofiled else failures).append(f"{cell[0]} / {cell[1]}: {why}")
    done = sorted(done, key=lambda d: (patterns.index(d["cell"][0]), configs.index(d["cell"][1]), d["launch"]))
    probes: dict = {}
    for d in done:
        pattern, config = d["cell"]
        ranks = d["ranks"]
        probes[(pattern, config)] = "raised" if any(g["error"] for g in ranks) else ranks[0]["probe_steps"]
        if config == REFERENCE:
            errs = [g["error"] for g in ranks if g["error"]]
            if errs:
                harness.append(f"{pattern}: the unprofiled run itself failed: {_clean(errs[0])}")
                continue
            equal = [len({g["grads"][k] for g in ranks}) == 1 for k in range(len(ranks[0]["grads"]))]
            synced = pw.PATTERNS[pattern][1]
            if synced and not all(equal):
                harness.append(
                    f"{pattern}: unprofiled, the ranks' gradients differ at step {equal.index(False)} "
                    "(declared reduced by DDP)"
                )
            if not synced and all(equal):
                harness.append(
                    f"{pattern}: unprofiled, the ranks' gradients never differ (declared unreduced: "
                    "are the ranks' data the same?)"
                )
            continue
        ref = refs.get((d["launch"], pattern))
        if ref is None:
            harness.append(f"{pattern} / {config}: not compared: no unprofiled run of it in the same launch")
            continue
        if any(g["error"] for g in ref):
            continue  # (reported above)
        problems = _compare(ref, ranks)
        if problems:
            target = harness if config == "repeat" else failures
            prefix = "NOT REPRODUCIBLE unprofiled: " if config == "repeat" else ""
            target.append(f"{pattern} / {config}: {prefix}" + "; ".join(problems))
    for (pattern, config), steps in probes.items():
        if config not in PROBING_CONFIGS or not isinstance(steps, int):
            continue
        if pattern in PROBED and steps == 0:
            failures.append(f"{pattern} / {config}: no probe step (this shape is a plain one: it must be probed)")
        if pattern in NOT_PROBED and steps > 0:
            failures.append(f"{pattern} / {config}: {steps} probe steps (this shape is no plain pass: never a probe)")
    shown = [c for c in configs if pw.CONFIGS[c] is not None]
    table = [
        f"probe steps per profiled cell ({world} ranks; '-': crashed, hung or not run):",
        f"  {'pattern':30s}" + "".join(f"{c:>18s}" for c in shown),
    ]
    for p in patterns:
        table.append(f"  {p:30s}" + "".join(f"{str(probes.get((p, c), '-')):>18s}" for c in shown))
    order = {f"{p} / {c}": i for i, (p, c) in enumerate((p, c) for p in patterns for c in configs)}
    failures.sort(key=lambda line: order.get(line.split(":", 1)[0], -1))
    return failures, harness, "\n".join(table)


def _check(world: int, patterns: list[str], configs: list[str], tmp_path: Path) -> None:
    cells = [(p, c) for p in patterns for c in configs]
    t0 = time.monotonic()
    done, lost = run_matrix(world, cells, tmp_path)
    failures, harness, table = judge(world, patterns, configs, done, lost)
    print(f"{len(cells)} cells at {world} ranks in {time.monotonic() - t0:.1f} s")
    profiled_cells = sum(1 for _, c in cells if pw.CONFIGS[c] is not None)
    message = []
    if harness:
        message.append(f"the harness itself ({len(harness)}):\n  " + "\n  ".join(harness))
    if failures:
        message.append(
            f"dtprofile changed or broke training in {len(failures)} of {profiled_cells} profiled "
            f"pattern/config cells at {world} ranks:\n  " + "\n  ".join(failures)
        )
    assert not message, "\n".join(message) + "\n" + table
    print(table)


# --------------------------------------------------------------------------- tests
def test_profiling_leaves_every_loop_pattern_bit_identical_at_2_ranks(tmp_path):
    _check(2, list(pw.PATTERNS), list(pw.CONFIGS), tmp_path)


def test_profiling_leaves_plain_and_static_graph_ddp_bit_identical_at_3_ranks(tmp_path):
    """Three ranks: a reduction in another order, or in other chunks, rounds differently."""
    _check(3, ["plain", "static_graph"], ["unprofiled", "repeat", "defaults", "no_probes"], tmp_path)


def test_lightning_ddp_fit_is_bit_identical_with_the_callback(tmp_path):
    """strategy="ddp" on 2 CPU processes: the loss logged with sync_dist=True and (with
    torchmetrics) a metric computed in training_step; weights and logged values the same
    with DTProfileCallback as without."""
    pytest.importorskip("pytorch_lightning")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTPROFILE")}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "pattern_workers.py"), "lightning", str(tmp_path)],
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own process group: the ranks it starts die with it
    try:
        out, _ = proc.communicate(timeout=LIGHTNING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the Lightning fits still ran after {LIGHTNING_TIMEOUT_S} s (a hang); killed\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    paths = [tmp_path / f"result_rank{r}.json" for r in range(2)]
    assert proc.returncode == 0 and all(p.exists() for p in paths), f"rc={proc.returncode}\n{out[-6000:]}"
    failures = []
    for r, path in enumerate(paths):
        res = json.loads(path.read_text())
        for name in sorted({k.split("/")[0] for k in res}):
            ref, got = res[f"{name}/unprofiled"], res[f"{name}/profiled"]
            if "error" in ref:
                failures.append(f"{name}: rank {r}: the unprofiled fit failed: {ref['error']}")
                continue
            if "error" in got:
                failures.append(f"{name}: rank {r}: the profiled fit raised: {got['error']}")
                continue
            if not ref["history"] or (name == "metric" and "acc" not in ref["history"][-1]):
                failures.append(f"{name}: rank {r}: the harness recorded no logged values: {ref['history'][-1:]}")
            if got["global_step"] != ref["global_step"]:
                failures.append(f"{name}: rank {r}: {got['global_step']} steps, unprofiled {ref['global_step']}")
            if got["weights"] != ref["weights"]:
                failures.append(f"{name}: rank {r}: final weights differ")
            k = _first_difference(ref["history"], got["history"])
            if k is not None:
                a = ref["history"][k] if k < len(ref["history"]) else None
                b = got["history"][k] if k < len(got["history"]) else None
                failures.append(f"{name}: rank {r}: logged values differ at step {k}: {b} vs {a} unprofiled")
    assert not failures, "Lightning:\n  " + "\n  ".join(failures)
