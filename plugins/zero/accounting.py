"""Which of a partitioner's tensors are which: for the memory report (by category) and for
``offload_states`` (by kind). Sizes and identities only; no values are read."""
from __future__ import annotations

import torch

from .unit import FREE


def memory_tensors(part, masters: list, in_flight: list) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each memory category (zeroplug.observe.memory.memory_report):
    ``masters`` what the optimizer steps, ``in_flight`` the outputs of reductions in flight."""
    return {
        "lp_params": [u.full for u in part.all_units if u.persistent]
        + [u.shard for u in part.all_units if u.sharded_params]
        + [u.secondary.values for u in part.all_units if u.secondary is not None],      # hpZ
        "master": [] if part.alias else list(masters),
        "gradients": [u.grad_flat for u in part.units] + [u.master.grad for u in part.units]
        + [t.grad for t in masters]      # (offloaded: the tier's gradient buffers)
        + _lp_grads(part),
        # (on the device: none between steps; in backward, each unit's from its reduction on)
        "buckets": [u.bucket for u in part.units] + list(in_flight),
        "prefetch": [u.full for u in part.all_units if not u.persistent and u.state != FREE],
    }


def state_tensors(part, masters: list) -> dict[str, list[torch.Tensor]]:
    """The tensors this rank holds by kind: lp_params, lp_grads, hp_params, hp_grads."""
    alias = part.alias
    hp_grads = ([u.master.grad for u in part.units] if alias and part.shard_grads
                else [] if alias else [t.grad for t in masters])
    return {"lp_params": [u.full for u in part.all_units] + [u.shard for u in part.all_units if u.sharded_params],
            "lp_grads": [u.grad_flat for u in part.units if u.grad_flat is not None] + _lp_grads(part),
            "hp_params": [] if alias else list(masters),
            "hp_grads": [g for g in hp_grads if g is not None]}


def _lp_grads(part) -> list[torch.Tensor]:
    return part.lp_grads.tensors() if part.lp_grads is not None else []
