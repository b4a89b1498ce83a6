"""GPU-side features, tested on any machine through fakes: lazy CUDA-event read-back
(the fake event clock), NVML telemetry (a fake pynvml), bandwidth discovery (fake NVML and
a fake /sys tree), memory headroom; plus the real no-sync check when CUDA is present."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from fakes import TimedNet
from torch import nn

import dtprofile
from dtprofile import nvml as dnvml
from dtprofile.analysis import advice, projection, recommendations
from dtprofile.capture.clocks import FakeEventClock
from dtprofile.engine import Engine
from dtprofile.hardware import PCIE_LANE_GBPS, discover_hardware, nic_info, nvlink_info, pcie_info
from dtprofile.options import Options

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- fakes


class NVMLError(Exception):
    pass


class FakeNVML(types.ModuleType):
    """Enough of pynvml for the sampler and discovery; values set per test."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = 90
    NVML_FI_DEV_NVLINK_GET_SPEED = 164
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self, uuids=("GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd")) -> None:
        super().__init__("pynvml")
        self.uuids = list(uuids)
        self.inits = self.shutdowns = 0
        self.calls: dict[str, int] = {}
        self.util = (80, 40)
        self.mem = (30e9, 141e9)
        self.power_mw = 500_000
        self.clock, self.clock_max = 1980, 1980
        self.reasons = 0
        self.pcie_kbps = (2_000_000, 1_000_000)
        self.nvlink_links, self.nvlink_mbps, self.nvlink_version = 18, 26562, 6
        self.nvlink_common_field = True
        self.nvlink_kib = [0.0, 0.0]
        self.pcie = {"max_gen": 5, "max_width": 16, "cur_gen": 1, "cur_width": 16}
        self.broken: set[str] = set()

    def _call(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.broken:
            raise NVMLError(f"{name}: Not Supported")

    # lifecycle and handles
    def nvmlInit(self):
        self._call("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.uuids):
            raise NVMLError("Invalid Argument")
        return ("handle", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.uuids:
            raise NVMLError("Not Found")
        return ("handle", self.uuids.index(uuid))

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]].encode()

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    # sampled
    def nvmlDeviceGetUtilizationRates(self, h):
        self._call("util")
        return types.SimpleNamespace(gpu=self.util[0], memory=self.util[1])

    def nvmlDeviceGetMemoryInfo(self, h):
        self._call("mem")
        return types.SimpleNamespace(used=self.mem[0], total=self.mem[1])

    def nvmlDeviceGetPowerUsage(self, h):
        self._call("power")
        return self.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, kind):
        self._call("clock")
        return self.clock

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return self.clock_max

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._call("temperature")
        return 55

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._call("reasons")
        return self.reasons

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        self._call("pcie_throughput")
        return self.pcie_kbps[counter]

    def nvmlDeviceGetFieldValues(self, h, ids):
        self._call("fields")
        out = []
        for fid, scope in ids:
            ok, value = 0, 0.0
            if fid == self.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
                ok, value = (0, self.nvlink_mbps) if self.nvlink_common_field else (3, 0)
            elif fid == self.NVML_FI_DEV_NVLINK_GET_SPEED:
                value = self.nvlink_mbps
            elif fid == self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                ok, value = (0, self.nvlink_kib[0]) if self.nvlink_links else (3, 0)
            elif fid == self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
                ok, value = (0, self.nvlink_kib[1]) if self.nvlink_links else (3, 0)
            out.append(
                types.SimpleNamespace(nvmlReturn=ok, valueType=3, value=types.SimpleNamespace(ullVal=int(value)))
            )
        return out

    # discovery
    def nvmlDeviceGetNvLinkState(self, h, link):
        if self.nvlink_links == 0:
            raise NVMLError("Not Supported")
        if link >= self.nvlink_links:
            raise NVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self.nvlink_version

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.pcie["max_gen"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.pcie["max_width"]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self.pcie["cur_gen"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self.pcie["cur_width"]


def _sampler(fake, **kw):
    return dnvml.TelemetrySampler(dnvml.NvmlSession(0, nvml=fake), **kw)


def _nvml_threads():
    return [t for t in threading.enumerate() if t.name == "dtprofile-nvml" and t.is_alive()]


# --------------------------------------------------------------------------- telemetry


def test_sampler_medians_units_and_keys():
    fake = FakeNVML()
    s = _sampler(fake)
    for util in (10, 90, 70):
        fake.util = (util, util / 2)
        fake.nvlink_kib = [fake.nvlink_kib[0] + 1e6, fake.nvlink_kib[1] + 2e6]
        s.sample_once()
    t = s.summary(rank=0)
    assert t["available"] is True and t["samples"] == 3 and t["rank"] == 0
    assert t["gpu_util_percent"] == 70 and t["mem_util_percent"] == 35
    assert t["memory_used_bytes"] == 30e9 and t["memory_total_bytes"] == int(141e9)
    assert t["power_w"] == pytest.approx(500.0) and t["power_limit_w"] == pytest.approx(700.0)
    assert t["sm_clock_mhz"] == 1980 and t["sm_clock_max_mhz"] == 1980 and t["sm_clock_ratio"] == 1.0
    assert t["temperature_c"] == 55
    assert t["pcie_tx_GBps"] == pytest.approx(2.0) and t["pcie_rx_GBps"] == pytest.approx(1.0)
    assert t["nvlink_tx_GBps"] > 0 and t["nvlink_rx_GBps"] == pytest.approx(2 * t["nvlink_tx_GBps"], rel=1e-6)
    assert t["throttled"] is False and t["throttle_reasons"] == []
    assert t["metrics_dropped"] == {}
    assert t["device_name"] == "NVIDIA H200"
    s.stop()
    assert fake.shutdowns == fake.inits == 1


def test_failing_metric_is_dropped_not_the_sampler():
    fake = FakeNVML()
    fake.broken = {"temperature", "pcie_throughput"}
    s = _sampler(fake)
    for _ in range(4):
        s.sample_once()
    t = s.summary()
    assert t["temperature_c"] is None and t["pcie_tx_GBps"] is None
    assert set(t["metrics_dropped"]) == {"temperature", "pcie_throughput"}
    assert "Not Supported" in t["metrics_dropped"]["temperature"]
    assert fake.calls["temperature"] == 1  # dropped for good: never called again
    assert t["gpu_util_percent"] == 80 and t["samples"] == 4  # the rest goes on


def test_throttle_reasons_fall_back_to_the_old_name_on_old_drivers():
    """nvidia-ml-py always defines nvmlDeviceGetCurrentClocksEventReasons; a driver older
    than 535 lacks the symbol and the call raises: the old name answers then."""
    fake = FakeNVML()

    def missing(h):
        raise NVMLError("Function Not Found")

    fake.nvmlDeviceGetCurrentClocksEventReasons = missing
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    s = _sampler(fake)
    s.sample_once()
    t = s.summary()
    assert t["clock_event_reasons"] == {"sw_power_cap": 1.0}  # 0x4, in every sample
    assert "reasons" not in t["metrics_dropped"], t


def test_sampler_thread_is_bounded_and_stops(monkeypatch):
    fake = FakeNVML()
    s = _sampler(fake, interval_s=0.005, ring_size=8)
    s.start()
    deadline = time.monotonic() + 10
    while s.summary()["samples"] < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.running and s.summary()["samples"] >= 20
    assert all(len(r) <= 8 for r in s._rings.values())  # bounded memory
    s.stop()
    assert not s.running and fake.shutdowns == 1
    n = fake.calls["util"]
    time.sleep(0.05)
    assert fake.calls["util"] == n  # nothing sampled after stop


def test_run_shorter_than_one_interval_still_gets_a_reading():
    """Warm-up's end clears the samples; a steady state shorter than the interval would
    have none: stop() takes one then (NVML's counters cover the last 1/6 s to 1 s)."""
    fake = FakeNVML()
    s = _sampler(fake, interval_s=60.0)
    s.start()
    deadline = time.monotonic() + 10
    while s.summary()["samples"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    s.reset()
    assert s.summary()["samples"] == 0
    s.stop()
    t = s.summary()
    assert t["samples"] == 1 and t["gpu_util_percent"] == 80
    assert fake.shutdowns == 1


def test_sampler_internal_error_warns_once_and_stops():
    fake = FakeNVML()
    s = _sampler(fake, interval_s=0.001)

    def boom():
        raise ValueError("bug in the sampler")

    s.sample_once = boom
    with pytest.warns(RuntimeWarning, match="telemetry stopped after an internal error"):
        s.start()
        s._thread.join(5)
    assert not s.running and "bug in the sampler" in s.summary()["error"]
    s.stop()


def test_no_nvml_no_gpu_no_thread(monkeypatch):
    assert dnvml.start_sampler(torch.device("cpu")) == (None, "device is cpu, not cuda")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler, reason = dnvml.start_sampler(torch.device("cuda", 0))
    assert sampler is None and "nvidia-ml-py" in reason
    fake = FakeNVML()
    fake.broken = {"nvmlInit"}
    sampler, reason = dnvml.start_sampler(torch.device("cuda", 0), nvml=fake)
    assert sampler is None and "NVML unavailable" in reason
    assert not _nvml_threads()


def test_resolve_handle_respects_cuda_visible_devices():
    fake = FakeNVML()
    assert dnvml.resolve_handle(fake, 0, uuid="GPU-cccc")[1:] == (2, "uuid")
    assert dnvml.resolve_handle(fake, 1, uuid="GPU-zzzz", visible="2,3")[1] == 3
    assert dnvml.resolve_handle(fake, 0, visible="GPU-dd,GPU-aa")[1] == 3
    assert dnvml.resolve_handle(fake, 1, visible=None)[1] == 1
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        dnvml.resolve_handle(fake, 2, visible="0,1")


def _throttle_summary(fake):
    s = _sampler(fake)
    for _ in range(4):
        s.sample_once()
    return s.summary(rank=1)


def test_throttling_needs_a_limiting_reason_and_a_slow_clock():
    fake = FakeNVML()
    fake.reasons = 0x4 | 0x40  # power cap + hardware thermal slowdown
    fake.clock = 1200
    t = _throttle_summary(fake)
    assert t["throttled"] is True and t["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert t["clock_event_reasons"] == {"hw_thermal_slowdown": 1.0, "sw_power_cap": 1.0}
    fake.clock = 1980  # power-capped but at full clock: not a straggler
    assert _throttle_summary(fake)["throttled"] is False
    fake.reasons, fake.clock = 0x1, 300  # idle
    t = _throttle_summary(fake)
    assert t["throttled"] is False and t["throttle_reasons"] == []
    entry = dnvml.rank_entry(
        1, dict(zip(dnvml.RANK_KEYS, [None if v != v else v for v in dnvml.rank_vector(t)], strict=False))
    )
    assert entry["rank"] == 1 and entry["throttled"] is False and entry["sm_clock_mhz"] == 300


def _summary_for_advice(telemetry, device="cuda"):
    return {
        "device": device,
        "world_size": 2,
        "per_step_ms": {
            "step": 100.0,
            "data_wait": 1.0,
            "forward": 30.0,
            "backward": 60.0,
            "optimizer": 5.0,
            "comm_total": 20.0,
            "comm_exposed": 1.0,
            "compute": 98.0,
            "overhead": 2.0,
        },
        "ranks": [],
        "ratios": {},
        "grad_bytes": 1e8,
        "busbw_GBps": 100.0,
        "run": {"batch_size": 32, "micro_batches": 1, "telemetry": telemetry, "hardware": {}, "memory": None},
        "options": {"target_efficiency": 0.8, "project_gpus": [1, 2, 4]},
    }


def test_telemetry_feeds_straggler_and_launch_bound_advice():
    fake = FakeNVML()
    fake.util, fake.reasons, fake.clock = (20, 10), 0x20, 1000
    slow = _throttle_summary(fake)
    vec = dnvml.rank_vector(slow)
    slow["ranks"] = [
        {"rank": 0, "throttled": False, "throttle_reasons": [], "gpu_util_percent": 20.0},
        dnvml.rank_entry(1, dict(zip(dnvml.RANK_KEYS, vec, strict=False))),
    ]
    ids = {f["id"]: f for f in advice.advise(_summary_for_advice(slow))}
    assert ids["straggler"]["evidence"]["throttled_ranks"] == [1]
    assert ids["straggler"]["evidence"]["throttle_reasons"] == {"1": ["sw_thermal_slowdown"]}
    assert ids["launch_bound"]["evidence"]["gpu_util_percent"] == 20.0
    # Unavailable telemetry: no telemetry-driven finding, no error.
    ids = {f["id"] for f in advice.advise(_summary_for_advice(dnvml.unavailable("no NVML")))}
    assert "launch_bound" not in ids and "straggler" not in ids


# --------------------------------------------------------------------------- discovery


def test_nvlink_speed_sources():
    fake = FakeNVML()
    info = nvlink_info(fake, ("handle", 0))
    assert info["nvlink_links"] == 18 and info["nvlink_version"] == 6
    assert info["nvlink_link_GBps"] == pytest.approx(26.562)
    assert info["nvlink_GBps"] == pytest.approx(18 * 26.562)
    assert info["nvlink_speed_source"] == "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON"
    fake.nvlink_common_field = False
    info = nvlink_info(fake, ("handle", 0))
    assert info["nvlink_speed_source"] == "NVML_FI_DEV_NVLINK_GET_SPEED"
    assert info["nvlink_GBps"] == pytest.approx(18 * 26.562)
    fake.nvmlDeviceGetFieldValues = lambda h, ids: (_ for _ in ()).throw(NVMLError("Not Supported"))
    info = nvlink_info(fake, ("handle", 0))
    assert info["nvlink_speed_source"] == "nvlink_version_table" and info["nvlink_GBps"] == pytest.approx(18 * 25.0)
    fake.nvlink_links = 0
    info = nvlink_info(fake, ("handle", 0))
    assert info["nvlink_links"] is None and info["nvlink_GBps"] is None


def test_pcie_generation_and_width():
    fake = FakeNVML()
    info = pcie_info(fake, ("handle", 0))
    assert (info["pcie_generation"], info["pcie_width"]) == (5, 16)
    assert info["pcie_generation_current"] == 1  # idle power saving: recorded, not used
    assert info["pcie_GBps"] == pytest.approx(PCIE_LANE_GBPS[5] * 16)
    fake.nvmlDeviceGetMaxPcieLinkGeneration = None  # missing call: fall back to current
    fake.pcie["cur_gen"] = 4
    assert pcie_info(fake, ("handle", 0))["pcie_GBps"] == pytest.approx(PCIE_LANE_GBPS[4] * 16)


def _iface(root, name, speed=None, state="up", physical=True, bond=False, carrier="1"):
    d = root / name
    d.mkdir(parents=True)
    if physical:
        (d / "device").mkdir()
    if bond:
        (d / "bonding").mkdir()
    (d / "operstate").write_text(state + "\n")
    (d / "carrier").write_text(carrier + "\n")
    if speed is not None:
        (d / "speed").write_text(f"{speed}\n")


def _ib(root, hca, port, rate, state="4: ACTIVE"):
    d = root / hca / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "rate").write_text(rate + "\n")
    (d / "state").write_text(state + "\n")


def test_nic_speed_from_a_fake_sys_tree(tmp_path):
    net, ib = tmp_path / "net", tmp_path / "ib"
    _iface(net, "lo", 100000, physical=False, state="unknown")
    _iface(net, "docker0", 100000, physical=False)
    _iface(net, "veth12", 10000, physical=False)
    _iface(net, "eth0", 25000)
    _iface(net, "eth1", 100000, state="down")
    _iface(net, "eth2", -1)
    _iface(net, "eth3")  # no speed file
    info = nic_info(str(net), str(ib))
    assert info["nic_Gbps"] == 25.0 and info["nic_name"] == "eth0"
    assert [n["name"] for n in info["nics"]] == ["eth0"]
    _iface(net, "bond0", 50000, physical=False, bond=True)
    assert nic_info(str(net), str(ib))["nic_name"] == "bond0"
    _ib(ib, "mlx5_0", 1, "200 Gb/sec (4X HDR)")
    _ib(ib, "mlx5_1", 1, "400 Gb/sec (4X NDR)", state="1: DOWN")
    info = nic_info(str(net), str(ib))
    assert info["nic_Gbps"] == 200.0 and info["nic_name"] == "mlx5_0/1"
    assert nic_info(str(tmp_path / "missing"), str(tmp_path / "missing")) == {
        "nic_Gbps": None,
        "nic_name": None,
        "nics": [],
    }


def _projection_for(hardware):
    summary = _summary_for_advice(None)
    summary["world_size"] = 1
    summary["busbw_GBps"] = None
    summary["run"]["hardware"] = hardware
    return projection.project_summary(summary)


def test_discovered_keys_are_what_the_projection_reads(tmp_path):
    net = tmp_path / "net"
    _iface(net, "eth0", 100000)
    fake = FakeNVML()
    hw = discover_hardware(torch.device("cuda", 0), nvml=fake, net_root=str(net), ib_root=str(tmp_path / "ib"))
    assert hw["nvml"] == "ok" and hw["gpu_name"] == "NVIDIA H200"
    assert hw["bandwidth_key"] == "nvlink_GBps" and hw["nic_Gbps"] == 100.0
    proj = _projection_for(hw)
    assert proj["bandwidth_source"] == "nvml" and proj["bandwidth_GBps"] == pytest.approx(hw["nvlink_GBps"])
    fake.nvlink_links = 0  # a PCIe card
    hw = discover_hardware(torch.device("cuda", 0), nvml=fake, net_root=str(net), ib_root=str(tmp_path / "ib"))
    assert hw["bandwidth_key"] == "pcie_GBps"
    assert _projection_for(hw)["bandwidth_GBps"] == pytest.approx(hw["pcie_GBps"])
    fake.broken = {"nvmlInit"}  # no driver: the NIC is what is left
    hw = discover_hardware(torch.device("cuda", 0), nvml=fake, net_root=str(net), ib_root=str(tmp_path / "ib"))
    assert hw["nvml"].startswith("unavailable") and hw["bandwidth_key"] == "nic_Gbps"
    proj = _projection_for(hw)
    assert proj["bandwidth_source"] == "nic" and proj["bandwidth_GBps"] == pytest.approx(100 / 8)
    assert fake.inits == fake.shutdowns + 0  # every session closed (the failed init opened none)


# --------------------------------------------------------------------------- memory headroom


def test_max_batch_size_from_memory_numbers():
    # peak = static + per_sample * batch: 10 GB = 2 GB + 32 * 0.25 GB; (80 * 0.9 - 2) / 0.25 = 280
    summary = _summary_for_advice(None)
    summary["run"]["memory"] = {"peak_bytes": 10e9, "static_bytes": 2e9, "total_bytes": 80e9}
    rec = recommendations.recommend(summary, projection.project_summary(summary))
    assert rec["max_batch_size"] == 280
    summary["device"] = "cpu"
    assert recommendations.recommend(summary, projection.project_summary(summary))["max_batch_size"] is None
    summary["device"], summary["run"]["memory"]["peak_bytes"] = "cuda", 1e9  # peak below static: unknown
    assert recommendations.recommend(summary, projection.project_summary(summary))["max_batch_size"] is None


class FakeCuda:
    """torch.cuda's host-side counters, and a count of synchronising calls."""

    def __init__(self):
        self.syncs = 0
        self.resets = 0
        self.peak = 0

    def install(self, monkeypatch):
        props = types.SimpleNamespace(
            name="Fake H200", total_memory=int(80e9), multi_processor_count=132, major=9, minor=0, uuid="cccc"
        )
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", self._sync)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak + int(1e9))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def _sync(self, device=None):
        self.syncs += 1

    def _reset(self, device=None):
        self.resets += 1
        self.peak = 0


class StrictClock(FakeEventClock):
    """Records every read of an unfinished mark (which on CUDA would synchronise)."""

    def __init__(self):
        super().__init__()
        self.violations = []
        self.pending = []

    def mark(self):
        event = super().mark()
        self.pending.append(event)
        return event

    def elapsed_ms(self, start, end):
        if not (start.done and end.done):
            self.violations.append((start.time_ms, end.time_ms))
        return super().elapsed_ms(start, end)

    def complete_until(self, t_ms):
        """The device reached ``t_ms``: events recorded up to then are complete."""
        for event in self.pending:
            if event.time_ms <= t_ms:
                event.done = True
        self.pending = [e for e in self.pending if not e.done]


def _device_engine(clock, **options):
    """A started engine on the fake device ``clock``, timing a TimedNet and its SGD."""
    net = TimedNet(clock)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = Engine(Options(warmup_steps=0, every_n_steps=1000, **options), clock=clock)
    engine.attach_module(net)
    engine.attach_optimizer(opt)
    engine.start()
    return engine, net, opt


def _run_steps(engine, clock, net, opt, idles, lag_ms=None, on_step=None):
    for i, idle in enumerate(idles):
        clock.advance(idle)  # the device waits for the host's next batch
        net(torch.randn(8, 4)).sum().backward()
        clock.advance(1.0)
        opt.step()
        opt.zero_grad()
        if lag_ms is not None:
            clock.complete_until(clock.now_ms - lag_ms)
        if on_step:
            on_step(i)


def test_gap_mode_data_wait_is_the_device_idle_between_steps():
    """Device idle between steps is the gap from one step's last event to the next step's first."""
    clock = StrictClock()
    engine, net, opt = _device_engine(clock)
    idles = [5.0, 1.0, 9.0, 0.0, 3.0, 7.0, 2.0, 4.0]
    drained = []
    # The device lags the host by ~2 steps: only old steps are complete at each boundary.
    _run_steps(engine, clock, net, opt, idles, lag_ms=30.0, on_step=lambda i: drained.append(len(engine.steps.run)))
    assert drained[0] == 0 and drained[-1] < len(idles)  # read lazily, never ahead of the device
    clock.complete_until(float("inf"))
    engine.steps.drain()
    assert clock.violations == [] and engine.parts["timing"].enabled
    rows = engine.steps.run._data[: len(engine.steps.run)]
    col = {name: i for i, name in enumerate(("step", "data_wait", "forward", "backward", "optimizer"))}
    assert list(rows[:, col["data_wait"]]) == pytest.approx(idles)
    assert list(rows[:, col["step"]]) == pytest.approx([idle + 3 + 7 + 1 for idle in idles])
    engine.stop()


class CountingClock(StrictClock):
    """Counts the device clock's driver calls: events recorded, queries, readings."""

    def __init__(self):
        super().__init__()
        self.recorded = self.queries = self.readings = 0

    def mark(self):
        self.recorded += 1
        return super().mark()

    def ready(self, mark):
        self.queries += 1
        return super().ready(mark)

    def elapsed_ms(self, start, end):
        self.readings += 1
        return super().elapsed_ms(start, end)


def test_a_device_step_is_read_once_per_event_and_queried_once_while_the_device_is_behind():
    """Each query and each reading of a CUDA event is a driver call on the training
    thread: each event of a step is read once, and a step the device has not finished
    costs one query, however far into it the device is."""
    clock = CountingClock()
    engine, net, opt = _device_engine(clock)
    queries = []

    def behind(i: int) -> None:
        before = clock.queries
        engine.steps.drain()
        queries.append(clock.queries - before)

    # Steps of 11 ms (3 forward, 7 backward, 1 between); the device 4 ms behind the host,
    # well into the step just closed.
    _run_steps(engine, clock, net, opt, [0.0] * 12, lag_ms=4.0, on_step=behind)
    # At each drain: the step finished since, its 7 events once each (the first step has
    # no span of the profiler's own work before it; the others are the steady lane's,
    # whose start, the step before's end, was known with that step), then the unfinished
    # one, its end only.
    assert engine.steps.lane.steps_taken == 11
    assert queries == [1, 7 + 1] + [7 + 1] * 10
    clock.complete_until(float("inf"))
    before = clock.queries
    engine.steps.drain()
    assert clock.queries - before == 7  # its 7 events, each once
    assert clock.violations == [] and len(engine.steps.run) == 12
    # Every event read once against its step's start: all but the first step's start and
    # the one mark of the step still open (the end of the profiler's own work).
    assert clock.readings == clock.recorded - 2, (clock.readings, clock.recorded)
    engine.stop()


def test_a_step_that_does_not_time_backward_records_three_events_fewer(monkeypatch):
    """Without a process group, backward is timed on a sample of the steps: the others
    record neither of its events (nor register the hook) nor the forward's end (the lean
    forward hooks of the steady lane), and still give the step, data wait and optimizer."""
    import dtprofile.capture.schedule

    monkeypatch.setattr(dtprofile.capture.schedule, "BACKWARD_TIMING_FIRST", 4)
    # (whatever another test compiled before: nothing here is, so the lean hooks apply)
    monkeypatch.setattr(dtprofile._torch_internals, "_frames_compiled", lambda: False)
    clock = CountingClock()
    engine, net, opt = _device_engine(clock, backward_timing_every=3)
    per_step = []

    def count(i: int) -> None:
        per_step.append(clock.recorded)

    _run_steps(engine, clock, net, opt, [2.0] * 10, on_step=count)
    recorded = [b - a for a, b in zip([per_step[0]] + per_step, per_step, strict=False)][1:]
    # Steps 1-3 and 6 and 9 time backward (the first 4, then every 3rd): 7 events a step
    # (the start is the last step's end); steps 4, 5, 7 and 8 record 4: the end of the
    # profiler's own work, the forward's start, the update's start and the step's end.
    assert engine.steps.lane.steps_taken == 9
    assert recorded == [7, 7, 7, 4, 4, 7, 4, 4, 7]
    clock.complete_until(float("inf"))
    summary = engine.stop()
    per = summary["per_step_ms"]
    assert summary["backward_timed_steps"] == 6 and per["backward"] == pytest.approx(7.0)
    assert per["forward"] == pytest.approx(3.0) and per["data_wait"] == pytest.approx(2.0)
    assert clock.violations == []


def test_engine_with_fake_cuda_and_fake_nvml(monkeypatch, tmp_path):
    """Telemetry and hardware in the summary; peak reset at start; the only sync is at stop()."""
    fake_cuda = FakeCuda()
    fake_cuda.install(monkeypatch)
    fake = FakeNVML()
    fake.util = (30, 20)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(dnvml, "DEFAULT_INTERVAL_S", 0.005)
    clock = FakeEventClock()
    net = TimedNet(clock)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = Engine(Options(warmup_steps=2, every_n_steps=1000), device=torch.device("cuda", 0), clock=clock)
    engine.attach_module(net)
    engine.attach_optimizer(opt)
    fake_cuda.peak = int(50e9)  # before the run (e.g. an evaluation): must not count
    engine.start()
    assert fake_cuda.resets == 1 and fake_cuda.peak == 0
    assert engine.telemetry.sampler is not None and engine.telemetry.sampler.running
    _run_steps(engine, clock, net, opt, [0.1] * 8)  # no data wait to blame
    assert fake_cuda.resets == 1  # not again mid-run: the loop's own max_memory_allocated() stays its own
    deadline = time.monotonic() + 10
    while engine.telemetry.sampler.summary()["samples"] < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    # peak = static + per_sample * batch(8): static is 2*param bytes + no SGD state
    static = 2 * sum(p.numel() * 4 for p in net.parameters())
    fake_cuda.peak = static + 8 * int(1e9)
    assert fake_cuda.syncs == 0  # no synchronisation inside the steps
    clock.complete_all()
    summary = engine.stop().to_dict()
    assert fake_cuda.syncs == 1  # stop(): the one final drain
    assert not engine.telemetry.sampler.running and fake.shutdowns == fake.inits
    tel = summary["run"]["telemetry"]
    assert tel["available"] is True and tel["gpu_util_percent"] == 30 and tel["nvml_index"] == 2  # by UUID
    assert tel["ranks_source"] == "local" and tel["ranks"][0]["rank"] == 0
    hw = summary["run"]["hardware"]
    assert hw["gpu_sm_count"] == 132 and hw["nvlink_links"] == 18 and hw["bandwidth_key"] == "nvlink_GBps"
    assert summary["projection"]["bandwidth_source"] == "nvml"
    assert summary["run"]["memory"]["peak_bytes"] == static + 8 * int(1e9)
    assert summary["recommendations"]["max_batch_size"] == int((80e9 * 0.9 - static) / 1e9)
    ids = {f["id"] for f in summary["advice"]}
    assert "launch_bound" in ids  # 30% busy, nothing else to blame
    assert "batch_headroom" in ids


@pytest.mark.parametrize("interval_s", [0.0, 0.05])
def test_telemetry_interval_option(monkeypatch, interval_s):
    """telemetry_interval_s=0: no NVML thread, and the summary says it was turned off;
    otherwise the sampler runs at the interval asked for."""
    FakeCuda().install(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    clock = FakeEventClock()
    net = TimedNet(clock)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = Engine(
        Options(warmup_steps=0, every_n_steps=1000, telemetry_interval_s=interval_s),
        device=torch.device("cuda", 0),
        clock=clock,
    )
    engine.attach_module(net)
    engine.attach_optimizer(opt)
    engine.start()
    if interval_s == 0:
        assert engine.telemetry.sampler is None and not _nvml_threads()
    else:
        assert engine.telemetry.sampler.running and engine.telemetry.sampler.interval_s == interval_s
    _run_steps(engine, clock, net, opt, [0.1] * 3)
    clock.complete_all()
    summary = engine.stop().to_dict()
    tel = summary["run"]["telemetry"]
    if interval_s == 0:
        assert tel == {"available": False, "reason": "turned off (telemetry_interval_s=0)"}
    else:
        assert tel["available"] is True and tel["interval_s"] == interval_s
    assert summary["options"]["telemetry_interval_s"] == interval_s


def test_cpu_engine_reports_telemetry_unavailable_and_starts_no_thread():
    model_ = nn.Linear(4, 1)
    opt = torch.optim.SGD(model_.parameters(), lr=0.1)
    with dtprofile.profile(model_, opt, warmup_steps=0) as prof:
        assert not _nvml_threads()
        for _ in range(3):
            model_(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    run = prof.report().to_dict()["run"]
    assert run["telemetry"] == {"available": False, "reason": "device is cpu, not cuda"}
    assert "nic_Gbps" in run["hardware"] and run["memory"] is None


def test_gathered_telemetry_gives_every_rank_an_entry():
    engine = Engine(Options(warmup_steps=0))
    engine.telemetry.sampler = types.SimpleNamespace(
        summary=lambda rank=None: {"available": True, "rank": rank, "gpu_util_percent": 90.0}
    )
    rows = [
        {"rank": 0, "telemetry_gpu_util_percent": 90.0, "telemetry_throttle_mask": 0.0},
        {
            "rank": 1,
            "telemetry_gpu_util_percent": 50.0,
            "telemetry_sm_clock_mhz": 900.0,
            "telemetry_throttle_mask": float(0x40),
        },
    ]
    tel = engine.telemetry.summary(engine.rank, rows)
    assert tel["ranks_source"] == "gather"
    assert tel["ranks"][1] == {
        "rank": 1,
        "gpu_util_percent": 50.0,
        "sm_clock_mhz": 900.0,
        "sm_clock_ratio": None,
        "power_w": None,
        "temperature_c": None,
        "throttled": True,
        "throttle_reasons": ["hw_thermal_slowdown"],
    }
    assert tel["ranks"][0]["throttled"] is False


# --------------------------------------------------------------------------- real CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiled_steps_make_no_synchronising_call_on_cuda():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
    ).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = [
        (torch.randn(32, 3, 32, 32, device="cuda"), torch.randint(0, 10, (32,), device="cuda")) for _ in range(4)
    ]
    prof = dtprofile.profile(net, opt, warmup_steps=2, every_n_steps=5)
    prof.start()
    try:
        for i in range(20):
            if i == 3:
                torch.cuda.set_sync_debug_mode("error")  # after warm-up: any sync raises
            x, y = batches[i % len(batches)]
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)  # stop() synchronises once, on purpose
    summary = prof.stop().to_dict()
    assert summary["timing"] == "cuda_event" and not summary["parts_disabled"]
    assert summary["steps_profiled"] >= 15
    assert summary["per_step_ms"]["forward"] > 0


# --------------------------------------------------------------------------- the GPU check script


def test_gpu_check_without_cuda_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real check")
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "no CUDA device: nothing to check" in out.stdout


def _load_gpu_check():
    """benchmarks/gpu_check.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_profiler_kernel_times_skip_annotation_ranges():
    """Kineto projects record_function ranges ("nccl:all_reduce", the optimizer step,
    DDP's forward) onto the GPU timeline; they span kernels counted on their own, so
    the comparison with dtprofile counts kernels only (as torch's own table does)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    gpu_check = _load_gpu_check()

    def event(name, start_us, end_us, annotation=False):
        return FunctionEvent(
            id=0,
            name=name,
            thread=0,
            start_us=start_us,
            end_us=end_us,
            device_type=DeviceType.CUDA,
            is_user_annotation=annotation,
            device_index=0,
        )

    trace = types.SimpleNamespace(
        events=lambda: [
            event("void cudnn::conv_fwd_kernel", 0, 400),
            event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 400, 700),
            event("nccl:all_reduce", 400, 700, annotation=True),
            event("Memcpy DtoD (Device -> Device)", 700, 720),
            event("void at::native::multi_tensor_apply_kernel", 720, 800),
            event("Optimizer.step#SGD.step", 720, 800, annotation=True),
            event("DistributedDataParallel.forward", 0, 400, annotation=True),
        ]
    )
    times = gpu_check.kernel_times_ms(trace, steps=2)
    assert times["kernel_ms"] == pytest.approx(0.4) and times["nccl_ms"] == pytest.approx(0.15)
    assert times["compute_kernel_ms"] == pytest.approx(0.25) and times["memcpy_memset_ms"] == pytest.approx(0.01)
    assert times["kernel_events"] == 4 and times["annotation_events_skipped"] == 3
    assert times["device_period_ms"] == pytest.approx(0.4)  # 0..800 us over 2 steps, the 0.08 ms gap kept
    compared = gpu_check.compare(
        {"per_step_ms": {"forward": 0.2, "backward": 0.15, "optimizer": 0.05, "step": 0.44}}, times
    )
    assert compared["compute_ratio"] == pytest.approx(0.4 / 0.25)
    assert compared["step_vs_device_period_ratio"] == pytest.approx(1.1)


def test_sync_warning_count_leaves_out_the_prototype_notice():
    """set_sync_debug_mode itself warns that it is a prototype: that is not a sync in a step."""
    gpu_check = _load_gpu_check()
    assert not gpu_check._is_sync_warning(
        "Synchronization debug mode is a prototype feature and does not yet detect "
        "all synchronizing operations (Triggered internally at Module.cpp:1003.)"
    )
    assert gpu_check._is_sync_warning("called a synchronizing CUDA operation (Triggered internally at Context.cpp)")


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_runs_every_check(tmp_path):
    """The script a GPU session runs, end to end on the CPU: every check, the JSON out, at
    a small --batch/--image (the DDP and FSDP checks' spawned ranks get them too)."""
    out_json = tmp_path / "gpu_check.json"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--cpu-dry-run",
            "--steps",
            "5",
            "--batch",
            "3",
            "--image",
            "8",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(out_json.read_text())
    assert (results["batch"], results["image"], results["failed"]) == (3, 8, [])
    for name in ("ddp_gloo_cuda", "ddp_nccl_1rank", "fsdp2"):
        assert (results[name]["batch"], results[name]["image"]) == (3, 8), (name, results[name])
    plain = results["no_sync_plain"]
    assert plain["ok"] and plain["steps_profiled"] == 5
    # What the host paid in the steps after warm-up: the steady lane took them, each a
    # handful of marks (on a GPU, CUDA events).
    assert plain["steady_lane_steps"] == 5 and 3 <= plain["marks_per_step"] <= 8, plain
    assert results["vs_torch_profiler"]["dtprofile_fwd_bwd_opt_ms"] > 0
    waits = results["data_wait_gpu_ahead"]  # on the CPU every sleep is data wait
    for case in ("sleep_quarter_step", "sleep_twice_step"):
        assert waits[case]["data_wait_ms"] == pytest.approx(waits[case]["sleep_ms"], rel=0.5, abs=1.0), waits
    for name in ("overhead", "overhead_host_bound"):
        assert results[name]["plain_step_ms"] > 0 and len(results[name]["profiled_blocks_ms"]) == 1
    assert results["overhead_host_bound"]["batch"] == 4 and results["overhead_host_bound"]["image"] == 32
    assert results["lightning"]["steps_profiled"] == 5 and not results["lightning"]["parts_disabled"]
    ddp = results["ddp_gloo_cuda"]  # one "GPU": DDP over gloo
    assert ddp["backend"] == "gloo" and not ddp["errors"]
    assert ddp["per_step_ms"]["comm_total"] > 0 and ddp["probe"]["steps"] >= 1
    assert all(n >= 5 for n in ddp["steady_lane_steps_per_rank"]), ddp  # DDP's own all-reduce: the lane
    one = results["ddp_nccl_1rank"]  # NCCL on a GPU; gloo in the dry run
    assert one["world_size"] == 1 and not one["errors"] and one["per_step_ms"]["comm_total"] > 0
    fsdp = results["fsdp2"]  # FSDP2 over gloo on the CPU
    assert fsdp["comm_source"] == "fsdp" and not fsdp["errors"] and fsdp["fsdp"]["reduce_scatters"] >= 2
    assert 0 < fsdp["per_step_ms"]["comm_exposed"] <= fsdp["per_step_ms"]["comm_total"]
    for section in (
        "== no_sync_plain",
        "== data_wait_gpu_ahead",
        "== telemetry",
        "== hardware",
        "== ddp_gloo_cuda",
        "== fsdp2",
        "== result: all checks ran",
    ):
        assert section in out.stdout, section
    # The three distributed checks ran one after another in ranks spawned once (the 2-rank
    # ones first, then the 1-rank one), each with its own process group and results.
    assert "== ddp_gloo_cuda, fsdp2, ddp_nccl_1rank: their ranks spawned once" in out.stdout


def test_gpu_check_options_name_the_accepted_values():
    gpu_check = _load_gpu_check()
    assert gpu_check._check_names("overhead, vs_torch_profiler") == ["overhead", "vs_torch_profiler"]
    with pytest.raises(Exception, match="accepted: no_sync_plain, data_wait_gpu_ahead"):
        gpu_check._check_names("overhead,speed")
    with pytest.raises(Exception, match="must be >= 1"):
        gpu_check._positive("0")


@pytest.mark.slow
def test_gpu_check_dry_run_of_chosen_checks_and_sizes(tmp_path):
    """--checks runs only those, at --batch/--image (the spawned ranks' sizes: the dry run
    of every check above)."""
    out_json = tmp_path / "gpu_check.json"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--cpu-dry-run",
            "--steps",
            "5",
            "--checks",
            "vs_torch_profiler,overhead",
            "--batch",
            "2",
            "--image",
            "8",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(out_json.read_text())
    assert (results["batch"], results["image"], results["failed"]) == (2, 8, [])
    assert {"vs_torch_profiler", "overhead"} <= set(results) and "no_sync_plain" not in results
    assert "ddp_nccl_1rank" not in results and "lightning" not in results and "fsdp2" not in results
    assert results["vs_torch_profiler"]["dtprofile_fwd_bwd_opt_ms"] > 0
    assert (results["overhead"]["batch"], results["overhead"]["image"]) == (2, 8), results["overhead"]
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--checks", "speed"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "accepted: no_sync_plain" in bad.stderr


@pytest.mark.parametrize(
    "gpus, checks, runs, skipped",
    [
        (2, "ddp_gloo_cuda,ddp_nccl_1rank", [], {"ddp_gloo_cuda", "ddp_nccl_1rank"}),
        (2, "ddp_nccl,fsdp2", [(), ("nccl", True)], set()),  # check_ddp's default backend is NCCL
        (1, "ddp_nccl", [], {"ddp_nccl"}),
        (1, "ddp_gloo_cuda,fsdp2", [("gloo",)], {"fsdp2"}),
        (1, "ddp_nccl_1rank", [("nccl", False, 1)], set()),
    ],
)
def test_gpu_check_runs_or_says_skipped_every_ddp_check_asked_for(monkeypatch, tmp_path, gpus, checks, runs, skipped):
    """A check asked for with --checks runs, or is in the results as skipped: never silently left out."""
    gpu_check = _load_gpu_check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "fake GPU")
    calls = []
    monkeypatch.setattr(gpu_check, "check_ddp", lambda steps, *args: calls.append(args) or {"errors": {}})
    out = tmp_path / "out.json"
    assert gpu_check.main(["--checks", checks, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert calls == runs
    asked = set(checks.split(","))
    assert asked <= set(results) and not (set(gpu_check.CHECKS) - asked) & set(results)
    assert {name for name in asked if "skipped" in results[name]} == skipped
