"""Explicit contracts, checked on the source with ``ast``: what the engine, the checkpoint
code and the integrations call on a slot object is declared by the slot's base class (so
they call it directly, never through ``getattr`` / ``hasattr``), and the step's gradient
multiplier travels as an argument (``grad_scale`` is only torch's fused optimizers' own)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from zeroplug.slots import Monitor, OptimizerFactory, Partitioner, Precision, Scheduler
from zeroplug.tiers import OffloadTier, SubGroupOptimizer, init_group_states, step_all, step_group

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(list((ROOT / "core").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py")))
SLOT_BASES = (Partitioner, Precision, OptimizerFactory, Scheduler, Monitor, OffloadTier, SubGroupOptimizer)


def _trees():
    for path in SOURCES:
        yield path.relative_to(ROOT), ast.parse(path.read_text())


def _is_partitioner(node, aliases: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "partitioner"
            or isinstance(node, ast.Name) and node.id in aliases)


def partitioner_uses() -> dict[str, list[str]]:
    """Attribute name -> where it is used on a partitioner outside the ZeRO plugin (which
    implements it): ``x.partitioner.name``, and ``part.name`` after ``part = x.partitioner``."""
    found: dict[str, list[str]] = {}
    for rel, tree in _trees():
        if rel.parts[:2] == ("plugins", "zero"):
            continue
        aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and isinstance(node.value, ast.Attribute) and node.value.attr == "partitioner"
                   for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_partitioner(node.value, aliases):
                found.setdefault(node.attr, []).append(f"{rel}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and node.args
                  and _is_partitioner(node.args[0], aliases)):
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
                found.setdefault(f"{node.func.id}:{name}", []).append(f"{rel}:{node.lineno}")
    return found


def test_partitioner_declares_every_method_its_callers_use():
    uses = partitioner_uses()
    assert {"gathered_params", "checkpoint_state", "memory_tensors", "wait_optimizer"} <= set(uses), sorted(uses)
    undeclared = {k: v for k, v in uses.items() if not hasattr(Partitioner, k)}
    assert not undeclared, f"used on the partitioner but not declared by zeroplug.slots.Partitioner: {undeclared}"


def test_partitioner_declares_what_a_stage_may_leave_out():
    for name in ("gathered_params", "construction_context", "checkpoint_state", "load_checkpoint_state",
                 "memory_tensors", "state_tensors", "stage", "shard_optimizer", "shard_params"):
        assert hasattr(Partitioner, name), name
    with Partitioner.construction_context(None, None, None):     # a stage with nothing to do
        pass
    assert Partitioner.memory_tensors(Partitioner(None, None)) == {}


#: the names slot objects go by where they are used (the last part of the expression)
SLOT_OBJECTS = {"partitioner", "part", "tier", "offload_optimizer", "offload_param", "optimizer", "precision",
                "scheduler", "monitor", "m", "impl"}
#: optional class-level declarations of any slot's implementation, read by the config loader
#: for every registered class (zeroplug.slots' docstring)
OPTIONAL = {"check_config", "shared_tables"}


def test_no_getattr_for_what_a_slot_base_declares():
    """A caller calls what the base declares; ``getattr(x, "declared_name")`` on a slot
    object hides a missing declaration (or a typo) behind a default."""
    declared = {n for base in SLOT_BASES for n, _ in inspect.getmembers(base) if not n.startswith("_")}
    declared |= {"step_group", "init_group_states"}
    assert {"memory_tensors", "gathered_params", "cpu_workers", "write_eval", "param_dtype"} <= declared
    found = []
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in declared - OPTIONAL
                    and ast.unparse(node.args[0]).split(".")[-1] in SLOT_OBJECTS):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_grad_scale_is_only_torchs_own():
    """The multiplier is an argument of the step: no module reads or writes a ``grad_scale``
    attribute except where torch's fused optimizers take theirs (zeroplug.tiers)."""
    found = []
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "grad_scale"
                    or isinstance(node, ast.Constant) and node.value == "grad_scale"):
                found.append(f"{rel}:{node.lineno}")
    assert found and all(f.startswith("core/tiers.py:") for f in found), found


def _adamw(fused: bool, n: int = 1000):
    p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.randn(n, generator=torch.Generator().manual_seed(1))
    return p, torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=fused)


