"""How many threads the CPU optimizer of this rank uses.

The default is the cores this process may run on (its CPU affinity, capped by a cgroup CPU
quota: containers, Slurm, Kubernetes) divided among the ranks of this host, whatever
``OMP_NUM_THREADS`` says. Note: torchrun sets ``OMP_NUM_THREADS=1`` for every rank that
does not set it, which is right for a GPU training loop and three times too slow for an
offloaded optimizer step that is bound by host memory bandwidth; DeepSpeed's launcher
binds cores per rank for the same reason. An explicit count (``[optimizer] threads``)
wins, then the ``ZEROPLUG_CPU_ADAM_THREADS`` environment variable; one above the rank's share
is clamped, with a warning. This is the rule of ``cpu_plan = "off"``; :mod:`.plan` binds
each rank to its own cores and measures the thread count instead.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from zeroplug.launch import local_ranks

from .topology import read_text

THREADS_ENV = "ZEROPLUG_CPU_ADAM_THREADS"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int            # per rank
    cores: int              # cores this process may use (affinity, cgroup quota)
    local_ranks: int        # ranks on this host sharing them
    source: str             # "cores" (the default rule) or the option that set it
    warning: str | None = None

    def describe(self) -> str:
        how = "" if self.source == "cores" else f" ({self.source})"
        ranks = f"{self.local_ranks} local rank" + ("s" if self.local_ranks != 1 else "")
        return f"cpu_adam: {self.threads} threads per rank{how}, {self.cores} cores, {ranks}"


def affinity_cores() -> int:
    """CPUs this process may be scheduled on (its affinity mask), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _v2_quota(text: str | None) -> float | None:
    """cgroup v2 ``cpu.max``: "<quota> <period>" or "max <period>"."""
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota: str | None, period: str | None) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """CPUs the cgroup quota of this process allows (may be fractional), None if unlimited.

    cgroup v2: ``cpu.max`` of the process's group and of each ancestor (the smallest wins);
    v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the cpu controller's group. Inside a
    container the group path in ``/proc/self/cgroup`` may be the host's while the mount shows
    the container's own group at its root, so the root is read too."""
    v2_path, v1_path = None, None
    for line in (read_text(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    limits = []
    if v2_path is not None or os.path.exists(os.path.join(root, "cpu.max")):
        rel = (v2_path or "/").strip("/")
        dirs = [root]
        parts = rel.split("/") if rel else []
        for i in range(len(parts)):
            dirs.append(os.path.join(root, *parts[:i + 1]))
        limits += [q for d in dirs if (q := _v2_quota(read_text(os.path.join(d, "cpu.max")))) is not None]
    rel = (v1_path or "/").strip("/")
    for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        base = os.path.join(root, mount)
        for d in ([os.path.join(base, rel)] if rel else []) + [base]:
            q = _v1_quota(read_text(os.path.join(d, "cpu.cfs_quota_us")), read_text(os.path.join(d, "cpu.cfs_period_us")))
            if q is not None:
                limits.append(q)
                break
    return min(limits) if limits else None


def available_cores(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """Whole cores this process may use: its affinity, capped by the cgroup quota."""
    cores = affinity_cores()
    quota = cgroup_cpu_limit(root, proc_cgroup)
    if quota is not None:
        # a quota of 2.5 CPUs runs 2 threads flat out; a third would be throttled mid-barrier
        cores = min(cores, max(1, math.floor(quota + 1e-9)))
    return cores


def choose_threads(explicit: int = 0, cores: int | None = None, ranks: int | None = None,
                   option: str = "optimizer.threads") -> ThreadChoice:
    """Threads per rank: ``explicit`` (> 0) clamped to the rank's share, else the share."""
    cores = available_cores() if cores is None else max(1, int(cores))
    ranks = local_ranks() if ranks is None else max(1, int(ranks))
    share = max(1, cores // ranks)
    if explicit and explicit > 0:
        if explicit > share:
            warning = (f"{option} = {explicit} is more than the {share} cores available to each rank "
                       f"({cores} cores, {ranks} local ranks): using {share} (more threads than cores stall "
                       f"at every barrier of the kernel)")
            return ThreadChoice(share, cores, ranks, option, warning)
        return ThreadChoice(int(explicit), cores, ranks, option)
    return ThreadChoice(share, cores, ranks, "cores")
