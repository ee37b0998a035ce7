"""The base of the ``deepspeed.ops`` optimizer classes: settings holders that the engine maps
to zeroplug's optimizer plugins (zeroplug.deepspeed.client reads ``zeroplug_plugin``)."""
from __future__ import annotations

import torch

from zeroplug.errors import ConfigError, StateError


class HeldOptimizer(torch.optim.Optimizer):
    """Parameter groups and settings for zeroplug's ``plugin`` optimizer."""

    def zeroplug_plugin(self) -> tuple[str, dict]:
        """(zeroplug optimizer plugin, its [optimizer] options from this object's defaults)."""
        raise NotImplementedError

    def step(self, closure=None):
        raise StateError(f"{type(self).__name__} is stepped by the engine: pass it to "
                         "deepspeed.initialize(optimizer=...) and call engine.step()")


def refuse(name: str, alternative: str):
    raise ConfigError(f"{name} is not supported by zeroplug: {alternative}", key=name)
