"""The stage's side of :mod:`zeroplug.shard_map`: each trainable unit as a block of the map.

Every unit's master is a view of one optimizer tensor (one per unit on the training device,
one per sub-group when offloaded): the block names that tensor and where the unit's shard
starts in it, found by storage as the checkpoint code finds it (a master moved out of memory
keeps its storage object, with no bytes)."""
from __future__ import annotations

from zeroplug.shard_map import Block, ShardMap, Span


def _storage_key(t):
    return (t.device, t.untyped_storage()._cdata)


def build_shard_map(part) -> ShardMap:
    """``part``'s (a FlatPartitioner after setup) layout as a :class:`ShardMap`."""
    names: dict[int, str] = {}
    for n, p in part.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    tensors = tuple(part.master_params())
    index: dict = {}
    for k, t in enumerate(tensors):
        index.setdefault(_storage_key(t), []).append((t.storage_offset(), t.numel(), k))
    blocks = []
    for u in part.units:
        x = u.master.storage_offset()
        k, start = next(((k, x - off) for off, n, k in index.get(_storage_key(u.master), ())
                         if off <= x and x + u.master.numel() <= off + n), (None, None))
        if k is None:
            raise RuntimeError("a unit's master is not a view of any optimizer tensor")
        lay = u.layout
        spans = tuple(Span(names.get(id(p), f"<unit {u.index} param {i}>"), tuple(lay.shapes[i]), lay.offsets[i],
                           lay.numels[i], getattr(p, "use_muon", None))
                      for i, p in enumerate(u.params))
        blocks.append(Block(k, start, u.lo, u.hi, lay.padded, spans))
    return ShardMap(tensors, tuple(blocks), part.shard_comm if part.layout_world > 1 else _One(), part.device)


class _One:
    """The map's comm where every rank holds whole blocks (stage 0, or one rank): no exchange."""
    rank, world_size, distributed = 0, 1, False
