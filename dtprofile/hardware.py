"""What the run is made of: device, model and optimizer sizes, device memory.

Read once per summary, never per step.
"""

from __future__ import annotations

import os
import platform
from typing import Iterable

import torch

__all__ = ["describe_device", "model_sizes", "memory_info"]

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
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def model_sizes(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> dict:
    """Parameter, trainable-parameter and optimizer-state bytes; whether it convolves."""
    modules = [m for m in modules if m is not None]
    params = _unique_params(modules)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state_bytes = 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    state_bytes += value.numel() * value.element_size()
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for mod in modules for m in mod.modules())
    return {
        "param_bytes": int(param_bytes),
        "trainable_param_bytes": int(trainable),
        "optimizer_state_bytes": int(state_bytes),
        "has_conv": has_conv,
    }


def memory_info(device: torch.device, sizes: dict) -> dict | None:
    """CUDA memory: peak allocated, device total, and the static part.

    Static = parameters + gradients (one per trainable parameter) + optimizer state;
    the rest of the peak grows with the batch. ``None`` on the CPU.
    ``max_memory_allocated`` reads the caching allocator's counter: no device sync.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return {
        "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
        "total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
        "static_bytes": int(sizes["param_bytes"] + sizes["trainable_param_bytes"] + sizes["optimizer_state_bytes"]),
        "plan_fraction": MEMORY_PLAN_FRACTION,
    }
