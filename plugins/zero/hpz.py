"""ZeRO++ hpZ (``zero.zero_hpz_partition_size = N``, stage 3): a secondary parameter shard per group.

The optimizer states, the fp32 masters and the gradients stay sharded across every rank, as
in plain stage 3 (the same layout, reductions and checkpoints). In addition each group of N
consecutive ranks (torchrun's ranks of one host, when N is ``--nproc-per-node``) holds the
model-dtype parameters of every gathered unit sharded N ways: rank ``r`` keeps the slice
``r % N`` of N of the unit's gathered buffer (its *secondary shard*), copied out of the first
all-gather of that unit after a step, which runs across every rank (from the masters). Until
the next step changes the masters, a unit is gathered from the secondary shards within the
group: the backward's gathers (and a forward's again, without a step between) never leave the
host. Cost: the secondary shards, 2 bytes per parameter / N per rank, kept between steps.

Units kept whole on every rank (``stage3_param_persistence_threshold``) need no secondary shard.
A secondary shard is stale after every step, after a checkpoint is loaded and after a write with a
modifier rank (``gathered_parameters``); the next gather then goes across every rank again.
"""
from __future__ import annotations

import torch


class SecondaryShard:
    """One unit's slice of its gathered buffer for the ranks of its group."""

    def __init__(self, comm, padded: int, dtype: torch.dtype, device: torch.device):
        n = comm.world_size
        self.comm = comm                      # the group (its ranks gather these slices)
        self.lo = comm.rank * (padded // n)   # padded is a multiple of the world size, so of n
        self.hi = self.lo + padded // n
        self.values = torch.empty(self.hi - self.lo, dtype=dtype, device=device)
        self.fresh = False                    # holds the values of the current step

    def keep(self, full: torch.Tensor) -> None:
        """Take this rank's slice of a unit just gathered across every rank."""
        self.values.copy_(full[self.lo:self.hi])
        self.fresh = True


class SecondaryFirst:
    """A unit's parameter source with an hpZ secondary shard (:mod:`.param_sources`): while
    the secondary is current a gather stays within the group; otherwise ``source`` fills the
    unit across every rank and the secondary keeps its slice."""

    def __init__(self, source):
        self.source = source
        self.whole, self.tiered, self.from_master = source.whole, source.tiered, source.from_master

    def fill(self, u, comm, upload=None):
        sec = u.secondary
        if sec.fresh:
            return sec.comm.all_gather(u.full, sec.values, async_op=True)
        return self.source.fill(u, comm, upload)

    def gathered(self, u) -> None:
        if not u.secondary.fresh:
            u.secondary.keep(u.full)      # later gathers, until the next step: in the group
        self.source.gathered(u)

    def fetch(self, u) -> None:
        self.source.fetch(u)

    def prefetch(self, u) -> bool:
        return self.source.prefetch(u)

    def evict(self, u) -> None:
        self.source.evict(u)


def check_hpz(size: int, options, params_offloaded: bool, optimizer_offloaded: bool) -> None:
    """The combinations hpZ does not take, as one-line errors."""
    from zeroplug.errors import ConfigError
    if size <= 1:
        return
    if options.shard_group_size:
        raise ConfigError("zero.zero_hpz_partition_size and zero.shard_group_size both group the ranks: keep one "
                          "(shard_group_size shards everything within the group; hpZ only a second copy of the "
                          "parameters)", key="zero.zero_hpz_partition_size")
    if params_offloaded or optimizer_offloaded:
        raise ConfigError("zero.zero_hpz_partition_size keeps a second parameter shard on the device and does not "
                          "combine with offloading; use zero.shard_group_size to keep the gathers within hosts",
                          key="zero.zero_hpz_partition_size")
