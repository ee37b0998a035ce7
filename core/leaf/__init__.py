"""Leaf modules: stage 3 gathers a leaf module's parameters, everything inside it
included, as one unit when the leaf's forward starts, on every rank.

A mixture-of-experts block runs an expert only when some token routes to it, so two
ranks call different experts. Stage 3 gathers a module's parameters with a collective
just before that module runs: if the experts were gathered one by one, the ranks'
collectives would not pair up and training would hang. A leaf is gathered whole in the
pre-forward of the block that every rank calls, so the collectives do not depend on
routing. Stage 3 finds such blocks itself (``zero.stage3_auto_leaf_modules``: a module
that holds a ``ModuleList`` or ``ModuleDict`` named like ``experts``); others are
declared with :func:`set_leaf_modules` or ``zero.stage3_leaf_modules`` (class names),
as DeepSpeed users declare them with ``deepspeed.utils.set_z3_leaf_modules``.

A leaf that is a module of the model rather than a class (``set_leaf_modules(model,
[model.experts])``), and a leaf that is a ModuleList or ModuleDict (never called itself), is
gathered with the module that holds it, in that module's forward: the experts of a model
whose own forward routes over them (an ``experts`` list held by the model itself, found as
such), or a module that a branch runs on some ranks only.
"""
from __future__ import annotations

import torch

_MARK = "_zp_leaf"
_WITH_HOLDER = "holder"        # the mark of a leaf gathered with the module that holds it


def class_names(module: torch.nn.Module) -> tuple[str, str]:
    """The names a leaf declaration may give ``module``'s class: ``Name`` and ``package.module.Name``."""
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: torch.nn.Module, kinds) -> bool:
    return any(module is k if isinstance(k, torch.nn.Module) else
               k in class_names(module) if isinstance(k, str) else isinstance(module, k) for k in kinds)


def set_leaf_modules(model: torch.nn.Module, leaf_modules, raise_if_not_found: bool = True) -> list:
    """Mark every module of ``model`` whose class is in ``leaf_modules`` (classes, class
    names or dotted ``package.module.Class`` paths), and every module of ``model`` given
    itself (``model.experts``: gathered with the module that holds it), as a leaf; returns
    the marked modules. Call it before ``zeroplug.initialize``. Raises ValueError when
    nothing matches (unless ``raise_if_not_found`` is false)."""
    kinds = list(leaf_modules)
    found = [m for m in model.modules() if _matches(m, kinds)]
    if not found and raise_if_not_found:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"set_leaf_modules: no module of the model is a {', '.join(map(_name, kinds))}; "
                         f"its module classes are: {', '.join(names)}")
    given = {id(k) for k in kinds if isinstance(k, torch.nn.Module)}
    for m in found:
        setattr(m, _MARK, _WITH_HOLDER if id(m) in given else True)
    return found


def unset_leaf_modules(model: torch.nn.Module, leaf_modules, raise_if_not_found: bool = True) -> list:
    """Undo :func:`set_leaf_modules` for the modules of these classes; returns them."""
    kinds = list(leaf_modules)
    found = [m for m in model.modules() if _matches(m, kinds) and is_leaf_module(m)]
    if not found and raise_if_not_found:
        raise ValueError(f"unset_leaf_modules: no leaf module is a {', '.join(map(_name, kinds))}")
    for m in found:
        delattr(m, _MARK)
    return found


def get_leaf_modules(model: torch.nn.Module) -> list:
    """The modules of ``model`` marked by :func:`set_leaf_modules`."""
    return [m for m in model.modules() if is_leaf_module(m)]


def is_leaf_module(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def gathered_with_holder(module: torch.nn.Module) -> bool:
    """Whether a leaf ``module`` is gathered in the forward of the module that holds it: one
    declared as a module of the model, and every ModuleList / ModuleDict (never called)."""
    return getattr(module, _MARK, None) == _WITH_HOLDER or isinstance(
        module, (torch.nn.ModuleList, torch.nn.ModuleDict))


def expert_lists(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module``'s children that are a ModuleList / ModuleDict named like ``experts`` with two
    or more entries that have parameters."""
    return [child for name, child in module.named_children()
            if "expert" in name.lower() and isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
            and sum(1 for c in child.children() if any(True for _ in c.parameters())) >= 2]


def holds_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds an experts list (:func:`expert_lists`): the shape of a
    mixture-of-experts block whose forward runs only the experts its tokens route to."""
    return bool(expert_lists(module))


def _name(k) -> str:
    return k if isinstance(k, str) else getattr(k, "__name__", repr(k))
