"""The CPU plan of a rank: which cores it binds to, how many threads its optimizer runs.

``[optimizer] cpu_plan`` (cpu_adam):

``measure`` (the default on a GPU run)
    The local ranks split their affinity set into disjoint sets of whole physical cores
    (:func:`.topology.split`: each on the NUMA node of its GPU where the cores allow);
    each rank binds every thread of its process to its set, leaves cores for the worker
    threads its offload tiers declare (:func:`tier_workers`: copy threads) and for
    the training loop, and runs its optimizer with the thread count that stepped fastest
    when measured (:func:`calibrate`). The measurement runs on the first run on a machine,
    all local ranks at once, and is cached (:mod:`.plan_cache`); later runs read it.
``bind``
    The same split and binding, no measurement: the optimizer takes every core of the set
    not left to the workers and the loop.
``off`` (the default on a CPU-only run)
    No binding: the cores this process may use divided among the local ranks
    (:func:`.cores.choose_threads`).

``[optimizer] threads`` and ``ZEROPLUG_CPU_ADAM_THREADS`` still set the thread count (the
binding stays). Each rank prints one line, whatever the log level:
``cpu plan: rank 0 cores 0-15, 12 optimizer threads, 2 copy threads, measured <rate> G params/s``.

Note: binding happens first in ``initialize``, before the offload tiers allocate and pin
their host buffers: Linux places a page on the NUMA node of the CPU that first touches it,
so the masters, gradients and moments of a rank land on its own node, beside the cores
that step them and the GPU that copies them.

Note: an Adam step is bound by host memory bandwidth, which every rank of the host
shares; the thread count past which it stops scaling depends on the machine and on how
many ranks step at once. That is why the local ranks measure together (between barriers)
and why the result is cached per machine, torch version and rank layout.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from zeroplug.launch import local_ranks

from . import plan_cache
from . import topology as topo_mod
from .cores import THREADS_ENV, cgroup_cpu_limit, choose_threads
from .kernels import compiler_missing
from .optimizer import CPUAdam
from .topology import Topology, format_cpulist, split

log = logging.getLogger("zeroplug")

#: the thread counts measured, as fractions of the most the set allows (the same number of
#: slots on every rank, so that every rank meets the same barriers)
FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25)
#: a count within this fraction of the best is as good; the smallest such count wins
#: (fewer threads leave more cores to the loop and to the other ranks)
TIE = 0.03
#: timed repetitions per count (their median counts)
REPS = 5
#: bytes per element of the measured step: fp32 master, m, v; bf16 gradient and copy
BYTES_PER_ELEMENT = 16


@dataclass
class Plan:
    rank: int
    cpus: tuple[int, ...]              # bound to (empty: not bound)
    threads: int                       # the optimizer's threads
    workers: dict = field(default_factory=dict)    # worker threads left a core each, by kind
    source: str = "measured"           # measured | cached | bind | off | the option that set threads
    rate: float | None = None          # elements per second at ``threads``
    warnings: list = field(default_factory=list)

    @staticmethod
    def own(warning: str) -> bool:
        """Whether a warning is this rank's alone (its own cache file), not the host's."""
        return "the cache file" in warning

    def describe(self) -> str:
        where = f"cores {format_cpulist(self.cpus)}" if self.cpus else "not bound"
        parts = [f"cpu plan: rank {self.rank} {where}", _count(self.threads, "optimizer")]
        parts += [_count(n, kind) for kind, n in self.workers.items() if n]
        if self.source in ("measured", "cached"):
            g = (self.rate or 0) / 1e9
            parts.append(f"{self.source} {g:.1f} G params/s" if g >= 1 else f"{self.source} {g:.2f} G params/s")
        elif self.source == "off":
            parts.append("cpu_plan = off (the cores divided among the local ranks)")
        elif self.source == "bind":
            parts.append("not measured")
        else:
            parts.append(f"threads from {self.source}")
        return ", ".join(parts)


def _count(n: int, kind: str) -> str:
    return f"{n} {kind} thread" + ("s" if n != 1 else "")


def say(line: str) -> None:
    """One line at the default log level: through the zeroplug logger where someone set it up
    to show INFO, else on stderr (an unconfigured logger shows warnings only)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("[zeroplug] %s", line)
    else:
        print(f"[zeroplug] {line}", file=sys.stderr, flush=True)


