"""plan(): the checks of a swap setup before anything is allocated.

Buffer size against the largest tensor, the buffers against the available host memory,
the swap files against the free space at ``nvme_path``; the result is a :class:`SwapPlan`.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import torch

from zeroplug.errors import ConfigError
from zeroplug.observe.memory import host_available_bytes

from .directio import ALIGN, align
from .errors import SwapMemoryError, SwapSpaceError
from .swapdir import check_path, clean_stale, fmt_bytes

log = logging.getLogger("zeroplug")


@dataclass(frozen=True)
class SwapPlan:
    path: str
    buffer_numel: int
    buffer_bytes: int
    buffer_count: int
    pinned: bool
    pinned_bytes: int            # buffer_count x buffer bytes
    swap_bytes: int              # the swap files' total, padded
    free_bytes: int              # free at path now

    def describe(self) -> str:
        return (f"NVMe swap at {self.path}: {self.buffer_count} x {self.buffer_numel} elements "
                f"= {fmt_bytes(self.pinned_bytes)} of {'pinned ' if self.pinned else ''}host buffers; "
                f"swap files {fmt_bytes(self.swap_bytes)} of {fmt_bytes(self.free_bytes)} free")


def plan(total_bytes: int, largest_numel: int, options, *, element_size: int = 4,
         num_files: int = 0, where: str = "offload") -> SwapPlan:
    """Check a swap setup before allocating anything.

    ``total_bytes``: the bytes that will be swapped out at once (all files);
    ``largest_numel``: the largest parameter / sub-group that one buffer must hold;
    ``options``: the nvme tier's options (``nvme_path``, ``buffer_count``, ``buffer_size``
    (None = ``largest_numel``), ``pin_memory``); ``where``: the TOML table, for messages.
    Raises :class:`ConfigError` (buffer_size too small), :class:`SwapMemoryError` (buffers
    over the available host memory), :class:`SwapSpaceError` (not enough free disk) or
    :class:`SwapPathError`. Removes stale swap directories first (they hold disk space).
    """
    path = check_path(options.nvme_path, f"{where}.nvme_path")
    size = options.buffer_size if options.buffer_size is not None else largest_numel
    size = max(1, int(size))
    if size < largest_numel:
        raise ConfigError(
            f"{where}.buffer_size = {size} elements is smaller than the largest parameter or sub-group "
            f"({largest_numel} elements), which one swap buffer must hold (DeepSpeed: \"More elements "
            f"... than buffer size\"). Set {where}.buffer_size >= {largest_numel}, or lower "
            f"zero.sub_group_size", key=f"{where}.buffer_size")
    count = options.buffer_count if options.buffer_count is not None else 4
    buffer_bytes = align(size * element_size)
    pinned = bool(options.pin_memory) and torch.cuda.is_available()
    pinned_bytes = count * buffer_bytes
    avail = host_available_bytes()
    if pinned_bytes > avail:
        raise SwapMemoryError(
            f"NVMe swap buffers need {fmt_bytes(pinned_bytes)} ({pinned_bytes} bytes) of "
            f"{'pinned ' if pinned else ''}host memory ({where}.buffer_count = {count} x buffer_size = "
            f"{size} elements x {element_size} bytes) but only {fmt_bytes(avail)} ({avail} bytes) is "
            f"available. Lower {where}.buffer_count or buffer_size (not below {largest_numel}), or "
            f"free host memory", path)
    clean_stale(path)
    swap_bytes = align(int(total_bytes)) + num_files * ALIGN
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if swap_bytes > free:
        raise SwapSpaceError(
            f"NVMe swap: the swap files need {fmt_bytes(swap_bytes)} ({swap_bytes} bytes) at {path} but "
            f"only {fmt_bytes(free)} ({free} bytes) is free there. Free space, point {where}.nvme_path "
            f"at a larger disk, or use more ranks (each holds a 1/N shard)", path, errno.ENOSPC)
    p = SwapPlan(path, size, buffer_bytes, count, pinned, pinned_bytes, swap_bytes, free)
    log.info(p.describe())
    return p


