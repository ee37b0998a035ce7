"""``deepspeed.ops.lamb``: FusedLamb, stepped by zeroplug's ``lamb`` plugin (FusedLamb's update
rule, with the trust ratio over whole parameters)."""
from __future__ import annotations

from .optimizer import HeldOptimizer

__all__ = ["FusedLamb"]


class FusedLamb(HeldOptimizer):
    """DeepSpeed's fused Lamb: zeroplug's ``lamb``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if amsgrad:
            from .optimizer import refuse
            refuse("FusedLamb(amsgrad=True)", "DeepSpeed's FusedLamb has no AMSGrad either; leave it false")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    def zeroplug_plugin(self):
        d = self.defaults
        return "lamb", {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