def test_torch_optimizer_gets_the_multiplier_as_its_own_grad_scale():
    """A plain torch optimizer is no SubGroupOptimizer: ``step_group`` / ``step_all`` hand a
    fused one the multiplier as its ``grad_scale`` (1 / multiplier) for the call only, which
    equals multiplying the gradients first."""
    a, fused = _adamw(True)
    b, plain = _adamw(False)
    assert not isinstance(fused, SubGroupOptimizer)
    init_group_states(fused, 0)                 # nothing ahead for torch's optimizers
    assert not fused.state
    b.grad.mul_(0.5)
    step_group(fused, 0, grad_multiplier=0.5)
    plain.step()
    assert getattr(fused, "grad_scale", None) is None
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    step_all(fused, 0.5)
    b.grad.mul_(0.5)
    plain.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_sub_group_optimizer_gets_the_multiplier_as_an_argument():
    """The protocol is structural: an optimizer declaring both methods is one, and the
    tiers' calls hand it the multiplier (never an attribute)."""
    calls = []

    class Recorder(torch.optim.SGD):
        def step_group(self, k, lp_out=None, grad_multiplier=1.0, threads=None):
            calls.append(("step", k, grad_multiplier))

        def init_group_states(self, k):
            calls.append(("init", k))

    p = torch.nn.Parameter(torch.zeros(3))
    opt = Recorder([{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=0.1)
    assert isinstance(opt, SubGroupOptimizer)
    init_group_states(opt, 1)
    step_group(opt, 0, grad_multiplier=0.25)
    step_all(opt, 0.5)
    assert calls == [("init", 1), ("step", 0, 0.25), ("step", 0, 0.5), ("step", 1, 0.5)]
    assert not hasattr(opt, "grad_scale")


# -- broad excepts say what they swallowed --------------------------------------------------

_BROAD = {"Exception", "BaseException"}
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "warn"}


def _broad(t) -> bool:
    return (t is None or isinstance(t, ast.Name) and t.id in _BROAD
            or isinstance(t, ast.Tuple) and any(_broad(e) for e in t.elts))


def silent_broad_excepts() -> list[str]:
    """Every bare / ``except Exception`` / ``except BaseException`` in core/ and plugins/ that
    goes on as if nothing happened: it raises nothing, logs nothing and does not use the
    exception it caught (an error kept to be reported counts as use). ``__del__`` is exempt:
    at interpreter shutdown even logging may be gone."""
    found = []
    for rel, tree in _trees():
        in_del = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__del__"
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ExceptHandler) and _broad(node.type)) or id(node) in in_del:
                continue
            body = list(ast.walk(ast.Module(body=node.body, type_ignores=[])))
            if any(isinstance(n, ast.Raise) for n in body):
                continue
            if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _LOG_CALLS
                   for n in body):
                continue
            if node.name and any(isinstance(n, ast.Name) and n.id == node.name for n in body):
                continue
            found.append(f"{rel}:{node.lineno}")
    return found


def test_every_broad_except_logs_or_reports_what_it_swallowed():
    found = silent_broad_excepts()
    assert not found, ("a broad except that goes on with a default must log what it caught "
                       f"(log.debug at least, with the exception) or be narrowed: {found}")


# -- the host tier is a public base -----------------------------------------------------------

def test_host_tier_is_a_documented_base_its_subclasses_use_publicly():
    """HostTier says what a subclass provides and may use; the nvme tier and the example tier
    use no private name of HostTier or OffloadTier."""
    from zeroplug.plugins.offload_cpu.host import HostTier
    doc = inspect.getdoc(HostTier)
    named = ["plan", "start_movement", "sub_group_loop", "publish_done", "run_in_background", "step_worker",
             "check_memory", "grad_dtype", "overlaps", "make_lane", "delayed_warmup", "speculative_mode", "empty"]
    for name in named:
        assert name in doc and callable(getattr(HostTier, name)), name
    private = {n for cls in (HostTier, OffloadTier) for n in vars(cls) if n.startswith("_") and not n.endswith("__")}
    for src in (ROOT / "core" / "tiers.py", ROOT / "plugins" / "offload_cpu" / "host.py"):
        private |= {n.attr for n in ast.walk(ast.parse(src.read_text()))
                    if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__")}
    assert {"_future", "_stepped", "_uploaded", "_stash"} <= private
    users = sorted((ROOT / "plugins" / "offload_nvme").glob("*.py")) + sorted(
        (ROOT / "examples" / "compressed_tier").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{n.lineno} .{n.attr}" for p in users for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr in private]
    assert len(users) > 5 and not found, found
