"""Typed, validated options: a TOML table into a frozen dataclass.

Each plugin declares its options as a frozen dataclass; fields carry their
documentation and limits in ``field(metadata=...)``:

* ``help``    — one sentence for the configuration reference (required: a test checks).
* ``min`` / ``max`` — inclusive numeric limits.
* ``alias``   — other accepted spellings (e.g. DeepSpeed's older name).

Types understood: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
``tuple[float, ...]``/``tuple[float, float]``, ``X | None`` and ``X | Literal["auto"]``
("auto" is then filled from the run by whoever owns the option).

Note: DeepSpeed users write sizes as ``5e8``; TOML parses that as a float, so an
``int`` option accepts a float with an integral value.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from .errors import ConfigError

AUTO = "auto"


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        above: float | None = None, below: float | None = None, alias: tuple[str, ...] = ()) -> Any:
    """A dataclass field with documentation and limits (``min`` / ``max`` inclusive,
    ``above`` / ``below`` exclusive). Numbers must be finite, whatever the limits."""
    meta = {"help": help, "min": min, "max": max, "above": above, "below": below, "alias": alias}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults")
    return dataclasses.field(default=default, metadata=meta)


def describe_type(tp: Any) -> str:
    """How an error message and the configuration reference name the type ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        inner = describe_type(args[0]) if args else "value"
        for article in ("a ", "an "):     # "a number" -> "numbers"
            if inner.startswith(article):
                inner = inner[len(article):]
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {inner}s"
        return f"a list of {len(args)} {inner}s"
    if tp is type(None):
        return "nothing (omit the key)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


class TypeMismatch(Exception):
    """A value does not fit the option's type (raised by :func:`coerce`)."""


def coerce(value: Any, tp: Any) -> Any:
    """``value`` as the option type ``tp`` takes it (an int option's 5e8 is 500000000);
    raises TypeMismatch when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool) or (
                isinstance(value, bool) and any(a is value for a in typing.get_args(tp))):
            return value
        raise TypeMismatch
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg)
            except TypeMismatch:
                continue
        raise TypeMismatch
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeMismatch
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0]) for v in value)
        if len(value) != len(args):
            raise TypeMismatch
        return tuple(coerce(v, a) for v, a in zip(value, args))
    if tp is type(None):
        if value is None:
            return None
        raise TypeMismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeMismatch
    if tp is int:
        if isinstance(value, bool):
            raise TypeMismatch
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeMismatch
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeMismatch
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeMismatch
    raise TypeError(f"unsupported option type {tp!r}")


def fields_of(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls, include_extras=False)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_keys(cls: type, table: dict, path: str) -> dict[str, str]:
    """Every key of ``table`` names an option of ``cls`` (or an alias): otherwise a
    ConfigError with a did-you-mean. Returns the aliases (alias -> option name)."""
    known = fields_of(cls)
    aliases = {a: name for name, (f, _) in known.items() for a in f.metadata.get("alias", ())}
    for key in table:
        if aliases.get(key, key) not in known:
            raise ConfigError(
                f"unknown key {path}.{key}.{suggest(key, list(known) + list(aliases))} "
                f"Known keys of [{path}]: {', '.join(sorted(known)) or '(none)'}",
                key=f"{path}.{key}")
    return aliases


def _check_range(v: Any, value: Any, meta: dict, full: str) -> None:
    """Finite, and within the field's limits (every element of a list)."""
    for n in v if isinstance(v, tuple) else (v,):
        if not isinstance(n, (int, float)) or isinstance(n, bool):
            continue
        if isinstance(n, float) and not math.isfinite(n):
            raise ConfigError(f"{full} = {value!r} is not a finite number; give a finite value", key=full)
        lo, hi, above, below = (meta.get(k) for k in ("min", "max", "above", "below"))
        for limit, word, ok in ((lo, ">=", lo is None or n >= lo), (hi, "<=", hi is None or n <= hi),
                                (above, ">", above is None or n > above), (below, "<", below is None or n < below)):
            if not ok:
                raise ConfigError(f"{full} = {value!r} is out of range: it must be {word} {limit}", key=full)


def build_options(cls: type, table: dict, path: str) -> Any:
    """Validate ``table`` (the TOML table at ``path``) into an instance of ``cls``."""
    known = fields_of(cls)
    aliases = check_keys(cls, table, path)
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = aliases.get(key, key)
        if name in values:
            raise ConfigError(f"{path}.{key} is given twice (also as {name!r}); keep one", key=f"{path}.{key}")
        f, tp = known[name]
        full = f"{path}.{key}"
        try:
            v = coerce(value, tp)
        except TypeMismatch:
            raise ConfigError(f"{full} = {value!r} has the wrong type: expected {describe_type(tp)}",
                              key=full) from None
        _check_range(v, value, f.metadata, full)
        values[name] = v
    for name, (f, tp) in known.items():     # defaults too: `opt(5e8, ...)` on an int option
        if name not in values and f.default is not dataclasses.MISSING:
            try:
                values[name] = coerce(f.default, tp)
            except TypeMismatch:
                raise TypeError(f"{cls.__name__}.{name}: default {f.default!r} is not {describe_type(tp)}") from None
    try:
        obj = cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{path}]: {exc}", key=path) from None
    check = getattr(obj, "validate", None)
    if check is not None:
        check(path)   # cross-field rules; raises ConfigError naming the key
    return obj
