"""``deepspeed.ops.adam``: DeepSpeedCPUAdam and FusedAdam, stepped by zeroplug's Adam plugins."""
from __future__ import annotations

from .optimizer import HeldOptimizer

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedCPUAdam(HeldOptimizer):
    """DeepSpeed's CPU Adam: zeroplug's ``auto`` optimizer (cpu_adam when the optimizer states
    are offloaded from a GPU, torch's AdamW otherwise: the same update), ``cpu_adam`` for the
    settings only it has (``adamw_mode=False``, ``bias_correction=False``)."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if amsgrad:
            from .optimizer import refuse
            refuse("DeepSpeedCPUAdam(amsgrad=True)", "DeepSpeed's CPU Adam has no AMSGrad either; use "
                   "torch.optim.AdamW(amsgrad=True) with the optimizer states on the GPU")
        super().__init__(model_params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                            weight_decay=weight_decay, amsgrad=False, adamw_mode=adamw_mode))

    def zeroplug_plugin(self):
        d = self.defaults
        opts = dict(lr=d["lr"], betas=list(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"])
        if d["adamw_mode"] and d["bias_correction"]:
            return "auto", opts
        return "cpu_adam", {**opts, "adamw_mode": d["adamw_mode"], "bias_correction": d["bias_correction"]}


class FusedAdam(HeldOptimizer):
    """DeepSpeed's fused GPU Adam: zeroplug's ``adamw`` (``adam_w_mode=True``, the default) or
    ``adam`` (torch's fused kernels); ``bias_correction=False``: ``cpu_adam``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad, adam_w_mode=adam_w_mode))

    def zeroplug_plugin(self):
        d = self.defaults
        opts = dict(lr=d["lr"], betas=list(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"])
        if not d["bias_correction"]:
            if d["amsgrad"]:
                from .optimizer import refuse
                refuse("FusedAdam(bias_correction=False, amsgrad=True)",
                       "cpu_adam (the optimizer with bias_correction) has no AMSGrad; keep bias_correction")
            return "cpu_adam", {**opts, "adamw_mode": d["adam_w_mode"], "bias_correction": False}
        return ("adamw" if d["adam_w_mode"] else "adam"), {**opts, "amsgrad": d["amsgrad"]}
