"""What the run is made of: device, model and optimizer sizes, device memory, links.

Read once per summary (or once per run: :func:`discover_hardware`), never per step.

Bandwidth discovery (``run.hardware``) gives the projection a link speed when there is
nothing to measure (one GPU). ``dtprofile.analysis.projection.resolve_bandwidth`` reads
``nvlink_GBps``, else ``pcie_GBps`` (source ``nvml``), else ``nic_Gbps`` (source ``nic``);
``bandwidth_key`` names the one it falls back to. What is used:

- NVLink: ``nvmlDeviceGetNvLinkState`` on links 0..NVML_NVLINK_MAX_LINKS-1 counts the
  active links; the per-link speed is the field value
  ``NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON`` (MB/s per link, one direction; nvidia-smi
  shows the same figure, e.g. 26.562 GB/s on H100), else ``NVML_FI_DEV_NVLINK_GET_SPEED``
  per link (scope = link), else the per-link nominal speed of the NVLink generation from
  ``nvmlDeviceGetNvLinkVersion`` (:data:`NVLINK_LINK_GBPS`). ``nvlink_GBps`` = active
  links x per-link speed: the GPU's aggregate one-direction NVLink bandwidth, what a ring
  all-reduce over NVSwitch can reach (NCCL's busbw).
- PCIe: ``nvmlDeviceGetMaxPcieLinkGeneration`` / ``...MaxPcieLinkWidth`` (the most this
  GPU and slot train to; the current link, ``nvmlDeviceGetCurrPcieLinkGeneration`` /
  ``...Width``, drops at idle to save power and is recorded too) times the per-lane
  one-direction GB/s after encoding overhead (:data:`PCIE_LANE_GBPS`).
- NIC: ``/sys/class/net/*/speed`` (Mbit/s) of interfaces that are up and physical (have
  a ``device`` link; bonds count), and ``/sys/class/infiniband/*/ports/*/rate`` of ACTIVE
  ports; the fastest wins.
- The CUDA device: ``torch.cuda.get_device_properties`` (name, total memory, SM count,
  compute capability).
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "describe_device",
    "model_sizes",
    "memory_info",
    "discover_hardware",
    "nvlink_info",
    "pcie_info",
    "nic_info",
    "PCIE_LANE_GBPS",
    "NVLINK_LINK_GBPS",
]

#: PCIe bandwidth per lane, one direction, GB/s after line encoding (8b/10b for gen 1-2,
#: 128b/130b for gen 3-5, FLIT 242/256 for gen 6).
PCIE_LANE_GBPS: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
#: Nominal NVLink bandwidth per link, one direction, GB/s, by ``nvmlNvlinkVersion_t``
#: value (1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0). Used only when
#: NVML gives no speed field; older drivers reported the bare generation number, so this
#: is the least trusted source (``nvlink_speed_source`` says so).
NVLINK_LINK_GBPS: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
_MAX_NICS = 16

# Share of device memory a recommended batch may plan to use (allocator fragmentation,
# cuDNN workspaces and the like take the rest).
MEMORY_PLAN_FRACTION = 0.9


def describe_device(device: torch.device) -> tuple[str, str]:
    """``(device_name, "cuda" | "cpu")`` for the summary."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device), "cuda"
    name = platform.processor() or platform.machine() or "cpu"
    return f"{name} ({os.cpu_count()} cores)", "cpu"


