"""Plugin boundaries, checked on the source with ``ast``: the ZeRO stages reach an offload
tier only through the contract (zeroplug.tiers) and the optimizer only through its
declared per-sub-group step: they import no other plugin, read no tier option and name
no tier; core never imports a plugin (test_hooks_contract.py). The engine and the config
loader, through every core module they import, import no plugin and no optional
integration; no modules import each other around a circle; no plugin imports another. The
docs that describe the tree stay true to it: docs/architecture.md names only files that
exist and states the engine's size as the code gives it, and docs/benchmarks.md holds current
figures, each table with its command, machine and date."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from zeroplug.registry import get_plugin_manager
from zeroplug.tools import engine_size

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


# -- what the engine imports, and what imports what -----------------------------------------

#: the optional integrations: the paths that use them import them, the engine never does
INTEGRATIONS = ("zeroplug.integrations", "transformers", "peft", "lightning", "pytorch_lightning", "accelerate",
                "tensorboard", "torch.utils.tensorboard", "matplotlib")


def _under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def forbidden_imports(modules: dict) -> list[str]:
    """Every import of a plugin or an optional integration among ``modules``."""
    return sorted(f"{_rel(m.path)}: {name}" for m in modules.values() for name in m.imports
                  if _under(name, ("zeroplug.plugins",) + INTEGRATIONS))


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:      # an installed (not editable) zeroplug
        return str(path)


def test_engine_and_config_import_no_plugin_and_no_integration():
    """core/engine.py and core/config.py, through every core module they import at top level or
    inside a function, import no plugin (core finds them through entry points) and no optional
    integration."""
    modules = engine_size.closure()
    names = {_rel(m.path) for m in modules.values()}
    assert {"core/engine.py", "core/config.py", "core/checkpoint/__init__.py"} <= names   # lazy imports followed
    assert forbidden_imports(modules) == []
    # the walk sees an integration where a function imports it
    assert any(f.endswith(": transformers") for f in
               forbidden_imports(engine_size.closure(("zeroplug.integrations.transformers",))))


def test_architecture_states_the_engine_size():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert engine_size.block(text) == engine_size.size_line(), (
        "docs/architecture.md's engine size is not the code's: "
        "python3 -m zeroplug.tools.engine_size --write docs/architecture.md")


def _modules() -> dict[str, Path]:
    """Every module of core/ and plugins/ by its import name."""
    out = {}
    for root, prefix in (("core", "zeroplug"), ("plugins", "zeroplug.plugins")):
        for path in (ROOT / root).rglob("*.py"):
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            out[".".join((prefix,) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return out


def _module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports by name, at top level or in a function
    (``from pkg import sub`` names the submodule, not the package's ``__init__``)."""
    edges = {}
    for name, path in modules.items():
        package = engine_size.package_of(path, name)
        found = set()
        tree = ast.parse(path.read_text())
        # Note: imports under ``if TYPE_CHECKING:`` exist for annotations only (the hookspecs
        # name the Engine they receive); they never run, so they close no circle.
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = engine_size.from_module(node, package)
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                if len(subs) < len(node.names) and base in modules:
                    subs.add(base)
                found |= subs
        edges[name] = found - {name}
    return edges


