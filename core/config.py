"""The configuration: ``zero.toml`` (or a dict) into a validated :class:`Config`.

One rule (DESIGN.md): each slot is a table with a ``plugin`` key naming who
fills it; every other key of that table is that plugin's option, validated by
the plugin's ``Options`` dataclass. Tables that belong to no slot (``[batch]``,
``[checkpoint]``) are core's own. Precedence: command line > file > defaults.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .faults import FaultOptions
from .convert.keys import selector_key_error
from .options import AUTO, build_options, check_keys, opt, suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class BatchOptions:
    """Batch sizes, clipping, the metrics line, and what makes the first and every step steady."""
    micro_batch_size: int | Literal["auto"] = opt(
        AUTO, "Samples per rank per forward pass (DeepSpeed: train_micro_batch_size_per_gpu).",
        min=1, max=1 << 24, alias=("train_micro_batch_size_per_gpu",))   # never an int64 overflow in torch
    gradient_accumulation_steps: int | Literal["auto"] = opt(
        AUTO, "Micro batches whose gradients are summed before one optimizer step.", min=1, max=1 << 24)
    train_batch_size: int | Literal["auto"] = opt(
        AUTO, "Samples per optimizer step over all ranks; must equal "
              "micro_batch_size x gradient_accumulation_steps x world size.", min=1, max=1 << 34)
    gradient_clipping: float = opt(0.0, "Clip gradients to this global L2 norm; 0 disables.", min=0.0)
    steps_per_print: int = opt(10, "Print one metrics line every this many optimizer steps.", min=1)
    warm_up_rows: int = opt(
        8192, "On a GPU, `initialize` runs each distinct nn.Linear shape of the model forward and "
              "backward once at this many rows (tokens of a micro batch; fewer where one output "
              "would pass 512 MiB), so that the first step does not pay cuBLAS's set-up and the "
              "first load of its kernels; 0 turns this warm-up off.", min=0)
    freeze_gc: bool | Literal["auto"] = opt(
        AUTO, "At the end of `initialize`, collect Python's garbage once and freeze what is alive "
              "(gc.freeze), so that the collector's full passes during training walk only what the "
              "steps create instead of stalling one step now and then for every object of the "
              "process; close() unfreezes. \"auto\" = on a CUDA device (where a step is short).")


@dataclass(frozen=True)
class CheckpointOptions:
    """Checkpoints that `zeroplug train` writes."""
    dir: str = opt("", "Directory for checkpoints written by `zeroplug train`; empty: its run directory's "
                       "checkpoints/ (none with --no-save).")
    every_n_steps: int = opt(0, "Save a checkpoint every N optimizer steps; 0 disables.", min=0)
    keep_last: int = opt(0, "Keep only the K newest checkpoints; 0 keeps all.", min=0)
    async_save: bool = opt(
        False, "Write checkpoints in the background (also the default of engine.save_checkpoint's "
               "async_save): the save returns once the values that the forward changes are taken; a "
               "thread copies the states into host memory (one checkpoint's size, kept for the run) "
               "before the next optimizer step and writes them while training goes on, under the same "
               "atomic protocol. One save is in flight at a time; the next save, a load and close() wait "
               "for it, and a failed one is raised at a later step (the same on every rank), save, load or close(). Saved "
               "synchronously (with a warning) when the host lacks the memory for the copy. DeepSpeed's "
               "checkpoint.writer.decoupled.")


#: slot tables: TOML path -> (registry slot, default plugin)
SLOT_TABLES = {
    "zero": ("zero", "stage0"),
    "precision": ("precision", "fp32"),
    "optimizer": ("optimizer", "adamw"),
    "scheduler": ("scheduler", "none"),
    "offload.optimizer": ("offload", "none"),
    "offload.param": ("offload", "none"),
    "monitor": ("monitor", "stdout"),
    "activation_checkpointing": ("activations", "none"),
    "sequence": ("sequence", "none"),
}
CORE_TABLES = {"batch": BatchOptions, "checkpoint": CheckpointOptions, "faults": FaultOptions}


@dataclass(frozen=True)
class SlotChoice:
    """The implementation chosen for one slot and its validated options."""
    path: str
    name: str
    impl: type
    options: Any


@dataclass(frozen=True)
class Config:
    batch: BatchOptions
    checkpoint: CheckpointOptions
    slots: dict[str, SlotChoice] = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    world_size: int = 1
    faults: FaultOptions = FaultOptions()

    def slot(self, path: str) -> SlotChoice:
        return self.slots[path]


# --- reading -------------------------------------------------------------------

def read_file(path: str | os.PathLike) -> dict:
    """A TOML file, or a DeepSpeed JSON file (translated), into a raw dict."""
    p = Path(path)
    if not p.is_file():     # a FIFO or a device is never read (a read could block, or never end)
        raise ConfigError(f"config file {str(p)!r} {'is not a regular file' if p.exists() else 'does not exist'}; "
                          f"pass an existing TOML file (see zero.toml in the project root for an example)")
    text = p.read_text()
    if p.suffix == ".json":
        from .convert.load import read_json
        return read_json(p, text)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None


def parse_override(item: str) -> tuple[str, Any]:
    """``--section.key=value`` (leading dashes optional); value parsed as TOML, else a string."""
    body = item.lstrip("-")
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like --section.key=value "
                          f"(e.g. --optimizer.lr=1e-4)")
    key, value = body.split("=", 1)
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key, parsed


def _slot_table(raw: dict, path: str) -> dict | None:
    node = raw
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _drop_for_switch(raw: dict, path: str, name: Any, pm) -> None:
    """An override that names another plugin for slot table ``path`` than the lower layers
    (the TOML file, the built-in default) leaves out those layers' keys of that table which
    the new plugin has no option for, with a note: they configured the plugin replaced.

    Note: keys the new plugin also takes (an optimizer's ``lr`` across adamw and cpu_adam)
    stay, and the overrides' own keys are applied after this, so an unknown key written on
    the command line is still an error."""
    table = _slot_table(raw, path)
    if not table or not isinstance(name, str):
        return
    slot, default = SLOT_TABLES[path]
    before = table.get("plugin", default)
    if before == name:
        return
    if pm is None:
        from .registry import get_plugin_manager
        pm = get_plugin_manager()
    reg = pm.registry().get(slot, {}).get(name)
    if reg is None:             # resolve names the unknown plugin
        return
    from .options import fields_of
    known = fields_of(reg.impl.Options)
    aliases = {a for f, _ in known.values() for a in f.metadata.get("alias", ())}
    dropped = [k for k in table if k != "plugin" and k not in known and k not in aliases]
    for k in dropped:
        del table[k]
    if dropped:
        logging.getLogger("zeroplug").info(
            "[zeroplug] %s.plugin = %r (override) replaces %r: its keys %s are left out", path, name, before,
            ", ".join(dropped))


def apply_overrides(raw: dict, overrides, pm=None) -> dict:
    raw = copy.deepcopy(raw)
    items = [parse_override(item) if isinstance(item, str) else item for item in overrides or ()]
    for key, value in items:
        if key.endswith(".plugin") and key[:-len(".plugin")] in SLOT_TABLES:
            _drop_for_switch(raw, key[:-len(".plugin")], value, pm)
    for key, value in items:
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a table", key=key)
        node[parts[-1]] = value
    return raw


# --- validation -------------------------------------------------------------------

def _resolve_batch(b: BatchOptions, world: int, label: str = "") -> BatchOptions:
    """The batch sizes resolved for ``world`` data-parallel ranks (``label``: how messages name
    that number, when it is not the world size)."""
    label = label or f"world size ({world})"
    mbs, gas, tbs = b.micro_batch_size, b.gradient_accumulation_steps, b.train_batch_size
    if gas == AUTO and (mbs == AUTO or tbs == AUTO):
        gas = 1
    if mbs == AUTO and tbs == AUTO:
        mbs = 1
    if tbs == AUTO:
        tbs = mbs * gas * world
    elif mbs == AUTO:
        if tbs % (gas * world):
            raise ConfigError(
                f"batch.train_batch_size = {tbs} is not divisible by gradient_accumulation_steps "
                f"({gas}) x {label} = {gas * world}, so micro_batch_size cannot be "
                f"derived; set train_batch_size to a multiple of {gas * world}", key="batch.train_batch_size")
        mbs = tbs // (gas * world)
    elif gas == AUTO:
        if tbs % (mbs * world):
            raise ConfigError(
                f"batch.train_batch_size = {tbs} is not divisible by micro_batch_size ({mbs}) x "
                f"{label} = {mbs * world}, so gradient_accumulation_steps cannot be "
                f"derived; set train_batch_size to a multiple of {mbs * world}", key="batch.train_batch_size")
        gas = tbs // (mbs * world)
    if mbs * gas * world != tbs:
        raise ConfigError(
            f"batch sizes disagree: train_batch_size = {tbs}, but micro_batch_size ({mbs}) x "
            f"gradient_accumulation_steps ({gas}) x {label} = {mbs * gas * world}. "
            f"Set train_batch_size = \"auto\" or make the product equal it", key="batch.train_batch_size")
    return dataclasses.replace(b, micro_batch_size=mbs, gradient_accumulation_steps=gas, train_batch_size=tbs)


def _data_parallel(slots: dict, world: int) -> tuple[int, str]:
    """The ranks that the batch arithmetic counts and how messages name them: the world size,
    divided by the ranks that share one sample (the ``[sequence]`` slot's
    ``ranks_per_sample``: DeepSpeed's sequence_parallel_size)."""
    choice = slots.get("sequence")
    share = getattr(choice.impl, "ranks_per_sample", None) if choice else None
    n = share(choice.options) if share else 1
    if n == 1:
        return world, ""
    if world % n:
        raise ConfigError(f"sequence.sequence_parallel_size = {n} does not divide the world size ({world}): "
                          f"each group of {n} consecutive ranks shares one sequence; run a multiple of {n} "
                          f"ranks or pick a divisor of {world}", key="sequence.sequence_parallel_size")
    return world // n, f"data-parallel ranks ({world // n} = world size {world} / sequence_parallel_size {n})"


def _check_shared(table, name: str, options_cls) -> None:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table", key=name)
    check_keys(options_cls, table, name)


def resolve(raw: dict, pm=None, world_size: int = 1) -> Config:
    """Validate a raw dict into a :class:`Config` for a run of ``world_size`` ranks."""
    if pm is None:
        from .registry import get_plugin_manager
        pm = get_plugin_manager()
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a table of tables, got {type(raw).__name__}")
    # Note: an implementation may name top-level tables whose keys are defaults for its own
    # options (`shared_tables`), e.g. DeepSpeed's [aio] for the nvme tier: one [aio] serves
    # both [offload.optimizer] and [offload.param].
    owners: dict[str, list] = {}     # shared table -> [(slot, registration)] that read it
    for slot, reg in pm.registry().items():
        for r in reg.values():
            for t in getattr(r.impl, "shared_tables", ()):
                owners.setdefault(t, []).append((slot, r))
    shared = set(owners)
    known_top = set(CORE_TABLES) | {p.split(".")[0] for p in SLOT_TABLES} | shared
    for t in shared & set(raw):     # checked even when no selected plugin uses it
        _check_shared(raw[t], t, owners[t][0][1].impl.Options)
    for key, value in raw.items():
        if key not in known_top:
            raise ConfigError(f"unknown table [{key}].{suggest(key, known_top)} "
                              f"Known tables: {', '.join(sorted(known_top))}", key=key)
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table, got {value!r}", key=key)
    offload = raw.get("offload", {})
    for key in offload:
        if key not in ("optimizer", "param"):
            raise ConfigError(f"unknown table [offload.{key}].{suggest(key, ['optimizer', 'param'])} "
                              f"Known: [offload.optimizer], [offload.param]", key=f"offload.{key}")
        if not isinstance(offload[key], dict):
            raise ConfigError(f"[offload.{key}] must be a table", key=f"offload.{key}")

    batch_options = build_options(BatchOptions, raw.get("batch", {}), "batch")
    ckpt = build_options(CheckpointOptions, raw.get("checkpoint", {}), "checkpoint")
    faults = build_options(FaultOptions, raw.get("faults", {}), "faults")
    slots, used_shared = {}, set()
    for path, (slot, default) in SLOT_TABLES.items():
        table = dict(raw.get("offload", {}).get(path.split(".")[1], {}) if path.startswith("offload.")
                     else raw.get(path, {}))
        name = table.pop("plugin", default)
        selector_key_error(path, slot, table)
        impl = pm.registry()[slot].get(name) if isinstance(name, str) else None
        for t in getattr(impl.impl, "shared_tables", ()) if impl else ():
            if t in raw:
                table = {**raw[t], **table}         # the slot's own keys win
                used_shared.add(t)
        if not isinstance(name, str):
            raise ConfigError(f"{path}.plugin must be a plugin name (a string), got {name!r}",
                              key=f"{path}.plugin")
        reg = pm.get(slot, name, key=f"{path}.plugin")
        options = build_options(reg.impl.Options, table, path)
        slots[path] = SlotChoice(path, name, reg.impl, options)
    for t in sorted(shared & set(raw) - used_shared):
        logging.getLogger("zeroplug").warning(
            "[zeroplug] [%s] is set but no selected plugin uses it (it configures: %s); it changes nothing",
            t, ", ".join(sorted(f"{s}:{r.name}" for s, r in owners[t])))
    batch = _resolve_batch(batch_options, *_data_parallel(slots, world_size))
    cfg = Config(batch=batch, checkpoint=ckpt, slots=slots, raw=raw, world_size=world_size, faults=faults)
    for choice in slots.values():   # cross-slot rules, e.g. offload.param needs stage 3
        check = getattr(choice.impl, "check_config", None)
        if check is not None:
            check(cfg, choice)
    return cfg


def load(source=None, overrides=None, pm=None, world_size: int = 1, model=None) -> Config:
    """A path, a raw dict, an existing Config (returned as is) or None (defaults). A DeepSpeed
    JSON file or dict is translated (convert.py); ``model`` fills its "auto" sizes that follow
    the model's hidden size, as the Hugging Face integration does."""
    if isinstance(source, Config):
        if overrides:
            return resolve(apply_overrides(source.raw, overrides, pm), pm, world_size)
        if source.world_size != world_size:
            return resolve(source.raw, pm, world_size)
        return source
    if source is None:
        raw = {}
    elif isinstance(source, dict):
        from .convert import from_deepspeed, looks_like_deepspeed
        raw = from_deepspeed(source) if looks_like_deepspeed(source) else source
    elif isinstance(source, (str, os.PathLike)):
        raw = read_file(source)
    else:
        raise ConfigError(f"config must be a path, a dict or a zeroplug Config, got {type(source).__name__}")
    raw = apply_overrides(raw, overrides, pm)
    if getattr(raw, "translation", None) is None:
        return resolve(raw, pm, world_size)
    from .convert.load import resolve_translated
    return resolve_translated(raw, model, world_size, lambda r: resolve(r, pm, world_size))
