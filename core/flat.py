"""Storage helpers shared by the stages and the offload tiers: free a tensor's memory and
bring it back in place (views stay valid), count bytes, attach gradients.

(The flat layout of a stage's units is :mod:`zeroplug.plugins.zero.flat_layout`.)
"""
from __future__ import annotations

import torch


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory while keeping the tensor object (and views of it) alive.

    Note: resizing the storage (rather than replacing tensors) keeps every view's
    identity, so parameters and tensors that autograd saved in forward see the
    data again once :func:`alloc_storage` and a gather refill it.
    """
    s = t.untyped_storage()
    if s.size() != 0:
        s.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    s = t.untyped_storage()
    need = t.numel() * t.element_size()
    if s.size() != need:
        s.resize_(need)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what they really hold)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.device)
        if key in seen or s.size() == 0:
            continue
        seen.add(key)
        total += s.size()
    return total


def set_grad(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t.grad = g``, also where g's dtype differs (an fp32 master, a bf16 gradient shard)."""
    if g.dtype != t.dtype and hasattr(t, "grad_dtype"):
        t.grad_dtype = None     # Note: torch >= 2.10 checks .grad's dtype unless told not to
    t.grad = g


def mixed_grad_ok() -> bool:
    """Whether this torch lets an fp32 tensor hold a gradient of another dtype."""
    try:
        set_grad(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False
