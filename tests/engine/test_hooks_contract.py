"""The hook contract.

(a) Every hook in ``core/hookspecs.py`` is documented in ``docs/plugins.md`` and exercised
    here by a recording plugin; adding a hook without a test here fails ``test_every_hook_is_covered``.
(b) Core never imports a plugin (DESIGN.md's dependency rule), checked on the source with ``ast``.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug import hookspecs, registry
from zeroplug.registry import SLOTS
from tests.support.toy import ToyNet, batches

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_plugin_manager(monkeypatch):
    monkeypatch.delenv("ZEROPLUG_PLUGINS_ALLOW", raising=False)
    monkeypatch.delenv("ZEROPLUG_PLUGINS_BLOCK", raising=False)
    registry.reset_plugin_manager()
    yield
    registry.reset_plugin_manager()


def hook_names() -> set[str]:
    """Every hook declared in hookspecs.py (functions carrying pluggy's spec marker)."""
    return {name for name, fn in vars(hookspecs).items()
            if inspect.isfunction(fn) and hasattr(fn, "zeroplug_spec")}


# --- a recording plugin ----------------------------------------------------------------------

class Recorder:
    """Implements every lifecycle hook and records each call."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.strategy = None        # what zeroplug_sequence_strategy answers

    def of(self, name):
        return [kw for n, kw in self.calls if n == name]

    @zeroplug.hookimpl
    def zeroplug_engine_created(self, engine):
        self.calls.append(("zeroplug_engine_created", {"engine": engine, "has_optimizer": hasattr(engine, "optimizer"),
                                                      "global_step": engine.global_step}))

    @zeroplug.hookimpl
    def zeroplug_gathered_params(self, params, modifier_rank):
        self.calls.append(("zeroplug_gathered_params", {"params": list(params), "modifier_rank": modifier_rank}))
        return None         # holds none of them

    @zeroplug.hookimpl
    def zeroplug_step_begin(self, engine):
        self.calls.append(("zeroplug_step_begin", {"engine": engine, "global_step": engine.global_step,
                                                  "micro_step": engine.micro_step}))

    @zeroplug.hookimpl
    def zeroplug_step_end(self, engine, metrics):
        self.calls.append(("zeroplug_step_end", {"engine": engine, "metrics": dict(metrics)}))
        metrics["recorder_saw"] = metrics["step"]      # plugins may add keys

    @zeroplug.hookimpl
    def zeroplug_checkpoint_state_save(self, engine):
        self.calls.append(("zeroplug_checkpoint_state_save", {"engine": engine}))
        return {"recorder": {"steps_seen": len(self.of("zeroplug_step_end")), "t": torch.arange(3.0)}}

    @zeroplug.hookimpl
    def zeroplug_checkpoint_state_load(self, engine, states):
        self.calls.append(("zeroplug_checkpoint_state_load", {"engine": engine, "states": states}))

    @zeroplug.hookimpl
    def zeroplug_offload_states(self, engine, include, device, pin_memory, non_blocking, nvme_path):
        from zeroplug.offload_states import engine_state_tensors
        freed = {name for name, ts in engine_state_tensors(engine).items()
                 if ts and all(t.untyped_storage().size() == 0 for t in ts)}
        self.calls.append(("zeroplug_offload_states", {"engine": engine, "include": set(include),
                                                      "device": device, "freed": freed}))
        return None         # moved none of the engine's states

    @zeroplug.hookimpl
    def zeroplug_reload_states(self, engine):
        self.calls.append(("zeroplug_reload_states", {"engine": engine}))

    @zeroplug.hookimpl(tryfirst=True)
    def zeroplug_sequence_strategy(self, engine):
        self.calls.append(("zeroplug_sequence_strategy", {"engine": engine}))
        return self.strategy        # None: the built-in plugin's answer stands

    @zeroplug.hookimpl
    def zeroplug_engine_closed(self, engine):
        self.calls.append(("zeroplug_engine_closed", {"engine": engine, "step": engine.global_step}))

    @zeroplug.hookimpl
    def zeroplug_engine_setup(self, engine):
        self.calls.append(("zeroplug_engine_setup", {"engine": engine, "has_optimizer": hasattr(engine, "optimizer"),
                                                    "created": bool(self.of("zeroplug_engine_created"))}))

    @zeroplug.hookimpl
    def zeroplug_phase(self, engine, phase):
        self.calls.append(("zeroplug_phase", {"engine": engine, "phase": phase, "step": engine.global_step}))

    @zeroplug.hookimpl
    def zeroplug_state_devices(self, engine, state):
        self.calls.append(("zeroplug_state_devices", {"engine": engine, "state": state}))
        return None         # tracks nothing: the built-in plugin answers

    @zeroplug.hookimpl
    def zeroplug_model_presets(self):
        self.calls.append(("zeroplug_model_presets", {}))
        return {"recorder-mlp": _recorder_spec}

    @zeroplug.hookimpl
    def zeroplug_add_commands(self, subparsers):
        self.calls.append(("zeroplug_add_commands", {}))
        subparsers.add_parser("recorder-hello", help="say hello").set_defaults(fn=lambda args, overrides: 7)

    @zeroplug.hookimpl
    def zeroplug_memory_report(self, engine):
        self.calls.append(("zeroplug_memory_report", {"engine": engine}))
        return None         # the built-in plugin answers


def _recorder_spec(checkpointing):
    from zeroplug.tools.probe import ModelSpec
    return ModelSpec("recorder-mlp", lambda layers: ToyNet(), None, 16, hf=False, max_seq=8)


def _make_impl(slot):
    class Impl:
        __doc__ = f"A recorder's {slot} implementation."

        @dataclass(frozen=True)
        class Options:
            pass
    return Impl


class RegisterRecorder:
    """Implements every registration hook; registers one ``rec_<slot>`` per slot."""

    def __init__(self):
        self.called: dict[str, int] = {}
        self.impls = {slot: _make_impl(slot) for slot in SLOTS}

    def _do(self, hook, slot, register):
        assert callable(register)
        self.called[hook] = self.called.get(hook, 0) + 1
        register(f"rec_{slot}", self.impls[slot])


def _add_register_hook(slot, hook_name):
    def impl(self, register):
        self._do(hook_name, slot, register)
    impl.__name__ = hook_name
    setattr(RegisterRecorder, hook_name, zeroplug.hookimpl(impl))


for _slot, _hook in SLOTS.items():
    _add_register_hook(_slot, _hook)


def make_engine(recorder, gas=1, **cfg):
    pm = registry.get_plugin_manager()
    pm.register(recorder, "recorder")
    torch.manual_seed(0)
    config = {"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": gas},
              "optimizer": {"plugin": "sgd", "lr": 0.05}, "monitor": {"plugin": "none"}, **cfg}
    return zeroplug.initialize(ToyNet(), config, device="cpu")


def train(engine, micro_steps):
    for x, y in batches(micro_steps, 2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


# --- (a) each hook, exercised -------------------------------------------------------------------

def test_register_hooks():
    rec = RegisterRecorder()
    pm = registry.get_plugin_manager()
    pm.register(rec, "register_recorder")
    reg = pm.registry()
    for slot, hook in SLOTS.items():
        assert rec.called.get(hook) == 1, hook
        assert reg[slot][f"rec_{slot}"].impl is rec.impls[slot]
        assert reg[slot][f"rec_{slot}"].plugin == "register_recorder"
        assert f"rec_{slot}" in pm.names(slot)
        # the built-ins use the very same hook
        assert any(r.plugin != "register_recorder" for r in reg[slot].values()), slot
    row = next(r for r in pm.describe() if r["name"] == "register_recorder")
    assert set(row["hooks"]) == set(SLOTS.values())


def test_engine_created():
    rec = Recorder()
    engine = make_engine(rec)
    calls = rec.of("zeroplug_engine_created")
    assert len(calls) == 1
    assert calls[0]["engine"] is engine
    assert calls[0]["has_optimizer"] and calls[0]["global_step"] == 0
    assert rec.of("zeroplug_step_begin") == []
    engine.close()


def test_engine_setup_before_created():
    rec = Recorder()
    engine = make_engine(rec)
    calls = rec.of("zeroplug_engine_setup")
    assert len(calls) == 1 and calls[0]["engine"] is engine
    assert calls[0]["has_optimizer"] and not calls[0]["created"]
    engine.close()


def test_sequence_strategy_is_the_plugins_answer():
    """engine.sequence() is the first plugin's answer: the built-in ``sequence`` plugin's
    strategy where no other answers, another plugin's where it answers first."""
    rec = Recorder()
    engine = make_engine(rec)
    sp = engine.sequence()
    assert [c["engine"] for c in rec.of("zeroplug_sequence_strategy")] == [engine]
    assert sp.group.degree == 1 and sp.group.data_parallel_size == 1    # the built-in's, one rank
    rec.strategy = mine = object()
    assert engine.sequence() is mine
    engine.close()


def test_phases_in_step_order_and_phase_metrics():
    rec = Recorder()
    engine = make_engine(rec, gas=2)
    train(engine, 2)                                 # 2 micro steps, 1 optimizer step
    phases = [c["phase"] for c in rec.of("zeroplug_phase")]
    assert phases == ["forward", "backward", "forward", "backward", "wait_gradients", "optimizer", "other"]
    m = engine.last_metrics                          # step 1 is a print step: the observe plugin's readings
    assert m["phase_forward"] > 0 and m["phase_backward"] > 0 and m["phase_optimizer"] > 0
    assert "memory_report" in m and "bytes per trainable parameter" in m["memory_report"]
    engine.close()


def test_memory_report_and_state_devices_come_from_plugins(monkeypatch):
    rec = Recorder()
    engine = make_engine(rec)
    train(engine, 1)
    report = engine.memory_report()
    assert report["device"]["lp_params"] > 0         # the built-in observe plugin answered
    assert rec.of("zeroplug_memory_report")[-1]["engine"] is engine
    assert zeroplug.get_state_devices(engine, "lp_params") == {torch.device("cpu")}
    assert rec.of("zeroplug_state_devices")[-1]["state"] == "lp_params"
    engine.close()
    monkeypatch.setenv("ZEROPLUG_PLUGINS_BLOCK", "observe")      # without it: training works, the report names why not
    registry.reset_plugin_manager()
    try:
        bare = make_engine(Recorder())
        train(bare, 1)
        assert "phase_forward" not in bare.last_metrics and "loss" in bare.last_metrics
        with pytest.raises(zeroplug.PluginError, match="no plugin reports memory"):
            bare.memory_report()
        bare.close()
    finally:
        monkeypatch.delenv("ZEROPLUG_PLUGINS_BLOCK")
        registry.reset_plugin_manager()


def test_model_presets_and_commands_come_from_plugins(capsys):
    from zeroplug.cli import build_parser, main
    from zeroplug.tools.probe import load_spec
    rec = Recorder()
    registry.get_plugin_manager().register(rec, "recorder")
    try:
        assert load_spec("recorder-mlp").name == "recorder-mlp"       # a plugin's preset
        assert load_spec("char-tiny").vocab_size > 0                    # the built-in workload plugin's
        assert rec.of("zeroplug_model_presets")
        parser = build_parser()
        assert rec.of("zeroplug_add_commands")
        assert parser.parse_args(["recorder-hello"]).fn(None, []) == 7
        assert main(["recorder-hello"]) == 7
        assert parser.parse_args(["train", "--steps", "1"]).steps == 1  # train: the workload plugin's
    finally:
        registry.reset_plugin_manager()


def test_step_begin_once_per_optimizer_step():
    rec = Recorder()
    engine = make_engine(rec, gas=2)
    train(engine, 6)                                 # 6 micro steps, 3 optimizer steps
    calls = rec.of("zeroplug_step_begin")
    assert [c["global_step"] for c in calls] == [0, 1, 2]
    assert [c["micro_step"] for c in calls] == [2, 4, 6]   # at each accumulation boundary (micro steps done)
    assert all(c["engine"] is engine for c in calls)
    engine.close()


def test_step_end_metrics():
    rec = Recorder()
    engine = make_engine(rec, scheduler={"plugin": "warmup", "warmup_num_steps": 4, "warmup_type": "linear"})
    train(engine, 3)
    calls = rec.of("zeroplug_step_end")
    assert len(calls) == 3
    for n, c in enumerate(calls, start=1):
        m = c["metrics"]
        assert c["engine"] is engine
        assert m["step"] == n
        assert m["lr"] == pytest.approx(0.05 * (n - 1) / 4)
        assert m["loss_scale"] == 1.0                  # fp32: no scaling
        assert m["grad_norm"] > 0 and m["skipped"] is False
    assert "loss" in calls[0]["metrics"]               # step 1 is a print step
    assert engine.last_metrics["recorder_saw"] == 3    # keys a plugin adds reach the monitors' dict
    engine.close()


def test_step_end_reports_fp16_scale_and_skips():
    rec = Recorder()
    engine = make_engine(rec, precision={"plugin": "fp16", "initial_scale_power": 6, "hysteresis": 1})
    x, y = next(batches(1, 2))
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    m = rec.of("zeroplug_step_end")[0]["metrics"]
    assert m["skipped"] is True and m["loss_scale"] == 32.0 and m["step"] == 1
    engine.close()


def test_checkpoint_state_save_and_load(tmp_path):
    rec = Recorder()
    engine = make_engine(rec)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    saves = rec.of("zeroplug_checkpoint_state_save")
    assert len(saves) == 1 and saves[0]["engine"] is engine

    rec2 = Recorder()
    registry.reset_plugin_manager()
    engine2 = make_engine(rec2)
    engine2.load_checkpoint(str(tmp_path / "ckpt"))
    loads = rec2.of("zeroplug_checkpoint_state_load")
    assert len(loads) == 1 and loads[0]["engine"] is engine2
    state = loads[0]["states"]["recorder"]
    assert state["steps_seen"] == 2
    assert torch.equal(state["t"], torch.arange(3.0))
    engine.close()
    engine2.close()


def test_offload_and_reload_states(tmp_path):
    rec = Recorder()
    engine = make_engine(rec)
    train(engine, 1)
    # nvme: on a CPU run "cpu" is where the states are already (nothing leaves)
    engine.offload_states(include={"optim_states", "hp_params", "lp_params"}, device="nvme", nvme_path=str(tmp_path))
    calls = rec.of("zeroplug_offload_states")
    assert len(calls) == 1 and calls[0]["engine"] is engine
    assert calls[0]["include"] >= {"optim_states", "hp_params"}
    assert str(calls[0]["device"]) == "nvme"
    assert calls[0]["freed"] == {"lp_params"}               # the built-in plugin moved them first (tryfirst;
                                                            # fp32 stage 0 with SGD holds no others)
    assert engine.states_offloaded == calls[0]["include"]   # what it returned, recorded by the engine
    with pytest.raises(zeroplug.StateError, match="offloaded"):
        train(engine, 1)
    assert rec.of("zeroplug_reload_states") == []
    engine.reload_states()
    assert len(rec.of("zeroplug_reload_states")) == 1
    train(engine, 1)                                   # training works again
    engine.close()


class FailingMover:
    """Raises in zeroplug_offload_states, after the built-in plugin moved the engine's states."""

    def __init__(self):
        self.freed = None

    @zeroplug.hookimpl
    def zeroplug_offload_states(self, engine, include):
        from zeroplug.offload_states import engine_state_tensors
        self.freed = all(t.untyped_storage().size() == 0 for t in engine_state_tensors(engine)["lp_params"])
        raise RuntimeError("device lost")


def test_a_failed_offload_brings_back_what_moved(tmp_path):
    from zeroplug.offload_states import engine_state_tensors
    rec = Recorder()
    engine = make_engine(rec)
    train(engine, 1)
    failing = FailingMover()
    registry.get_plugin_manager().register(failing, "failing_mover")
    before = [t.clone() for t in engine_state_tensors(engine)["lp_params"]]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.offload_states(include={"lp_params"}, device="nvme", nvme_path=str(tmp_path))
    assert failing.freed                            # the built-in plugin had moved them
    assert len(rec.of("zeroplug_reload_states")) == 1 and not engine.states_offloaded
    assert all(torch.equal(a, b) for a, b in zip(before, engine_state_tensors(engine)["lp_params"]))
    with pytest.raises(zeroplug.StateError, match="keeps states on the training device"):
        engine.offload_states(device="none")        # refused before anything moves
    train(engine, 1)                                # every state in place: training goes on
    engine.close()


class Holder:
    """Holds the parameters tagged ``held`` (as zeroplug.init's partitioner holds its own)."""

    def __init__(self):
        self.events: list = []

    @zeroplug.hookimpl
    def zeroplug_gathered_params(self, params, modifier_rank):
        from contextlib import contextmanager
        mine = [p for p in params if getattr(p, "held", False)]
        if not mine:
            return None

        @contextmanager
        def ctx():
            self.events.append(("enter", len(mine), modifier_rank))
            yield
            self.events.append(("exit", len(mine), modifier_rank))
        return ctx(), mine


def test_gathered_params_hook():
    from zeroplug.gathering import gathered_parameters
    holder, rec = Holder(), Recorder()
    registry.get_plugin_manager().register(holder, "holder")
    registry.get_plugin_manager().register(rec, "recorder")
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.held = True
    with gathered_parameters([a, b], modifier_rank=0):
        assert holder.events == [("enter", 1, 0)]          # only the parameter it holds
        b.data.fill_(1.0)                                   # the other one is plain: whole already
    assert holder.events == [("enter", 1, 0), ("exit", 1, 0)]
    with gathered_parameters([b]):
        pass
    assert len(holder.events) == 2                          # holds none: not asked to gather
    asked = rec.of("zeroplug_gathered_params")              # every plugin is asked until one answers
    assert [len(c["params"]) for c in asked] == [2, 1] and [c["modifier_rank"] for c in asked] == [0, None]


class ListMonitor(zeroplug.slots.Monitor):
    """Keeps what it is given (a monitor: the engine's lifecycle plugin)."""
    rows: list = []
    closed: list = []

    def write(self, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        self.closed.append(True)


class MonitorPlugin:
    @zeroplug.hookimpl
    def zeroplug_register_monitors(self, register):
        register("list", ListMonitor)


def test_engine_closed_and_monitors_are_hook_implementations():
    rec = Recorder()
    registry.get_plugin_manager().register(MonitorPlugin(), "list_monitor")
    ListMonitor.rows, ListMonitor.closed = [], []
    engine = make_engine(rec, monitor={"plugin": "list"}, batch={"micro_batch_size": 2, "steps_per_print": 2})
    other = zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "list"}}, device="cpu")   # its monitor: its steps
    train(engine, 4)
    assert [r["step"] for r in ListMonitor.rows] == [1, 2, 4]        # the reported steps, of this engine only
    assert all(r["recorder_saw"] == r["step"] for r in ListMonitor.rows)   # after the other plugins' keys
    pm = registry.get_plugin_manager()
    attached = [n for n, p in pm.pm.list_name_plugin() if isinstance(p, ListMonitor)]
    assert len(attached) == 2
    engine.close()
    calls = rec.of("zeroplug_engine_closed")
    assert len(calls) == 1 and calls[0]["engine"] is engine and calls[0]["step"] == 4
    assert ListMonitor.closed == [True]
    assert len([p for _, p in pm.pm.list_name_plugin() if isinstance(p, ListMonitor)]) == 1
    other.close()
    assert not [p for _, p in pm.pm.list_name_plugin() if isinstance(p, ListMonitor)]


