"""Host memory as a budget, checked in ``initialize`` before anything big is allocated.

The stage says how many elements of this rank's shard each offload tier will hold
(``Partitioner.tier_elements``); each tier says what they cost in host memory, pinned and
pageable (``OffloadTier.host_bytes``, which asks the optimizer for its state bytes per
element). Every rank's needs are exchanged, summed per host over the ranks that share
it, and compared with what that host can still give: ``MemAvailable`` or, tighter, the
room a cgroup memory limit (v1 or v2) leaves (:func:`zeroplug.observe.memory.host_available_bytes`),
plus the model's own host memory that the stage moves to the training device, and at most
``ZEROPLUG_HOST_MEMORY_LIMIT`` (bytes, or "48GiB"; the share of a shared host that this
run may plan for). A run that cannot fit is refused with the numbers and the fixes,
instead of being killed by the kernel's OOM killer part-way (exit code 247 / 137).

Activations on the host (``[activation_checkpointing] plugin = "cpu"``) depend on the batch,
so they are counted as they come: :func:`host_room` (at the end of ``initialize``, once the tiers
hold their memory) gives each rank its share of what its host has left after the states'
budget, and the store refuses a copy that would pass it (HostMemoryError, with the numbers),
instead of the kernel killing the run.

Not counted: the tiers' transient buffers that depend on the layout (swap buffers sized
by sub-group, the speculative step's copies) and an asynchronous checkpoint's copy (it is
checked at each save, which falls back to a synchronous one).
"""
from __future__ import annotations

import os
import socket

import torch

from .errors import HostMemoryError
from .observe.memory import host_available_bytes, host_memory_source

LIMIT_ENV = "ZEROPLUG_HOST_MEMORY_LIMIT"


def _limit() -> int | None:
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return None
    from .checkpoint.writers import parse_size
    try:
        return parse_size(text)
    except ValueError:
        raise HostMemoryError(f"{LIMIT_ENV}={text!r} is not a size: write bytes or e.g. 48GiB") from None


def _moved_to_device(module: torch.nn.Module, device: torch.device) -> int:
    """Host bytes of ``module``'s parameters that the stage moves to a CUDA device (they
    leave host memory before the tiers allocate)."""
    if device.type == "cpu":
        return 0
    seen, total = set(), 0
    for p in module.parameters():
        if p.device.type == "cpu" and p.is_floating_point():
            s = p.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _gib(n: float) -> str:
    from .checkpoint.directory import fmt_bytes
    return fmt_bytes(n)


def _exact(n: int) -> str:
    return f"{_gib(n)} = {n:,} bytes" if n >= 1024 else _gib(n)


def check_host_budget(run, module: torch.nn.Module, needs: list[tuple[str, object]]) -> None:
    """Refuse, on every rank, a run whose tiers' host memory (``needs``: ``(slot path,
    HostBytes)`` of this rank) does not fit a host. Every rank must call it (collective
    when several ranks run)."""
    if not needs:
        return
    mine = {
        "host": socket.gethostname(),
        "pinned": sum(h.pinned for _, h in needs),
        "pageable": sum(h.pageable for _, h in needs),
        "free": host_available_bytes(),
        "moved": _moved_to_device(module, run.device),
        "source": host_memory_source(),
    }
    everyone = run.comm.all_gather_object(mine) if run.comm.distributed else [mine]
    here = [e for e in everyone if e["host"] == mine["host"]]
    ranks = len(here)
    pinned = sum(e["pinned"] for e in here)
    pageable = sum(e["pageable"] for e in here)
    total = pinned + pageable
    free = min(e["free"] for e in here)
    source = next(e["source"] for e in here if e["free"] == free)
    moved = sum(e["moved"] for e in here)
    available = free + moved
    if moved:
        source += f", and {_gib(moved)} of the model's parameters that leave it for the GPU"
    limit = _limit()
    if limit is not None and limit < available:
        available, source = limit, f"{LIMIT_ENV}"
    run.host_planned = total
    if total <= available:
        return
    parts = "; ".join(f"{path}: {_gib(h.total)} {'pinned' if h.pinned else 'pageable'}, {h.what}"
                      for path, h in needs if h.total)
    per_rank = mine["pinned"] + mine["pageable"]
    together = (f", x {ranks} ranks on this host = {_exact(total)} ({_gib(pinned)} pinned, {_gib(pageable)} "
                f"pageable)" if ranks > 1 else "")
    fixes = ["offload to NVMe instead (offload.optimizer.plugin = \"nvme\", and offload.param for stage 3)"]
    if ranks > 1:
        fixes.append("run fewer ranks on this host (torchrun --nproc-per-node)")
    fixes.append("keep smaller optimizer states (fewer bytes per element in the optimizer's states)")
    if run.world_size == 1 or ranks == len(everyone):
        fixes.append("use more hosts (each rank holds 1 / world size of the states)")
    raise HostMemoryError(
        f"host memory: the offload tiers need {_exact(per_rank)} per rank ({parts}){together}, but this host "
        f"has {_exact(available)} ({source}): the kernel would kill the run part-way. Fix: "
        + "; or ".join(fixes) + ".")


def host_room(run) -> tuple[int, str]:
    """(bytes, where the number comes from): what this rank may still take from its host for
    memory that grows with the batch (activations), its share of the host's ranks: what the host
    has available now (the tiers' buffers are allocated by then), or, under
    ``ZEROPLUG_HOST_MEMORY_LIMIT``, that limit less the tiers' planned bytes. Every rank must call
    it (collective when several ranks run)."""
    mine = {"host": socket.gethostname(), "free": host_available_bytes(), "source": host_memory_source()}
    everyone = run.comm.all_gather_object(mine) if run.comm.distributed else [mine]
    here = [e for e in everyone if e["host"] == mine["host"]]
    free = min(e["free"] for e in here)
    source = next(e["source"] for e in here if e["free"] == free)
    limit = _limit()
    if limit is not None and limit - run.host_planned < free:
        free, source = max(0, limit - run.host_planned), f"{LIMIT_ENV} less the offload tiers' {_gib(run.host_planned)}"
    ranks = len(here)
    return free // ranks, (source + (f", shared by {ranks} ranks on this host" if ranks > 1 else ""))
