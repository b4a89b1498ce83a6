"""A cluster on one machine: change the network, check dtprofile's projections and advice.

N network namespaces (``node<i>-<id>``) on one switch: a bridge (``br-<id>``) in a hub
namespace (``hub-<id>``), one veth per node whose peer is a bridge port. Addresses live
on the node veths only (a random ``10.213.x.0/24``), with loopback up in each node. Every
node's link is shaped in both directions (``tc`` tbf on the node's egress and on its
bridge port's egress; netem in front of the node's for ``--latency``). ``torchrun
--nnodes G --nproc-per-node 1`` runs ``benchmarks/cluster_train.py`` on the first G
nodes (``ip netns exec``, static rendezvous on node0's address at a random port,
``GLOO_SOCKET_IFNAME`` = the node's veth), profiled by ``dtprofile.profile``. Nothing
leaves the switch and the namespaces' loopback. The namespaces (and with them the veths
and the bridge) are deleted afterwards, also on Ctrl-C, SIGTERM, an error or interpreter
exit; every subprocess has a timeout.

    python benchmarks/cluster.py --rate 1gbit [--latency 0ms] [--logdir DIR] [--steps N]
        [--slow-rank R --slow-ms MS] [--slow-link-rate RATE] [--device-ms F,B]
    python benchmarks/cluster.py --rate 300mbit,700mbit,1gbit,2gbit --base 1gbit
    python benchmarks/cluster.py --rate 1gbit --scale 1,2,3,4,6 --device-ms 30,60 --model medium

With several rates, two nodes run at each rate in turn (reshaped), each summary in
``DIR/<rate>/``, and the step at every rate is also predicted from the ``--base`` run
with ``dtprofile project BASE --gpus 2 --bandwidth RATE``. With ``--scale``, a
``--base-nodes`` run (default 2) is profiled and projected to each count with
``dtprofile project``, each count is run, and predicted against measured step, speedup
and efficiency is printed (speedup against the measured one-node run: the per-rank batch
is fixed). ``--device-ms F,B`` emulates an accelerator (F and B ms slept in forward and
backward while the CPU idles, so co-located ranks do not compete for it; gradients and
all-reduces are real). Needs root, ``ip`` and ``tc``; :func:`unavailable_reason` says why
not otherwise. The tests use the same code (tests/test_cluster.py).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "cluster_train.py"
SUMMARY_NAME = "dtprofile_summary.json"

#: Seconds any single ``ip``/``tc`` command may take.
CMD_TIMEOUT_S = 15.0
#: tbf bucket: at least this many bytes (a veth with TSO hands tbf 64 KiB GSO packets;
#: a smaller bucket makes tbf split them), else this many seconds of the rate. A bigger
#: bucket only lets the first bytes of a transfer through at line speed: 2 ms of the
#: rate is < 1% of a 50 MB all-reduce.
TBF_MIN_BURST_BYTES = 128 * 1024
TBF_BURST_S = 0.002
#: tbf queue: how long a packet may wait (sets the queue limit to rate x this + burst).
#: Deep enough that TCP keeps the link busy (no drop-induced stalls), shallow enough to
#: bound the wait of small messages (rendezvous, dtprofile's gather) behind a transfer.
TBF_QUEUE_LATENCY_MS = 50
#: Nodes of a cluster unless told otherwise; one training process per node.
NNODES = 2
#: The most nodes a cluster may have (one process each; the machine's cores are shared).
MAX_NODES = 16

_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the two-namespace cluster (not root, no ip/tc, ...)."""


class ClusterRunError(RuntimeError):
    """The training run failed or timed out; the message carries both nodes' log tails."""


# --------------------------------------------------------------------------- units


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(bit|bps)\s*$", re.I)
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s)?\s*$", re.I)


def parse_rate(text: str) -> float:
    """A tc-style link rate in bits/s: ``300mbit``, ``1gbit``, ``2.5Gbit``, ``10gbps``.

    (tc itself reads ``mbps`` as megabytes; here every form is bits, as a link is named.)

    >>> parse_rate("1gbit"), parse_rate("300mbit")
    (1000000000.0, 300000000.0)
    """
    m = _RATE_RE.match(str(text))
    if not m:
        raise ValueError(f"rate must look like 300mbit, 1gbit, 2.5gbit; got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return value


def parse_latency(text: str) -> float:
    """One-way delay in seconds: ``0ms``, ``500us``, ``2ms``, ``0``.

    >>> parse_latency("2ms"), parse_latency("0")
    (0.002, 0.0)
    """
    m = _TIME_RE.match(str(text))
    if not m:
        raise ValueError(f"latency must look like 0ms, 500us, 2ms; got {text!r}")
    return (
        float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2).lower() if m.group(2) else None]
    )


