"""Plugin boundaries, checked on the source with ``ast``: the ZeRO stages reach an offload
tier only through the contract (zeroplug.tiers) and the optimizer only through its
declared per-sub-group step: they import no other plugin, read no tier option and name
no tier; core never imports a plugin (test_hooks_contract.py)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from zeroplug.registry import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
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


#: the core's budget: the step, the hooks and the contracts; everything else lives beside it
CORE_LINES = 2000
FILE_LINES = 500


def test_core_stays_small_and_no_source_file_is_long():
    core = sum(len(p.read_text().splitlines()) for p in (ROOT / "core").glob("*.py"))
    assert core <= CORE_LINES, f"core/ has {core} lines (budget {CORE_LINES}): move what is not the step out"
    packages = [ROOT / d for d in ("core", "plugins", "checkpoint", "convert", "workload", "cli", "tools",
                                   "benchmarking", "integrations", "testing", "observe", "offload_states", "locks")]
    long = {str(p.relative_to(ROOT)): n for d in packages for p in d.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > FILE_LINES}
    assert not long, f"source files over {FILE_LINES} lines: {long}"
