"""zeroplug: plugin-based ZeRO training for PyTorch.

Public surface::

    engine = zeroplug.initialize(model, config="zero.toml")
    with zeroplug.init(config): model = build()
"""
from __future__ import annotations

import importlib
import importlib.util

from .config import Config, load as load_config
from .errors import ConfigError, PluginError, RanksDisagree, StateError, ZeroplugError
from .hookspecs import hookimpl

__version__ = "0.1.0"

# Note: the names that need torch are imported on first use (PEP 562), so that the command
# line's help, its config errors and a plugin's `from zeroplug import hookimpl` start
# without torch's import (about 2 s on a busy 2-core machine).
_LAZY = {
    "Engine": ".engine", "init": ".engine", "initialize": ".engine",
    "gathered_parameters": ".gathering",
    "OffloadDeviceEnum": ".offload_states", "OffloadStateTypeEnum": ".offload_states",
    "get_state_devices": ".offload_states",
    "get_leaf_modules": ".leaf", "is_leaf_module": ".leaf", "set_leaf_modules": ".leaf",
    "unset_leaf_modules": ".leaf",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        # a submodule read as an attribute (``zeroplug.engine.X`` after ``import zeroplug``)
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'zeroplug' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["initialize", "init", "gathered_parameters", "Engine", "Config", "load_config", "hookimpl",
           "ZeroplugError", "get_state_devices", "OffloadStateTypeEnum", "OffloadDeviceEnum", "ConfigError",
           "PluginError", "StateError", "RanksDisagree", "set_leaf_modules", "unset_leaf_modules", "get_leaf_modules",
           "is_leaf_module"]
