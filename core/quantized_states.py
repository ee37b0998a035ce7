"""Block-quantised 8-bit optimizer states: the format, shared by the optimizer that steps
them (cpu_adam) and the stage that checkpoints them.

The format is bitsandbytes' blockwise 8-bit optimizer state (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", 2021), which torchao's 8-bit optimizers hold too:

* a state of n elements is cut into blocks of ``BLOCK`` (256) consecutive elements, counted
  from the state tensor's first element (the last block may be shorter);
* each block keeps its absolute maximum (``absmax``, fp32) and each element an 8-bit code,
  the index of the entry of a 256-value table (``qmap``) nearest to ``x / absmax``;
* the table is the dynamic-tree code: entries spread over seven decades below 1, denser
  near 0 in relative terms; a signed table for states of either sign (Adam's first moment),
  an unsigned one for states that are never negative (the second moment).

How zeroplug holds it: state ``key`` is its codes, a tensor of the master's shape and dtype
``torch.int8`` (signed table: code = table index - 128) or ``torch.uint8`` (unsigned table:
code = index), and ``key + ABSMAX`` (``"exp_avg_absmax"``), one fp32 per block. The codes'
dtype therefore says which table decodes them. A block whose values are all 0 has absmax 0.

Nothing here depends on zeroplug's plugins; the optimizer's fused step (cpu_adam) and
checkpoint conversions call these functions on chunks that start at a block boundary
(``phase`` = 0), except :func:`dequantize`, which also decodes a run of elements that starts
inside a block (a checkpoint piece).
"""
from __future__ import annotations

import functools

import torch

#: elements per block (bitsandbytes' and torchao's block size for 8-bit optimizer states)
BLOCK = 256
#: the suffix of a quantised state's per-block scales in the optimizer state
ABSMAX = "_absmax"
CODE_DTYPES = (torch.int8, torch.uint8)


#: the forms an offloaded optimizer may hold Adam's moments in (optimizer.state_dtype)
STATE_DTYPES = ("fp32", "bf16", "int8")


def state_bytes(state_dtype: str) -> float:
    """Bytes per element of Adam's two moments held as ``state_dtype``: 8 (fp32), 4 (bf16),
    2 codes + 2 absmax per block of ``BLOCK`` (int8)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / BLOCK}[state_dtype]


def nblocks(n: int) -> int:
    """Blocks of a state of ``n`` elements."""
    return (n + BLOCK - 1) // BLOCK


def is_codes(t) -> bool:
    return torch.is_tensor(t) and t.dtype in CODE_DTYPES


@functools.lru_cache(maxsize=None)
def _table(signed: bool) -> tuple[float, ...]:
    """The dynamic-tree code's 256 values, ascending.

    Decade d = 0..6 covers magnitudes [10^(d-7), 10^(d-6)) of which a signed code spends 2^d
    values (per sign) and an unsigned one 2^(d+1): the midpoints of that many equal steps
    between 0.1 and 1, scaled by 10^(d-6). With 0 and 1 that makes 256 values."""
    vals = [0.0, 1.0]
    for d in range(7):
        steps = 2 ** d if signed else 2 ** (d + 1)
        edges = torch.linspace(0.1, 1.0, steps + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (d - 6)).tolist()
        vals += mids
        if signed:
            vals += [-x for x in mids]
    assert len(vals) == 256
    return tuple(sorted(vals))


@functools.lru_cache(maxsize=None)
def qmap(signed: bool) -> torch.Tensor:
    """The 256-value table (fp32, ascending) of the signed or unsigned code."""
    return torch.tensor(_table(signed), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def midpoints(signed: bool) -> torch.Tensor:
    """The 255 decision boundaries between neighbouring table values (fp32): a value
    quantises to the entry whose interval holds it (``torch.bucketize``)."""
    t = torch.tensor(_table(signed), dtype=torch.float64)
    return ((t[:-1] + t[1:]) / 2).to(torch.float32)


def offset(dtype: torch.dtype) -> int:
    """Table index - code for codes of ``dtype``."""
    return 128 if dtype == torch.int8 else 0


def signed(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def zero_code(dtype: torch.dtype) -> int:
    """The code of 0 in the table that codes of ``dtype`` index."""
    return _table(signed(dtype)).index(0.0) - offset(dtype)


def empty_state(n: int, dtype: torch.dtype, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax of an all-zero state of ``n`` elements (``kw``: device, pin_memory)."""
    codes = torch.full((n,), zero_code(dtype), dtype=dtype, **kw)
    return codes, torch.zeros(nblocks(n), dtype=torch.float32, **kw)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor | None = None,
               phase: int = 0) -> torch.Tensor:
    """The values of ``codes`` (1-D), whose element 0 is element ``phase`` of the block of
    ``absmax[0]`` (``absmax`` holds every block they touch), written into ``out`` (any float
    dtype) or a new fp32 tensor."""
    n = codes.numel()
    table = qmap(signed(codes.dtype))
    idx = codes.to(torch.int32)
    if offset(codes.dtype):
        idx += offset(codes.dtype)
    vals = table[idx]
    if n:
        blk = torch.arange(phase, phase + n, dtype=torch.int64).div_(BLOCK, rounding_mode="floor")
        vals.mul_(absmax[blk])
    if out is None:
        return vals
    out.copy_(vals)
    return out


