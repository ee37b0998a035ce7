"""Newton-Schulz orthogonalisation of one matrix: Muon's non-element-wise step.

Two update rules, each reproducing its reference's arithmetic (the same dtype, the same
operations in the same order), so that zeroplug given the same momentum matrix computes the
same bits as the reference does:

* ``torch``: ``torch.optim.Muon`` (torch 2.13): bf16 throughout, the spectral norm bounded by
  the Frobenius norm clamped at ``eps``, each quintic iteration as two ``addmm``; the learning
  rate adjusted per shape afterwards (``adjust_lr``).
* ``deepspeed``: DeepSpeed's Muon (``ns_method``): ``"standard"`` is the same quintic
  iteration in bf16 written as separate products, normalised by ``norm + 1e-7``;
  ``"gram"`` iterates on the small Gram matrix in fp16 with a restart after two
  iterations. The result is scaled by ``sqrt(max(1, rows / cols))`` in that dtype.

Note: each rule's first operation casts the input to its working dtype, so the momentum may
travel to the rank that orthogonalises it in that dtype (:func:`input_dtype`) at no cost in
accuracy: half the bytes of fp32.
"""
from __future__ import annotations

import math

import torch

TORCH_COEFFICIENTS = (3.4445, -4.775, 2.0315)


def input_dtype(rule: str, ns_method: str, ns_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype the rule's first operation casts the momentum matrix to (``ns_dtype``: the
    torch rule's working dtype)."""
    if rule == "deepspeed":
        return torch.float16 if ns_method == "gram" else torch.bfloat16
    return ns_dtype


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a parameter of ``shape`` is orthogonalised as (more than two dimensions:
    the first against the rest, as DeepSpeed views convolution filters)."""
    return shape[0], math.prod(shape[1:])


def orthogonalize_torch(g: torch.Tensor, coefficients=TORCH_COEFFICIENTS, steps: int = 5,
                        eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's iteration in ``dtype`` (torch's: bf16); may overwrite ``g`` when it
    is of that dtype already. ``g`` of shape (B, rows, cols): B matrices of one shape, each
    orthogonalised on its own, one batched product per product of the iteration (``baddbmm``
    where torch's has ``addmm``; the norm per matrix)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
        return x.T if tall else x
    x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust: str, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's per-shape learning rate (``adjust_lr_fn``)."""
    rows, cols = shape
    if adjust == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _standard(x: torch.Tensor, a: float, b: float, c: float, steps: int) -> torch.Tensor:
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x


def _gram(x: torch.Tensor, a: float, b: float, c: float, steps: int) -> torch.Tensor:
    """The quintic iteration carried on R = X X^T (n x n, n the short side) and the
    accumulated left factor Q, X = Q X0 at the end; X is refreshed once, after two steps,
    to bound fp16's drift."""
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == 2:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != 2:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return q @ x


def orthogonalize_deepspeed(g: torch.Tensor, steps: int = 5, ns_method: str = "gram",
                            coefficients=TORCH_COEFFICIENTS) -> torch.Tensor:
    """DeepSpeed's Muon update of a momentum matrix: orthogonalised and scaled by
    ``sqrt(max(1, rows / cols))``, in the working dtype (:func:`input_dtype`). ``g`` of shape
    (B, rows, cols): B matrices of one shape, each on its own (batched products)."""
    a, b, c = coefficients
    x = g.to(input_dtype("deepspeed", ns_method))
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    if ns_method == "gram" and x.size(-1) > x.size(-2):
        x = _gram(x, a, b, c, steps)
    else:
        x = _standard(x, a, b, c, steps)
    if tall:
        x = x.mT
    x *= max(1.0, g.size(-2) / g.size(-1)) ** 0.5
    return x