# -- binding ------------------------------------------------------------------------------
#: the affinity this process had before the first binding (a second engine in the same
#: process plans from it, not from the set the first one bound to)
_ORIGINAL: tuple[int, ...] | None = None


def original_affinity() -> tuple[int, ...]:
    return _ORIGINAL if _ORIGINAL is not None else topo_mod.affinity()


def bind(cpus) -> str | None:
    """Bind every thread of this process to ``cpus``; threads started later inherit it.
    Returns why it failed, or None."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = topo_mod.affinity()
    cpus = set(cpus)
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    # Note: sched_setaffinity binds one thread; threads that exist already (torch's intra-op
    # pool, the kernel warm-up, CUDA's and the process group's helpers) are bound one by one.
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):
            pass        # a thread that ended meanwhile
    return None


# -- the topology of this run -------------------------------------------------------------
def gather_topology(run) -> Topology:
    """This rank's topology; with a process group, the other local ranks' GPU nodes and
    affinity sets too (a launcher that bound each rank to its own set already is honoured)."""
    cpus = original_affinity()
    lr, n = topo_mod.local_rank(), local_ranks()
    device = run.device
    my_node = topo_mod.gpu_numa_node(device) if device.type == "cuda" else None
    quota = cgroup_cpu_limit()
    quota = None if quota is None else max(1, math.floor(quota + 1e-9))
    gpu_nodes: list = [None] * n
    bound_outside = False
    if run.comm.distributed:
        host = socket.gethostname()
        infos = run.comm.all_gather_object((host, lr, cpus, my_node))
        mine = [i for i in infos if i[0] == host]
        for _, r, _, node in mine:
            if 0 <= r < n:
                gpu_nodes[r] = node
        bound_outside = len({i[2] for i in mine}) > 1
    elif 0 <= lr < n:
        gpu_nodes[lr] = my_node
    return Topology(cpus=cpus, local_rank=lr, local_ranks=n, nodes=topo_mod.read_nodes(),
                    core_of=topo_mod.read_core_of(cpus), gpu_nodes=tuple(gpu_nodes), quota=quota,
                    bound_outside=bound_outside)


def tier_workers(run) -> dict:
    """Worker threads the offload tiers run beside the optimizer's step that want a core each,
    summed by kind: a tier may declare ``cpu_workers(options, run, kind)`` (a classmethod,
    e.g. ``{"copy": 2}``; threads that mostly wait for the disk or the device are not counted)."""
    out: dict = {}
    for path, kind in (("offload.optimizer", "optimizer"), ("offload.param", "param")):
        try:
            choice = run.config.slot(path)
        except (KeyError, AttributeError):
            continue
        for name, n in (choice.impl.cpu_workers(choice.options, run, kind) or {}).items():
            out[name] = out.get(name, 0) + int(n)
    return out


def budget(cores: int, workers: dict, loop: int) -> int:
    """The most optimizer threads a set of ``cores`` physical cores runs, after the workers
    and the loop have theirs (at least one)."""
    return max(1, cores - sum(workers.values()) - loop)


def candidates(most: int) -> list[int]:
    """The thread counts to measure: one per :data:`FRACTIONS` slot (repeats kept)."""
    return [max(1, round(most * f)) for f in FRACTIONS]


def pick(rates: dict, order=None) -> int:
    """The smallest thread count within :data:`TIE` of the best rate; with ``order`` the keys
    are slots and ``order[slot]`` their thread counts (the slot with the fewest threads wins)."""
    best = max(rates.values())
    near = [k for k, r in rates.items() if r >= best * (1 - TIE)]
    return min(near, key=(lambda k: (order[k], k)) if order is not None else None)


def default_elements() -> int:
    """Elements of the measured step: four times the last-level cache (at least 4M, at most
    64M): a step that fits in cache would measure the cache, not host memory."""
    llc = 0
    root = os.path.join(topo_mod.SYS_CPU, "cpu0", "cache")
    for name in (os.listdir(root) if os.path.isdir(root) else []):
        size = topo_mod.read_text(os.path.join(root, name, "size"))
        try:
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1].upper(), 1)
            llc = max(llc, int(size.rstrip("KMGkmg")) * mult)
        except (TypeError, ValueError, IndexError):
            continue
    return int(min(1 << 26, max(1 << 22, 4 * llc // BYTES_PER_ELEMENT)))


def calibrate(counts, barrier, grad_dtype=torch.bfloat16, lp_dtype=torch.bfloat16,
              elements: int | None = None, single_pass: bool = False) -> tuple[dict, str | None]:
    """Elements per second of cpu_adam's step at each thread count in ``counts``, and the
    error that stopped it (None). ``barrier`` runs before each count on every rank, whatever
    happens here, so that the local ranks measure each count together.

    ``single_pass``: measure ATen's fused Adam over the whole fp32 tensor (fp32 gradient, no
    model-dtype copy), a proxy for the compiled kernel; else the eager path with the run's
    dtypes (the chunked walk that converts the gradient and writes the copy).

    Note: the compiled kernel itself is not measured: its thread count is fixed when it is
    built, so measuring it at five counts would build five kernels (a minute each on a first
    run). The single-pass fused kernel moves the same bytes per element in one pass (it
    measured equal to the compiled kernel), so it stops scaling at the same thread count;
    the chunked eager walk does more work per element and would keep scaling longer.
    A run without a compiler steps with that eager walk, so that is what it measures."""
    if single_pass:
        grad_dtype, lp_dtype = torch.float32, None
    n = int(elements or default_elements())
    rates: dict = {}
    error = None
    before = torch.get_num_threads()
    opt = p = g = lp = None
    try:
        p = torch.zeros(n, dtype=torch.float32)
        g = torch.full((n,), 1e-3, dtype=grad_dtype)   # passed beside p: torch refuses a bf16 p.grad
        lp = torch.empty(n, dtype=lp_dtype) if lp_dtype is not None else None
        opt = CPUAdam([p], lr=1e-3, impl="eager")
    except Exception as e:      # memory, most likely
        error = f"{type(e).__name__}: {e}"
    for t in counts:
        barrier()
        if error is not None:
            continue
        try:
            torch.set_num_threads(t)
            opt.step_param(p, g, lp_out=lp)        # first touch, thread start
            times = []
            for _ in range(REPS):
                t0 = time.perf_counter()
                opt.step_param(p, g, lp_out=lp)
                times.append(time.perf_counter() - t0)
            rate = n / max(statistics.median(times), 1e-9)
            rates[t] = max(rates.get(t, 0.0), rate)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    torch.set_num_threads(before)
    del opt, p, g, lp
    return rates, error


def compiled_kernel_expected() -> bool:
    """Whether the steps will run a single-pass kernel: cpu_adam's compiled one, or its native
    one where ``ZEROPLUG_CPU_ADAM_IMPL=native`` asks (a compiler is there and the variable does
    not ask for the eager path)."""
    try:
        if CPUAdam([torch.zeros(1)]).impl == "eager":
            return False
        return compiler_missing() is None
    except Exception as exc:    # noqa: BLE001 - a broken toolchain: the eager path is what runs
        log.debug("cpu plan: the compiled cpu_adam kernel is not available: %r", exc)
        return False


# -- the plan ------------------------------------------------------------------------------
def requested_threads(explicit: int) -> tuple[int, str, str | None]:
    """(threads or 0, the option that set them, a warning): ``[optimizer] threads`` first,
    then ``ZEROPLUG_CPU_ADAM_THREADS``."""
    if explicit and explicit > 0:
        return int(explicit), "optimizer.threads", None
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return 0, "", None
    try:
        n = int(value)
        if n < 0:
            raise ValueError
        return n, THREADS_ENV, None
    except ValueError:
        return 0, "", f"{THREADS_ENV}={value!r} is not a thread count: ignored"


@dataclass
class Binding:
    """What ``begin`` decided (the split, bound or not); ``finish`` adds the thread count."""
    topology: Topology
    cpus: tuple[int, ...]
    cores: int
    warnings: list = field(default_factory=list)


def start(run, mode: str) -> Binding | None:
    """Split and bind (modes measure / bind), first thing in ``initialize``. None: off."""
    if mode == "off":
        return None
    topo = gather_topology(run)
    s = split(topo)
    warnings = [s.warning] if s.warning else []
    if s.cpus and set(s.cpus) != set(topo_mod.affinity()):
        why = bind(s.cpus)
        if why is not None:
            warnings.append(f"binding to cores {format_cpulist(s.cpus)} failed ({why}): not binding")
            return Binding(topo, (), s.cores, warnings)
    return Binding(topo, s.cpus, s.cores, warnings)


def finish(run, mode: str, binding: Binding | None, explicit: int, workers: dict,
           grad_dtype=torch.bfloat16, lp_dtype=torch.bfloat16, cache=None) -> Plan:
    """This rank's thread count (measured, cached, or set), given to torch."""
    cache = plan_cache if cache is None else cache
    asked, option, bad = requested_threads(explicit)
    warnings = [bad] if bad else []
    if binding is None:
        choice = choose_threads(asked, option=option or "optimizer.threads")
        if choice.warning:
            warnings.append(choice.warning)
        plan = Plan(run.rank, (), choice.threads, {}, option or "off", None, warnings)
        return _apply(plan)
    warnings += binding.warnings
    loop = 1 if run.device.type == "cuda" else 0
    most = budget(binding.cores, workers, loop)     # a set smaller than the ranks: 1 core
    if asked:
        threads = asked
        limit = max(1, len(binding.cpus) or most)
        if asked > limit:
            warnings.append(f"{option} = {asked} is more than the {limit} CPUs of this rank's set "
                            f"({format_cpulist(binding.cpus) or 'not bound'}): using {limit}")
            threads = limit
        return _apply(Plan(run.rank, binding.cpus, threads, workers, option, None, warnings))
    if mode == "bind":
        return _apply(Plan(run.rank, binding.cpus, most, workers, "bind", None, warnings))
    # Note: from here on every rank makes the same collective calls (one all-reduce, one
    # barrier per measured count), whether it measures or not: a rank left unbound (its
    # binding failed) or holding a cached plan still meets the others at each of them.
    key = found = None
    single_pass = compiled_kernel_expected()
    if binding.cpus:
        key = cache.key(binding.topology, binding.cpus, most, grad_dtype, lp_dtype)
        key["kernel"] = "single-pass" if single_pass else "eager"
        found, why = cache.load(key)
        if why:
            warnings.append(why)
    need = 1.0 if binding.cpus and found is None else 0.0
    if run.comm.distributed:
        import torch.distributed as dist
        need = run.comm.all_reduce_scalar(need, op=dist.ReduceOp.MAX)
    if not need:
        if found is None:
            return _apply(Plan(run.rank, binding.cpus, most, workers, "bind", None, warnings))
        return _apply(Plan(run.rank, binding.cpus, found["threads"], workers, "cached", found.get("rate"), warnings))
    counts = candidates(most)
    if binding.cpus:
        rates, error = calibrate(counts, run.comm.barrier, grad_dtype, lp_dtype, single_pass=single_pass)
    else:
        for _ in FRACTIONS:
            run.comm.barrier()
        rates, error = {}, None
    # Note: a synchronous step waits for its slowest rank, so the ranks agree on one slot of
    # FRACTIONS: the one whose slowest rank is fastest (a rank without a measurement has no say).
    slots = [rates.get(t, 0.0) if rates and not error else math.inf for t in counts]
    if run.comm.distributed:
        import torch.distributed as dist
        slots = [run.comm.all_reduce_scalar(r, op=dist.ReduceOp.MIN) for r in slots]
    if not binding.cpus:
        return _apply(Plan(run.rank, binding.cpus, most, workers, "bind", None, warnings))
    if error or not rates:
        warnings.append(f"cpu plan: the thread count could not be measured ({error or 'no result'}): "
                        f"using {most} threads (the set's cores less the workers')")
        return _apply(Plan(run.rank, binding.cpus, most, workers, "bind", None, warnings))
    slot = pick(dict(enumerate(slots)), order=counts)
    threads = counts[slot]
    why = cache.store(key, {"threads": threads, "rate": rates[threads],
                            "rates": {str(t): r for t, r in sorted(rates.items())}})
    if why:
        warnings.append(why)
    return _apply(Plan(run.rank, binding.cpus, threads, workers, "measured", rates[threads], warnings))


def _apply(plan: Plan) -> Plan:
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    return plan