def test_misspelled_hook_implementation_is_an_error():
    class Typo:
        @zeroplug.hookimpl
        def zeroplug_step_ned(self, engine, metrics):
            pass

    pm = registry.PluginManager(load_entry_points=False)
    with pytest.raises(zeroplug.PluginError, match=r"'typo'.*'zeroplug_step_ned' matches no zeroplug hook.*"
                                                   r"Did you mean 'zeroplug_step_end'"):
        pm.register(Typo(), "typo")
    assert not pm.pm.has_plugin("typo")


#: hook -> the test above that exercises it
COVERED = {
    **{hook: "test_register_hooks" for hook in SLOTS.values()},
    "zeroplug_engine_created": "test_engine_created",
    "zeroplug_step_begin": "test_step_begin_once_per_optimizer_step",
    "zeroplug_step_end": "test_step_end_metrics",
    "zeroplug_checkpoint_state_save": "test_checkpoint_state_save_and_load",
    "zeroplug_checkpoint_state_load": "test_checkpoint_state_save_and_load",
    "zeroplug_offload_states": "test_offload_and_reload_states",
    "zeroplug_reload_states": "test_offload_and_reload_states",
    "zeroplug_engine_closed": "test_engine_closed_and_monitors_are_hook_implementations",
    "zeroplug_gathered_params": "test_gathered_params_hook",
    "zeroplug_engine_setup": "test_engine_setup_before_created",
    "zeroplug_phase": "test_phases_in_step_order_and_phase_metrics",
    "zeroplug_sequence_strategy": "test_sequence_strategy_is_the_plugins_answer",
    "zeroplug_memory_report": "test_memory_report_and_state_devices_come_from_plugins",
    "zeroplug_state_devices": "test_memory_report_and_state_devices_come_from_plugins",
    "zeroplug_model_presets": "test_model_presets_and_commands_come_from_plugins",
    "zeroplug_add_commands": "test_model_presets_and_commands_come_from_plugins",
}


