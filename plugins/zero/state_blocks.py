"""Block-quantised optimizer states (:mod:`zeroplug.quantized_states`) in checkpoints.

A block-quantised state ``key`` of a master is its codes (element-wise, int8 or uint8) and
``key + ABSMAX`` (one fp32 per block of 256, counted from the master's first element). A
checkpoint piece holds the codes of its elements under ``optim`` like any element-wise
state, and under ``blocks`` the absmax of every block its elements touch and ``phase``, its
first element's place in its block: ``{"phase": p, "absmax": {key: tensor}}``. The codes
stay 8-bit on disk.

Loading puts each piece's elements where this rank holds them now. Where the blocks fall as
they did when it was saved (the same world size, stage and sub-group sizes), the codes and
absmax are copied as they are: a round trip is exact. Elsewhere the blocks are cut
differently, one new block taking elements of several old ones with different absmax, so
those states are decoded to fp32 while loading and the optimizer encodes them again
(:func:`Plan`'s requantised masters; values within one quantisation step of the saved ones).
"""
from __future__ import annotations

import torch

from zeroplug.checkpoint import CheckpointError, piece_view
from zeroplug.quantized_states import ABSMAX, BLOCK, dequantize, empty_state, is_codes, nblocks


def is_absmax(st: dict, key) -> bool:
    """Whether ``key`` of a master's state ``st`` is the absmax of a block-quantised state."""
    return isinstance(key, str) and key.endswith(ABSMAX) and is_codes(st.get(key[:-len(ABSMAX)]))


def piece_blocks(st: dict, mloc: int, n: int) -> dict | None:
    """The ``blocks`` entry of a piece of elements [mloc, mloc + n) of a master with state
    ``st`` (views of the absmax), or None when no state of it is block-quantised."""
    out = {}
    lo, hi = mloc // BLOCK, (mloc + n - 1) // BLOCK + 1
    for key, v in st.items():
        if is_codes(v) and torch.is_tensor(st.get(key + ABSMAX)):
            out[key] = piece_view(st[key + ABSMAX][lo:hi])
    return {"phase": mloc % BLOCK, "absmax": out} if out else None


def source(full: dict, key: str, t: torch.Tensor, where: str) -> tuple[torch.Tensor, int] | None:
    """For codes ``t`` of state ``key`` in piece ``full``: (its absmax, its phase); None for
    a state that is not block-quantised."""
    if not is_codes(t):
        return None
    blocks = full.get("blocks") or {}
    absmax = (blocks.get("absmax") or {}).get(key)
    if absmax is None:
        raise CheckpointError(f"checkpoint {where}: 8-bit optimizer state {key!r} has no absmax")
    return absmax, int(blocks["phase"])


def decode(codes: torch.Tensor, absmax: torch.Tensor, phase: int, s0: int, s1: int) -> torch.Tensor:
    """fp32 values of elements [s0, s1) of a piece's codes."""
    a = (phase + s0) // BLOCK
    return dequantize(codes[s0:s1], absmax[a:], phase=(phase + s0) % BLOCK)


class Plan:
    """Which masters' block-quantised states load as they are (blocks where they were) and
    which are decoded to fp32 (requantised by the optimizer), decided on the dry walk."""

    def __init__(self):
        self.requant: set[tuple[int, str]] = set()
        self.seen: dict[tuple[int, str], torch.Tensor] = {}

    def check(self, k: int, key: str, master: torch.Tensor, m0: int, src: tuple, s0: int, n: int) -> None:
        """Elements [m0, m0 + n) of master ``k`` from elements [s0, s0 + n) of a piece whose
        codes have (absmax, phase) ``src``."""
        if (k, key) in self.requant:
            return
        absmax, phase = src
        if (phase + s0) % BLOCK != m0 % BLOCK:
            self.requant.add((k, key))
            return
        seen = self.seen.get((k, key))
        if seen is None:
            seen = self.seen[(k, key)] = torch.full((nblocks(master.numel()),), float("nan"))
        a, b = m0 // BLOCK, (m0 + n - 1) // BLOCK + 1
        sa = (phase + s0) // BLOCK
        vals = absmax[sa:sa + (b - a)].to(torch.float32)
        cur = seen[a:b]
        known = ~torch.isnan(cur)
        if bool((cur[known] != vals[known]).any()):
            self.requant.add((k, key))      # one block now, several blocks then
            return
        cur.copy_(vals)

    def exact(self, k: int, key: str) -> bool:
        return (k, key) not in self.requant


def codes_buffers(optimizer, master: torch.Tensor, key: str, dtype: torch.dtype, st: dict) -> None:
    """``st[key]`` (codes, all coding 0) and ``st[key + ABSMAX]`` for master ``master``: the live
    ones when the optimizer holds that form (no second copy), else new."""
    cur = (optimizer.state.get(master) or {}) if optimizer is not None else {}
    codes, absmax = cur.get(key), cur.get(key + ABSMAX)
    if not (torch.is_tensor(codes) and codes.dtype == dtype and codes.shape == master.shape
            and torch.is_tensor(absmax) and absmax.numel() == nblocks(master.numel())):
        codes, absmax = empty_state(master.numel(), dtype)
        codes = codes.view(master.shape)
    else:
        fresh = empty_state(master.numel(), dtype)
        codes.view(-1).copy_(fresh[0])
        absmax.zero_()
    st[key], st[key + ABSMAX] = codes, absmax


def fill_exact(st: dict, key: str, codes: torch.Tensor, src: tuple, s0: int, s1: int, m0: int) -> None:
    """Copy a piece's codes [s0, s1) and their blocks' absmax to elements from ``m0`` of
    ``st[key]`` (blocks where they were: :class:`Plan` said so)."""
    absmax, phase = src
    n = s1 - s0
    st[key].view(-1)[m0:m0 + n].copy_(codes[s0:s1])
    a, b = m0 // BLOCK, (m0 + n - 1) // BLOCK + 1
    sa = (phase + s0) // BLOCK
    st[key + ABSMAX][a:b].copy_(absmax[sa:sa + (b - a)])
