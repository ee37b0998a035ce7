"""The optimizer ``deepspeed.initialize`` returns: the engine's torch optimizer (over this
rank's fp32 master shards) as DeepSpeed's ZeRO optimizer behaves toward a script.

Note: ``zero_grad()`` is the engine's (harmless: gradients are zeroed after every step);
the torch optimizer's own would drop the masters' gradient views that the engine keeps
between steps. ``step()`` is the engine's to call (``engine.step()``).
"""
from __future__ import annotations

import torch

from zeroplug.errors import StateError


class EngineOptimizer(torch.optim.Optimizer):
    """``param_groups``, ``state``, ``defaults``, ``state_dict`` of the engine's optimizer. Without
    a schedule in the config or passed to ``initialize``, the engine trains with the lr its
    groups hold: a torch LR scheduler built on this optimizer and stepped by the script sets it."""

    def __init__(self, engine):          # Note: torch's __init__ would take the groups over
        self.__dict__["engine"] = engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getattr__(self, name):
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine.optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def stepped(self) -> None:
        """The engine took a step. Note: torch's LR schedulers warn that they were stepped before
        the optimizer unless its step ran; the engine's step is this optimizer's."""
        self.__dict__["_opt_called"] = True

    def step(self, closure=None):
        raise StateError("the optimizer deepspeed.initialize returns is stepped by the engine: call "
                         "engine.step() after engine.backward(loss)")

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self):
        return f"EngineOptimizer({self.optimizer!r})"