def test_every_hook_is_covered():
    names = hook_names()
    assert len(names) >= 13
    assert names == set(COVERED), (f"hooks without a test here: {sorted(names - set(COVERED))}; "
                                   f"tests for hooks that no longer exist: {sorted(set(COVERED) - names)}")
    assert set(SLOTS.values()) <= names
    for test in set(COVERED.values()):
        assert inspect.isfunction(globals().get(test)), test
    for hook in names - set(SLOTS.values()):           # lifecycle hooks: the Recorder implements each
        assert hasattr(getattr(Recorder, hook, None), "zeroplug_impl"), hook


def test_every_hook_is_documented():
    doc = ROOT / "docs" / "plugins.md"
    assert doc.is_file(), "docs/plugins.md (the plugin authoring guide) is missing"
    text = doc.read_text()
    missing = sorted(h for h in hook_names() if h not in text)
    assert not missing, f"hooks not mentioned in docs/plugins.md: {missing}"


# --- (b) core never imports a plugin --------------------------------------------------------------

def plugin_imports(source: str, filename: str = "<src>") -> list[str]:
    """Every place ``source`` (a module of the ``zeroplug`` core package) imports a plugin."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name == "zeroplug.plugins" or a.name.startswith("zeroplug.plugins.")]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 0:
                bad = mod == "zeroplug.plugins" or mod.startswith("zeroplug.plugins.") or (
                    mod == "zeroplug" and any(a.name == "plugins" for a in node.names))
            else:   # relative: inside core, ``.plugins`` is zeroplug.plugins
                bad = (node.level == 1 and (mod == "plugins" or mod.startswith("plugins.")
                                            or (mod == "" and any(a.name == "plugins" for a in node.names))))
            if bad:
                found.append(f"{where} from {'.' * node.level}{mod} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and (
                        node.args[0].value.startswith("zeroplug.plugins") or node.args[0].value.startswith(".plugins")):
                found.append(f"{where} {name}({node.args[0].value!r})")
    return found


@pytest.mark.parametrize("snippet", [
    "import zeroplug.plugins.zero",
    "import zeroplug.plugins as p",
    "from zeroplug.plugins.precision.scaler import LossScaler",
    "from zeroplug import plugins",
    "from .plugins import zero",
    "from . import plugins",
    "def f():\n    from .plugins.optim import AdamW",
    "import importlib\nimportlib.import_module('zeroplug.plugins.optim')",
])
def test_plugin_import_checker_catches(snippet):
    assert plugin_imports(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import zeroplug", "from . import hookspecs", "from .registry import get_plugin_manager",
    "from zeroplug.options import opt", "import pluggy",
])
def test_plugin_import_checker_allows(snippet):
    assert plugin_imports(snippet) == []


def test_core_never_imports_a_plugin():
    files = sorted((ROOT / "core").rglob("*.py"))
    assert len(files) >= 8 and (ROOT / "core" / "engine.py") in files
    offenders = []
    for f in files:
        offenders += plugin_imports(f.read_text(), str(f.relative_to(ROOT)))
    assert not offenders, "core imports plugins (find them through entry points instead):\n" + "\n".join(offenders)
