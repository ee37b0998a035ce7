"""DeepSpeed's own optimizers' update rules, over ZeRO's flat shards.

* ``lion`` (DeepSpeed's Lion, FusedLion / DeepSpeedCPULion): ``c = beta1 m + (1 - beta1) g``;
  ``p <- p (1 - lr wd) - lr sign(c)``; ``m <- beta2 m + (1 - beta2) g``.
* ``ds_adagrad`` (DeepSpeedCPUAdagrad): ``s <- s + (g + wd p)^2``;
  ``p <- p - lr g / (sqrt(s) + eps)`` (the weight decay enters the sum of squares only, as
  DeepSpeed's kernel writes it).
* ``lamb`` (FusedLamb): Adam's bias-corrected moments, ``u = m^ / (sqrt(v^) + eps) + wd p``
  (``eps_inside_sqrt``: ``sqrt(v^ + eps)``), and per parameter the trust ratio
  ``||p|| / ||u||`` clamped to [min_coeff, max_coeff] (1 where either norm is 0);
  ``p <- p - lr ratio u``. The norms are over whole parameters: each rank sums the squares of
  its pieces of every parameter and one all-reduce of those sums gives the whole norms
  (:mod:`zeroplug.shard_map`), so sharding changes no value.

Lion and Adagrad are element-wise: their shards step as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroplug.options import opt
from zeroplug.shard_map import check_training_thread
from zeroplug.slots import OptimizerFactory


def with_grads(groups):
    """``(group, parameter)`` for each parameter of ``groups`` that has a gradient."""
    for g in groups:
        for p in g["params"]:
            if p.grad is not None:
                yield g, p


def adam_moments(state: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``p``'s first and second moments in ``state`` (zeros at its first step) and the step
    count, advanced by one."""
    if "exp_avg" not in state:
        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] = torch.tensor(0.0)
    state["step"] += 1
    return state["exp_avg"], state["exp_avg_sq"], float(state["step"])


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g, p in with_grads(self.param_groups):
            b1, b2 = g["betas"]
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p)
            m = st["exp_avg"]
            update = (m * b1).add_(p.grad, alpha=1 - b1).sign_()
            p.mul_(1 - g["lr"] * g["weight_decay"]).add_(update, alpha=-g["lr"])
            m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class DeepSpeedAdagrad(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g, p in with_grads(self.param_groups):
            st = self.state[p]
            if "exp_avg_sq" not in st:
                st["exp_avg_sq"] = torch.zeros_like(p)
            decayed = p.grad.add(p, alpha=g["weight_decay"]) if g["weight_decay"] > 0 else p.grad
            st["exp_avg_sq"].addcmul_(decayed, decayed)
            p.addcdiv_(p.grad, st["exp_avg_sq"].sqrt().add_(g["eps"]), value=-g["lr"])
        return loss


class Lamb(torch.optim.Optimizer):
    """FusedLamb's rule with per-parameter trust ratios (see the module doc). Without a
    shard map (``bind_shard_map``) each tensor is a whole parameter."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                 eps_inside_sqrt=False, max_coeff=10.0, min_coeff=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.shard_map = None

    def bind_shard_map(self, shard_map) -> None:
        self.shard_map = shard_map

    def _pieces(self, t):
        """(offset in ``t``, length) of each parameter's piece in ``t``, by parameter."""
        if self.shard_map is None:
            return [[(0, t.numel())]]
        out = []
        for b in self.shard_map.blocks_of(t):
            for s in b.spans:
                x, y = max(b.lo, s.offset), min(b.hi, s.offset + s.numel)
                out.append([(b.start + x - b.lo, y - x)] if x < y else [])
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g, p in with_grads(self.param_groups):
            b1, b2 = g["betas"]
            m, v, n = adam_moments(self.state[p], p)
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            c1, c2 = (1 - b1 ** n, 1 - b2 ** n) if g["bias_correction"] else (1.0, 1.0)
            v_hat = v / c2
            denom = (v_hat + g["eps"]).sqrt_() if g["eps_inside_sqrt"] else v_hat.sqrt_().add_(g["eps"])
            update = (m / c1).div_(denom).add_(p, alpha=g["weight_decay"])
            pieces = self._pieces(p)
            sums = torch.zeros(len(pieces), 2, dtype=torch.float64, device=p.device)
            for i, ps in enumerate(pieces):
                for a, k in ps:
                    sums[i, 0] += p[a:a + k].double().square().sum()
                    sums[i, 1] += update[a:a + k].double().square().sum()
            comm = self.shard_map.comm if self.shard_map is not None else None
            if comm is not None and comm.world_size > 1:
                check_training_thread(self.shard_map, "Lamb")
                wire = sums.to(self.shard_map.device)
                comm.all_reduce(wire)
                sums = wire.to(p.device)
            norms = sums.sqrt().tolist()
            for (w, u), ps in zip(norms, pieces):
                ratio = 1.0
                if w != 0 and u != 0:
                    ratio = min(max(w / u, g["min_coeff"]), g["max_coeff"])
                for a, k in ps:
                    p[a:a + k].add_(update[a:a + k], alpha=-g["lr"] * ratio)
        return loss


@dataclass(frozen=True)
class LionOptions:
    lr: float = opt(1e-4, "Learning rate.", min=0.0)
    betas: tuple[float, float] = opt((0.9, 0.99), "Lion's (beta1: the update's mix, beta2: the momentum's).",
                                     min=0.0, below=1.0)
    weight_decay: float = opt(0.0, "Decoupled weight decay.", min=0.0)


@dataclass(frozen=True)
class AdagradOptions:
    lr: float = opt(1e-2, "Learning rate.", min=0.0)
    eps: float = opt(1e-10, "Added to the root of the sum of squares.", min=0.0)
    weight_decay: float = opt(0.0, "Weight decay, added to the gradient in the sum of squares (DeepSpeed's).",
                              min=0.0)


@dataclass(frozen=True)
class LambOptions:
    lr: float = opt(1e-3, "Learning rate.", min=0.0)
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam's (beta1, beta2).", min=0.0, below=1.0)
    eps: float = opt(1e-8, "Added to the denominator.", min=0.0)
    weight_decay: float = opt(0.0, "Weight decay, added to the update before the trust ratio.", min=0.0)
    bias_correction: bool = opt(True, "Bias-correct the moments.")
    eps_inside_sqrt: bool = opt(False, "eps under the square root (DeepSpeed's mode 0).")
    max_coeff: float = opt(10.0, "The trust ratio's upper clamp.", min=0.0)
    min_coeff: float = opt(0.01, "The trust ratio's lower clamp.", min=0.0)


class _Factory(OptimizerFactory):
    cls = None
    states_per_element = 1      # fp32 state tensors the rule keeps per parameter element

    def build(self, params, device):
        from dataclasses import asdict
        return self.cls(params, **asdict(self.options))

    @classmethod
    def state_bytes(cls, options, run, state_device):
        return 4.0 * cls.states_per_element


class LionFactory(_Factory):
    """DeepSpeed's Lion."""
    Options = LionOptions
    cls = Lion


class AdagradFactory(_Factory):
    """DeepSpeed's Adagrad (DeepSpeedCPUAdagrad's rule)."""
    Options = AdagradOptions
    cls = DeepSpeedAdagrad


class LambFactory(_Factory):
    """DeepSpeed's Lamb (FusedLamb's rule; trust ratios over whole parameters)."""
    Options = LambOptions
    cls = Lamb
    states_per_element = 2      # exp_avg, exp_avg_sq
