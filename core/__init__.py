"""zeroplug: plugin-based ZeRO training for PyTorch.

Public surface::

    engine = zeroplug.initialize(model, config="zero.toml")
    with zeroplug.init(config): model = build()
"""
from .config import Config, load as load_config
from .engine import Engine, init, initialize
from .errors import ConfigError, PluginError, StateError, ZeroplugError
from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["initialize", "init", "Engine", "Config", "load_config", "hookimpl",
           "ZeroplugError", "ConfigError", "PluginError", "StateError"]
