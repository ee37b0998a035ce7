"""Ulysses attention: heads exchanged for sequence with one all-to-all, and back.

Each rank of a sequence group of ``P`` ranks holds a slice of ``s`` tokens of the sequence
and every head: ``[B, H, s, D]``. Attention needs every token of a head, so one all-to-all
sends heads ``[j H/P, (j+1) H/P)`` of the slice to rank ``j`` and receives, from every rank,
its slice of this rank's heads: ``[B, H/P, P s, D]``, the whole sequence for ``H/P`` heads.
Causal attention runs there as on one process; a second all-to-all returns each slice's
outputs to the rank that holds it. The backward of each all-to-all is the other one (the
exchange is a permutation of the elements), so the gradients travel the same way back.

Key and value heads fewer than ``P`` (grouped-query attention with ``P > num_key_value_heads``)
are repeated up to ``P`` first, as each rank needs the key-value head of its query heads;
autograd sums the repeats' gradients back into the one head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroplug.comm import Comm


def _seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, H, s, D] (every head, this rank's slice) -> [B, H/P, P s, D] (this rank's heads, every slice)."""
    P = comm.world_size
    B, H, s, D = x.shape
    send = x.reshape(B, P, H // P, s, D).transpose(0, 1).contiguous()       # [P(to), B, H/P, s, D]
    recv = torch.empty_like(send)                                             # [P(from), B, H/P, s, D]
    comm.all_to_all(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * s, D)


def _heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, h, P s, D] (this rank's heads, every slice) -> [B, P h, s, D] (every head, this rank's slice)."""
    P = comm.world_size
    B, h, S, D = y.shape
    s = S // P
    send = y.reshape(B, h, P, s, D).permute(2, 0, 1, 3, 4).contiguous()     # [P(to: slice), B, h, s, D]
    recv = torch.empty_like(send)                                             # [P(from: heads), B, h, s, D]
    comm.all_to_all(recv, send)
    return recv.transpose(0, 1).reshape(B, P * h, s, D)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.comm), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, comm):
        ctx.comm = comm
        return _heads_to_seq(y, comm)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.comm), None


#: SDPA reads grouped key-value heads itself (torch 2.5 and later), as Hugging Face's sdpa path uses it
_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _fused_only(q: torch.Tensor):
    """On CUDA, SDPA's fused kernels only: the math fallback holds [S, S] scores per head, which a
    long sequence cannot afford (an error instead, and the caller repeats the heads)."""
    if not q.is_cuda:
        import contextlib
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     dropout: float = 0.0) -> torch.Tensor:
    """Causal scaled-dot-product attention of ``[B, H, S, D]`` queries over ``[B, Hkv, S, D]`` keys and
    values (``H`` a multiple of ``Hkv``: query head ``i`` reads key-value head ``i // (H / Hkv)``)."""
    if k.shape[1] != q.shape[1]:
        if _GQA:    # Note: no copy of the keys and values per query head (4 GiB each at 500K tokens, 8B)
            try:
                with _fused_only(q):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout,
                                                          enable_gqa=True)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:    # no fused kernel takes grouped heads here: repeat them
                pass
        # the same grouping as Hugging Face's repeat_kv (each key-value head repeated in place)
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, scale: float | None = None,
                      dropout: float = 0.0) -> torch.Tensor:
    """Causal attention over the whole sequence of a group whose ranks each hold a slice:
    ``q`` ``[B, H, s, D]``, ``k`` / ``v`` ``[B, Hkv, s, D]`` of this rank's slice (slice ``j`` of
    rank ``j`` of ``comm``) -> ``[B, H, s, D]``. ``H`` must be a multiple of the group's size,
    ``Hkv`` a multiple of it or a divisor of it."""
    P = comm.world_size
    if P == 1:
        return causal_attention(q, k, v, scale, dropout)
    kv = k.shape[1]
    if kv % P:
        k = k.repeat_interleave(P // kv, dim=1)
        v = v.repeat_interleave(P // kv, dim=1)
    # Note: tensors with as many heads travel side by side in the last dim: one all-to-all for
    # the three (multi-head attention), or one for the query and one for key and value (grouped)
    D = q.shape[-1]
    if k.shape == q.shape:
        q_, k_, v_ = SeqToHeads.apply(torch.cat((q, k, v), dim=-1), comm).split(D, dim=-1)
    else:
        q_ = SeqToHeads.apply(q.contiguous(), comm)
        k_, v_ = SeqToHeads.apply(torch.cat((k, v), dim=-1), comm).split(D, dim=-1)
    out = causal_attention(q_, k_, v_, scale, dropout)
    return HeadsToSeq.apply(out, comm)
