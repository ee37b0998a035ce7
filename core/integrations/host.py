"""What the Trainer and Lightning adapters share: a zeroplug engine driven by a host loop.

A host loop (``transformers.Trainer``, Lightning) owns the data, the schedule, logging and
checkpoint timing; the engine owns the parameters, the gradients and the optimizer step.
This module holds the pieces both adapters need:

* :func:`load_raw` — ``zeroplug_config`` (a path, a dict, a DeepSpeed JSON) as a raw dict.
* :func:`reconcile` — one source of truth: values the host loop decides (learning rate,
  accumulation, clipping, precision, ...) fill the config where it leaves them out or
  ``"auto"``; a value given in both places and different is refused, naming both.
* :func:`build_engine` — the engine, with its learning rate read from the host's optimizer
  each step (the host's scheduler drives it), over torch-style parameter groups.
* :class:`HostOptimizer` — the optimizer object the host loop holds: its ``param_groups``
  carry the scheduled learning rates; its ``step`` and ``zero_grad`` leave the work to the
  engine.
* :func:`backward_and_step` — the backward of a loss the host already divided by its
  accumulation steps, then ``engine.step()`` (a no-op until the window's last micro-batch).
"""
from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

import zeroplug
from zeroplug.config import Config, read_file
from zeroplug.errors import ConfigError
from zeroplug.hookspecs import hookimpl
from zeroplug.slots import Scheduler

log = logging.getLogger("zeroplug")

AUTO = "auto"
#: the scheduler implementation registered for engines that a host loop drives
HOST_SCHEDULE = "host"


# --- the config ------------------------------------------------------------------------

def load_raw(source) -> dict:
    """``source`` (None, a TOML or DeepSpeed JSON path, a dict in either layout, or a
    :class:`zeroplug.Config`) as a raw dict in zeroplug's layout. A DeepSpeed config is
    translated; its ``"auto"`` values are the host loop's to fill (see :func:`reconcile`)."""
    if source is None:
        return {}
    if isinstance(source, Config):
        return copy.deepcopy(source.raw)
    if isinstance(source, (str, os.PathLike)):
        return read_file(source)
    if not isinstance(source, dict):
        raise ConfigError(f"zeroplug_config must be a path, a dict or a zeroplug Config, "
                          f"got {type(source).__name__}")
    from zeroplug.convert import from_deepspeed, looks_like_deepspeed
    return from_deepspeed(source) if looks_like_deepspeed(source) else copy.deepcopy(source)


def _deepspeed_autos(raw: dict) -> set[str]:
    """The zeroplug keys a DeepSpeed config gave as "auto" (the translation filled them with
    the Hugging Face defaults; a host loop knows the real values)."""
    translation = getattr(raw, "translation", None)
    return {target for _, target, _ in getattr(translation, "autos", ())}


@dataclass(frozen=True)
class Given:
    """A value the host loop decides: ``path`` in the zeroplug config, ``name`` in the host's
    terms. ``accepts``: config values that mean the same (default: only ``value``)."""
    path: str
    value: Any
    name: str
    accepts: tuple = ()


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def reconcile(raw: dict, given: list[Given], source: str = "zeroplug_config") -> dict:
    """``raw`` with each host value filled in where the config leaves it out or ``"auto"``.

    A value set in both places and different raises a :class:`ConfigError` naming both."""
    out = copy.deepcopy(raw)
    autos = _deepspeed_autos(raw)
    for g in given:
        table_path, key = g.path.rsplit(".", 1)
        table = out
        for part in table_path.split("."):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: [{table_path}] must be a table", key=table_path)
        current = table.get(key, AUTO)
        if current == AUTO and AUTO in g.accepts:
            continue            # a value named "auto" (optimizer.plugin = "auto": the optimizer that fits)
        if g.path in autos or (isinstance(current, str) and current == AUTO):
            table[key] = g.value
        elif not (_same(current, g.value) or any(_same(current, a) for a in g.accepts)):
            raise ConfigError(
                f"{source} sets {g.path} = {current!r} but {g.name} = {g.value!r}; give it in one "
                f"place (remove {g.path} from {source}, set it to \"auto\", or change {g.name})", key=g.path)
    return out