def import_circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The modules that import each other, directly or around a circle (Tarjan's components)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(frozenset(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


#: import circles, each with why it stays (a new one fails the test below)
CIRCLES_ALLOWED = {
    # convert/__init__.py re-exports the TOML writer's functions, which render its translation
    frozenset({"zeroplug.convert", "zeroplug.convert.toml"}),
}


def test_no_import_circle():
    """No modules of core/ or plugins/ import each other around a circle (cpu_adam's modules
    each import only the ones its package docstring lists before them)."""
    edges = _module_edges(_modules())
    assert any(n.startswith("zeroplug.plugins.optim.cpu_adam.") for n in edges)
    assert not [sorted(c) for c in import_circles(edges) if c not in CIRCLES_ALLOWED]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


#: (importing plugin's file, the other plugin's module) and why it must
CROSS_PLUGIN_IMPORTS_ALLOWED = {
    # HostTier is the documented base of host tiers; the nvme tier is one
    ("plugins/offload_nvme/tier.py", "zeroplug.plugins.offload_cpu.host"),
}


def test_no_plugin_imports_another_plugin():
    """What two plugins share lives in core (a plugin's ``local_ranks`` is zeroplug.launch's)."""
    modules = _modules()
    found = set()
    for name, targets in _module_edges(modules).items():
        if not name.startswith("zeroplug.plugins."):
            continue
        own = ".".join(name.split(".")[:3])
        for t in targets:
            if t.startswith("zeroplug.plugins.") and not _under(t, (own,)):
                found.add((_rel(modules[name]), t))
    assert found - CROSS_PLUGIN_IMPORTS_ALLOWED == set()


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


#: where a path named in the docs starts: the repository's folders
_PATH = re.compile(r"(?<![\w./-])((?:core|plugins|tests|docs|examples|shared)/[\w./*-]*[\w*])")
#: a file named alone: in backticks, or a capitalised page (DESIGN.md); it must be in the tree
_FILE = re.compile(r"`([\w-]+\.(?:py|c|md|toml|sh))`|\b([A-Z][A-Z_]+\.md)\b")


def test_architecture_names_only_files_that_exist():
    """Every path docs/architecture.md names (``core/engine.py``, ``tests/offload/test_x.py``) and
    every file it names alone (``native.py``) is in the tree; the Layout block's files too."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted({p for p in _PATH.findall(text) if not list(ROOT.glob(p.rstrip("/")))})
    tree = {f.name for d in ("core", "plugins", "tests", "examples", "docs") for f in (ROOT / d).rglob("*")}
    tree |= {f.name for f in ROOT.iterdir()}
    missing += sorted({a or b for a, b in _FILE.findall(text) if (a or b) not in tree})
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    top = None
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0] if line.strip() else ""
        if not line.startswith(" "):
            top = name.rstrip("/")
        elif name.endswith((".py", ".c")) and not (ROOT / top / name).is_file():
            missing.append(f"{top}/{name} (Layout)")
    assert len(_PATH.findall(text)) > 20 and not missing, f"docs/architecture.md names files the tree lacks: {missing}"


#: what a page of current figures does not say (history lives in git and its commits)
HISTORY = re.compile(r"\b(earlier|as of commit|before (this|the) change|used to|no longer|nowadays|"
                     r"previously|call [0-9]+|session [0-9]+|commit `?[0-9a-f]{7,40})\b", re.IGNORECASE)


def benchmark_page_problems(text: str) -> list[str]:
    """docs/benchmarks.md: one table per section, each section with a table says its command,
    its machine and its date (YYYY-MM-DD); no history."""
    problems = [f"history: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    sections = re.split(r"(?m)^(?=#{1,4} )", text)
    for sec in sections:
        title = sec.splitlines()[0] if sec.strip() else ""
        lines = sec.splitlines()
        tables = sum(1 for a, b in zip(lines, lines[1:]) if a.startswith("|") and re.match(r"^\|\s*:?-{3}", b))
        if not tables:
            continue
        if tables > 1:
            problems.append(f"{title}: {tables} tables (one per question)")
        for key, form in (("Command", r"`"), ("Machine", r"\S"), ("Date", r"\d{4}-\d{2}-\d{2}")):
            if not re.search(rf"(?m)^- {key}: {form}", sec):
                problems.append(f"{title}: no '- {key}:' line")
    return problems


def test_benchmarks_page_is_current_figures():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert benchmark_page_problems(text) == []
    assert len(text.splitlines()) < 700, "docs/benchmarks.md: one table per question, a page a reader finishes"
    # the checks bite
    assert benchmark_page_problems("## Q\n\n| a |\n| --- |\n| 1 |\n") == [
        "## Q: no '- Command:' line", "## Q: no '- Machine:' line", "## Q: no '- Date:' line"]
    assert benchmark_page_problems("Earlier, on a 4 x H100 host") == ["history: 'Earlier'"]


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
