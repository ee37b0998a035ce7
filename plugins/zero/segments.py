"""This rank's pieces of every parameter, in the parameter's own flattened numbering: what
a checkpoint of a partitioner holds per rank, and what loading one fills
(:mod:`.checkpointing`).

A :class:`Segment` is one range ``[a, b)`` of a parameter's elements that this rank owns
(``FlatLayout.shard_pieces``), cut where optimizer tensors (sub-groups of
``sub_group_size``) end, so each segment lies inside one master tensor and its states.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

import torch

from zeroplug.checkpoint import CheckpointError


class Segment(NamedTuple):
    name: str            # the parameter's (first) name in the module
    a: int               # [a, b): elements in the parameter's flattened numbering
    b: int
    shard: torch.Tensor  # the unit's model-dtype shard, holding them from offset ``q``
    k: int               # index of the master tensor (in master_params()) holding them
    mloc: int            # offset of element ``a`` inside that master tensor
    unit: int            # the unit's index
    q: int

    @property
    def lp(self) -> torch.Tensor:
        """The model-dtype values (a view of the shard; made on use, since a shard out of
        memory has no memory to view while it is out)."""
        return self.shard[self.q:self.q + (self.b - self.a)]

    def master(self, masters) -> torch.Tensor:
        """The fp32 values (a view of master ``k``; made on use, since a moved-out
        master has no memory to view)."""
        return masters[self.k][self.mloc:self.mloc + (self.b - self.a)]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _names(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def _canonical(part) -> dict[int, str]:
    names = _names(part.module)
    out = {}
    for u in part.units:
        for p in u.params:
            ns = names.get(id(p))
            if not ns:
                raise CheckpointError("a partitioned parameter is not reachable from the module "
                                      "(module.named_parameters() does not list it)")
            out[id(p)] = ns[0]
    return out


def checkpoint_meta(part) -> dict:
    """JSON-able: every partitioned parameter's name, shape and dtype, and the module's
    state-dict keys in order (each naming its parameter, or None for other entries)."""
    names = _names(part.module)
    params = {}
    for u in part.units:
        for i, p in enumerate(u.params):
            ns = names[id(p)]
            params[ns[0]] = {"shape": list(u.layout.shapes[i]), "dtype": dtype_name(part.pdtype),
                             "aliases": ns[1:]}
    canon = _canonical(part)
    keys = [[k, canon.get(id(v))] for k, v in part.module.state_dict(keep_vars=True).items()]
    return {"params": params, "state_dict": keys}


def storage_key(t: torch.Tensor):
    """What identifies ``t``'s storage: the storage object, not its address (masters moved
    out of memory all have none)."""
    return (t.device, t.untyped_storage()._cdata)


def segments(part) -> list[Segment]:
    """This rank's pieces of every parameter, each inside one master tensor."""
    canon = _canonical(part)
    masters = part.master_params()
    index: dict = {}
    for k, t in enumerate(masters):
        index.setdefault(storage_key(t), []).append((t.storage_offset(), t.numel(), k))
    for v in index.values():
        v.sort()
    out = []
    for u in part.units:
        if u.hi <= u.lo:
            continue
        cands = index.get(storage_key(u.master))
        if cands is None:
            raise CheckpointError("a unit's master is not a view of any optimizer tensor; the partitioner "
                                  "layout is not one this checkpointing understands")
        starts = [c[0] for c in cands]
        base = u.master.storage_offset()
        for i, a, b in u.layout.shard_pieces(part.layout_rank):
            name = canon[id(u.params[i])]
            p0 = u.layout.offsets[i] + a - u.lo         # position in the shard / unit master
            x, end = base + p0, base + p0 + (b - a)     # storage offsets covered
            j = bisect_right(starts, x) - 1
            while x < end:
                if j < 0 or j >= len(cands) or not cands[j][0] <= x < cands[j][0] + cands[j][1]:
                    raise CheckpointError(f"parameter {name!r}: part of its master is not an optimizer tensor")
                off, n, k = cands[j]
                y = min(end, off + n)
                s = a + (x - base - p0)
                q = x - base
                out.append(Segment(name, s, s + (y - x), u.shard, k, x - off, u.index, q))
                x = y
                j += 1
    return out
