"""Where each parameter's elements sit in the optimizer's tensors: what an optimizer that
needs whole tensors (Muon's matrices, Lamb's per-parameter norms) is handed by the stage.

A ZeRO stage steps flat fp32 shards: one optimizer tensor holds the shards of one or more
*blocks* (a stage's units: parameters laid out one after another in a padded flat buffer
that the ranks of ``comm`` split into equal, contiguous shards). An optimizer that declares
``bind_shard_map`` (:class:`ShardMapOptimizer`) gets, once the stage has built it, a
:class:`ShardMap`: for every block, which optimizer tensor holds this rank's shard, where,
and which parameters (name, shape, offset) the block's flat buffer holds. With it the
optimizer can put a whole block together from the shards (``comm.all_gather`` of the shard
into ``padded`` elements; the order is the ranks'), work on whole parameters, and hand each
rank its part back (``comm.reduce_scatter``). Element-wise optimizers need none of this.

Note: the map is a description, not a mechanism: the stage keeps its layout and its
collectives, and the optimizer issues its own on ``comm`` inside its step, which every rank
of ``comm`` takes at the same time in the same order (the stage steps every sub-group on
every rank, in one order).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Span:
    """One parameter inside a block's flat buffer."""
    name: str                   # its (first) name in the module
    shape: tuple[int, ...]
    offset: int                 # its first element in the block's padded numbering
    numel: int
    use_muon: bool | None = None    # the parameter's own ``use_muon`` attribute (DeepSpeed's tag), if any


@dataclass(frozen=True)
class Block:
    """One block (a stage's unit) as this rank holds it."""
    tensor: int                 # index of the optimizer tensor holding this rank's shard (ShardMap.tensors)
    start: int                  # where the shard's first element sits in that tensor
    lo: int                     # [lo, hi): the shard's elements in the block's padded numbering
    hi: int
    padded: int                 # the block's padded size: ``comm.world_size`` x (hi - lo)
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class ShardMap:
    tensors: tuple[torch.Tensor, ...]   # the optimizer's tensors (the same objects it steps)
    blocks: tuple[Block, ...]
    comm: object                # zeroplug.comm.Comm: the ranks that hold a block's other shards
    device: torch.device        # the training device (collectives and whole-tensor work run there)

    def blocks_of(self, tensor: torch.Tensor) -> list[Block]:
        """The blocks whose shard ``tensor`` holds, in the order of their place in it."""
        k = next((i for i, t in enumerate(self.tensors) if t is tensor), None)
        return sorted((b for b in self.blocks if b.tensor == k), key=lambda b: b.start) if k is not None else []


@runtime_checkable
class ShardMapOptimizer(Protocol):
    """An optimizer that works on whole parameters: it is handed the stage's map once."""

    def bind_shard_map(self, shard_map: ShardMap) -> None:
        """Called once, after the optimizer is built over the stage's tensors and before
        its first step (and again if the stage lays the tensors out anew)."""


def bind_shard_map(optimizer, build) -> None:
    """Hand ``optimizer`` the map ``build()`` makes, if it is a :class:`ShardMapOptimizer`
    (``build`` is not called otherwise)."""
    if isinstance(optimizer, ShardMapOptimizer):
        optimizer.bind_shard_map(build())


def check_training_thread(shard_map: ShardMap, who: str) -> None:
    """Refuse a step that would issue the map's collectives off the training thread with
    several ranks (a tier's step on a worker thread, e.g. the cpu tier's delayed_update): they
    would interleave with the training thread's own collectives in a different order on each rank."""
    if shard_map.comm.world_size > 1 and threading.current_thread() is not threading.main_thread():
        from .errors import StateError
        raise StateError(f"{who} exchanges whole tensors between the ranks in its step, which must run on the "
                         "training thread; a step on a worker thread (offload.optimizer.delayed_update) cannot "
                         "take it: set delayed_update = false")
