"""Memory readings and estimates.

The estimators follow the ZeRO accounting (bytes per parameter for model states,
seed 001's ``estimate_zero{2,3}_model_states_mem_needs``): with Adam in mixed
precision, 2 bytes of parameters + 2 of gradients (model dtype) + 12 of optimizer
state (fp32 master, m, v) per parameter, divided across N ranks as the stage shards.
Activations are not sharded by any stage: each rank holds its own micro-batch's, a figure
that ``zeroplug estimate --micro-batch`` measures with a probe step (``zeroplug.tools.probe``).
"""
from __future__ import annotations

import os

import torch

GB = 1024 ** 3


def host_rss_bytes() -> int:
    """Resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can still be allocated)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, max allocated) bytes on a CUDA device; (0, 0) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return 0, 0


def estimate_model_states(num_params: int, stage: int, world_size: int,
                          param_bytes: int = 2, offload_optimizer: bool = False,
                          offload_param: bool = False, activations: float = 0.0) -> dict[str, float]:
    """Bytes per rank on the device and on the host for the model states, plus ``activations``
    (bytes of one micro-batch's activations, on the device whatever the stage)."""
    n = max(1, world_size)
    params = num_params * param_bytes / (n if stage >= 3 else 1)
    grads = num_params * param_bytes / (n if stage >= 2 else 1)
    optim = num_params * (12 if param_bytes != 4 else 8) / (n if stage >= 1 else 1)
    if param_bytes == 4:     # fp32: master is the parameter itself, states are m and v
        optim = num_params * 8 / (n if stage >= 1 else 1)
    device = params * (not offload_param) + grads + optim * (not offload_optimizer) + activations
    host = params * offload_param + optim * offload_optimizer
    if offload_optimizer:   # the fp32 gradient shard lives next to the optimizer states
        host += num_params * 4 / (n if stage >= 2 else 1)
    return {"device": device, "host": host, "params": params, "grads": grads, "optim": optim,
            "activations": activations}
