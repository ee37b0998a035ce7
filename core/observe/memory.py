"""Memory readings: this process's host memory, what the host has left, the device's.
(The estimates of ``zeroplug estimate`` and ``tune`` are :mod:`zeroplug.tools.probe`'s.)"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit of this process's cgroup and its ancestors."""
    version: int            # 1 or 2
    path: str               # the directory whose limit binds
    limit: int
    used: int               # charged to it, less the page cache it can drop (inactive_file)

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)


_UNLIMITED = 1 << 60        # cgroup v1 writes "no limit" as a number near 2**63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> CgroupMemory | None:
    """The memory limit that binds this process (cgroup v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``, its own cgroup's or an ancestor's, the tightest room left),
    or None where no limit is set or cgroups are not readable."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":
            version, base, files = 2, Path(root), ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):
            version, base = 1, Path(root) / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")
        else:
            continue
        d = base / rel.lstrip("/")
        if not d.is_dir():          # a container that mounts its own cgroup at the root
            d = base
        while True:
            limit = _read_int(d / files[0])
            if limit is not None and limit < _UNLIMITED:
                used = (_read_int(d / files[1]) or 0) - _inactive_file(d / files[2], files[3])
                found = CgroupMemory(version, str(d), limit, max(0, used))
                if best is None or found.room < best.room:
                    best = found
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def host_available_bytes() -> int:
    """What this process can still allocate: MemAvailable (/proc/meminfo), or less where a
    cgroup memory limit (v1 or v2) leaves less room."""
    avail = _meminfo_available()
    cg = cgroup_memory()
    return avail if cg is None else min(avail, cg.room)


def host_memory_source() -> str:
    """What :func:`host_available_bytes` reads, for messages: ``MemAvailable`` or the cgroup."""
    cg = cgroup_memory()
    if cg is None or cg.room >= _meminfo_available():
        return "MemAvailable (/proc/meminfo)"
    return (f"the cgroup v{cg.version} memory limit {cg.limit / GB:.2f} GiB at {cg.path}, "
            f"{cg.used / GB:.2f} GiB of it in use")


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
