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


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(allocated, max allocated) bytes on a CUDA device; (None, None) elsewhere (a CPU run
    has no device memory apart from the host's, which the RSS reading covers)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return None, None


def allocation_failure(exc: BaseException) -> str | None:
    """torch's one line that says how much host memory a failed allocation asked for (from
    its multi-line ``RuntimeError``), else None when ``exc`` is not such a failure."""
    text = str(exc)
    at = text.find("DefaultCPUAllocator")
    if at < 0:
        return None
    return text[at:].strip().splitlines()[0][:200]


def memory_available() -> str:
    """``; this host has N GiB available`` (MemAvailable), or "" where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return f"; this host has {int(ln.split()[1]) / 2**20:.1f} GiB available"
    except (OSError, ValueError, IndexError):
        pass
    return ""
