"""Finding plugins and the named implementations they register.

Plugins load only from the ``zeroplug`` entry-point group (built-ins too).
Two environment variables filter them by entry-point name, comma-separated, matched
without regard to case:

* ``ZEROPLUG_PLUGINS_ALLOW`` — if set, only these entry points load.
* ``ZEROPLUG_PLUGINS_BLOCK`` — these never load.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from importlib import metadata

import pluggy

from . import hookspecs
from .errors import PluginError
from .options import suggest

ENTRY_POINT_GROUP = "zeroplug"
#: the entry points of zeroplug's own distribution that add ``zeroplug`` subcommands (named in
#: ``ENTRY_POINT_GROUP`` too): the command line loads them without the other built-in plugins
COMMANDS_GROUP = "zeroplug.commands"

#: slot name (as in TOML) -> registration hook name
SLOTS = {
    "zero": "zeroplug_register_partitioners",
    "precision": "zeroplug_register_precisions",
    "optimizer": "zeroplug_register_optimizers",
    "scheduler": "zeroplug_register_schedulers",
    "offload": "zeroplug_register_offload_devices",
    "monitor": "zeroplug_register_monitors",
    "activations": "zeroplug_register_activations",
    "sequence": "zeroplug_register_sequence",
}


@dataclass(frozen=True)
class Registered:
    """One named implementation: who registered it and the class itself."""
    slot: str
    name: str
    impl: type
    plugin: str      # entry-point name of the plugin that registered it


ALLOW_ENV = "ZEROPLUG_PLUGINS_ALLOW"
BLOCK_ENV = "ZEROPLUG_PLUGINS_BLOCK"


def _env_list(var: str) -> set[str] | None:
    """The names in ``var``, case-folded (entry-point names are matched without case)."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {x.strip().casefold() for x in raw.split(",") if x.strip()}


