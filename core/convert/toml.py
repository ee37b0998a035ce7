"""``zeroplug convert``: a translated DeepSpeed config written as zeroplug's TOML."""
from __future__ import annotations

from zeroplug.errors import ConfigError

from . import from_deepspeed, get_path


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1000:
        return str(int(v))          # DeepSpeed's 1e9 sizes, written as the integers they are
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


def convert_text(ds: dict) -> str:
    """``zeroplug convert``: the TOML, headed by comments on what was ignored and which "auto"
    values were filled, and which ones stay for zeroplug (or you) to fill at start."""
    raw = from_deepspeed(ds)
    t = raw.translation
    head = [f"# note: {n}" for n in t.notes]
    for ds_key, target, source in t.autos:
        value = get_path(raw, target)
        if value is None:
            head.append(f"# auto: {ds_key} -> {target} left out: {source}")
        elif value == "auto":
            head.append(f"# auto: {ds_key} -> {target} stays \"auto\": zeroplug fills it at start ({source})")
        else:
            head.append(f"# auto: {ds_key} -> {target} = {_toml_value(value)} ({source})")
    return "\n".join(head) + ("\n\n" if head else "") + to_toml(raw)
