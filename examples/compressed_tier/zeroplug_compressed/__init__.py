"""The "compressed" offload tier: optimizer states in host memory, deflated between steps.

Only the optimizer's states go here (``kinds``); each sub-group's master and its
element-wise optimizer states (Adam's ``exp_avg``, ``exp_avg_sq``) are kept as compressed
bytes while the sub-group is not in use, and their tensors' storages are freed in place
(the tensors stay the same objects, as the contract asks). The gradients stay in plain
host memory: they are rewritten every step.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from zeroplug import hookimpl
from zeroplug.flat import alloc_storage, free_storage
from zeroplug.options import opt
from zeroplug.tiers import OffloadTier, TierCapabilities

__version__ = "0.1.0"


def pack(t: torch.Tensor, level: int) -> bytes:
    """``t``'s bytes, those of each position within an element stored together, deflated."""
    raw = t.detach().reshape(-1).view(torch.uint8).view(-1, t.element_size()).t().contiguous()
    return zlib.compress(raw.numpy().tobytes(), level)


def unpack(blob: bytes, out: torch.Tensor) -> None:
    """The inverse of :func:`pack`, into ``out`` (same size and dtype as when packed)."""
    planes = torch.frombuffer(bytearray(zlib.decompress(blob)), dtype=torch.uint8)
    out.view(-1).view(torch.uint8).view(-1, out.element_size()).copy_(planes.view(out.element_size(), -1).t())


class CompressedHost(OffloadTier):
    """Optimizer states in host memory, compressed without loss between steps."""
    kinds = ("optimizer",)

    @dataclass(frozen=True)
    class Options:
        level: int = opt(1, "zlib compression level: 1 is fastest, 9 smallest.", min=1, max=9)

    def __init__(self, options, run, kind):
        super().__init__(options, run, kind)
        self.packed: dict[int, dict[str, bytes]] = {}    # sub-group -> its tensors' bytes, by name
        self.stored = self.raw = 0                        # bytes kept and what they hold (a statistic)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(offloaded=True, in_memory=False)

    def plan(self, layout):
        super().plan(layout)          # masters (from the shards) and gradients in host memory
        for k in range(len(self.masters)):
            self.release(k, None, changed=True)

    def _tensors(self, k: int, optimizer) -> dict[str, torch.Tensor]:
        master = self.masters[k]
        out = {"master": master}
        state = optimizer.state.get(master, {}) if optimizer is not None else {}
        out.update((name, v) for name, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)
        return out

    def acquire(self, k, optimizer):
        if k not in self.packed:
            return                      # in memory already
        for name, t in self._tensors(k, optimizer).items():
            alloc_storage(t)
            unpack(self.packed[k][name], t)
        del self.packed[k]

    def release(self, k, optimizer, changed):
        if k in self.packed:
            return                      # not brought in
        packed = {}
        for name, t in self._tensors(k, optimizer).items():
            packed[name] = pack(t, self.options.level)
            self.stored += len(packed[name])
            self.raw += t.numel() * t.element_size()
            free_storage(t)
        self.packed[k] = packed

    def close(self):
        super().close()
        self.packed.clear()


@hookimpl
def zeroplug_register_offload_devices(register):
    register("compressed", CompressedHost)