def drop_auto_schedule(raw: dict, host_schedule: str, source: str = "zeroplug_config") -> dict:
    """The host loop's scheduler drives the learning rate: a ``[scheduler]`` table whose
    options are all ``"auto"`` (a DeepSpeed JSON written for the Hugging Face Trainer) is
    dropped with a warning; any other is refused, naming the host's schedule."""
    table = raw.get("scheduler")
    if not table:
        return raw
    autos = _deepspeed_autos(raw)
    options = {k: v for k, v in table.items() if k != "plugin"}
    if options and all(v == AUTO or f"scheduler.{k}" in autos for k, v in options.items()):
        log.warning("[zeroplug] %s names the schedule %r with every option \"auto\": %s drives the "
                    "learning rate instead", source, table.get("plugin"), host_schedule)
        raw = copy.copy(raw)            # a DeepSpeed translation keeps its report
        del raw["scheduler"]
        return raw
    raise ConfigError(f"{source} [scheduler] (plugin = {table.get('plugin', 'none')!r}) and {host_schedule} "
                      f"both set the learning-rate schedule; remove [scheduler] from {source}: "
                      f"{host_schedule} drives it", key="scheduler.plugin")


# --- the optimizer the host loop sees --------------------------------------------------------

class HostOptimizer(torch.optim.Optimizer):
    """The optimizer a host loop holds when the engine does the optimizer step.

    Its ``param_groups`` are the host's view (parameters, scheduled ``lr``, hyper-parameters):
    the host's scheduler writes into them and the engine reads the learning rate back each
    step. ``step()`` only runs a closure; ``zero_grad()`` does nothing (the engine zeroes its
    gradients after each step). ``step_was_skipped`` is True after an fp16 step skipped for
    overflow, so a host that asks does not advance its schedule."""

    def __init__(self, engine, param_groups: list[dict]):
        super().__init__(param_groups, {})
        self.engine = engine

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    @property
    def step_was_skipped(self) -> bool:
        return bool(getattr(self.engine, "last_metrics", {}).get("skipped", False))


def _host_schedule_plugin(lr_source: Callable[[], float]):
    class HostSchedule(Scheduler):
        """The learning rate the host loop's scheduler last set (read at each step)."""
        @dataclass(frozen=True)
        class Options:
            pass

        def lr_at(self, step: int) -> float:
            lr = lr_source()
            return self.base_lr if lr is None else float(lr)

    class Plugin:
        @hookimpl
        def zeroplug_register_schedulers(self, register):
            register(HOST_SCHEDULE, HostSchedule)

    return Plugin()


def build_engine(module: torch.nn.Module, raw: dict, groups: list[dict] | None,
                 lr_source: Callable[[], float | None] | None, device=None):
    """``zeroplug.initialize`` for a host loop over the torch-style parameter ``groups``.

    With ``lr_source`` the host's scheduler drives the learning rate: the ``[scheduler]``
    slot reads ``lr_source()`` (the lr for ``optimizer.lr``; None: ``optimizer.lr`` itself)
    at every optimizer step, and each group follows in proportion to its own lr. Without
    it, the config's own ``[scheduler]`` does."""
    from zeroplug.registry import PluginManager
    pm = None
    if lr_source is not None:
        pm = PluginManager()
        pm.register(_host_schedule_plugin(lr_source), "host_schedule")
        raw = copy.copy(raw)            # a DeepSpeed translation keeps its report
        raw["scheduler"] = {"plugin": HOST_SCHEDULE}
    if groups is not None:
        groups = [g for g in groups if g["params"]]
    return zeroplug.initialize(module, raw, device=device, plugin_manager=pm, model_parameters=groups)


def scheduled_lr(optimizer: torch.optim.Optimizer, base_lr: float) -> float | None:
    """The schedule's lr for ``base_lr``, read off a torch optimizer whose scheduler writes
    its groups: ``base_lr`` x (a group's lr / that group's lr before scheduling)."""
    for g in optimizer.param_groups:
        start = float(g.get("initial_lr", g["lr"]))
        if start > 0:
            return base_lr * float(g["lr"]) / start
    return None


def save_engine_checkpoint(engine, save_dir, **kwargs) -> str:
    """``engine.save_checkpoint`` into a folder of the host's checkpoint.

    Note: a save keeps its directory locked for the engine's life, against a second run
    writing there. The host names a folder per checkpoint and removes old ones itself, so
    the lock is let go once the checkpoint is complete (a long run would otherwise hold one
    open file per checkpoint it ever wrote)."""
    from zeroplug.checkpoint import directory as checkpoint_dir
    path = engine.save_checkpoint(save_dir, **kwargs)
    checkpoint_dir.release(engine)
    return path


