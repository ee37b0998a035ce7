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

from dataclasses import dataclass, field

import torch


@dataclass
class Masters:
    """One rank's masters, as :func:`make_masters` laid them out (the partitioner keeps them)."""
    tensors: list           # what the optimizer steps: one fp32 tensor per unit or sub-group
    groups: list            # the parameter group of each
    offloaded: bool         # the tier keeps them (``offload`` talks to it)
    alias: bool             # fp32 model, states on the training device: the masters are the shards
    lazy_grads: bool        # master gradients allocated in backward and freed after the step
    flat: torch.Tensor | None = None        # the one buffer the unit masters are slices of
    sub_group_ranges: list | None = None    # [start, end) of each tensor in the rank's numbering
    offload: object | None = None           # the stage's side of the tier contract (offload.py)
    #: the units whose model-dtype shard the device step writes from the master (none when
    #: the masters alias the shards or a tier publishes them)
    published: list = field(default_factory=list)


def make_masters(part) -> Masters:
    """``part``'s masters: sets ``u.master`` of each unit and returns what the partitioner
    keeps (see :class:`Masters`)."""
    tier = part.offload_optimizer
    offloaded = tier.capabilities.offloaded
    alias = part.pdtype == torch.float32 and not offloaded
    # master gradients allocated in backward and freed after the step (see the note above)
    lazy_grads = not offloaded and (part.shard_grads or not alias)
    if alias:
        for u in part.units:
            u.master = u.shard
            u.master.grad = u.grad_flat[u.lo:u.hi] if not part.shard_grads else None
        return Masters([u.master for u in part.units], [u.group for u in part.units], offloaded, alias, lazy_grads)
    if offloaded:
        from .offload import Offloaded
        offload = Offloaded(part, unit_groups(part))
        return Masters(offload.masters, offload.groups, offloaded, alias, lazy_grads,
                       sub_group_ranges=offload.sub_group_ranges, offload=offload)
    total = sum(u.hi - u.lo for u in part.units)
    flat = torch.empty(total, dtype=torch.float32, device=part.device)
    published = list(part.units)
    off = 0
    ranges = []
    for u in part.units:
        n = u.hi - u.lo
        u.master = flat[off:off + n]
        u.master.copy_(u.shard)
        ranges.append((off, off + n))
        off += n
    return Masters([u.master for u in part.units], [u.group for u in part.units], offloaded, alias, lazy_grads,
                   flat=flat, sub_group_ranges=ranges, published=published)


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
