"""Plugin boundaries, checked on the source with ``ast``: the ZeRO stages reach an offload
tier only through the contract (zeroplug.tiers) and the optimizer only through its
declared per-sub-group step: they import no other plugin, read no tier option and name
no tier; core never imports a plugin (test_hooks_contract.py)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from zeroplug.registry import get_plugin_manager

ROOT = Path(__file__).resolve().parents[2]
ZERO = sorted((ROOT / "plugins" / "zero").glob("*.py"))


def _imports(tree) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append(node.module or "")
    return out


def test_zero_imports_no_other_plugin():
    bad = [f"{f.name}: {m}" for f in ZERO for m in _imports(ast.parse(f.read_text()))
           if m.startswith("zeroplug.plugins") and not m.startswith("zeroplug.plugins.zero")]
    assert len(ZERO) >= 5 and not bad, bad


def test_zero_reads_no_tier_option_and_names_no_tier():
    reg = get_plugin_manager().registry()
    own = {f.name for f in dataclasses.fields(reg["zero"]["stage3"].impl.Options)}
    options, names = set(), set()
    for name, r in reg["offload"].items():
        options |= {f.name for f in dataclasses.fields(r.impl.Options)} - own
        names.add(name)
    assert {"gpu_step_ratio", "overlap_step", "reuse_resident", "max_in_cpu", "grad_dtype"} <= options
    found = []
    for f in ZERO:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in options:
                found.append(f"{f.name}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in options or node.value in names - {"none", "cpu"}:   # "cpu": a device type too
                    found.append(f"{f.name}:{node.lineno} {node.value!r}")
        if "nvme" in f.read_text().lower():
            found.append(f"{f.name}: mentions nvme")
    assert not found, found


def test_zero_uses_no_private_attribute_of_the_optimizer():
    found = [f"{f.name}:{node.lineno} .{node.attr}" for f in ZERO for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in ("_find_group", "step_param", "grad_multiplier")]
    assert not found, found


#: lines of the engine's import closure: docs/architecture.md, "How big the engine is", says
#: what is in it and why this is the budget
ENGINE_CLOSURE_LINES = 8900


def _module_file(name: str):
    """The file of ``zeroplug.<...>`` under core/ (None for plugins and other packages)."""
    if name != "zeroplug" and not name.startswith("zeroplug.") or name.startswith("zeroplug.plugins"):
        return None
    base = ROOT.joinpath("core", *name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports_of(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function, as absolute names
    (``from x import y`` adds both ``x`` and ``x.y``: y may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def engine_closure() -> dict[Path, int]:
    """Lines of every core module the engine and the config loader import, eagerly or lazily."""
    seen: dict[Path, int] = {}
    todo = ["zeroplug.engine", "zeroplug.config"]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if path is None or path in seen:
            continue
        seen[path] = len(path.read_text().splitlines())
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]     # parents run on import
        todo += _imports_of(path, name)
    return seen


def test_engine_import_closure_stays_within_its_budget():
    closure = engine_closure()
    total = sum(closure.values())
    names = {str(p.relative_to(ROOT)) for p in closure}
    assert "core/engine.py" in names and "core/checkpoint/__init__.py" in names     # the walk follows lazy imports
    assert not any(n.startswith("plugins/") for n in names)
    biggest = sorted(closure.items(), key=lambda kv: -kv[1])[:5]
    assert total <= ENGINE_CLOSURE_LINES, (
        f"the engine imports {total} lines (budget {ENGINE_CLOSURE_LINES}); largest: "
        + ", ".join(f"{p.relative_to(ROOT)} {n}" for p, n in biggest)
        + ": move a feature into a plugin, or raise the budget with its reason in docs/architecture.md")


def _layout_tree() -> dict[str, set[str]]:
    """docs/architecture.md's Layout block: top-level folder -> the folders listed under it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    tree: dict[str, set[str]] = {}
    top = None
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0] if line.strip() else ""
        if not name.endswith("/"):
            continue
        if not line.startswith(" "):
            top = name.rstrip("/")
            tree[top] = set()
        elif top is not None:
            tree[top].add(name.rstrip("/"))
    return tree


def test_architecture_layout_matches_the_tree():
    tree = _layout_tree()
    for top in ("core", "plugins", "tests"):
        on_disk = {p.name for p in (ROOT / top).iterdir()
                   if p.is_dir() and not p.name.startswith((".", "__")) and p.name != "data"
                   and any(p.rglob("*.py"))}
        assert tree.get(top) == on_disk, (
            f"docs/architecture.md's Layout lists {sorted(tree.get(top, ()))} under {top}/, "
            f"the tree has {sorted(on_disk)}")
    assert {"core", "plugins", "tests", "examples", "docs"} <= set(tree)


def test_only_core_and_plugins_are_remapped():
    import sys
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"zeroplug": "core", "zeroplug.plugins": "plugins"}
    listed = set(setup["packages"])
    found = set()
    for root, prefix in (("core", "zeroplug"), ("plugins", "zeroplug.plugins")):
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / root).parts
            found.add(".".join((prefix, *rel)))
    assert listed == found, f"pyproject's packages differ from the tree: missing {sorted(found - listed)}, " \
                            f"extra {sorted(listed - found)}"


# -- private names stay in their module ------------------------------------------------------

SOURCES = sorted(list((ROOT / "core").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py")))

#: (file, name): a private name of another package that a module takes, and why it must
PRIVATE_IMPORTS_ALLOWED = {
    # Lightning builds a strategy's optimizers and forwards only through these (no public API)
    ("core/integrations/lightning.py", "_init_optimizers_and_lr_schedulers"),
    ("core/integrations/lightning.py", "_MockOptimizer"),
    ("core/integrations/lightning.py", "_ForwardRedirection"),
}
#: (file, attribute): a write to another object's private attribute, and why it must
PRIVATE_WRITES_ALLOWED = {
    # torch's LR schedulers warn when their optimizer's step() never ran: the engine stepped
    # instead, and torch reads only this attribute (no public way to say so)
    ("core/integrations/lightning.py", "_opt_called"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree) -> set[str]:
    """Private attributes a class of this module declares (annotated or assigned in its body):
    the module owns them, also on objects that are not ``self`` (a parameter it tags)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def private_name_uses() -> tuple[list[str], list[str]]:
    """(imports of another module's private names, writes to another object's private attributes)."""
    imports, writes = [], []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        ours = set()       # names bound to zeroplug modules (their ``_x`` are private to them)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if node.module != "__future__" and _private(a.name) and (rel, a.name) not in PRIVATE_IMPORTS_ALLOWED:
                        imports.append(f"{rel}:{node.lineno} from {'.' * node.level}{node.module or ''} import {a.name}")
                    if node.level or (node.module or "").startswith("zeroplug"):
                        ours.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                ours.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("zeroplug"))
        own = _own_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in ours):
                imports.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                if (isinstance(t, ast.Attribute) and _private(t.attr) and t.attr not in own
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
                        and (rel, t.attr) not in PRIVATE_WRITES_ALLOWED):
                    writes.append(f"{rel}:{node.lineno} {ast.unparse(t)} =")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                    and node.args[1].value not in own):
                writes.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return imports, writes


def test_no_module_imports_another_modules_private_names():
    imports, _ = private_name_uses()
    assert len(SOURCES) > 100 and not imports, imports


def test_no_module_writes_another_objects_private_attributes():
    """State shared between parts has one owner with a public method for it; a module writes
    ``_x`` only on ``self`` / ``cls``, or where a class of its own declares ``_x`` (a tag it puts
    on a torch parameter, say)."""
    _, writes = private_name_uses()
    assert not writes, writes
