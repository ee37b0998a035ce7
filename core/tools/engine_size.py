"""The engine's import closure: every module of ``zeroplug`` that ``zeroplug.engine`` and
``zeroplug.config`` import, at top level or inside a function, followed through the modules
they reach. Plugins are not in it (core finds them through entry points), nor are the
optional integrations; tests/engine/test_plugin_boundaries.py checks both on this walk.

docs/architecture.md ("How big the engine is") states the closure's size in a line this
module writes between two marker comments; the same test compares it with the code::

    python3 -m zeroplug.tools.engine_size                              # print the line
    python3 -m zeroplug.tools.engine_size --write docs/architecture.md # replace it there

Note: the walk reads the source with ``ast`` and imports nothing, so it sees the imports a
function makes only when called (the checkpoint package, the DeepSpeed translation).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("zeroplug.engine", "zeroplug.config")
BEGIN = "<!-- engine-size: python3 -m zeroplug.tools.engine_size --write docs/architecture.md -->"
END = "<!-- /engine-size -->"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    lines: int
    imports: frozenset[str]     # every module it names, as absolute names


def package_dir() -> Path:
    """Where ``zeroplug``'s source is (core/ in a checkout), found without importing it."""
    spec = importlib.util.find_spec("zeroplug")
    return Path(next(iter(spec.submodule_search_locations)))


def module_file(name: str, root: Path) -> Path | None:
    """The file of ``zeroplug.<...>`` (None for the plugins and for other packages)."""
    if (name != "zeroplug" and not name.startswith("zeroplug.")) or name.startswith("zeroplug.plugins"):
        return None
    base = root.joinpath(*name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def package_of(path: Path, name: str) -> str:
    """The package relative imports in module ``name`` (the file ``path``) start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` statement names."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def imports_of(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function, as absolute names
    (``from x import y`` adds both ``x`` and ``x.y``: y may be a submodule)."""
    package = package_of(path, name)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = from_module(node, package)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def closure(roots=ROOTS, root: Path | None = None) -> dict[str, Module]:
    """The modules of ``zeroplug`` that ``roots`` reach, by name (parent packages included:
    importing a module runs them)."""
    root = package_dir() if root is None else root
    seen: dict[str, Module] = {}
    paths: set[Path] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        path = module_file(name, root)
        if path is None or path in paths:
            continue
        paths.add(path)
        found = imports_of(path, name)
        seen[name] = Module(name, path, len(path.read_text().splitlines()), frozenset(found))
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += sorted(found)
    return seen


def size_line(modules: dict[str, Module] | None = None) -> str:
    """The sentence docs/architecture.md carries. Note: lines are rounded to the hundred, so
    that the page changes when the engine grows or shrinks, not with every edit."""
    modules = closure() if modules is None else modules
    lines = sum(m.lines for m in modules.values())
    return (f"The engine's import closure: about {round(lines, -2):,} lines in {len(modules)} files "
            f"(`core/engine.py`, `core/config.py` and every module of `core/` they import).")


def block(text: str) -> str | None:
    """The line between the markers in ``text`` (None without them)."""
    if BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def replace_block(text: str, line: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{line}\n{END}{rest.split(END, 1)[1]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m zeroplug.tools.engine_size",
                                description="print (or write into a page) the size of the engine's import closure")
    p.add_argument("--write", metavar="PAGE", help="replace the line between the engine-size markers of PAGE")
    args = p.parse_args(argv)
    line = size_line()
    if not args.write:
        print(line)
        return 0
    page = Path(args.write)
    try:
        text = page.read_text()
    except OSError as e:
        print(f"error: {page}: {e.strerror or e}", file=sys.stderr)
        return 2
    if block(text) is None:
        print(f"error: {page}: no engine-size markers ({BEGIN} ... {END}); add them where the line goes",
              file=sys.stderr)
        return 2
    page.write_text(replace_block(text, line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
