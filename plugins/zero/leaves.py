"""Stage 3's units and leaf modules (see ``zeroplug.leaf``): which module's hooks gather
which parameters, and which parameters a leaf's backward reaches."""
from __future__ import annotations

import torch

from zeroplug.errors import ConfigError
from zeroplug.leaf import class_names, expert_lists, gathered_with_holder, holds_experts, is_leaf_module


def find_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``module`` (a transformer's layers): the entries of a ModuleList
    or Sequential of two or more modules of one class, each built of two or more modules with
    parameters, and holding no parameter that a module outside it holds too. Where blocks nest
    (stages of blocks), the innermost; an ``experts`` list is never one (its owner is a leaf).

    Note: a block gathered as one unit is one all-gather before its forward and one
    reduce-scatter after its backward, as FSDP2 wraps each block; one unit per module is four
    or more smaller collectives per transformer layer, each with its own launch and wait, which
    the compute of one Linear does not hide."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(m)
    skip = {id(lst) for m in module.modules() for lst in expert_lists(m)}
    found = []
    for seq in module.modules():
        if not isinstance(seq, (torch.nn.ModuleList, torch.nn.Sequential)) or id(seq) in skip:
            continue
        kids = list(seq.children())
        if len(kids) < 2 or len({type(k) for k in kids}) != 1:
            continue
        for k in kids:
            with_params = sum(1 for c in k.modules() if any(True for _ in c.parameters(recurse=False)))
            inside = {id(c) for c in k.modules()}
            if with_params >= 2 and all(id(h) in inside for p in k.parameters() for h in holders[id(p)]):
                found.append(k)
    ids = {id(b) for b in found}
    return [b for b in found if not any(id(c) in ids for c in b.modules() if c is not b)]


def find_leaves(module: torch.nn.Module, options) -> list[torch.nn.Module]:
    """The outermost leaf modules of ``module``: marked by ``zeroplug.set_leaf_modules``,
    named in ``stage3_leaf_modules``, (``stage3_auto_leaf_modules``) holding experts or, for
    the model itself, its experts lists (gathered with the model's own forward), or
    (``stage3_block_units``) a repeated block (:func:`find_blocks`)."""
    declared = set(options.stage3_leaf_modules)
    names = {n for m in module.modules() for n in class_names(m)}
    missing = sorted(declared - names)
    if missing:
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise ConfigError(f"zero.stage3_leaf_modules names {', '.join(map(repr, missing))}, but the model has "
                          f"no module of that class; its classes are: {', '.join(classes)}",
                          key="zero.stage3_leaf_modules")
    # Note: the model itself is never found a leaf (a model whose own forward routes over its
    # experts): gathered whole it would not be sharded at all, and its output need not be a
    # tensor, so no backward hook of its own would gather it again for the backward. Its
    # experts lists are leaves instead, gathered with its own forward (on every rank).
    blocks = {id(b) for b in find_blocks(module)} if options.stage3_block_units else set()
    leaves, inside = [], set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if is_leaf_module(m) or declared.intersection(class_names(m)) or id(m) in blocks or (
                options.stage3_auto_leaf_modules and m is not module and holds_experts(m)):
            leaves.append(m)
            inside.update(id(c) for c in m.modules())
        elif options.stage3_auto_leaf_modules and m is module:
            for experts in expert_lists(m):
                leaves.append(experts)
                inside.update(id(c) for c in experts.modules())
    return leaves


def holders(module: torch.nn.Module, leaves) -> dict[int, torch.nn.Module]:
    """id(leaf) -> the module whose forward gathers it, for the leaves gathered with the
    module that holds them (``zeroplug.leaf.gathered_with_holder``): the nearest module above
    the leaf that is not a ModuleList / ModuleDict (the model itself at most)."""
    parent = {id(c): m for m in module.modules() for c in m.children()}
    out = {}
    for leaf in leaves:
        if leaf is module or not gathered_with_holder(leaf):
            continue
        up = parent.get(id(leaf), module)
        while up is not module and isinstance(up, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            up = parent.get(id(up), module)
        out[id(leaf)] = up
    return out


def gatherers(module: torch.nn.Module, leaves) -> set:
    """The modules whose forward gathers a leaf's units: each leaf, or the module that holds it."""
    held = holders(module, leaves)
    return {held.get(id(leaf), leaf) for leaf in leaves}


def owners(module: torch.nn.Module, leaves) -> list[tuple[torch.nn.Module, list]]:
    """(module, the parameters its hooks gather) in ``module.modules()`` order: a leaf owns
    every parameter inside it, and the modules inside a leaf own none (no hooks); a leaf
    gathered with its holder (:func:`holders`) adds its parameters to the holder's."""
    held = holders(module, leaves)
    carried: dict[int, list] = {}
    # Note: in the model's module order, never a set's: a unit's layout must be the same on
    # every rank, and a set of modules iterates by address, which differs between processes
    for leaf in module.modules():
        if id(leaf) in held:
            carried.setdefault(id(held[id(leaf)]), []).extend(leaf.parameters())
    out, inside = [], set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if m in leaves:
            inside.update(id(c) for c in m.modules())
            if id(m) not in held:
                out.append((m, list(m.parameters())))
        else:
            out.append((m, [p for p in m._parameters.values() if p is not None] + carried.get(id(m), [])))
    return out


def reachable_params(outputs, inputs) -> set[int]:
    """ids of the leaf tensors (parameters) whose gradient a backward from ``outputs`` reaches
    without passing through ``inputs`` (the module's arguments: what lies before the module)."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)       # AccumulateGrad: a leaf tensor
        if var is not None:
            found.add(id(var))
            continue
        stack.extend(f for f, _ in node.next_functions)
    return found
