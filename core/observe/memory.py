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


MEMORY_CATEGORIES = ("lp_params", "master", "gradients", "optimizer", "buckets", "prefetch")


def memory_report(engine) -> dict:
    """Bytes held now, per category, on the training device and on the host: the distinct
    storages behind the partitioner's tensors (``partitioner.memory_tensors()``) and the
    optimizer's state, as allocated; a storage is counted once, in the first category that
    holds it. On CUDA, ``rest`` is what the allocator holds beyond them (activations,
    workspaces, caches of the model's own)."""
    part = engine.partitioner
    cats = dict(part.memory_tensors()) if hasattr(part, "memory_tensors") else {}
    cats["optimizer"] = [v for st in engine.optimizer.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.dim() > 0]
    dev = engine.run.device
    device, host, seen = {}, {}, set()
    for name in MEMORY_CATEGORIES:
        for t in cats.get(name, []):
            if t is None:
                continue
            s = t.untyped_storage()
            key = (s.data_ptr(), str(s.device))
            if s.size() == 0 or key in seen:
                continue
            seen.add(key)
            on_device = s.device.type == dev.type and (dev.index is None or s.device.index == dev.index)
            where = device if on_device else host
            where[name] = where.get(name, 0) + s.size()
    out = {"device": {k: device.get(k, 0) for k in MEMORY_CATEGORIES}, "host": host}
    if engine.run.device.type == "cuda":
        total = torch.cuda.memory_allocated(engine.run.device)
        out["device"]["rest"] = max(0, total - sum(device.values()))
    return out


def format_memory_report(report: dict, params: int) -> str:
    """One line: GiB per category on the device (and bytes per trainable parameter), then the host."""
    dev = report["device"]
    total = sum(dev.values())
    unit, div = ("GiB", GB) if total >= GB else ("MiB", 2**20)
    parts = [f"{k} {v / div:.2f}" for k, v in dev.items() if v]
    line = (f"[zeroplug] memory after the first step ({unit}, device): {' | '.join(parts) or '0'} | "
            f"total {total / div:.2f} ({total / max(1, params):.1f} bytes per trainable parameter)")
    if report["host"]:
        line += "; host: " + " | ".join(f"{k} {v / div:.2f}" for k, v in report["host"].items())
    return line


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
