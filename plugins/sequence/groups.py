"""The groups of ranks that share one sequence.

With ``sequence_parallel_size = P`` on ``W`` ranks, ranks ``[0, P)``, ``[P, 2P)``, ... each
share one sample's sequence: rank ``r`` holds slice ``r % P`` of it (its *sequence rank*)
and reads the samples of data-parallel rank ``r // P``. The ZeRO stage is not told: it shards
the states over all ``W`` ranks, as DeepSpeed does with ``sequence_parallel_size``.

Note: torchrun numbers a host's ranks consecutively, so a group of ``P <= nproc_per_node``
ranks is on one host: the all-to-alls of attention, the only traffic that grows with the
sequence, stay on the host's links.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zeroplug.comm import Comm


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's place: its group of ``degree`` ranks (``comm``), its slice of the sequence
    (``rank``), and the data-parallel rank and size that pick its samples."""
    comm: Comm
    rank: int
    degree: int
    data_parallel_rank: int
    data_parallel_size: int

    @property
    def distributed(self) -> bool:
        return self.degree > 1


# Note: every rank must create every group, in the same order (torch.distributed.new_group is
# collective); engines built one after another in a process share them.
_CACHE: dict = {}        # (default group, world, degree) -> SequenceGroup


def sequence_group(world: Comm, degree: int) -> SequenceGroup:
    """The group of ``degree`` consecutive ranks of ``world`` (the whole run) that this rank is in."""
    n, r = world.world_size, world.rank
    if degree == 1:
        return SequenceGroup(_Single(), 0, 1, r, n)
    key = (dist.group.WORLD, n, degree)
    if key not in _CACHE:
        mine = None
        for g in range(n // degree):
            ranks = list(range(g * degree, (g + 1) * degree))
            group = dist.new_group(ranks)
            if r in ranks:
                mine = Comm(group)
        _CACHE[key] = SequenceGroup(mine, r % degree, degree, r // degree, n // degree)
    return _CACHE[key]


class _Single(Comm):
    """The group of one rank: every collective has nothing to do (Comm's world-size-1 path)."""

    def __init__(self):
        self.group, self.rank, self.world_size, self.backend = None, 0, 1, None
