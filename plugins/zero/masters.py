"""Where a stage's fp32 masters come from: one rank's master layout.

* fp32 model, states on the training device: the master *is* the rank's slice of the
  flat parameter buffer (aliased; stages 0-1 also alias the gradient buffer).
* states on the training device otherwise: one flat fp32 buffer and its gradient.
* states offloaded: the tier allocates them (:class:`.offload.Offloaded` hands it the
  layout); sub-groups are whole units, so every tier steps the same arithmetic.
"""
from __future__ import annotations

import torch

from zeroplug.flat import set_grad
from .flat_layout import sub_group_ranges


def make_masters(part) -> None:
    """Set ``part``'s masters: ``u.master`` per unit, ``_master_list`` (what the optimizer
    steps), ``_master_group`` (their parameter groups), ``sub_group_ranges`` and, offloaded,
    ``part.offload``."""
    tier = part.offload_optimizer
    part.offloaded = tier.capabilities.offloaded
    part.alias = part.pdtype == torch.float32 and not part.offloaded
    part.master_flat = part.master_grad_flat = None
    if part.alias:
        for u in part.units:
            u.master = u.shard
            u.master.grad = (u.grad_flat[u.lo:u.hi] if not part.shard_grads
                             else torch.zeros_like(u.shard))
        part._master_list = [u.master for u in part.units]
        part._master_group = [u.group for u in part.units]
        return
    if part.offloaded:
        from .offload import Offloaded
        part.offload = Offloaded(part, unit_groups(part))
        return
    total = sum(u.hi - u.lo for u in part.units)
    part.master_flat = torch.empty(total, dtype=torch.float32, device=part.device)
    part.master_grad_flat = torch.zeros(total, dtype=torch.float32, device=part.device)
    off = 0
    for u in part.units:
        n = u.hi - u.lo
        u.master = part.master_flat[off:off + n]
        u.master.copy_(u.shard)
        set_grad(u.master, part.master_grad_flat[off:off + n])
        off += n
    part._master_list = []
    part.sub_group_ranges = (unit_aligned_ranges(part) if not part.groups.plain
                             else sub_group_ranges(total, part.options.sub_group_size))
    part._master_group = range_groups(part, part.sub_group_ranges)
    for a, b in part.sub_group_ranges:
        t = part.master_flat[a:b]
        set_grad(t, part.master_grad_flat[a:b])
        part._master_list.append(t)


def range_groups(part, ranges) -> list[int]:
    """The parameter group of each master range (unit-aligned ranges hold one group)."""
    starts, off = [], 0
    for u in part.units:
        starts.append((off, u.group))
        off += u.hi - u.lo
    out = []
    for a, _ in ranges:
        out.append(next((g for o, g in reversed(starts) if o <= a), 0))
    return out


def unit_groups(part) -> list[list]:
    """Offloaded sub-groups: consecutive whole units up to sub_group_size elements (a
    larger unit is a sub-group of its own), the same for every tier, so that moving
    the optimizer between tiers changes no arithmetic; a parameter group never shares
    a sub-group with another."""
    groups, cur, n = [], [], 0
    for u in part.units:
        size = u.hi - u.lo
        if cur and (n + size > part.options.sub_group_size or u.group != cur[-1].group):
            groups.append(cur)
            cur, n = [], 0
        cur.append(u)
        n += size
    if cur:
        groups.append(cur)
    return groups


def unit_aligned_ranges(part) -> list[tuple[int, int]]:
    out, off = [], 0
    for g in unit_groups(part):
        size = sum(u.hi - u.lo for u in g)
        out.append((off, off + size))
        off += size
    return out
