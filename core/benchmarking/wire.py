"""What a rank puts on the wire: every ``torch.distributed`` collective it starts, with its
process group's ranks and its size, recorded at the dispatcher (each c10d op names its group).

    with Collectives() as rec:
        train_one_step()
    rec.calls        # [Call(op="_allgather_base_", ranks=(0, 1), nbytes=...), ...]
    rec.sent_bytes(crosses=lambda ranks: ...)   # the ring model's bytes sent, of those groups

``nbytes`` is the size of the whole buffer the collective works on (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor). :meth:`Collectives.sent_bytes` turns it into
what each rank sends in a ring over ``n`` ranks: ``(n - 1) / n`` of the buffer for an
all-gather or a reduce-scatter, twice that for an all-reduce (NCCL picks trees or rings; the
ring's figure is the usual bandwidth cost). Used by tests (which groups a mode talks in) and by
tests/benchmarks/memory_floor.py (bytes per step that cross hosts).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Call(NamedTuple):
    op: str                   # the c10d op ("_allgather_base_", "_reduce_scatter_base_", "allreduce_", ...)
    ranks: tuple[int, ...]    # the global ranks of its process group
    nbytes: int               # the whole buffer it works on


def _kind(op: str) -> str:
    for key in ("allgather", "reduce_scatter", "allreduce", "broadcast"):
        if key in op:
            return key
    return op


class Collectives(TorchDispatchMode):
    """Records every c10d collective started while it is active (the calling thread, and the
    autograd engine's, which inherits the mode)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            flat = tree_flatten((args, kwargs))[0]
            groups = [a for a in flat if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())]
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            if groups and tensors:
                op = func.__name__.split(".")[0]
                ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(groups[0])))
                size = max(t.numel() * t.element_size() for t in tensors)
                if _kind(op) == "allreduce":
                    size = sum(t.numel() * t.element_size() for t in tensors)
                self.calls.append(Call(op, ranks, size))
        return func(*args, **kwargs)

    def sent_bytes(self, crosses: Callable[[tuple[int, ...]], bool] = lambda ranks: True) -> int:
        """Bytes this rank sends (ring model) in the collectives whose group ``crosses`` accepts."""
        total = 0.0
        for c in self.calls:
            n = len(c.ranks)
            if n < 2 or not crosses(c.ranks):
                continue
            kind = _kind(c.op)
            share = (n - 1) / n
            total += c.nbytes * (2 * share if kind == "allreduce" else share if kind in ("allgather", "reduce_scatter")
                                 else 1.0)
        return int(total)


def spans_hosts(ranks: tuple[int, ...], ranks_per_host: int) -> bool:
    """Whether a group holds ranks of more than one host (hosts of ``ranks_per_host``
    consecutive ranks, as torchrun numbers them)."""
    return len({r // ranks_per_host for r in ranks}) > 1