def _unique_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Every parameter once. FSDP1's flat parameters stand for the original parameters
    they hold: with ``use_orig_params=True`` those are views of this rank's shard, and
    only the flat parameter knows the whole size."""
    seen: dict[int, torch.nn.Parameter] = {}
    covered: set[int] = set()
    for module in modules:
        if module is None:
            continue
        for m in module.modules():
            flat = _fsdp1_flat_param(m)
            if flat is not None:
                seen.setdefault(id(flat), flat)
                covered.update(id(p) for p in (getattr(flat, "_params", None) or ()))
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if id(p) not in covered:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _fsdp1_flat_param(module: torch.nn.Module) -> torch.nn.Parameter | None:
    """The flat parameter of an FSDP1 ``FullyShardedDataParallel`` unit (None otherwise)."""
    if type(module).__name__ != "FullyShardedDataParallel":
        return None
    return getattr(getattr(module, "_handle", None), "flat_param", None)


def model_sizes(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, Any]:
    """Parameter, trainable-parameter and optimizer-state bytes; whether it convolves.

    ``param_bytes`` is the whole model (what a replica all-reduces); ``local_*`` is what
    this rank holds, which differs for sharded parameters (FSDP2's DTensors, FSDP1's flat
    parameters) and is what its memory holds. Optimizer state is counted as held
    (sharded with the parameters).
    """
    modules = [m for m in modules if m is not None]
    params = _unique_params(modules)
    param_bytes = sum(_full_nbytes(p) for p in params)
    trainable = sum(_full_nbytes(p) for p in params if p.requires_grad)
    # A parameter server holds whole tensors: the largest one bounds how evenly they split.
    largest = max((_full_nbytes(p) for p in params if p.requires_grad), default=0)
    state_bytes = 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    state_bytes += _nbytes(_local(value))
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for mod in modules for m in mod.modules())
    return {
        "param_count": int(sum(_full_numel(p) for p in params)),
        "param_bytes": int(param_bytes),
        "trainable_param_bytes": int(trainable),
        "largest_trainable_param_bytes": int(largest),
        "local_param_bytes": int(sum(_local_nbytes(p) for p in params)),
        "local_trainable_param_bytes": int(sum(_local_nbytes(p) for p in params if p.requires_grad)),
        "optimizer_state_bytes": int(state_bytes),
        "has_conv": has_conv,
    }


def _full_numel(param: torch.Tensor) -> int:
    """The whole parameter's elements (see :func:`_full_nbytes`)."""
    size = getattr(param, "_unpadded_unsharded_size", None)
    return math.prod(size) if size is not None else param.numel()


def model_class(module: torch.nn.Module | None) -> str | None:
    """The class of the user's model inside its wrappers (compiled, DDP), e.g. ``GPT2LMHeadModel``."""
    for _ in range(4):
        inner = getattr(module, "_orig_mod", None)
        if inner is None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
            inner = module.module
        if inner is None:
            break
        module = inner
    return type(module).__name__ if module is not None else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _full_nbytes(param: torch.Tensor) -> int:
    """The whole parameter's bytes: a DTensor's global size; an FSDP1 flat parameter's
    unsharded size (without padding), whether or not it is gathered right now."""
    size = getattr(param, "_unpadded_unsharded_size", None)
    return math.prod(size) * param.element_size() if size is not None else _nbytes(param)


