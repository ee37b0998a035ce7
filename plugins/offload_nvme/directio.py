"""O_DIRECT for the swapper: the alignment it needs, whether a descriptor uses it, and a
tensor's bytes copied into / out of bounce buffers padded to that alignment."""
from __future__ import annotations

import os

import torch

ALIGN = 4096                          # O_DIRECT alignment of memory, offsets and lengths
O_DIRECT = getattr(os, "O_DIRECT", 0)


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(t):
        raise TypeError(f"AsyncSwapper: expected a tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("AsyncSwapper: tensors must be contiguous (call .contiguous() first)")
    t = t.detach().reshape(-1)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def copy_in(buf: torch.Tensor, src: torch.Tensor, off: int, n: int, padded: int) -> None:
    buf[:n].copy_(src[off:off + n])
    if padded > n:
        buf[n:padded].zero_()


def copy_out(buf: torch.Tensor, dst: torch.Tensor, off: int, n: int) -> None:
    dst[off:off + n].copy_(buf[:n])


def has_direct(fd: int) -> bool:
    import fcntl
    try:
        return bool(O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
    except OSError:
        return False


def clear_direct(fd: int) -> None:
    import fcntl
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
