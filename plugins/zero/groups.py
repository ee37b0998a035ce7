"""Hierarchical sharding (``zero.shard_group_size``): shard within groups, replicate across.

With ``shard_group_size = N`` on ``W`` ranks, the ranks form ``W / N`` shard groups of ``N``
consecutive ranks (``[0, N)``, ``[N, 2N)``, ...). Each group holds one copy of the sharded
states (stage 1: optimizer states; 2: and gradients; 3: and parameters) split ``N`` ways,
and every group holds the same copy: FSDP2's HSDP (a 2-D mesh, replicate x shard), and
DeepSpeed's MiCS. Rank ``r`` is rank ``r % N`` of its shard group and rank ``r // N`` of
its replica group (the ranks ``{r % N, r % N + N, ...}`` holding the same shard).

Collectives:

* parameter all-gathers (stage 3 on use; stages 1-2 after the step): within the shard group;
* gradients: reduce-scattered within the shard group, then all-reduced across the replica
  group (each rank sends its shard, ``1 / N`` of the gradients, across groups);
* the gradient norm: summed within the shard group (the replicas hold the same shards).

Note: torchrun numbers the ranks of one host consecutively (``node_rank x nproc_per_node +
local_rank``), so groups of ``nproc_per_node`` ranks are the hosts: the all-gathers of every
layer stay on the host's links and only one reduction per gradient crosses hosts.
Consecutive groups also make shard group 0 the ranks ``[0, N)``, whose rank in the group
equals their global rank: checkpointing.py lets exactly those write the sharded states.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist

from zeroplug.comm import Comm
from zeroplug.errors import ConfigError


class ShardMesh(NamedTuple):
    shard: Comm                  # the ranks sharing one copy of the states
    replicate: Comm | None       # the ranks holding this rank's shard, one per group (None: one group)

    @property
    def size(self) -> int:
        return self.shard.world_size

    @property
    def replicas(self) -> int:
        return 1 if self.replicate is None else self.replicate.world_size


# Note: every rank must create every group, in the same order (torch.distributed.new_group
# is collective); engines built one after another in a process share them.
_CACHE: list = []       # [(default process group, world, size, ShardMesh)]
_STREAMS: dict = {}     # device -> the side stream that orders a cross-group reduction


def shard_mesh(comm: Comm, size: int, key: str = "zero.shard_group_size") -> ShardMesh:
    """The shard and replica groups of ``comm`` (the world) for groups of ``size`` ranks
    (0, or at least the world size: one group of every rank); ``key``: the option that asked."""
    world = comm.world_size
    if size == 0 or size >= world:
        return ShardMesh(comm, None)
    if world % size:
        off = "0 for one group of every rank" if key == "zero.shard_group_size" else "1 (off)"
        raise ConfigError(f"{key} = {size} does not divide the {world} ranks into groups; use a "
                          f"divisor of {world} (the ranks of one host, usually torchrun's --nproc-per-node), "
                          f"or {off}", key=key)
    default = dist.group.WORLD
    for pg, w, s, mesh in _CACHE:
        if pg is default and (w, s) == (world, size):
            return mesh
    rank = comm.rank
    shard = replicate = None
    for g in range(world // size):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            shard = Comm(group)
    for j in range(size):
        ranks = list(range(j, world, size))
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate = Comm(group)
    mesh = ShardMesh(shard, replicate)
    _CACHE.append((default, world, size, mesh))
    return mesh


def reduce_gradients(mesh: ShardMesh, out: torch.Tensor, buf: torch.Tensor):
    """``buf``'s sum over every rank, this rank's shard of it into ``out``: reduce-scatter
    within the shard group, then all-reduce across the replicas; returns a handle to wait on.

    Note: on CUDA the all-reduce is launched from a side stream that waits for the
    reduce-scatter, so the compute stream never waits for the first hop (NCCL orders each
    collective after the stream it is launched from); the handle's wait orders the caller's
    stream after both. gloo's wait blocks the host until the reduce-scatter is done."""
    handle = mesh.shard.reduce_scatter(out, buf, async_op=True)
    if mesh.replicate is None:
        return handle
    side = None
    if out.is_cuda:
        side = _STREAMS.get(out.device)
        if side is None:
            side = _STREAMS[out.device] = torch.cuda.Stream(out.device)
        side.wait_stream(torch.cuda.current_stream(out.device))
    with torch.cuda.stream(side) if side is not None else nullcontext():
        handle.wait()
        return TwoHops(mesh.replicate.all_reduce(out, async_op=True), buf)


class TwoHops:
    """The cross-group all-reduce's handle, holding the reduce-scatter's input until it is
    waited on.

    Note: NCCL's work object lets go of its tensors when waited on, and the first hop is
    waited on from the side stream; were ``buf`` freed then, the caching allocator could
    hand its memory to the compute stream while the reduce-scatter still reads it. Held
    here, it is freed only after the caller's stream has waited for both hops."""

    def __init__(self, work, keep: torch.Tensor):
        self.work, self.keep = work, keep

    def wait(self) -> None:
        self.work.wait()
        self.keep = None
