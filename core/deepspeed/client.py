"""What a script hands ``deepspeed.initialize`` besides the model: its optimizer (a torch
optimizer, a ``deepspeed.ops`` one or a factory), its LR scheduler (or a factory) and its
config, mapped onto zeroplug's config and engine."""
from __future__ import annotations

import json
import os

import torch

from zeroplug.errors import ConfigError

from .ops.optimizer import HeldOptimizer

# torch optimizer class -> zeroplug optimizer plugin and the defaults it reads
_TORCH = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
SUPPORTED = ("torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch's other element-wise classes, "
             "deepspeed.ops.adam.FusedAdam, DeepSpeedCPUAdam")


def read_config(config=None, config_params=None, args=None):
    """The config as DeepSpeed finds it: ``config`` (dict or path), else ``config_params``,
    else ``args.deepspeed_config`` (``args.deepscale_config``); None when none is given."""
    given = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given and from_args is not None:
        raise ConfigError("config given both to deepspeed.initialize(config=...) and as "
                          "--deepspeed_config: pass one (DeepSpeed refuses both too)", key="deepspeed_config")
    source = given[0] if given else from_args
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".json"):
        try:
            with open(source) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{source}: no such DeepSpeed config file", key="deepspeed_config") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not valid JSON: {exc}", key="deepspeed_config") from None
    return source


def optimizer_table(optimizer) -> dict:
    """The ``[optimizer]`` table (plugin and options) that steps as ``optimizer`` would."""
    if isinstance(optimizer, HeldOptimizer):
        plugin, opts = optimizer.zeroplug_plugin()
        return {"plugin": plugin, **opts}
    cls = type(optimizer)
    plugin = next((name for c, name in _TORCH.items() if cls is c), None)
    if plugin is None and getattr(torch.optim, cls.__name__, None) is cls:
        return _torch_class_table(optimizer)
    if plugin is None:
        raise ConfigError(f"optimizer {cls.__module__}.{cls.__qualname__} has no zeroplug equivalent; use one "
                          f"of {SUPPORTED}", key="optimizer")
    d = optimizer.defaults
    if plugin == "adam" and d.get("decoupled_weight_decay"):
        plugin = "adamw"
    keys = _SGD_KEYS if plugin == "sgd" else _ADAM_KEYS
    out = {"plugin": plugin}
    for k in keys:
        if k in d:
            out[k] = list(d[k]) if k == "betas" else d[k]
    from zeroplug.param_groups import check_torch_flags
    check_torch_flags(d, f"{cls.__qualname__}(...)")
    return out


def _torch_class_table(optimizer) -> dict:
    """Another torch.optim class: the ``torch`` optimizer plugin with its class name and the
    settings it was built with (the plugin refuses, with the reason, a class whose update is
    not element-wise)."""
    from zeroplug.options import fields_of
    from zeroplug.param_groups import check_torch_flags
    from zeroplug.registry import get_plugin_manager
    cls = type(optimizer)
    check_torch_flags(optimizer.defaults, f"{cls.__qualname__}(...)")
    known = fields_of(get_plugin_manager().get("optimizer", "torch", "optimizer.plugin").impl.Options)
    out = {"plugin": "torch", "name": cls.__name__}
    for k, v in optimizer.defaults.items():       # the settings the plugin has (a class it refuses has others)
        if k in known and k != "name" and v is not None:
            out[k] = list(v) if isinstance(v, tuple) else v
    return out


def optimizer_groups(optimizer) -> list[dict]:
    """The optimizer's parameter groups as ``model_parameters``: each group's own settings,
    its lr the one a scheduler started from (``initial_lr``) when a scheduler set one."""
    groups = []
    for g in optimizer.param_groups:
        if not g["params"]:
            continue        # DeepSpeed drops empty groups too
        settings = {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
        if "initial_lr" in g:
            settings["lr"] = g["initial_lr"]
        groups.append({"params": list(g["params"]), **settings})
    return groups


class ClientSchedule:
    """The engine's lr from a torch optimizer's groups (the script's own, which its scheduler
    sets, or the engine's): the schedule (``lr_at``) follows the first group's lr, and every
    group keeps its lr in proportion (as torch's schedulers do with one lambda)."""

    def __init__(self, scheduler, optimizer, base_lr: float):
        self.scheduler, self.optimizer, self.base_lr = scheduler, optimizer, base_lr
        g = optimizer.param_groups[0]
        self.start = g.get("initial_lr", g["lr"])

    def lr_at(self, step: int) -> float:
        now = self.optimizer.param_groups[0]["lr"]
        if self.start == 0:
            return now
        return self.base_lr * now / self.start
