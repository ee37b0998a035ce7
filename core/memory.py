"""Memory readings: this process's host memory, what the host has left, the device's.
(The estimates of ``zeroplug estimate`` and ``tune`` are :mod:`zeroplug.tools.probe`'s.)"""
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
