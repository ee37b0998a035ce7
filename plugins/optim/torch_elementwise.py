"""torch's element-wise optimizers on ZeRO's flat shards (``plugin = "torch"``, ``name = "Adagrad"``).

torch's optimizers step any tensor, and an optimizer whose update of each element reads only
that element's gradient, value and states (:data:`ELEMENTWISE`) gives a flat shard exactly
the values it gives the whole parameters: the class is built over the stage's fp32 master
shards as it is. With CPU offload those shards live in host memory and torch's own CPU
implementation steps them; checkpoints hold its per-element states like Adam's.

Optimizers that are not element-wise are refused with the reason: LBFGS re-evaluates the
loss through a closure and keeps whole-model vectors; SparseAdam needs sparse gradients;
Muon orthogonalises whole matrices (``plugin = "muon"`` does that over shards); a class zeroplug
does not know cannot be vouched for (register it as an optimizer plugin: docs/plugins.md).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Literal

import torch

from zeroplug.errors import ConfigError
from zeroplug.options import opt
from zeroplug.slots import OptimizerFactory

#: torch.optim classes whose update is element-wise, and the fp32 states per element they keep
#: (bytes; those that depend on a setting are given for its default and corrected in state_bytes)
ELEMENTWISE = {"Adadelta": 8.0, "Adagrad": 4.0, "Adam": 8.0, "AdamW": 8.0, "Adamax": 8.0, "ASGD": 8.0,
               "NAdam": 8.0, "RAdam": 8.0, "RMSprop": 4.0, "Rprop": 8.0, "SGD": 0.0}
WHY_NOT = {
    "LBFGS": "it re-evaluates the loss through a closure and keeps whole-model vectors (no shard can step it); "
             "train with an element-wise optimizer (AdamW, Adagrad, ...) or plugin = \"muon\"",
    "SparseAdam": "it needs sparse gradients, and ZeRO's gradients are dense flat shards; use \"AdamW\" or "
                  "\"Adam\"",
    "Muon": "it orthogonalises whole matrices; use [optimizer] plugin = \"muon\" (Muon on the matrices, "
            "AdamW on the rest, over ZeRO's shards)",
}


def classify(name: str) -> None:
    """Raise a ConfigError naming why ``name`` (a torch.optim class name) cannot step shards."""
    if name in ELEMENTWISE:
        return
    if name in WHY_NOT:
        raise ConfigError(f"optimizer.name = \"{name}\": torch.optim.{name} cannot step ZeRO's flat shards: "
                          f"{WHY_NOT[name]}", key="optimizer.name")
    raise ConfigError(f"optimizer.name = \"{name}\": zeroplug does not know whether {name} updates each element "
                      f"alone, which stepping flat shards needs; use one of {', '.join(sorted(ELEMENTWISE))}, "
                      f"or register it as an optimizer plugin (docs/plugins.md)", key="optimizer.name")


@dataclass(frozen=True)
class TorchOptions:
    name: str = opt("Adagrad", "The torch.optim class (element-wise ones: " + ", ".join(sorted(ELEMENTWISE))
                    + "). Settings left unset take the class's defaults.")
    lr: float = opt(1e-2, "Learning rate (the peak, when a schedule warms up to it).", min=0.0)
    betas: tuple[float, float] | None = opt(None, "Adam-like classes' (beta1, beta2).")
    eps: float | None = opt(None, "Added to the denominator.")
    weight_decay: float | None = opt(None, "Weight decay as the class applies it.")
    momentum: float | None = opt(None, "SGD, RMSprop: momentum.")
    dampening: float | None = opt(None, "SGD: dampening.")
    nesterov: bool | None = opt(None, "SGD: Nesterov momentum.")
    alpha: float | None = opt(None, "RMSprop: smoothing constant; ASGD: the eta update's power.")
    centered: bool | None = opt(None, "RMSprop: centered.")
    lr_decay: float | None = opt(None, "Adagrad: learning-rate decay.")
    initial_accumulator_value: float | None = opt(None, "Adagrad: the sum of squares' start.")
    rho: float | None = opt(None, "Adadelta: the running average's coefficient.")
    momentum_decay: float | None = opt(None, "NAdam: momentum decay.")
    decoupled_weight_decay: bool | None = opt(None, "NAdam, RAdam: AdamW-style weight decay.")
    lambd: float | None = opt(None, "ASGD: decay term.")
    t0: float | None = opt(None, "ASGD: the step at which averaging starts.")
    etas: tuple[float, float] | None = opt(None, "Rprop: (etaminus, etaplus).")
    step_sizes: tuple[float, float] | None = opt(None, "Rprop: (minimal, maximal) step size.")
    amsgrad: bool | None = opt(None, "Adam, AdamW: AMSGrad.")
    implementation: Literal["auto", "foreach", "single"] = opt(
        "auto", "torch's loop: \"foreach\" (multi-tensor), \"single\" (one tensor at a time) or \"auto\" (the "
                "class's default).")

    def settings(self) -> dict:
        """The class's keyword arguments that are set."""
        skip = {"name", "implementation"}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in skip and getattr(self, f.name) is not None}

    def validate(self, path: str) -> None:
        classify(self.name)
        accepts = inspect.signature(getattr(torch.optim, self.name)).parameters
        for key in self.settings():
            if key not in accepts:
                raise ConfigError(f"{path}.{key} is not a setting of torch.optim.{self.name} (its settings: "
                                  f"{', '.join(k for k in accepts if k not in ('self', 'params'))})",
                                  key=f"{path}.{key}")


class TorchElementwise(OptimizerFactory):
    """A torch.optim class whose update is element-wise, over the flat fp32 master shards."""
    Options = TorchOptions

    @classmethod
    def state_bytes(cls, options, run, state_device):
        n = ELEMENTWISE.get(options.name, 8.0)
        if options.name == "SGD":
            return 4.0 if options.momentum else 0.0
        if options.name == "RMSprop":
            return n + 4.0 * bool(options.momentum) + 4.0 * bool(options.centered)
        return n + (4.0 if options.amsgrad else 0.0)

    def build(self, params, device):
        o = self.options
        kwargs = o.settings()
        if o.implementation != "auto":
            kwargs["foreach"] = o.implementation == "foreach"
        return getattr(torch.optim, o.name)(params, **kwargs)


def table_for(optimizer: torch.optim.Optimizer) -> dict:
    """The ``[optimizer]`` table that steps as ``optimizer`` (an instance of a torch.optim
    class) would: its class and the settings it was built with; a ConfigError for one that
    is not element-wise."""
    cls = type(optimizer)
    name = cls.__name__
    if getattr(torch.optim, name, None) is not cls:
        raise ConfigError(f"optimizer {cls.__module__}.{cls.__qualname__}: zeroplug does not know whether it "
                          "updates each element alone, which stepping flat shards needs; use a torch.optim class "
                          "(" + ", ".join(sorted(ELEMENTWISE)) + ") or register it as an optimizer plugin "
                          "(docs/plugins.md)", key="optimizer")
    classify(name)
    known = {f.name for f in fields(TorchOptions)} - {"name", "implementation"}
    out = {"plugin": "torch", "name": name}
    for k, v in optimizer.defaults.items():
        if k in known and v is not None:
            out[k] = list(v) if isinstance(v, tuple) else v
    return out
