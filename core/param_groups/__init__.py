"""Torch-style parameter groups, as ``zeroplug.initialize(model, cfg, model_parameters=...)`` takes them.

``model_parameters`` is what users pass to ``torch.optim.AdamW``: an iterable of parameters,
or of dicts ``{"params": [...], "lr": ..., "weight_decay": ..., "betas": ..., "eps": ...}``.
The partitioner keeps the parameters of different groups in different units, so every
master tensor belongs to one group; the optimizer gets one param group per group (per
sub-group when offloaded), with the group's settings over the ``[optimizer]`` table's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroplug.errors import ConfigError


@dataclass(frozen=True)
class ParamGroups:
    """Which group each parameter is in (by identity) and each group's own settings."""
    group_of: dict            # id(param) -> group index
    settings: tuple = ({},)   # per group: optimizer settings that override the [optimizer] table

    def index(self, p: torch.Tensor) -> int:
        return self.group_of.get(id(p), 0)

    @property
    def plain(self) -> bool:
        """One group with no settings of its own: the [optimizer] table's alone."""
        return len(self.settings) == 1 and not self.settings[0]


# Note: torch.optim fills every group with its constructor's settings; groups that went through
# torch.optim.AdamW(groups) (accelerate, DeepSpeed-Chat) carry these. Kernel choices are
# zeroplug's (optimizer.implementation); a group's fused=None would switch the fused step off.
KERNEL_FLAGS = ("fused", "foreach", "capturable")
# settings whose torch default is the only value zeroplug trains with
MATH_FLAGS = {"maximize": (False, "zeroplug minimizes the loss: negate the loss instead"),
              "differentiable": (False, "autograd through the optimizer step is not supported")}
# settings of torch's own classes that zeroplug's optimizer plugin decides (adam / adamw)
CLASS_FLAGS = ("decoupled_weight_decay",)


def check_torch_flags(settings: dict, where: str) -> None:
    """Refuse the torch optimizer settings that would change the maths (ConfigError)."""
    for k, (default, why) in MATH_FLAGS.items():
        if settings.get(k, default) not in (default, None):
            raise ConfigError(f"{where}: {k} = {settings[k]!r} is not supported: {why}", key=k)


def group_settings(g: dict, where: str) -> dict:
    """A torch param group's own settings: torch's kernel flags and defaults left out, the
    lr a torch LR scheduler started from (``initial_lr``) as its lr (zeroplug's schedule
    drives it from there)."""
    check_torch_flags(g, where)
    out = {}
    for k, v in g.items():
        if k in ("params", "initial_lr") or k in KERNEL_FLAGS or k in MATH_FLAGS or k in CLASS_FLAGS:
            continue
        if k == "amsgrad" and not v:
            continue
        out[k] = tuple(v) if k == "betas" else v
    if "initial_lr" in g:
        out["lr"] = g["initial_lr"]
    return out


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def param_groups(module: torch.nn.Module, model_parameters=None) -> ParamGroups:
    """Check ``model_parameters`` against ``module`` and number the groups.

    None: every trainable parameter of the module, one group. Parameters that require
    gradients must all be listed (a listed parameter must belong to the module);
    frozen ones may be listed or not and are never stepped."""
    if model_parameters is None:
        return ParamGroups({})
    if isinstance(model_parameters, torch.Tensor):
        raise ConfigError("model_parameters: pass an iterable of parameters or of param-group dicts "
                          "(as for torch.optim.AdamW), not one tensor", key="model_parameters")
    items = list(model_parameters)
    if not items:
        raise ConfigError("model_parameters is empty: pass the parameters to train, or leave it out to "
                          "train every parameter with requires_grad=True", key="model_parameters")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    names = _names(module)
    group_of, settings = {}, []
    for gi, g in enumerate(items):
        if not isinstance(g, dict) or "params" not in g:
            raise ConfigError(f"model_parameters[{gi}]: expected a dict with a 'params' key (torch-style "
                              "param group) or a parameter", key="model_parameters")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for p in ps:
            if id(p) not in names:
                raise ConfigError(f"model_parameters[{gi}] holds a parameter that is not in the model "
                                  f"(shape {tuple(p.shape)}); pass parameters of the model you wrap",
                                  key="model_parameters")
            if id(p) in group_of and group_of[id(p)] != gi:
                raise ConfigError(f"parameter {names[id(p)]!r} is in model_parameters groups "
                                  f"{group_of[id(p)]} and {gi}; a parameter belongs to one group "
                                  "(torch.optim refuses this too)", key="model_parameters")
            group_of[id(p)] = gi
        settings.append(group_settings(g, f"model_parameters[{gi}]"))
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"parameter {', '.join(repr(n) for n in missing[:3])}{more} requires grad but is "
                          "in no group of model_parameters; add it to a group, or set requires_grad=False "
                          "to freeze it", key="model_parameters")
    return ParamGroups(group_of, tuple(settings))
