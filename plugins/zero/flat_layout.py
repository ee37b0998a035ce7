"""Flat buffers: many parameters in one padded 1-D buffer, sharded across ranks.

A :class:`FlatLayout` places tensors side by side at fixed offsets and pads the
total to a multiple of ``world_size * align`` so that every rank owns one
contiguous, equally sized shard ``[rank * shard_size, (rank + 1) * shard_size)``.
Equal shards are what ``reduce_scatter_tensor`` and ``all_gather_into_tensor``
need, and contiguity is what lets a shard be stepped, copied or swapped as one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total: int            # elements used by the tensors
    padded: int           # total rounded up to world_size * align
    world_size: int

    @classmethod
    def build(cls, tensors, world_size: int, align: int = 1) -> "FlatLayout":
        shapes, offsets, numels = [], [], []
        off = 0
        for t in tensors:
            shapes.append(t.shape)
            offsets.append(off)
            numels.append(t.numel())
            off += t.numel()
        unit = world_size * max(1, align)
        padded = max(unit, -(-off // unit) * unit)
        return cls(tuple(shapes), tuple(offsets), tuple(numels), off, padded, world_size)

    @property
    def shard_size(self) -> int:
        return self.padded // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into a full flat buffer."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def copy_in(self, flat: torch.Tensor, tensors) -> None:
        """Copy ``tensors`` into their places in ``flat`` (padding zeroed)."""
        for v, t in zip(self.views(flat), tensors):
            v.copy_(t.detach())
        if self.padded > self.total:
            flat[self.total:].zero_()

    def shard_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(tensor index, start, end) in the tensor's flat numbering for the parts of
        each tensor that fall into ``rank``'s shard."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, o), min(hi, o + n)
            if a < b:
                out.append((i, a - o, b - o))
        return out
