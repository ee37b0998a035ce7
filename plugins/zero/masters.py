"""Where a stage's fp32 masters come from: one rank's master layout.

* fp32 model, states on the training device: the master *is* the rank's slice of the
  flat parameter buffer (aliased; stages 0-1 also alias the gradient buffer).
* states on the training device otherwise: one flat fp32 buffer; the optimizer steps
  each unit's slice of it (a tensor per unit, as the alias case).
* states offloaded: the tier allocates them (:class:`.offload.Offloaded` hands it the
  layout); sub-groups are whole units, so every tier steps the same arithmetic.

Note: on the training device, a master's gradient exists only from the moment its unit's
reduction lands (or its first gradient is added, on one rank) until the step after which
it is freed (``zero_grad``): between steps no fp32 gradient is held, and in backward they
appear unit by unit while the activations are freed, as FSDP2's ``.grad`` do. Within an
accumulation window they persist.
"""
from __future__ import annotations

import torch


def make_masters(part) -> None:
    """Set ``part``'s masters: ``u.master`` per unit, ``_master_list`` (what the optimizer
    steps), ``_master_group`` (their parameter groups), ``sub_group_ranges`` and, offloaded,
    ``part.offload``."""
    tier = part.offload_optimizer
    part.offloaded = tier.capabilities.offloaded
    part.alias = part.pdtype == torch.float32 and not part.offloaded
    part.master_flat = None
    # master gradients allocated in backward and freed after the step (see the note above)
    part.lazy_grads = not part.offloaded and (part.shard_grads or not part.alias)
    if part.alias:
        for u in part.units:
            u.master = u.shard
            u.master.grad = u.grad_flat[u.lo:u.hi] if not part.shard_grads else None
        part._master_list = [u.master for u in part.units]
        part._master_group = [u.group for u in part.units]
        return
    if part.offloaded:
        from .offload import Offloaded
        part.offload = Offloaded(part, unit_groups(part))
        return
    total = sum(u.hi - u.lo for u in part.units)
    part.master_flat = torch.empty(total, dtype=torch.float32, device=part.device)
    off = 0
    part.sub_group_ranges = []
    for u in part.units:
        n = u.hi - u.lo
        u.master = part.master_flat[off:off + n]
        u.master.copy_(u.shard)
        part.sub_group_ranges.append((off, off + n))
        off += n
    part._master_list = [u.master for u in part.units]
    part._master_group = [u.group for u in part.units]


def unit_groups(part) -> list[list]:
    """Offloaded sub-groups: consecutive whole units up to sub_group_size elements, or the
    tier's granularity where that is smaller (a larger unit is a sub-group of its own); a
    parameter group never shares a sub-group with another. The optimizer's arithmetic is
    elementwise, so where sub-groups are cut changes no value."""
    limit = part.options.sub_group_size
    granularity = part.offload_optimizer.capabilities.granularity
    if granularity:
        limit = min(limit, granularity)
    groups, cur, n = [], [], 0
    for u in part.units:
        size = u.hi - u.lo
        if cur and (n + size > limit or u.group != cur[-1].group):
            groups.append(cur)
            cur, n = [], 0
        cur.append(u)
        n += size
    if cur:
        groups.append(cur)
    return groups
