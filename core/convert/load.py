"""A translated config through ``zeroplug.config.load``: a DeepSpeed JSON file read, its
"auto" values filled, errors naming the DeepSpeed key, and the report of what was ignored
and how each "auto" resolved."""
from __future__ import annotations

import json
import logging

from zeroplug.errors import ConfigError

from . import DeepSpeedRaw, check_batch, fill_from_model, from_deepspeed


def read_json(path, text: str) -> DeepSpeedRaw:
    """A DeepSpeed JSON file's text, translated (errors name the file)."""
    try:
        ds = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON: nested more deeply than a config can be") from None
    try:
        return from_deepspeed(ds)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", key=exc.key) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested more deeply than a DeepSpeed config can be") from None


def resolve_translated(raw: DeepSpeedRaw, model, world_size: int, resolve):
    """``resolve(raw)`` of a translated config: its "auto" sizes filled from ``model``, its batch
    sizes checked, errors naming the DeepSpeed key the user wrote; then, once on rank 0, the
    ignored keys and every "auto" as resolved are printed."""
    translation = raw.translation
    fill_from_model(raw, model)
    check_batch(raw, world_size)
    try:
        cfg = resolve(raw)
    except ConfigError as exc:     # name the DeepSpeed key the user wrote
        ds_key = translation.origin.get(exc.key or "")
        if ds_key is None:
            raise
        raise ConfigError(f"{exc} (DeepSpeed key {ds_key})", key=ds_key) from None
    _report_deepspeed(cfg, translation)
    return cfg


def _report_deepspeed(cfg, translation) -> None:
    """Once, on rank 0: the DeepSpeed keys ignored (and why) and every "auto" value as resolved."""
    if translation.reported:
        return
    translation.reported = True
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    log = logging.getLogger("zeroplug")
    for note in translation.notes:
        log.warning("[zeroplug] DeepSpeed config: %s", note)
    for ds_key, target, source in translation.autos:
        log.warning("[zeroplug] DeepSpeed config: %s = \"auto\" -> %s = %s (%s)", ds_key, target,
                    _final_value(cfg, target), source)


def _final_value(cfg, target: str):
    """The value a resolved Config ended up with for a zeroplug key (for the "auto" report)."""
    table, _, name = target.rpartition(".")
    if table == "batch":
        return getattr(cfg.batch, name)
    if name == "plugin":
        return cfg.slot(table).name
    choice = cfg.slots.get(table)
    value = getattr(choice.options, name, None) if choice else None
    if value == "auto" and target.startswith("zero."):
        return "auto; the ZeRO stage sets it at setup"
    if value == "auto" and target == "scheduler.warmup_max_lr":
        return _final_value(cfg, "optimizer.lr")
    return value
