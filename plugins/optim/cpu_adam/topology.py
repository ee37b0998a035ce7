"""The CPUs a rank may use, as data: its affinity set, the host's NUMA nodes and physical
cores, the NUMA node of each local rank's GPU; and the split of the cores among the local
ranks (:func:`split`).

Everything here is a pure function of a :class:`Topology` except :func:`read_topology`,
which reads this machine (``/sys``, ``/proc``), so tests feed synthetic layouts (64 cores
on 2 NUMA nodes, SMT siblings, sets smaller than the ranks).
"""
from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass, field

log = logging.getLogger("zeroplug")

SYS_NODE = "/sys/devices/system/node"
SYS_CPU = "/sys/devices/system/cpu"
SYS_PCI = "/sys/bus/pci/devices"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` (the kernel's cpulist format) -> (0, 1, 2, 3, 8, 10, 11)."""
    out: set[int] = set()
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        lo = int(a)
        hi = int(b.split(":")[0]) if b else lo
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 3, 8) -> ``"0-3,8"``."""
    cpus = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs)


@dataclass(frozen=True)
class Topology:
    """What the plan needs to know about this host and this rank."""
    cpus: tuple[int, ...]                    # this process's affinity set (logical CPUs)
    local_rank: int = 0
    local_ranks: int = 1
    #: NUMA node -> its logical CPUs (all of them; the affinity set picks); empty: one node
    nodes: dict = field(default_factory=dict)
    #: logical CPU -> its physical core (the smallest logical CPU of its SMT siblings)
    core_of: dict = field(default_factory=dict)
    #: per local rank: the NUMA node of its GPU (None: unknown, or no GPU)
    gpu_nodes: tuple = ()
    #: whole CPUs the cgroup quota allows this process (None: no quota)
    quota: int | None = None
    #: True when each local rank already has its own affinity set from outside (a launcher
    #: bound it): the set is this rank's alone and is not split again
    bound_outside: bool = False

    def node_of(self, cpu: int):
        for n, cs in self.nodes.items():
            if cpu in cs:
                return n
        return None

    def physical(self, cpus) -> list[tuple[int, ...]]:
        """``cpus`` grouped by physical core (SMT siblings together), in CPU order."""
        groups: dict[int, list[int]] = {}
        for c in sorted(cpus):
            groups.setdefault(self.core_of.get(c, c), []).append(c)
        return [tuple(v) for _, v in sorted(groups.items(), key=lambda kv: kv[1][0])]

    def describe(self) -> dict:
        """The layout as plain data (the plan cache's key)."""
        return {"cpus": format_cpulist(self.cpus), "local_rank": self.local_rank, "local_ranks": self.local_ranks,
                "nodes": {str(n): format_cpulist(c) for n, c in sorted(self.nodes.items())},
                "physical_cores": len(self.physical(self.cpus)), "gpu_nodes": list(self.gpu_nodes),
                "quota": self.quota, "bound_outside": self.bound_outside}


@dataclass(frozen=True)
class Split:
    """This rank's CPUs, and why (a warning when the split had to fall back)."""
    cpus: tuple[int, ...]           # the logical CPUs this rank binds to (empty: do not bind)
    cores: int                      # physical cores in it (after the cgroup quota's share)
    node: object = None             # the NUMA node it lies on (None: several or unknown)
    warning: str | None = None


def split(topo: Topology) -> Split:
    """This rank's share of the affinity set: disjoint sets of whole physical cores, one per
    local rank, each on the NUMA node of its rank's GPU where the cores allow.

    Ranks are ordered by their GPU's node (then by local rank) and the cores by node (then by
    number), and consecutive runs of cores go to consecutive ranks: a rank lands on its GPU's
    node unless that node has fewer cores than its ranks' shares. A set with fewer physical
    cores than local ranks is not split (each rank then gets one optimizer thread)."""
    n = max(1, topo.local_ranks)
    phys = topo.physical(topo.cpus)
    quota_share = None if topo.quota is None else max(1, topo.quota // (1 if topo.bound_outside else n))
    if topo.bound_outside or n == 1:
        cores = len(phys) if quota_share is None else min(len(phys), quota_share)
        nodes = {topo.node_of(c) for c in topo.cpus}
        return Split(tuple(topo.cpus), max(1, cores), nodes.pop() if len(nodes) == 1 else None)
    if len(phys) < n:
        return Split((), 1, None, (
            f"the affinity set of this process ({format_cpulist(topo.cpus)}: {len(phys)} physical cores) "
            f"is smaller than its {n} local ranks: not binding, 1 optimizer thread per rank"))
    known = {}
    for r in range(n):
        g = topo.gpu_nodes[r] if r < len(topo.gpu_nodes) else None
        known[r] = g
    node_rank = {nd: i for i, nd in enumerate(sorted(topo.nodes))}

    def node_key(nd):
        return (nd is None, node_rank.get(nd, len(node_rank)))

    ranks = sorted(range(n), key=lambda r: (node_key(known[r]), r))
    cores = sorted(phys, key=lambda core: (node_key(topo.node_of(core[0])), core[0]))
    base, extra = divmod(len(cores), n)
    at = 0
    mine: list[tuple[int, ...]] = []
    for i, r in enumerate(ranks):
        take = base + (1 if i < extra else 0)
        if r == topo.local_rank:
            mine = cores[at:at + take]
        at += take
    cpus = tuple(sorted(c for core in mine for c in core))
    nodes = {topo.node_of(c) for c in cpus}
    count = len(mine) if quota_share is None else min(len(mine), quota_share)
    return Split(cpus, max(1, count), nodes.pop() if len(nodes) == 1 else None)


# -- reading this machine ---------------------------------------------------------------
def read_text(path: str) -> str | None:
    """A small text file's stripped contents (None: unreadable)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_nodes(root: str = SYS_NODE) -> dict:
    """NUMA node -> its logical CPUs (empty when the kernel shows none)."""
    out = {}
    for path in glob.glob(os.path.join(root, "node[0-9]*")):
        m = re.search(r"node(\d+)$", path)
        text = read_text(os.path.join(path, "cpulist"))
        if m and text:
            try:
                out[int(m.group(1))] = frozenset(parse_cpulist(text))
            except ValueError:
                continue
    return out


def read_core_of(cpus, root: str = SYS_CPU) -> dict:
    """logical CPU -> its physical core (smallest sibling), from ``thread_siblings_list``."""
    out = {}
    for c in cpus:
        text = read_text(os.path.join(root, f"cpu{c}", "topology", "thread_siblings_list"))
        try:
            sib = parse_cpulist(text) if text else ()
        except ValueError:
            sib = ()
        out[c] = min(sib) if sib else c
    return out


def gpu_numa_node(device, root: str = SYS_PCI):
    """The NUMA node of a CUDA device's PCI slot (None: unknown, or the kernel says -1)."""
    try:
        import torch
        props = torch.cuda.get_device_properties(device)
        bus_id = "%04x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except Exception as exc:    # noqa: BLE001 - no CUDA, or a torch without the PCI fields
        log.debug("cpu plan: no PCI address for device %s: %r", device, exc)
        return None
    text = read_text(os.path.join(root, bus_id, "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def local_rank(env=None) -> int:
    """This process's rank on its host: torchrun's / the launchers' LOCAL_RANK (0 when not set)."""
    env = os.environ if env is None else env
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        try:
            r = int(str(env.get(key, "")))
        except ValueError:
            continue
        if r >= 0:
            return r
    return 0


def affinity() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def cpu_model() -> str:
    text = read_text("/proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    import platform
    return platform.processor() or platform.machine()