def rate_label(bits: float) -> str:
    """``1gbit``, ``300mbit``, ``2.5gbit``: a short name for a rate in bits/s."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def tbf_params(rate_bits: float) -> dict[str, int]:
    """tbf's ``rate`` (bit/s), ``burst`` and ``limit`` (bytes) for a link of ``rate_bits``.

    Over a transfer of S bytes tbf passes ``burst + rate * t``: the long-run rate is
    exact and the bucket adds at most ``burst`` bytes once (see TBF_MIN_BURST_BYTES).

    >>> tbf_params(1e9)
    {'rate': 1000000000, 'burst': 250000, 'limit': 6500000}
    """
    rate_Bps = rate_bits / 8.0
    burst = int(max(TBF_MIN_BURST_BYTES, rate_Bps * TBF_BURST_S))
    limit = int(burst + rate_Bps * TBF_QUEUE_LATENCY_MS / 1e3)
    return {"rate": int(round(rate_bits)), "burst": burst, "limit": limit}


def _tbf(rate_bits: float) -> list[str]:
    """tc arguments of a tbf qdisc at ``rate_bits`` (see :func:`tbf_params`)."""
    p = tbf_params(rate_bits)
    return ["tbf", "rate", f"{p['rate']}bit", "burst", str(p["burst"]), "limit", str(p["limit"])]


# --------------------------------------------------------------------------- commands


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def _cmd(args: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run a short command (ip/tc); its stdout. Raises RuntimeError with stderr on failure."""
    try:
        cp = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(args)}` timed out after {timeout:.0f} s") from None
    if check and cp.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp.stdout


def unavailable_reason() -> str | None:
    """Why the cluster cannot be built here (None: it can): not root, no ip/tc, no netns."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            return f"`{tool}` not found (iproute2)"
    try:
        import torch.distributed.run  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torchrun unavailable: {e}"
    return None


# --------------------------------------------------------------------------- the cluster

_LIVE: set[Cluster] = set()
_LIVE_LOCK = threading.Lock()


def _cleanup_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        try:
            c.down()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


atexit.register(_cleanup_all)


def _suffix(n: int = 6) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=n))


@dataclass
class RunResult:
    """One training run on the cluster: the summary and each rank's own figures."""

    rate_bits: float
    node1_rate_bits: float
    latency_s: float
    logdir: str
    summary: dict
    ranks: list[dict]
    wall_s: float
    logs: dict = field(default_factory=dict)

    # Convenience views -------------------------------------------------------
    @property
    def per_step(self) -> dict:
        return self.summary.get("per_step_ms") or {}

    @property
    def step_ms(self) -> float | None:
        return self.per_step.get("step")

    @property
    def busbw_bits(self) -> float | None:
        bw = self.summary.get("busbw_GBps")
        return bw * 8e9 if bw is not None else None

    @property
    def raw_busbw_bits(self) -> float | None:
        vals = [r["raw_allreduce"]["busbw_Bps"] * 8 for r in self.ranks if r.get("raw_allreduce")]
        return statistics.median(vals) if vals else None

    @property
    def reference_step_ms(self) -> float | None:
        """The no_sync step (no communication, no profiler), median over the ranks."""
        vals = [r["reference_step_ms"] for r in self.ranks if r.get("reference_step_ms")]
        return statistics.median(vals) if vals else None

    @property
    def paused_reference_step_ms(self) -> float | None:
        """The no_sync step pausing after backward as long as the profiled steps waited for
        their all-reduce (the pause left out), median over the ranks: the synchronised
        steps' compute without their communication (``--paused-reference-steps``)."""
        vals = [r["paused_reference_step_ms"] for r in self.ranks if r.get("paused_reference_step_ms")]
        return statistics.median(vals) if vals else None

    @property
    def wall_step_ms(self) -> float | None:
        vals = [r["step_ms"] for r in self.ranks if r.get("step_ms")]
        return statistics.median(vals) if vals else None

    @property
    def advice_ids(self) -> list[str]:
        return [a.get("id") for a in self.summary.get("advice") or []]

    def finding(self, ident: str) -> dict | None:
        for a in self.summary.get("advice") or []:
            if a.get("id") == ident:
                return a
        return None


class Cluster:
    """N namespaces on one shaped switch; ``with Cluster(...) as c: c.run(...)``.

    Each node ``node<i>-<id>`` has one veth (``veth<i>-<id>``, its only address); its
    peer (``vh<i>-<id>``) is a port of a bridge (``br-<id>``) in a hub namespace
    (``hub-<id>``). Both directions of every node's link are shaped: the node's egress
    on its veth, its ingress on its bridge port's egress.

    ``rate``: the link rate (tc form, ``1gbit``) of every node;
    ``slow_link_rate``: node1's egress instead (an asymmetric, slower link on one node);
    ``latency``: one-way delay added on each node's egress (netem; needs sch_netem);
    ``mtu``: of the veths and the bridge. 9000 (jumbo frames, usual on cluster networks)
    by default: TCP/IP headers then cost 0.7% of the rate instead of 4.5% at 1500, and the
    emulation handles 6x fewer packets, so the configured rate, not the CPU, limits the link;
    ``nodes``: how many (a run may use the first few of them).
    """

    def __init__(
        self,
        rate: str = "1gbit",
        latency: str = "0ms",
        slow_link_rate: str | None = None,
        mtu: int = 9000,
        nodes: int = NNODES,
    ) -> None:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if not 1 <= int(nodes) <= MAX_NODES:
            raise ValueError(f"nodes must be an integer in 1..{MAX_NODES}, got {nodes!r}")
        self.nodes = n = int(nodes)
        self.id = _suffix()
        self.hub = f"hub-{self.id}"
        self.bridge = f"br-{self.id}"
        self.ns = [f"node{i}-{self.id}" for i in range(n)]
        self.veth = [f"veth{i}-{self.id}" for i in range(n)]  # <= 13 chars (IFNAMSIZ 15)
        self.port = [f"vh{i}-{self.id}" for i in range(n)]
        third = random.randrange(256)
        self.addr = [f"10.213.{third}.{1 + i}" for i in range(n)]  # one /24, on the node veths only
        self.mtu = mtu
        self.ip, self.tc = _tool("ip"), _tool("tc")
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._up = False
        self.rate_bits = self.node1_rate_bits = 0.0
        self.latency_s = 0.0
        self._initial = (rate, latency, slow_link_rate)

    # -- lifecycle --------------------------------------------------------------
    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> Cluster:
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            for ns in [self.hub, *self.ns]:
                _cmd([self.ip, "netns", "add", ns])
                self._created.append(ns)
            hub = [self.ip, "-n", self.hub]
            _cmd(hub + ["link", "add", self.bridge, "mtu", str(self.mtu), "type", "bridge"])
            _cmd(hub + ["link", "set", self.bridge, "up"])
            for i in range(self.nodes):
                # Created inside the namespaces: the host's namespace never sees the veths.
                _cmd(
                    [
                        self.ip,
                        "link",
                        "add",
                        self.veth[i],
                        "netns",
                        self.ns[i],
                        "mtu",
                        str(self.mtu),
                        "type",
                        "veth",
                        "peer",
                        "name",
                        self.port[i],
                        "netns",
                        self.hub,
                        "mtu",
                        str(self.mtu),
                    ]
                )
                _cmd(hub + ["link", "set", self.port[i], "master", self.bridge])
                _cmd(hub + ["link", "set", self.port[i], "up"])
                _cmd([self.ip, "-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.veth[i]])
                _cmd([self.ip, "-n", self.ns[i], "link", "set", "lo", "up"])
                _cmd([self.ip, "-n", self.ns[i], "link", "set", self.veth[i], "up"])
            rate, latency, slow = self._initial
            self.shape(rate, latency, slow)
            self._ping()
        except ClusterUnavailable:
            self.down()
            raise
        except Exception as e:
            self.down()
            raise ClusterUnavailable(f"cannot build the namespaces/veth/tc here: {e}") from e
        self._up = True
        return self

    def shape(self, rate: str, latency: str = "0ms", slow_link_rate: str | None = None) -> None:
        """(Re)shape both directions: tbf at ``rate`` (node1: ``slow_link_rate`` if given),
        netem delay in front when ``latency`` > 0."""
        base = parse_rate(rate)
        rates = [base] * self.nodes
        if slow_link_rate and self.nodes > 1:
            rates[1] = parse_rate(slow_link_rate)
        delay = parse_latency(latency)
        hub_tc = [self.ip, "netns", "exec", self.hub, self.tc]
        for i in range(self.nodes):
            # The node's ingress: its bridge port's egress, at the node's link rate.
            _cmd(hub_tc + ["qdisc", "del", "dev", self.port[i], "root"], check=False)
            _cmd(hub_tc + ["qdisc", "add", "dev", self.port[i], "root", "handle", "1:"] + _tbf(base))
            dev, tc = self.veth[i], [self.ip, "netns", "exec", self.ns[i], self.tc]
            _cmd(tc + ["qdisc", "del", "dev", dev, "root"], check=False)
            tbf = _tbf(rates[i])
            if delay > 0:
                try:
                    _cmd(
                        tc
                        + [
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "handle",
                            "1:",
                            "netem",
                            "delay",
                            f"{delay * 1e6:.0f}us",
                            "limit",
                            "100000",
                        ]
                    )
                except RuntimeError as e:
                    raise ClusterUnavailable(f"--latency needs the netem qdisc, which this kernel lacks ({e})") from e
                _cmd(tc + ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"] + tbf)
            else:
                _cmd(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:"] + tbf)
        self.rate_bits, self.node1_rate_bits, self.latency_s = base, rates[min(1, self.nodes - 1)], delay

    def _ping(self) -> None:
        """Check the switch carries traffic (a TCP connect from each node to node0)."""
        for i in range(1, self.nodes):
            self._ping_one(i)

    def _ping_one(self, i: int) -> None:
        code = (
            "import socket,sys;s=socket.socket();s.bind((sys.argv[1],0));s.listen(1);"
            "print(s.getsockname()[1],flush=True);c,_=s.accept();c.close()"
        )
        srv = subprocess.Popen(
            [self.ip, "netns", "exec", self.ns[0], sys.executable, "-c", code, self.addr[0]],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            port = int(_readline(srv, 15.0))
            _cmd(
                [
                    self.ip,
                    "netns",
                    "exec",
                    self.ns[i],
                    sys.executable,
                    "-c",
                    "import socket,sys;socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5).close()",
                    self.addr[0],
                    str(port),
                ],
                timeout=20,
            )
            srv.wait(10)
        finally:
            _kill_group(srv)

    def down(self) -> None:
        """Kill every process this cluster started, then delete its namespaces."""
        for p in list(self._procs):
            _kill_group(p)
        self._procs.clear()
        for ns in list(self._created):
            # Anything left inside our namespace (started by us) goes too.
            pids = _cmd([self.ip, "netns", "pids", ns], check=False).split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError, PermissionError):
                    pass
            _cmd([self.ip, "netns", "del", ns], check=False)
            if ns not in _cmd([self.ip, "netns", "list"], check=False).split():
                self._created.remove(ns)
        self._up = False
        if not self._created:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    # -- training ---------------------------------------------------------------
    def run(
        self,
        logdir: str,
        *,
        steps: int = 10,
        warmup: int = 2,
        model: str = "comm_heavy",
        batch: int = 8,
        reference_steps: int = 0,
        paused_reference_steps: int = 0,
        no_sync: bool = False,
        slow_rank: int | None = None,
        slow_ms: float = 0.0,
        raw_mb: float = 0.0,
        timeout_s: float | None = None,
        nodes: int | None = None,
        device_ms: tuple[float, float] | None = None,
        options: dict | None = None,
    ) -> RunResult:
        """Train on the first ``nodes`` nodes (default: all) under torchrun, profiled into
        ``logdir``; the results.

        ``device_ms``: (forward, backward) milliseconds of an emulated accelerator per
        step, slept in the passes while the CPU idles (see ``cluster_train.py``);
        ``options``: more ``dtprofile.profile`` options (JSON-able).

        Raises ClusterRunError (with the nodes' log tails) when a node fails or the
        run passes ``timeout_s`` (default: from the link rate and the steps); the
        processes are killed either way.
        """
        if not self._up:
            raise RuntimeError("Cluster.run() before up()")
        n = self.nodes if nodes is None else int(nodes)
        if not 1 <= n <= self.nodes:
            raise ValueError(f"nodes must be in 1..{self.nodes}, got {nodes!r}")
        logdir = os.path.abspath(logdir)
        os.makedirs(logdir, exist_ok=True)
        summary_path = os.path.join(logdir, SUMMARY_NAME)
        if os.path.exists(summary_path):
            os.remove(summary_path)
        if timeout_s is None:
            # Generous: 60 MB per step at the slower rate, x4, plus start-up.
            per_step = 4 * (60e6 * 8 / min(self.rate_bits, self.node1_rate_bits) + 0.3)
            timeout_s = 120.0 + (steps + warmup + reference_steps + paused_reference_steps) * (per_step + slow_ms / 1e3)
        out = tempfile.mkdtemp(prefix="dtprofile-cluster-")
        port = random.randrange(20000, 60000)
        script = [
            str(TRAIN_SCRIPT),
            "--model",
            model,
            "--batch",
            str(batch),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--reference-steps",
            str(reference_steps),
            "--paused-reference-steps",
            str(paused_reference_steps),
            "--logdir",
            logdir,
            "--out",
            out,
            "--raw-mb",
            str(raw_mb),
            "--timeout",
            str(max(60.0, min(timeout_s, 600.0))),
            "--link-bandwidth",
            str(min(self.rate_bits, self.node1_rate_bits) / 8),
        ]
        if no_sync:
            script.append("--no-sync")
        if device_ms is not None:
            script += ["--device-ms", f"{device_ms[0]},{device_ms[1]}"]
        if options:
            script += ["--options", json.dumps(options)]
        if slow_rank is not None:
            script += ["--slow-rank", str(slow_rank), "--slow-ms", str(slow_ms)]
        logs = [os.path.join(out, f"node{i}.log") for i in range(n)]
        try:
            return self._launch(script, logs, logdir, summary_path, timeout_s, port, out)
        finally:
            if not os.environ.get("DTPROFILE_CLUSTER_KEEP"):
                shutil.rmtree(out, ignore_errors=True)
            else:
                print(f"kept {out}", file=sys.stderr)

    def _launch(
        self, script: list, logs: list, logdir: str, summary_path: str, timeout_s: float, port: int, out: str
    ) -> RunResult:
        base_env = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "MASTER_ADDR",
                "MASTER_PORT",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "TORCHELASTIC_RUN_ID",
            )
        }
        t0 = time.monotonic()
        procs = []
        try:
            n = len(logs)
            for i in range(n):
                env = dict(base_env, GLOO_SOCKET_IFNAME=self.veth[i], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
                cmd = [
                    self.ip,
                    "netns",
                    "exec",
                    self.ns[i],
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(n),
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(i),
                    "--master-addr",
                    self.addr[0],
                    "--master-port",
                    str(port),
                    "--max-restarts",
                    "0",
                    *script,
                ]
                with open(logs[i], "w") as fh:
                    p = subprocess.Popen(
                        cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(HERE.parent)
                    )
                procs.append(p)
                self._procs.append(p)
            deadline = t0 + timeout_s
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise ClusterRunError(f"run timed out after {timeout_s:.0f} s; killed" + _tails(logs))
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > 20:
                    break  # one node failed; its peer will not finish either
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill_group(p)
                if p in self._procs:
                    self._procs.remove(p)
        wall = time.monotonic() - t0
        codes = [p.returncode for p in procs]
        if any(c != 0 for c in codes):
            raise ClusterRunError(f"training failed: exit codes {codes}" + _tails(logs))
        ranks = []
        for r in range(len(logs)):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                raise ClusterRunError(f"rank {r} left no result" + _tails(logs))
            with open(path) as fh:
                ranks.append(json.load(fh))
        if not os.path.exists(summary_path):
            raise ClusterRunError(f"no {SUMMARY_NAME} in {logdir}" + _tails(logs))
        with open(summary_path) as fh:
            summary = json.load(fh)
        texts = {}
        for i, path in enumerate(logs):
            with open(path, errors="replace") as fh:
                texts[f"node{i}"] = fh.read()[-20000:]
        return RunResult(self.rate_bits, self.node1_rate_bits, self.latency_s, logdir, summary, ranks, wall, texts)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or not box[0].strip():
        raise RuntimeError("no answer from node0 within the timeout")
    return box[0]


def _kill_group(p: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group ``p`` leads, SIGKILL what is left after ``grace`` s."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group may outlive its leader (torchrun's workers)
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _tails(paths: Sequence[str], n: int = 2500) -> str:
    out = []
    for i, path in enumerate(paths):
        try:
            with open(path, errors="replace") as fh:
                text = fh.read()[-n:]
        except OSError:
            text = "(no log)"
        out.append(f"\n--- node{i} log tail ---\n{text}")
    return "".join(out)


def our_namespaces() -> list[str]:
    """Namespaces this machine holds that look like ours (node<i>-*, hub-*)."""
    ip = _tool("ip")
    if ip is None:
        return []
    listing = _cmd([ip, "netns", "list"], check=False)
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(r"(node\d+|hub)-[a-z0-9]{6}", n)]


# --------------------------------------------------------------------------- prediction


def project(base_logdir: str, gpus: Sequence[int], rate_bits: float, timeout_s: float = 60.0) -> dict:
    """``dtprofile project BASE --gpus G1,G2,... --bandwidth RATE --json``."""
    cmd = [
        sys.executable,
        "-m",
        "dtprofile",
        "project",
        base_logdir,
        "--gpus",
        ",".join(str(g) for g in gpus),
        "--bandwidth",
        f"{int(round(rate_bits))}bps",
        "--json",
    ]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if cp.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({cp.returncode}): {cp.stderr.strip()}")
    return json.loads(cp.stdout)


def predict_step_ms(base_logdir: str, rate_bits: float, timeout_s: float = 60.0) -> dict:
    """The projection at G=2 from ``base_logdir`` at ``rate_bits`` (:func:`project`)."""
    proj = project(base_logdir, [2], rate_bits, timeout_s)
    return {
        "step_ms": proj["step_ms"][0],
        "comm_ms": proj["comm_ms"][0],
        "comm_exposed_ms": proj["comm_exposed_ms"][0],
        "compute_ms": proj["compute_ms"][0],
        "hideable_ms": proj["hideable_ms"][0],
        "projection": proj,
    }


def scale_rows(projection: dict, measured: dict[int, float]) -> list[dict]:
    """Predicted (from the base run's projection) against measured step, speedup and
    efficiency at each node count; measured speedup is ``G * step(1) / step(G)`` (the
    per-rank batch is fixed: weak scaling), so it needs a measured one-node run."""
    one = measured.get(1)
    rows = []
    for i, g in enumerate(projection["gpus"]):
        step = measured.get(g)
        speedup = g * one / step if one and step else None
        pred = {k: projection[k][i] for k in ("step_ms", "speedup", "efficiency")}
        rows.append(
            {
                "gpus": g,
                "predicted_step_ms": pred["step_ms"],
                "measured_step_ms": step,
                "step_error": _rel(pred["step_ms"], step),
                "predicted_speedup": pred["speedup"],
                "measured_speedup": speedup,
                "speedup_error": _rel(pred["speedup"], speedup),
                "predicted_efficiency": pred["efficiency"],
                "measured_efficiency": speedup / g if speedup else None,
                "efficiency_error": _rel(pred["efficiency"], speedup / g if speedup else None),
            }
        )
    return rows


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured - 1.0 if predicted is not None and measured else None


def format_scale_table(rows: Sequence[dict]) -> str:
    header = [
        "G",
        "predicted ms",
        "measured ms",
        "error",
        "speedup pred",
        "speedup meas",
        "error",
        "eff. pred",
        "eff. meas",
        "error",
    ]
    body = [
        [
            str(r["gpus"]),
            _f(r["predicted_step_ms"]),
            _f(r["measured_step_ms"]),
            _f(r["step_error"], "{:+.1%}"),
            _f(r["predicted_speedup"], "{:.2f}"),
            _f(r["measured_speedup"], "{:.2f}"),
            _f(r["speedup_error"], "{:+.1%}"),
            _f(r["predicted_efficiency"], "{:.3f}"),
            _f(r["measured_efficiency"], "{:.3f}"),
            _f(r["efficiency_error"], "{:+.1%}"),
        ]
        for r in rows
    ]
    return _format(header, body)


# --------------------------------------------------------------------------- the table


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def table_rows(results: Sequence[RunResult], predictions: dict | None = None) -> list[dict]:
    rows = []
    for r in results:
        per = r.per_step
        rec = r.summary.get("recommendations") or {}
        pred = (predictions or {}).get(id(r))
        rate = rate_label(r.rate_bits) + (
            f"/{rate_label(r.node1_rate_bits)}" if r.node1_rate_bits != r.rate_bits else ""
        )
        rows.append(
            {
                "rate": rate,
                "latency_ms": r.latency_s * 1e3,
                "busbw_Gbps": r.busbw_bits / 1e9 if r.busbw_bits else None,
                "raw_busbw_Gbps": r.raw_busbw_bits / 1e9 if r.raw_busbw_bits else None,
                "step_ms": per.get("step"),
                "wall_step_ms": r.wall_step_ms,
                "no_sync_step_ms": r.reference_step_ms,
                "paused_no_sync_step_ms": r.paused_reference_step_ms,
                "comm_total_ms": per.get("comm_total"),
                "comm_exposed_ms": per.get("comm_exposed"),
                "T_C_ms": per.get("compute"),
                "predicted_step_ms": pred["step_ms"] if pred else None,
                "prediction_error": (pred["step_ms"] / per["step"] - 1.0) if pred and per.get("step") else None,
                "bandwidth_needed_Gbps": rec.get("bandwidth_needed_Gbps"),
                "advice": [i for i in r.advice_ids if i],
            }
        )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    header = [
        "rate",
        "busbw Gb/s",
        "raw Gb/s",
        "step ms",
        "no-sync ms",
        "paused ms",
        "comm_exposed",
        "T_C ms",
        "predicted",
        "error",
        "BW needed",
        "advice",
    ]
    body = [
        [
            r["rate"],
            _f(r["busbw_Gbps"], "{:.3f}"),
            _f(r["raw_busbw_Gbps"], "{:.3f}"),
            _f(r["step_ms"]),
            _f(r["no_sync_step_ms"]),
            _f(r.get("paused_no_sync_step_ms")),
            _f(r["comm_exposed_ms"]),
            _f(r["T_C_ms"]),
            _f(r["predicted_step_ms"]),
            _f(r["prediction_error"], "{:+.1%}"),
            _f(r["bandwidth_needed_Gbps"], "{:.2f}"),
            ",".join(r["advice"]),
        ]
        for r in rows
    ]
    return _format(header, body)


def _format(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first and last columns left-aligned, the others right."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=False)]
    lines = []
    for i, row in enumerate([header, *body]):
        lines.append(
            "  ".join(
                str(c).ljust(w) if j in (0, len(row) - 1) else str(c).rjust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=False))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _install_signal_handlers() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):
            pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Two-node DDP cluster on one machine (network namespaces + shaped veth), profiled with dtprofile."
    )
    p.add_argument(
        "--rate", default="1gbit", help="link rate(s), tc style, comma-separated: 1gbit or 300mbit,1gbit,2gbit"
    )
    p.add_argument(
        "--base",
        default=None,
        help="with several rates: the run the others are predicted from (default: the first rate)",
    )
    p.add_argument("--latency", default="0ms", help="one-way delay per direction (netem), e.g. 1ms")
    p.add_argument(
        "--logdir", default=None, help="where the summary goes (several rates: DIR/<rate>/); default a temp dir"
    )
    p.add_argument("--steps", type=int, default=10, help="profiled steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    p.add_argument("--model", default="comm_heavy", help="comm_heavy (50 MB grads), medium, small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--reference-steps", type=int, default=6, help="no_sync steps timed first in each run (default 6; 0: none)"
    )
    p.add_argument(
        "--paused-reference-steps",
        type=int,
        default=0,
        help="no_sync steps timed after each run, each pausing after backward as long as the "
        "profiled steps waited for their all-reduce (default 0: none): on a CPU the truth "
        "for T_C of synchronised steps, whose compute follows that wait",
    )
    p.add_argument(
        "--raw-mb", type=float, default=50.0, help="MB of a plain all_reduce timed after each run (default 50; 0: none)"
    )
    p.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps before backward")
    p.add_argument("--slow-ms", type=float, default=100.0, help="for how long (default 100)")
    p.add_argument(
        "--slow-link-rate", default=None, help="node1's egress rate instead of --rate (a slower link on one node)"
    )
    p.add_argument(
        "--mtu",
        type=int,
        default=9000,
        help="MTU of the veth pair (default 9000; 1500: ~4.5%% of the rate goes to TCP/IP headers)",
    )
    p.add_argument(
        "--steady-malloc",
        action="store_true",
        help="glibc never returns freed memory to the system in the node processes "
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_): a backward's fresh "
        "gradients then never page-fault, which glibc otherwise decides anew "
        "from run to run and phase to phase",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per run before its processes are killed (default: from the rate)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    p.add_argument(
        "--scale",
        default=None,
        help="node counts, e.g. 1,2,3,4,6: profile a --base-nodes run, project it to each "
        "count, run each count and print predicted against measured step, speedup "
        "and efficiency",
    )
    p.add_argument("--base-nodes", type=int, default=2, help="with --scale: the profiled run's nodes (default 2)")
    p.add_argument(
        "--device-ms",
        default=None,
        help="F,B: an emulated accelerator (F ms in forward, B ms in backward per step, "
        "slept while the CPU idles) instead of real CPU compute only",
    )
    return p


def _device_ms(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        forward_ms, backward_ms = (float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--device-ms must be F,B in milliseconds (e.g. 30,60), got {text!r}") from None
    return forward_ms, backward_ms


def _on_cluster(cluster: Cluster, work: Callable[[], Any]) -> tuple[Any, int]:
    """``work()`` with ``cluster`` up, taken down whatever happens: ``(its result, 0)``, or
    ``(None, exit code)``: 130 when interrupted, 2 when the cluster or a run failed."""
    try:
        cluster.up()
        return work(), 0
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr)
        return None, 130
    except (ClusterUnavailable, ClusterRunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2
    finally:
        cluster.down()


def _scale(args: argparse.Namespace, logroot: str) -> int:
    """``--scale``: a base run, its projection to each node count, a run at each count."""
    try:
        counts = sorted({int(g) for g in args.scale.split(",") if g.strip()} | {1})
    except ValueError:
        raise SystemExit(f"--scale must be node counts like 1,2,3,4,6, got {args.scale!r}") from None
    if args.base_nodes < 2 or max(counts + [args.base_nodes]) > MAX_NODES or min(counts) < 1:
        raise SystemExit(f"--scale counts must be in 1..{MAX_NODES} and --base-nodes >= 2")
    rate = args.rate.split(",")[0].strip()
    device = _device_ms(args.device_ms)
    cluster = Cluster(rate, args.latency, None, mtu=args.mtu, nodes=max(counts + [args.base_nodes]))
    kw = dict(
        steps=args.steps,
        warmup=args.warmup,
        model=args.model,
        batch=args.batch,
        timeout_s=args.timeout,
        device_ms=device,
    )
    measured: dict[int, float] = {}

    def runs() -> tuple[RunResult, dict]:
        print(f"cluster of {cluster.nodes} nodes on {cluster.bridge} ({cluster.hub}) at {rate}", file=sys.stderr)
        base_dir = os.path.join(logroot, f"base-{args.base_nodes}")
        print(f"base run on {args.base_nodes} nodes ...", file=sys.stderr)
        base = cluster.run(base_dir, nodes=args.base_nodes, **kw)
        projection = project(base_dir, counts, cluster.rate_bits)
        for g in counts:
            print(f"running on {g} node{'s' if g > 1 else ''} ...", file=sys.stderr)
            measured[g] = cluster.run(os.path.join(logroot, f"nodes-{g}"), nodes=g, **kw).wall_step_ms
        return base, projection

    done, code = _on_cluster(cluster, runs)
    if code:
        return code
    base, projection = done
    rows = scale_rows(projection, measured)
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "base": base.summary.get("per_step_ms"),
                    "compute_source": base.summary.get("compute_source"),
                },
                indent=2,
            )
        )
    else:
        workload = f"emulated accelerator {device[0]:g}+{device[1]:g} ms" if device else "real CPU compute"
        print(
            f"{args.model} model, batch {args.batch} per rank, {workload}, {rate} per node; "
            f"projected from the {args.base_nodes}-node run (T_C from: {base.summary.get('compute_source')})"
        )
        print(format_scale_table(rows))
    return 0


#: glibc's allocator with no memory given back to the system: on a CPU, a backward that
#: allocates its gradients in freshly mapped pages pays a page fault per 4 KiB (about
#: 1.2 us each here: 14 ms for 50 MB), and whether it does flips with glibc's own
#: thresholds, so the same step measures 7 or 21 ms of backward from one run to the next.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**34)}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steady_malloc:
        os.environ.update(STEADY_MALLOC)
    if args.scale:
        reason = unavailable_reason()
        if reason:
            print(f"cluster unavailable: {reason}", file=sys.stderr)
            return 3
        _install_signal_handlers()
        return _scale(args, args.logdir or tempfile.mkdtemp(prefix="dtprofile-cluster-runs-"))
    rates = [r.strip() for r in args.rate.split(",") if r.strip()]
    for r in rates + ([args.slow_link_rate] if args.slow_link_rate else []):
        parse_rate(r)
    parse_latency(args.latency)
    base = args.base or rates[0]
    if base not in rates:
        rates.insert(0, base)
    else:  # the base first, the others predicted from it
        rates.remove(base)
        rates.insert(0, base)
    reason = unavailable_reason()
    if reason:
        print(f"cluster unavailable: {reason}", file=sys.stderr)
        return 3
    logroot = args.logdir or tempfile.mkdtemp(prefix="dtprofile-cluster-runs-")
    _install_signal_handlers()
    results: list[RunResult] = []
    predictions: dict = {}
    cluster = Cluster(rates[0], args.latency, args.slow_link_rate, mtu=args.mtu)

    def runs() -> None:
        print(
            f"cluster {cluster.ns[0]} ({cluster.addr[0]}) <-> {cluster.ns[1]} ({cluster.addr[1]}) "
            f"over {cluster.bridge} in {cluster.hub}",
            file=sys.stderr,
        )
        base_dir = None
        for rate in rates:
            cluster.shape(rate, args.latency, args.slow_link_rate)
            logdir = logroot if len(rates) == 1 else os.path.join(logroot, rate)
            print(f"running at {rate} ...", file=sys.stderr)
            res = cluster.run(
                logdir,
                steps=args.steps,
                warmup=args.warmup,
                model=args.model,
                batch=args.batch,
                reference_steps=args.reference_steps,
                paused_reference_steps=args.paused_reference_steps,
                slow_rank=args.slow_rank,
                slow_ms=args.slow_ms if args.slow_rank is not None else 0.0,
                raw_mb=args.raw_mb,
                timeout_s=args.timeout,
                device_ms=_device_ms(args.device_ms),
            )
            results.append(res)
            if base_dir is None:
                base_dir = logdir
            else:
                predictions[id(res)] = predict_step_ms(base_dir, cluster.rate_bits)
        if len(rates) > 1 and results:  # the base predicts itself too (sanity)
            predictions[id(results[0])] = predict_step_ms(base_dir, results[0].rate_bits)

    _, code = _on_cluster(cluster, runs)
    if code:
        return code
    rows = table_rows(results, predictions)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
        print(
            f"\nsummaries: {logroot}/"
            + ("" if len(rates) == 1 else "<rate>/")
            + f"{SUMMARY_NAME}; base for predictions: {base}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