def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, idx: torch.Tensor) -> None:
    """``out`` (fp32, 1-D) = the values of ``codes`` (1-D, starting at a block boundary);
    ``idx`` is an int32 scratch of the same size (the fused step's eager chunk)."""
    n = codes.numel()
    idx.copy_(codes)
    if offset(codes.dtype):
        idx.add_(offset(codes.dtype))
    torch.index_select(qmap(signed(codes.dtype)), 0, idx, out=out)
    full = n // BLOCK * BLOCK
    if full:
        out[:full].view(-1, BLOCK).mul_(absmax[:full // BLOCK, None])
    if full < n:
        out[full:].mul_(absmax[full // BLOCK])


def quantize_(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor,
              idx: torch.Tensor | None = None) -> None:
    """``codes`` and ``absmax`` of the fp32 values ``x`` (1-D, starting at a block boundary).

    ``x`` is scaled in place (it is the step's scratch); ``idx`` an optional int32 scratch of
    its size. Each block's absmax is its largest magnitude; each element gets the code of the
    table entry nearest to x / absmax (0 for an all-zero block)."""
    n = x.numel()
    if n == 0:
        return
    sgn = signed(codes.dtype)
    full = n // BLOCK * BLOCK
    for lo, hi in ((0, full), (full, n)):
        if lo == hi:
            continue
        xb = x[lo:hi].view(-1, hi - lo if lo == full else BLOCK)
        if sgn:
            mn, mx = torch.aminmax(xb, dim=1)
            am = torch.maximum(mx, mn.neg_())
        else:
            am = xb.amax(dim=1)
        absmax[lo // BLOCK:lo // BLOCK + am.numel()].copy_(am)
        inv = torch.where(am > 0, am.reciprocal(), torch.zeros_like(am))
        xb.mul_(inv[:, None])
    out = idx if idx is not None else torch.empty(n, dtype=torch.int32)
    torch.bucketize(x, midpoints(sgn), out_int32=True, out=out)
    if offset(codes.dtype):
        out.sub_(offset(codes.dtype))
    codes.copy_(out)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New codes (of ``dtype``) and absmax of the values ``x`` (any float dtype; not changed)."""
    x = x.detach().reshape(-1).to(torch.float32, copy=True)
    codes = torch.empty(x.numel(), dtype=dtype, device=x.device)
    absmax = torch.empty(nblocks(x.numel()), dtype=torch.float32, device=x.device)
    quantize_(x, codes, absmax)
    return codes, absmax