def load_engine_checkpoint(engine, load_dir, **kwargs):
    """``engine.load_checkpoint`` keeping each optimizer group's own hyper-parameters.

    Note: a checkpoint stores one group's hyper-parameters and loading applies them to
    every group; with per-group settings (no weight decay on biases and norms) that would
    change the run. A group's settings are the run's, not training state: they are kept."""
    own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
    out = engine.load_checkpoint(load_dir, **kwargs)
    for g, settings in zip(engine.optimizer.param_groups, own):
        g.update(settings)
    return out


def backward_and_step(engine, loss: torch.Tensor, window: int | None = None) -> None:
    """Backward of ``loss`` as the host loop computed it (already divided by its accumulation
    steps), then ``engine.step()``, which steps the optimizer at the window's last micro-batch.

    ``window``: how many micro-batches the host's current accumulation window has (the last
    window of an epoch may be shorter); None keeps the engine's count."""
    # Note: the engine closes a window after its length in backward calls; the host's
    # shorter last window must close after its own length (engine.backward's ``window``).
    gas = window if window is not None else engine.gradient_accumulation_steps
    # Note: engine.backward divides by the window's length; the host already did.
    engine.backward(loss * gas if gas > 1 else loss, window=window)
    engine.step()


# --- torch optimizers as zeroplug's ------------------------------------------------------------

#: torch optimizer class -> (zeroplug optimizer plugin, the hyper-parameters it maps)
_TORCH_OPTIMIZERS = {
    torch.optim.AdamW: ("adamw", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    torch.optim.Adam: ("adam", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    torch.optim.SGD: ("sgd", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
}
#: hyper-parameters that choose a kernel, not the arithmetic (zeroplug picks its own)
_KERNEL_FLAGS = {"foreach", "fused", "capturable", "differentiable"}
#: zeroplug optimizers that compute what each torch class computes
COMPATIBLE = {"adamw": ("adamw", "cpu_adam", "auto"), "adam": ("adam",), "sgd": ("sgd",)}


def _plain(v):
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else [x.item() for x in v]
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def torch_optimizer_spec(optimizer: torch.optim.Optimizer, where: str) -> tuple[str, dict, list[dict]]:
    """``(plugin, defaults, groups)`` for a torch AdamW, Adam or SGD: the zeroplug optimizer,
    its options, and the parameter groups with the options that differ per group.
    Anything else is refused (``where`` names where it came from)."""
    cls = type(optimizer)
    if cls not in _TORCH_OPTIMIZERS:
        raise ConfigError(f"{where} returned {cls.__module__}.{cls.__qualname__}; zeroplug steps "
                          f"torch.optim.AdamW, Adam or SGD (mapped to its own adamw, adam, sgd). Return "
                          f"one of those, or set [optimizer] in the zeroplug config and return none")
    plugin, keys = _TORCH_OPTIMIZERS[cls]
    defaults = optimizer.defaults
    if cls is torch.optim.Adam and defaults.get("decoupled_weight_decay"):
        plugin = "adamw"
    for key, value in defaults.items():
        if key in keys or key in _KERNEL_FLAGS or key == "decoupled_weight_decay" or value in (False, None):
            continue
        raise ConfigError(f"{where}: {cls.__name__}({key}={value!r}) has no zeroplug equivalent; "
                          f"remove it", key=f"optimizer.{key}")
    options = {k: _plain(defaults[k]) for k in keys if k in defaults}
    groups = []
    for group in optimizer.param_groups:
        values = {k: _plain(group[k]) for k in keys if k in group}
        if "initial_lr" in group:
            values["lr"] = _plain(group["initial_lr"])     # before the scheduler's first factor
        own = {k: v for k, v in values.items() if not _same(v, options.get(k))}
        groups.append({"params": list(group["params"]), **own})
    return plugin, options, groups


def optimizer_givens(plugin: str, options: dict, name: str) -> list[Given]:
    """The config entries an optimizer object decides, for :func:`reconcile`."""
    out = [Given("optimizer.plugin", plugin, f"{name} (torch {plugin})", accepts=COMPATIBLE[plugin])]
    for key, value in options.items():
        if key == "amsgrad" and not value:
            continue            # the default of both; cpu_adam has no such option set
        out.append(Given(f"optimizer.{key}", value, f"{name} {key}"))
    return out
