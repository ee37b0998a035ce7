"""zeroplug: plugin-based ZeRO training for PyTorch.

Public surface::

    engine = zeroplug.initialize(model, config="zero.toml")
    with zeroplug.init(config): model = build()
"""
from .config import Config, load as load_config
from .engine import Engine, init, initialize
from .gathering import gathered_parameters
from .errors import ConfigError, PluginError, RanksDisagree, StateError, ZeroplugError
from .hookspecs import hookimpl
from zeroplug.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum, get_state_devices
from zeroplug.leaf import get_leaf_modules, is_leaf_module, set_leaf_modules, unset_leaf_modules
__version__ = "0.1.0"
__all__ = ["initialize", "init", "gathered_parameters", "Engine", "Config", "load_config", "hookimpl",
           "ZeroplugError", "get_state_devices", "OffloadStateTypeEnum", "OffloadDeviceEnum", "ConfigError", "PluginError", "StateError", "RanksDisagree", "set_leaf_modules", "unset_leaf_modules", "get_leaf_modules", "is_leaf_module"]
