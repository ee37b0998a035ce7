"""What a unit holds, in words, for messages (the ranks' comparisons, zeroplug.faults): the
path of the module whose hooks gather it at stage 3 ("" for the model's own parameters),
its first and last parameter's names below stage 3. Worked out on the first question and
kept per partitioner."""
from __future__ import annotations

import weakref

_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def unit_name(part, index: int) -> str:
    names = _names.get(part)
    if names is None:
        names = _names[part] = _build(part)
    return names.get(index, "")


def _build(part) -> dict[int, str]:
    out: dict[int, str] = {}
    module = part.module
    by_module = getattr(part, "units_of_module", None)
    if by_module:
        path = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        for m, units in by_module.items():
            for u in units:
                out.setdefault(u.index, path.get(id(m), ""))
        return out
    pname = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for u in part.all_units:
        ns = [pname.get(id(p), "?") for p in u.params]
        out[u.index] = ns[0] if len(ns) == 1 else f"{ns[0]} .. {ns[-1]}"
    return out