class PluginManager:
    """Holds the loaded plugins and, per slot, the implementations by name."""

    def __init__(self, load_entry_points: bool = True, builtin_only: bool = False):
        self.pm = pluggy.PluginManager("zeroplug")
        self.pm.add_hookspecs(hookspecs)
        self.hook = self.pm.hook
        self.versions: dict[str, str] = {}
        self._registry: dict[str, dict[str, Registered]] | None = None
        if load_entry_points:
            self.load_entry_points(builtin_only)

    def load_entry_points(self, builtin_only: bool = False, skip=None) -> None:
        """The plugins of the entry-point group (``builtin_only``: those zeroplug ships;
        ``skip(ep)`` True: not that one)."""
        allow = _env_list(ALLOW_ENV)
        block = _env_list(BLOCK_ENV) or set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            name = ep.name.casefold()
            if name in block or (allow is not None and name not in allow):
                continue
            if self.pm.has_plugin(ep.name) or builtin_only and not _builtin(ep) or skip is not None and skip(ep):
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken third-party plugin names itself
                raise PluginError(
                    f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}. "
                    f"Fix or uninstall it, or skip it with ZEROPLUG_PLUGINS_BLOCK={ep.name}"
                ) from exc
            self.register(module, ep.name, version=ep.dist.version if ep.dist else "?")

    def register(self, plugin, name: str, version: str = "?") -> None:
        """Add a plugin object (a module or an instance with hookimpls)."""
        self.attach(plugin, name)
        self.versions[name] = version
        self._registry = None

    def attach(self, plugin, name: str) -> None:
        """Register ``plugin`` for its lifecycle hooks only (an engine's monitor: registers
        no implementations). A hook implementation that matches no hook is an error."""
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            known = [h for h in dir(hookspecs) if h.startswith("zeroplug_")]
            bad = sorted(n for n in dir(plugin) if n not in known and hasattr(getattr(plugin, n), "zeroplug_impl"))
            what = ", ".join(f"{b!r}" for b in bad) or str(exc)
            raise PluginError(f"plugin {name!r}: hook implementation {what} matches no zeroplug hook."
                              f"{suggest(bad[0], known) if bad else ''} The hooks are in zeroplug.hookspecs "
                              f"(docs/plugins.md)") from None

    def detach(self, name: str) -> None:
        """Undo :meth:`attach` (harmless when already gone)."""
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)

    # -- named implementations -------------------------------------------------
    def registry(self) -> dict[str, dict[str, Registered]]:
        if self._registry is None:
            reg: dict[str, dict[str, Registered]] = {slot: {} for slot in SLOTS}
            for slot, hook_name in SLOTS.items():
                hook = getattr(self.hook, hook_name)
                for impl in hook.get_hookimpls():
                    def register(name: str, cls: type, _slot=slot, _plugin=impl.plugin_name):
                        if not hasattr(cls, "Options"):
                            raise PluginError(f"{_plugin}: {_slot} implementation {name!r} "
                                              "has no Options dataclass")
                        if name in reg[_slot]:
                            other = reg[_slot][name].plugin
                            raise PluginError(f"{_slot} implementation {name!r} is registered by "
                                              f"both {other!r} and {_plugin!r}; block one with "
                                              f"ZEROPLUG_PLUGINS_BLOCK")
                        reg[_slot][name] = Registered(_slot, name, cls, _plugin)
                    impl.function(register=register)
            self._registry = reg
        return self._registry

    def names(self, slot: str) -> list[str]:
        return sorted(self.registry()[slot])

    def get(self, slot: str, name: str, key: str) -> Registered:
        """The implementation ``name`` of ``slot``; ``key`` is the TOML path for errors."""
        impls = self.registry()[slot]
        if name not in impls:
            from .errors import ConfigError
            if not impls:
                allow = os.environ.get(ALLOW_ENV)
                why = (f"{ALLOW_ENV}={allow!r} excludes every plugin that provides one (only the entry points "
                       f"it names load); add the plugin's entry point to it, or unset it"
                       if allow is not None else
                       f"no loaded plugin provides one (is {BLOCK_ENV} blocking it?)")
                raise ConfigError(f"{key} = {name!r}: no {slot} plugin is loaded: {why}", key=key)
            close = difflib.get_close_matches(name, impls, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key} = {name!r} is not a registered {slot} plugin.{hint} "
                              f"Choose one of: {', '.join(sorted(impls))}", key=key)
        return impls[name]

    def describe(self) -> list[dict]:
        """One row per loaded plugin: name, version, hooks it implements, what it registered."""
        rows = []
        reg = self.registry()
        for name, plugin in self.pm.list_name_plugin():
            hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            provides = sorted(f"{r.slot}:{r.name}" for slot in reg.values()
                              for r in slot.values() if r.plugin == name)
            rows.append({"name": name, "version": self.versions.get(name, "?"),
                         "hooks": hooks, "provides": provides})
        return sorted(rows, key=lambda r: r["name"])


def _builtin(ep) -> bool:
    return ep.dist is not None and ep.dist.name == "zeroplug"


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loading entry points on first use."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default


def command_plugin_manager() -> PluginManager:
    """The plugins asked for ``zeroplug_add_commands`` while the command line is built: the
    process-wide manager once it is loaded; else one without zeroplug's own plugins that add
    no command (the stages, tiers and optimizers, whose import brings in torch), so that
    ``zeroplug --help`` starts in a fraction of a second. Every other distribution's plugins
    load as always, so a third party's commands are found without any declaration."""
    if _default is not None:
        return _default
    commands = {ep.name for ep in metadata.entry_points(group=COMMANDS_GROUP) if _builtin(ep)}
    if not commands:        # metadata of an install older than the group: every plugin
        return get_plugin_manager()
    pm = PluginManager(load_entry_points=False)
    pm.load_entry_points(skip=lambda ep: _builtin(ep) and ep.name not in commands)
    return pm


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests; after installing a plugin)."""
    global _default
    _default = None
