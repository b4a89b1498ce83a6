"""Many ranks: what dtprofile's cross-rank gather costs each rank as the job grows.

    python benchmarks/many_ranks.py                    # N = 2, 4, 8, 16, 32 and the store at 64-4,096 keys
    python benchmarks/many_ranks.py --quick            # N = 2 and 4, the store at 64 and 512 keys (the test suite)
    python benchmarks/many_ranks.py --against 9cb78da  # the same, also with dtprofile as of that commit, side by side

The job, on every rank: a tiny DDP model (``nn.Linear(16, 4)``, gloo on 127.0.0.1, a
free port, one thread a process), one step before profiling, then
``dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=2, logdir=None)`` over
``--steps`` steps (an interval gather every 2 steps, then the final gather at stop).
Each rank records its file descriptors (``/proc/self/fd``) and native threads
(``/proc/self/task``) before ``start()``, two steps before the end (while profiling) and
after ``stop()``, and how long ``start()`` and ``stop()`` took, each timed from a barrier
of the job's own (so that the ranks' skew in reaching them is not counted), and, within
``stop()``, the final gather alone (``RankGather.finish``; the rest of ``stop()`` is the
summary, which N processes build at once on this machine's cores). The table gives, per
world size N, the median (and max) over the ranks.

Bytes per interval are counted from the protocol, not sniffed: V bytes a vector, as each
rank encoded it (the median of its vectors; a vector is sparse, a bitmask of the entries
present and their float64; 8 (len(VECTOR_KEYS) + 1) dense, in a version before).
Through the store (this version): N-1 vectors in, N-1 out to rank 0, and where every
rank reads the rows (an integration summarising every interval on every rank, the final
gather) N vectors out to each of the N-1 others. The side gloo group
(before): an all-gather, each rank receiving the N-1 others' vectors.

``--store-keys``: rank 0's read, measured alone: one process holds a TCPStore server and
a client, sets K keys of V bytes (as K ranks would) and times one ``multi_get`` of them
(median of ``--repeats``), for the model at 4,096 ranks in docs/benchmarks.md.

``--against REV``: ``git archive REV dtprofile integrations`` into a temporary folder (the
repository is not touched), then both versions each run in a child process of this
script (``--json``), the old one with that folder first on ``PYTHONPATH``.

Exits 1 if a run failed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import describe_machine, free_port, launch, table  # noqa: E402
from torch import nn  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLDS = (2, 4, 8, 16, 32)
QUICK_WORLDS = (2, 4)
STORE_KEYS = (64, 512, 4096)
QUICK_STORE_KEYS = (64, 512)
LAUNCH_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- one rank
def _snapshot() -> dict[str, int]:
    return {"fds": len(os.listdir("/proc/self/fd")), "tasks": len(os.listdir("/proc/self/task"))}


def _rank(rank: int, world: int, cfg: dict) -> dict:
    """One rank of the job: its descriptors and threads around a profiled run."""
    import torch.distributed as dist

    import dtprofile
    import dtprofile.gather

    finals: list[float] = []  # the final gather's own time, apart from the summary's at stop
    finish = dtprofile.gather.RankGather.finish

    def timed_finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return finish(self, *args, **kwargs)
        finally:
            finals.append(time.perf_counter() - t0)

    dtprofile.gather.RankGather.finish = timed_finish  # type: ignore[method-assign]
    blobs: list[int] = []  # the bytes of each vector this rank sent (sparse since the notes)
    encode = getattr(dtprofile.gather, "_encode", None)
    if encode is not None:

        def counted_encode(values: Any) -> bytes:
            blob = encode(values)
            blobs.append(len(blob))
            return blob

        dtprofile.gather._encode = counted_encode

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step() -> None:
        ddp(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()  # what DDP and gloo make at a first step is not dtprofile's
    before = _snapshot()
    prof = dtprofile.profile(ddp, opt, warmup_steps=1, every_n_steps=2, logdir=None, gather_timeout_s=60.0)
    dist.barrier()  # (the job's own: start and stop times from a common point, not the ranks' skew)
    t0 = time.perf_counter()
    prof.start()
    start_s = time.perf_counter() - t0
    for i in range(cfg["steps"]):
        step()
        if i == cfg["steps"] - 3:
            during = _snapshot()
    dist.barrier()
    t0 = time.perf_counter()
    report = prof.stop().to_dict()
    stop_s = time.perf_counter() - t0
    time.sleep(0.2)  # (a native thread joined a moment ago may still be listed)
    return {
        "before": before,
        "during": during,
        "after": _snapshot(),
        "start_s": start_s,
        "stop_s": stop_s,
        "final_s": finals[0] if finals else float("nan"),
        "ranks": len(report.get("ranks") or []),
        "vector_bytes": statistics.median(blobs) if blobs else None,
        "store": hasattr(__import__("dtprofile.gather").gather, "StoreExchange"),
    }


# --------------------------------------------------------------------------- rank 0's read alone
def store_read(keys: int, repeats: int, vector_bytes: int) -> dict[str, float]:
    """One TCPStore (server and client in this process): ``keys`` values of
    ``vector_bytes`` set, then read back in one ``multi_get``; the median seconds of each."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
    blob = b"\x00" * vector_bytes
    reads, sets = [], []
    for r in range(repeats):
        names = [f"bench/{r}/{k}" for k in range(keys)]
        t0 = time.perf_counter()
        for name in names:
            store.set(name, blob)
        sets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = store.multi_get(names)
        reads.append(time.perf_counter() - t0)
        assert len(got) == keys and len(got[-1]) == vector_bytes
        for name in names:
            store.delete_key(name)
    return {"keys": keys, "set_s": statistics.median(sets), "multi_get_s": statistics.median(reads)}