def _local_nbytes(param: torch.Tensor) -> int:
    """What this rank holds of the parameter: its shard (FSDP1: with padding)."""
    size = getattr(param, "_sharded_size", None)
    return math.prod(size) * param.element_size() if size is not None else _nbytes(_local(param))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and their state), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def memory_info(device: torch.device, sizes: dict[str, Any]) -> dict[str, Any] | None:
    """CUDA memory: peak allocated, device total, and the static part.

    Static = parameters + gradients (one per trainable parameter) + optimizer state, as
    held on this rank (a shard each, when sharded);
    the rest of the peak grows with the batch. ``None`` on the CPU.
    ``max_memory_allocated`` reads the caching allocator's counter: no device sync.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return {
        "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
        "static_bytes": int(
            sizes.get("local_param_bytes", sizes["param_bytes"])
            + sizes.get("local_trainable_param_bytes", sizes["trainable_param_bytes"])
            + sizes["optimizer_state_bytes"]
        ),
        "plan_fraction": MEMORY_PLAN_FRACTION,
    }


# --------------------------------------------------------------------------- discovery


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def nic_info(net_root: str = "/sys/class/net", ib_root: str = "/sys/class/infiniband") -> dict[str, Any]:
    """The fastest up physical network link: ``{"nic_Gbps", "nic_name", "nics"}``.

    Ethernet (and IPoIB) from ``<net_root>/<if>/speed`` in Mbit/s: skips ``lo``,
    interfaces without a ``device`` link (virtual: veth, bridges, docker) unless they are
    bonds, interfaces not up, and unknown speeds (-1, or unreadable). InfiniBand from
    ``<ib_root>/<hca>/ports/<n>/rate`` ("200 Gb/sec (4X HDR)") of ports whose ``state``
    is ACTIVE.
    """
    nics: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(net_root))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(net_root, name)
        if name == "lo":
            continue
        physical = os.path.exists(os.path.join(path, "device"))
        bond = os.path.isdir(os.path.join(path, "bonding"))
        if not (physical or bond):
            continue
        state = (_read(os.path.join(path, "operstate")) or "").lower()
        if state != "up" and not (state == "unknown" and _read(os.path.join(path, "carrier")) == "1"):
            continue
        try:
            mbps = float(_read(os.path.join(path, "speed")) or "nan")
        except ValueError:
            continue
        if not mbps > 0:
            continue
        nics.append({"name": name, "Gbps": mbps / 1e3, "kind": "bond" if bond else "ethernet"})
    try:
        hcas = sorted(os.listdir(ib_root))
    except OSError:
        hcas = []
    for hca in hcas:
        ports_dir = os.path.join(ib_root, hca, "ports")
        try:
            ports = sorted(os.listdir(ports_dir))
        except OSError:
            continue
        for port in ports:
            state = _read(os.path.join(ports_dir, port, "state")) or ""
            if "ACTIVE" not in state.upper():
                continue
            rate = _read(os.path.join(ports_dir, port, "rate")) or ""
            try:
                gbps = float(rate.split()[0])
            except (ValueError, IndexError):
                continue
            if gbps > 0:
                nics.append({"name": f"{hca}/{port}", "Gbps": gbps, "kind": "infiniband"})
    best = max(nics, key=lambda n: n["Gbps"], default=None)
    return {
        "nic_Gbps": best["Gbps"] if best else None,
        "nic_name": best["name"] if best else None,
        "nics": sorted(nics, key=lambda n: -n["Gbps"])[:_MAX_NICS],
    }


def _field(nvml: Any, handle: Any, field_id: int, scope: int = 0) -> float | None:
    from .nvml import field_value

    values = nvml.nvmlDeviceGetFieldValues(handle, [(field_id, scope)])
    return field_value(values[0])


def nvlink_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """Active NVLink links and their speed (see the module docstring); never raises."""
    out: dict[str, Any] = {
        "nvlink_links": None,
        "nvlink_version": None,
        "nvlink_link_GBps": None,
        "nvlink_GBps": None,
        "nvlink_speed_source": None,
    }
    active: list[int] = []
    supported = False
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:
            continue
        supported = True
        if state == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            active.append(link)
    if not supported:
        return out
    out["nvlink_links"] = len(active)
    if not active:
        return out
    try:
        out["nvlink_version"] = int(nvml.nvmlDeviceGetNvLinkVersion(handle, active[0]))
    except Exception:
        pass
    per_link, source = None, None
    try:
        mbps = _field(nvml, handle, nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON)
        if mbps:
            per_link, source = mbps / 1e3, "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON"
    except Exception:
        pass
    if per_link is None:
        try:
            speeds = [_field(nvml, handle, nvml.NVML_FI_DEV_NVLINK_GET_SPEED, link) for link in active]
            if all(speeds):
                total = sum(speeds) / 1e3  # type: ignore[arg-type]
                out["nvlink_link_GBps"] = total / len(active)
                out["nvlink_GBps"] = total
                out["nvlink_speed_source"] = "NVML_FI_DEV_NVLINK_GET_SPEED"
                return out
        except Exception:
            pass
    if per_link is None and out["nvlink_version"] in NVLINK_LINK_GBPS:
        per_link, source = NVLINK_LINK_GBPS[out["nvlink_version"]], "nvlink_version_table"
    if per_link is not None:
        out["nvlink_link_GBps"] = per_link
        out["nvlink_GBps"] = per_link * len(active)
        out["nvlink_speed_source"] = source
    return out


def pcie_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """PCIe generation and width (max and current) and the one-direction GB/s; never raises."""

    def call(name: str) -> int | None:
        try:
            value = int(getattr(nvml, name)(handle))
            return value if value > 0 else None
        except Exception:
            return None

    out: dict[str, Any] = {
        "pcie_generation": call("nvmlDeviceGetMaxPcieLinkGeneration"),
        "pcie_width": call("nvmlDeviceGetMaxPcieLinkWidth"),
        "pcie_generation_current": call("nvmlDeviceGetCurrPcieLinkGeneration"),
        "pcie_width_current": call("nvmlDeviceGetCurrPcieLinkWidth"),
    }
    gen = out["pcie_generation"] or out["pcie_generation_current"]
    width = out["pcie_width"] or out["pcie_width_current"]
    out["pcie_GBps"] = PCIE_LANE_GBPS[gen] * width if gen in PCIE_LANE_GBPS and width else None
    return out


def _torch_properties(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "gpu_name": None,
        "gpu_total_memory_bytes": None,
        "gpu_sm_count": None,
        "gpu_compute_capability": None,
    }
    try:
        props = torch.cuda.get_device_properties(device)
    except Exception:
        return out
    out["gpu_name"] = getattr(props, "name", None)
    total = getattr(props, "total_memory", None)
    out["gpu_total_memory_bytes"] = int(total) if total is not None else None
    sms = getattr(props, "multi_processor_count", None)
    out["gpu_sm_count"] = int(sms) if sms is not None else None
    if getattr(props, "major", None) is not None:
        out["gpu_compute_capability"] = f"{props.major}.{props.minor}"
    return out


def bandwidth_key(hardware: dict[str, Any]) -> str | None:
    """The ``run.hardware`` figure the projection falls back to (model.resolve_bandwidth's order)."""
    for key in ("nvlink_GBps", "pcie_GBps", "nic_Gbps"):
        value = hardware.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return key
    return None


def discover_hardware(
    device: torch.device, *, nvml: Any = None, net_root: str = "/sys/class/net", ib_root: str = "/sys/class/infiniband"
) -> dict[str, Any]:
    """``run.hardware``: the GPU (torch and NVML), its NVLink and PCIe links, the NIC.

    Never raises; what cannot be found is None and ``nvml`` says why NVML gave nothing.
    ``nvml`` injects a pynvml-like module (tests); the default imports ``pynvml``.
    """
    out: dict[str, Any] = {}
    if device.type == "cuda":
        out.update(_torch_properties(device))
        out.update({"nvml": None, "nvml_index": None})
        out.update(
            {
                k: None
                for k in (
                    "nvlink_links",
                    "nvlink_version",
                    "nvlink_link_GBps",
                    "nvlink_GBps",
                    "nvlink_speed_source",
                    "pcie_generation",
                    "pcie_width",
                    "pcie_generation_current",
                    "pcie_width_current",
                    "pcie_GBps",
                )
            }
        )
        try:
            from .nvml import NvmlSession

            index = device.index if device.index is not None else torch.cuda.current_device()
            session = NvmlSession(int(index), nvml=nvml)
        except Exception as exc:
            out["nvml"] = f"unavailable: {type(exc).__name__}: {exc}"
        else:
            try:
                out["nvml"] = "ok"
                out["nvml_index"] = session.index
                if out["gpu_name"] is None:
                    out["gpu_name"] = session.name()
                out.update(nvlink_info(session.nvml, session.handle))
                out.update(pcie_info(session.nvml, session.handle))
            finally:
                session.close()
    else:
        out["nvml"] = f"not used: device is {device.type}"
    out.update(nic_info(net_root, ib_root))
    out["bandwidth_key"] = bandwidth_key(out)
    return out
