"""Computations tiled along the sequence, so that what grows with it per token never exists
for the whole sequence at once.

* :class:`TiledMLP`: a position-wise module (the MLP) applied to one chunk of tokens at a time.
  The forward keeps only its input and output; the backward recomputes each chunk with grad
  and takes its gradients before the next chunk. The widest temporaries (``[tokens,
  4 x hidden]`` and more) exist for one chunk.
* :class:`TiledHeadLoss`: the language-model head and the cross entropy, chunk by chunk: the
  forward sums each chunk's loss and drops its logits; the backward recomputes each chunk's
  logits and writes the gradients of the softmax by hand (``softmax - one_hot``). The logits
  ``[tokens, vocab]`` never exist, forward or backward, for more than one chunk.

The gradients of the parameters come back from the Function as one sum over the chunks (in
fp32 when that fits the tile budget), so autograd accumulates each parameter's gradient once
and the ZeRO stage's hooks see one gradient per parameter per backward, as without tiles.

Note: the chunk count of a call is the same on every rank (``chunks``: from the longest local
sequence of the forward), because a stage-3 parameter gathered by a chunk's call is a
collective: ranks that ran different numbers of chunks would pair different gathers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(n: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous [start, end) ranges covering ``n`` (some empty if ``n < chunks``)."""
    base, extra = divmod(n, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _accumulator(p: torch.Tensor, fp32: bool) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=torch.float32 if fp32 else p.dtype, device=p.device)


class TiledMLP(torch.autograd.Function):
    """``fn(x)`` of a position-wise ``fn`` over ``x [B, T, d]`` in ``chunks`` slices of T;
    ``params`` are ``fn``'s parameters (their gradients are returned summed over the chunks)."""

    @staticmethod
    def forward(ctx, fn, chunks, fp32_grads, x, *params):
        ctx.fn, ctx.chunks, ctx.fp32_grads = fn, chunks, fp32_grads
        ctx.save_for_backward(x)
        ctx.params = params
        with torch.no_grad():
            parts = [fn(x[:, a:b]) for a, b in _chunks(x.shape[1], chunks)]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = ctx.params
        want = [p for p in params if p.requires_grad]
        sums = [None] * len(want)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        for a, b in _chunks(x.shape[1], ctx.chunks):
            xc = x[:, a:b].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                y = ctx.fn(xc)
            inputs = ([xc] if grad_x is not None else []) + want
            got = torch.autograd.grad(y, inputs, grad[:, a:b], allow_unused=True)
            if grad_x is not None:
                grad_x[:, a:b] = got[0]
                got = got[1:]
            for i, g in enumerate(got):
                if g is None:
                    continue
                if sums[i] is None:
                    sums[i] = _accumulator(want[i], ctx.fp32_grads)
                sums[i].add_(g)
        by_param = dict(zip(map(id, want), sums))
        out = []
        for p in params:
            s = by_param.get(id(p))
            out.append(None if s is None else s.to(p.dtype))
        return (None, None, None, grad_x, *out)


class TiledHeadLoss(torch.autograd.Function):
    """The summed cross entropy of ``hidden [N, d] @ weight.T (+ bias)`` against ``targets [N]``
    (``ignore_index`` skipped), in ``chunks`` slices of the N tokens; the logits are computed in
    fp32 one slice at a time. Returns the sum (fp32 scalar)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks, ignore_index, fp32_grads):
        ctx.chunks, ctx.ignore_index, ctx.fp32_grads = chunks, ignore_index, fp32_grads
        ctx.save_for_backward(hidden, weight, bias, targets)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for a, b in _chunks(hidden.shape[0], chunks):
                if a == b:
                    continue
                logits = F.linear(hidden[a:b], weight, bias).float()
                total += F.cross_entropy(logits, targets[a:b], ignore_index=ignore_index, reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = _accumulator(weight, ctx.fp32_grads) if need_w else None
        grad_b = _accumulator(bias, True) if need_b and bias is not None else None
        for a, b in _chunks(hidden.shape[0], ctx.chunks):
            if a == b:
                continue
            h, t = hidden[a:b], targets[a:b]
            logits = F.linear(h, weight, bias).float()
            # d(sum of CE)/d(logits) = softmax - one_hot(target), 0 on ignored rows; times the
            # incoming gradient
            d = torch.softmax(logits, dim=-1)
            del logits
            valid = t != ctx.ignore_index
            rows = torch.arange(t.shape[0], device=t.device)
            d[rows, torch.where(valid, t, 0)] -= 1
            d.mul_((valid.to(d.dtype) * grad.float()).unsqueeze(1))
            d = d.to(hidden.dtype)
            if grad_h is not None:
                grad_h[a:b] = d @ weight
            if grad_w is not None:
                grad_w.add_(d.t() @ h)
            if grad_b is not None:
                grad_b.add_(d.sum(0, dtype=torch.float32))
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  ignore_index: int, chunks: int, fp32_grads: bool = True) -> torch.Tensor:
    """The summed cross entropy of the head over ``hidden [..., d]`` and ``targets [...]``:
    tiled in ``chunks`` (> 1), else the plain computation (fp32 logits, as the reference GPT does)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if chunks <= 1:
        logits = F.linear(h, weight, bias).float()
        return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")
    return TiledHeadLoss.apply(h, weight, bias, t, chunks, ignore_index, fp32_grads)


def tiled_call(fn, x: torch.Tensor, params: list[torch.Tensor], chunks: int, fp32_grads: bool = True):
    """``fn(x)`` in ``chunks`` slices of dim 1 (> 1), else ``fn(x)`` itself."""
    if chunks <= 1 or not torch.is_grad_enabled():
        # Note: without grad (evaluation) nothing is kept for a backward: the chunks' temporaries
        # are freed one after another anyway; with grad, tiles keep only the input
        if chunks <= 1:
            return fn(x)
        with torch.no_grad():
            return torch.cat([fn(x[:, a:b]) for a, b in _chunks(x.shape[1], chunks)], dim=1)
    return TiledMLP.apply(fn, chunks, fp32_grads, x, *params)