def vector_bytes() -> int:
    from dtprofile.gather import VECTOR_KEYS

    return 8 * (len(VECTOR_KEYS) + 1)


def _sent_bytes(ranks: list[dict[str, Any]], dense: int) -> float:
    """The bytes of a vector the ranks sent (median over the ranks), where they counted them
    (a version that encodes sparsely); else the dense ``dense``."""
    sent = [r["vector_bytes"] for r in ranks if r.get("vector_bytes")]
    return statistics.median(sent) if sent else dense


def interval_bytes(world: int, v: float, store: bool, shared: bool = False) -> float:
    """Bytes on the wire per interval gather (see the module's docstring)."""
    if not store:
        return world * (world - 1) * v  # every rank receives the N-1 others'
    through = 2 * (world - 1) * v  # in, and out to rank 0
    return through + ((world - 1) * world * v if shared else 0)


# --------------------------------------------------------------------------- one version
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every world size of ``args.worlds``, then the store reads: JSON-able rows."""
    import dtprofile.gather as gather

    runs = []
    for world in args.worlds:
        t0 = time.monotonic()
        res = launch(_rank, world, {"steps": args.steps}, timeout_s=LAUNCH_TIMEOUT_S)
        runs.append({"world": world, "ranks": res, "wall_s": time.monotonic() - t0})
        print(f"  N={world}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    v = vector_bytes()
    sent = int(statistics.median(_sent_bytes(run["ranks"], v) for run in runs)) if runs else v  # (rank 0 reads these)
    reads = [store_read(k, args.repeats, sent) for k in args.store_keys] if hasattr(gather, "StoreExchange") else []
    return {
        "store": hasattr(gather, "StoreExchange"),
        "vector_bytes": v,
        "sent_bytes": sent,
        "runs": runs,
        "reads": reads,
    }


def _med_max(values: list[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} / {max(values):{spec}}"


def run_rows(result: dict[str, Any], label: str) -> list[list[Any]]:
    rows = []
    for run in result["runs"]:
        ranks, world = run["ranks"], run["world"]
        fd = {k: [r[k]["fds"] for r in ranks] for k in ("before", "during", "after")}
        grown = [r["during"]["fds"] - r["before"]["fds"] for r in ranks]
        tasks = [r["during"]["tasks"] - r["before"]["tasks"] for r in ranks]
        rows.append(
            [
                label,
                world,
                f"{statistics.median(fd['before']):.0f} -> {statistics.median(fd['during']):.0f} -> "
                f"{statistics.median(fd['after']):.0f}",
                f"+{statistics.median(grown):.0f} (max +{max(grown)})",
                f"+{statistics.median(tasks):.0f}",
                _med_max([r["start_s"] for r in ranks], ".3f"),
                _med_max([r["stop_s"] for r in ranks], ".3f"),
                _med_max([r["final_s"] for r in ranks], ".3f"),
                f"{interval_bytes(world, _sent_bytes(ranks, result['vector_bytes']), result['store']) / 1e3:.1f}",
                f"{_sent_bytes(ranks, result['vector_bytes']):.0f}",
                "yes" if all(r["ranks"] == world for r in ranks) else "NO",
            ]
        )
    return rows


RUN_HEADERS = [
    "version",
    "N",
    "fds before -> profiling -> after (median)",
    "fds opened a rank",
    "threads a rank",
    "start s (median / max)",
    "stop s (median / max)",
    "final gather s (median / max)",
    "KB a interval",
    "bytes a vector (dense: 8 a key)",
    "all ranks in every report",
]


def print_tables(results: dict[str, dict[str, Any]]) -> None:
    rows = [row for label, result in results.items() for row in run_rows(result, label)]
    print(table(RUN_HEADERS, rows, title="Per world size N (each rank's figures, over the N ranks)"))
    for label, result in results.items():
        if result["reads"]:
            v = result.get("sent_bytes", result["vector_bytes"])
            print(
                table(
                    ["keys K", "MB", "K sets from one client, s", "one multi_get of K, s", "per key, us"],
                    [
                        [
                            r["keys"],
                            f"{r['keys'] * v / 1e6:.2f}",
                            f"{r['set_s']:.4f}",
                            f"{r['multi_get_s']:.4f}",
                            f"{r['multi_get_s'] / r['keys'] * 1e6:.1f}",
                        ]
                        for r in result["reads"]
                    ],
                    title=f"Rank 0's read, alone ({label}; {v} bytes a vector)",
                )
            )


def _old_tree(rev: str, into: str) -> str:
    """dtprofile as of ``rev``, importable from the returned folder (read from git only)."""
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", rev, "dtprofile", "integrations"], check=True, capture_output=True
    ).stdout
    raw = os.path.join(into, "raw")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(raw, filter="data")
    root = os.path.join(into, "tree")
    os.makedirs(root)
    os.rename(os.path.join(raw, "dtprofile"), os.path.join(root, "dtprofile"))
    os.rename(os.path.join(raw, "integrations"), os.path.join(root, "dtprofile", "integrations"))
    return root


def _child(argv: list[str], pythonpath: str | None, out: str) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # (from another folder: the ranks' fork server puts the working folder on sys.path,
    # where the repository's own dtprofile would come before PYTHONPATH's)
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, "--json", out], env=env, check=True, cwd=os.path.dirname(out)
    )
    with open(out) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 2 and 4, the store at 64 and 512 keys")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4,8,16,32)")
    ap.add_argument("--steps", type=int, default=8, help="profiled steps per run (default 8)")
    ap.add_argument("--store-keys", default=None, help="comma-separated key counts for rank 0's read")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each store read (default 5)")
    ap.add_argument("--against", default=None, help="a git revision: also run dtprofile as of it")
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)  # (a child: write the results here)
    args = ap.parse_args(argv)
    args.worlds = (
        [int(w) for w in args.worlds.split(",")] if args.worlds else list(QUICK_WORLDS if args.quick else WORLDS)
    )
    keys = args.store_keys
    args.store_keys = (
        [int(k) for k in keys.split(",")] if keys else list(QUICK_STORE_KEYS if args.quick else STORE_KEYS)
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(measure(args), fh)
        return 0
    print(describe_machine())
    passed = list(argv if argv is not None else sys.argv[1:])
    passed = [a for i, a in enumerate(passed) if a != "--against" and (i == 0 or passed[i - 1] != "--against")]
    try:
        if args.against is None:
            results = {"this": measure(args)}
        else:
            with tempfile.TemporaryDirectory(prefix="dtprofile-many-") as tmp:
                old = _old_tree(args.against, tmp)
                results = {
                    args.against: _child(passed, old, os.path.join(tmp, "old.json")),
                    "this": _child(passed, None, os.path.join(tmp, "new.json")),
                }
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
        print(f"a run failed: {exc}", file=sys.stderr)
        return 1
    print_tables(results)
    ok = all(r["ranks"] == run["world"] for res in results.values() for run in res["runs"] for r in run["ranks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
