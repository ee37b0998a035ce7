"""The configuration reference's rows: each option's type, default, bounds and help, as
``zeroplug docs`` prints them (docs/configuration.md)."""
from __future__ import annotations

import dataclasses

from zeroplug.options import TypeMismatch, coerce, describe_type, fields_of


def option_docs(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) for every option of ``cls``: the docs table."""
    rows = []
    for name, (f, tp) in fields_of(cls).items():
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        try:
            default = coerce(default, tp)          # 5e8 on an int option shows as 500000000
        except (TypeMismatch, TypeError):
            pass
        extra = []
        if f.metadata.get("min") is not None:
            extra.append(f">= {f.metadata['min']}")
        if f.metadata.get("max") is not None:
            extra.append(f"<= {f.metadata['max']}")
        if f.metadata.get("above") is not None:
            extra.append(f"> {f.metadata['above']}")
        if f.metadata.get("below") is not None:
            extra.append(f"< {f.metadata['below']}")
        if f.metadata.get("alias"):
            extra.append("alias: " + ", ".join(f.metadata["alias"]))
        help_ = f.metadata.get("help", "")
        if extra:
            help_ = f"{help_} ({'; '.join(extra)})"
        rows.append((name, describe_type(tp), repr(default), help_))
    return rows
