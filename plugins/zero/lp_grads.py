"""Gradients kept in the model dtype until the step, on one rank.

With one rank, no reduction and no accumulation, a unit's fp32 master gradient would be
an exact widening of the bf16 (or fp16) gradients autograd produced: 4 bytes per element
that hold nothing the 2-byte gradients do not. So the partitioner keeps autograd's
gradients as they are and widens them a few units at a time inside the step, each slice
stepped and freed before the next is widened.

Note: this is what sets the end of backward. With fp32 master gradients, the 1.3B
reference model at stage 2 held 18 bytes per parameter there (bf16 parameters, fp32
master, Adam's moments, fp32 gradients), its peak; with these, 16, and the step holds at
most 2 bytes per parameter of gradients plus one slice of fp32 (``SLICES`` of the model).

Only where it changes no value: the optimizer must apply the step's gradient multiplier
inside its own pass (torch's fused kernels, cpu_adam), because the engine's alternative, multiplying the
gradients in place before the step, would round them to the model dtype.
"""
from __future__ import annotations

import torch

from zeroplug.tiers import step_all

SLICES = 8      # the step widens about 1/SLICES of the gradients at a time


class LowPrecisionGrads:
    """Per unit, the model-dtype gradient of each of its parameters (None: none arrived)."""

    def __init__(self, units):
        self.grads = {u.index: [None] * len(u.params) for u in units}
        total = sum(u.hi - u.lo for u in units)
        size = max([u.hi - u.lo for u in units] + [-(-total // SLICES)])
        self.slices, cur, n = [], [], 0
        for u in units:
            if cur and n + (u.hi - u.lo) > size:
                self.slices.append(cur)
                cur, n = [], 0
            cur.append(u)
            n += u.hi - u.lo
        if cur:
            self.slices.append(cur)

    def keep(self, u, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i`` of unit ``u`` has its gradient. A second one in the same window
        (two backward calls before a step) is added in fp32, as the master gradient would."""
        prev = self.grads[u.index][i]
        self.grads[u.index][i] = grad if prev is None else prev.float().add_(grad)

    def tensors(self) -> list[torch.Tensor]:
        return [g for gs in self.grads.values() for g in gs if g is not None]

    def norm_sq(self, device) -> torch.Tensor:
        """The squared global norm, accumulated in fp32 (as of the widened gradients)."""
        grads = self.tensors()
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).pow(2).sum()

    def widen(self, u) -> torch.Tensor:
        """Unit ``u``'s fp32 master gradient (zeros where no gradient arrived, and padding)."""
        out = torch.empty_like(u.master)      # (one rank: the unit's elements, then its padding)
        for i, g in enumerate(self.grads[u.index]):
            o, n = u.layout.offsets[i] - u.lo, u.layout.numels[i]
            if g is None:
                out[o:o + n].zero_()
            else:
                out[o:o + n].view(g.shape).copy_(g)
        out[u.layout.total - u.lo:].zero_()
        return out

    def step(self, optimizer, grad_multiplier: float = 1.0) -> None:
        """Step the masters slice by slice; each slice's gradients are freed after its step.

        Note: the optimizer skips every master whose gradient is None, so each call steps
        exactly one slice, and every master is stepped once per boundary."""
        for units in self.slices:
            for u in units:
                u.master.grad = self.widen(u)
                self.grads[u.index] = [None] * len(u.params)
            step_all(optimizer, grad_multiplier)
            for u in units:
                u.master.grad = None

    def clear(self) -> None:
        for k in self.grads:
            self.grads[k] = [None] * len(self.grads[k])
