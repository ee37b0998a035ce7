"""DeepSpeed JSON configs into zeroplug's TOML layout (``zeroplug convert``)."""
from __future__ import annotations

from .errors import ConfigError

_BATCH = {"train_batch_size": "train_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
          "gradient_accumulation_steps": "gradient_accumulation_steps",
          "gradient_clipping": "gradient_clipping", "steps_per_print": "steps_per_print"}
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "cpuadam": "cpu_adam", "deepspeedcpuadam": "cpu_adam"}
_SCHEDULERS = {"warmuplr": "warmup", "warmupdecaylr": "warmup_decay", "warmupcosinelr": "warmup_cosine"}
#: DeepSpeed keys that zeroplug accepts and deliberately drops, with the reason
_DROPPED = {
    "wall_clock_breakdown": "zeroplug always prints per-step timing",
    "zero_allow_untested_optimizer": "every registered optimizer is allowed",
    "allgather_partitions": "zeroplug always all-gathers partitions",
    "round_robin_gradients": "not needed: gradients are reduce-scattered per bucket",
    "elastic_checkpoint": "zeroplug checkpoints always reshape to any world size",
    "ignore_unused_parameters": "unused parameters are always handled",
    "stage": "mapped to zero.plugin",
}


def _zero(z: dict, out: dict, notes: list[str]) -> None:
    zero = out.setdefault("zero", {})
    zero["plugin"] = f"stage{int(z.get('stage', 0))}"
    for key, value in z.items():
        if key in ("offload_optimizer", "offload_param"):
            table = dict(value)
            device = table.pop("device", "none")
            table = {"plugin": device, **table}
            out.setdefault("offload", {})["optimizer" if key == "offload_optimizer" else "param"] = table
        elif key in _DROPPED:
            if key != "stage":
                notes.append(f"zero_optimization.{key} dropped: {_DROPPED[key]}")
        else:
            zero[key] = value


def from_deepspeed(ds: dict, notes: list[str] | None = None) -> dict:
    """Translate a DeepSpeed config dict; ``notes`` collects what was dropped and why."""
    notes = [] if notes is None else notes
    out: dict = {}
    for key, value in ds.items():
        if key in _BATCH:
            out.setdefault("batch", {})[_BATCH[key]] = value
        elif key == "optimizer":
            name = str(value.get("type", "adamw")).lower()
            if name not in _OPTIMIZERS:
                raise ConfigError(f"optimizer.type = {value.get('type')!r} has no zeroplug equivalent; "
                                  f"use one of {sorted(set(_OPTIMIZERS.values()))}", key="optimizer.type")
            out["optimizer"] = {"plugin": _OPTIMIZERS[name], **value.get("params", {})}
        elif key == "scheduler":
            name = str(value.get("type", "")).lower()
            if name not in _SCHEDULERS:
                raise ConfigError(f"scheduler.type = {value.get('type')!r} has no zeroplug equivalent; "
                                  f"use one of {list(_SCHEDULERS)}", key="scheduler.type")
            out["scheduler"] = {"plugin": _SCHEDULERS[name], **value.get("params", {})}
        elif key in ("fp16", "bf16"):
            table = dict(value)
            enabled = table.pop("enabled", False)
            table.pop("auto_cast", None)
            if enabled is True or enabled == "auto":
                if key == "fp16":
                    out["precision"] = {"plugin": "fp16", **table}
                else:
                    out["precision"] = {"plugin": "bf16"}
        elif key == "zero_optimization":
            _zero(value, out, notes)
        elif key == "aio":
            out["aio"] = dict(value)
        elif key in _DROPPED:
            notes.append(f"{key} dropped: {_DROPPED[key]}")
        else:
            raise ConfigError(f"DeepSpeed key {key!r} has no zeroplug equivalent; remove it "
                              f"(zeroplug supports: {', '.join(sorted(_BATCH))}, optimizer, scheduler, "
                              f"fp16, bf16, zero_optimization)", key=key)
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} as TOML")


def to_toml(cfg: dict, prefix: str = "") -> str:
    """A nested dict as TOML tables (``plugin`` first in each table)."""
    lines, subs = [], []
    items = sorted(cfg.items(), key=lambda kv: (kv[0] != "plugin", 0))
    for k, v in items:
        if isinstance(v, dict):
            subs.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    text = ""
    if prefix and lines:
        text += f"[{prefix}]\n" + "\n".join(lines) + "\n\n"
    for k, v in subs:
        text += to_toml(v, f"{prefix}.{k}" if prefix else k)
    return text
