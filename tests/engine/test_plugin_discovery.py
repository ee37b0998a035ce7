"""Third-party plugins found through a real ``zeroplug`` entry point (a dist-info on sys.path).

The fake package lives in ``tmp_path``: ``<name>-0.1.dist-info/{METADATA,entry_points.txt}``
plus a module; importlib.metadata finds it exactly as it would find an installed wheel.
"""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import zeroplug
from zeroplug import registry
from zeroplug.errors import ConfigError, PluginError
from tests.support.toy import ToyNet


BUILTINS = ("zero", "precision", "optim", "schedulers", "offload_cpu", "monitors", "activations", "warmup",
            "observe", "offload_states", "workload", "sequence")

FAKE_SGD = '''
from dataclasses import dataclass

import torch

import zeroplug
from zeroplug.options import opt
from zeroplug.slots import OptimizerFactory


class FakeSGD(OptimizerFactory):
    """Plain SGD, shipped by a third-party package."""

    @dataclass(frozen=True)
    class Options:
        lr: float = opt(0.1, "Learning rate.", min=0.0)

    def build(self, params, device):
        return torch.optim.SGD(params, lr=self.options.lr)


@zeroplug.hookimpl
def zeroplug_register_optimizers(register):
    register("fake_sgd", FakeSGD)
'''

BROKEN = '''
import zeroplug_missing_dependency_xyz  # noqa: F401  (not installed: the import fails)
'''


class FakeDists:
    """Writes fake distributions into one directory that is on sys.path."""

    def __init__(self, root, monkeypatch):
        self.root, self.modules = root, []
        monkeypatch.syspath_prepend(str(root))

    def add(self, dist: str, module: str, source: str, ep_name: str | None = None):
        info = self.root / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[zeroplug]\n{ep_name or dist} = {module}\n")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        self.modules.append(module)
        registry.reset_plugin_manager()


@pytest.fixture
def dists(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROPLUG_PLUGINS_ALLOW", raising=False)
    monkeypatch.delenv("ZEROPLUG_PLUGINS_BLOCK", raising=False)
    registry.reset_plugin_manager()
    d = FakeDists(tmp_path, monkeypatch)
    yield d
    registry.reset_plugin_manager()
    for m in d.modules:
        sys.modules.pop(m, None)


CONFIG = """
[batch]
micro_batch_size = 4

[optimizer]
plugin = "fake_sgd"
lr = 0.5

[monitor]
plugin = "none"
"""


def test_third_party_optimizer_trains(dists, tmp_path):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    pm = registry.get_plugin_manager()
    assert "fake_sgd" in pm.names("optimizer")
    assert pm.registry()["optimizer"]["fake_sgd"].plugin == "fakeplug"
    assert pm.versions["fakeplug"] == "0.1"
    row = next(r for r in pm.describe() if r["name"] == "fakeplug")
    assert row["provides"] == ["optimizer:fake_sgd"]
    assert row["hooks"] == ["zeroplug_register_optimizers"]
    # the built-ins come through the same entry-point group
    for name in BUILTINS:
        assert pm.pm.has_plugin(name), name

    cfg = tmp_path / "zero.toml"
    cfg.write_text(CONFIG)
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), str(cfg))
    assert isinstance(engine.optimizer, torch.optim.SGD)
    assert engine.config.slot("optimizer").name == "fake_sgd"
    assert engine.get_lr() == [0.5]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (4, 8), generator=g)
    y = torch.randint(0, 37, (4, 8), generator=g)
    losses = []
    for _ in range(5):            # the same batch: SGD must drive its loss down
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_step == 5
    assert losses[-1] < losses[0] - 1e-3, losses
    assert len(set(losses)) == len(losses), losses
    engine.close()


def test_options_of_a_third_party_plugin_are_validated(dists):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    with pytest.raises(ConfigError) as info:
        zeroplug.load_config({"optimizer": {"plugin": "fake_sgd", "momentum": 0.9}})
    assert info.value.key == "optimizer.momentum"
    with pytest.raises(ConfigError) as info:
        zeroplug.load_config({"optimizer": {"plugin": "fake_sgd", "lr": -1.0}})
    assert info.value.key == "optimizer.lr" and ">= 0" in str(info.value)


def test_block_list_hides_the_plugin(dists, monkeypatch):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    monkeypatch.setenv("ZEROPLUG_PLUGINS_BLOCK", "fakeplug")
    registry.reset_plugin_manager()
    pm = registry.get_plugin_manager()
    assert not pm.pm.has_plugin("fakeplug")
    assert "fake_sgd" not in pm.names("optimizer")
    assert "adamw" in pm.names("optimizer")          # built-ins unaffected
    with pytest.raises(ConfigError) as info:
        zeroplug.load_config({"optimizer": {"plugin": "fake_sgd"}})
    msg = str(info.value)
    assert info.value.key == "optimizer.plugin"
    assert "'fake_sgd'" in msg and "not a registered optimizer plugin" in msg


def test_allow_list_restricts(dists, monkeypatch):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    monkeypatch.setenv("ZEROPLUG_PLUGINS_ALLOW", "fakeplug")
    registry.reset_plugin_manager()
    pm = registry.get_plugin_manager()
    assert [name for name, _ in pm.pm.list_name_plugin()] == ["fakeplug"]
    assert pm.names("optimizer") == ["fake_sgd"]
    assert pm.names("zero") == [] and pm.names("precision") == []

    # allow the built-ins but not the fake one: it disappears, everything else works
    monkeypatch.setenv("ZEROPLUG_PLUGINS_ALLOW", " , ".join(BUILTINS))
    registry.reset_plugin_manager()
    pm = registry.get_plugin_manager()
    assert not pm.pm.has_plugin("fakeplug")
    assert "fake_sgd" not in pm.names("optimizer")
    assert zeroplug.load_config({"optimizer": {"plugin": "sgd"}}).slot("optimizer").name == "sgd"


def test_broken_plugin_names_itself_and_the_way_out(dists, monkeypatch):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    dists.add("brokenplug", "brokenplug_mod", BROKEN)
    with pytest.raises(PluginError) as info:
        registry.get_plugin_manager()
    msg = str(info.value)
    assert "'brokenplug'" in msg
    assert "brokenplug_mod" in msg
    assert "zeroplug_missing_dependency_xyz" in msg          # the cause
    assert "ZEROPLUG_PLUGINS_BLOCK=brokenplug" in msg        # how to skip it
    # following the advice works
    monkeypatch.setenv("ZEROPLUG_PLUGINS_BLOCK", "brokenplug")
    registry.reset_plugin_manager()
    assert "fake_sgd" in registry.get_plugin_manager().names("optimizer")


def test_duplicate_registration_names_both_plugins(dists, monkeypatch):
    dists.add("fakeplug", "fakeplug_mod", FAKE_SGD)
    dists.add("otherplug", "otherplug_mod", FAKE_SGD)
    with pytest.raises(PluginError) as info:
        zeroplug.load_config({"optimizer": {"plugin": "fake_sgd"}})
    msg = str(info.value)
    assert "'fake_sgd'" in msg
    assert "'fakeplug'" in msg and "'otherplug'" in msg
    assert "ZEROPLUG_PLUGINS_BLOCK" in msg
    # blocking one of them resolves the clash
    monkeypatch.setenv("ZEROPLUG_PLUGINS_BLOCK", "otherplug")
    registry.reset_plugin_manager()
    assert registry.get_plugin_manager().registry()["optimizer"]["fake_sgd"].plugin == "fakeplug"


def test_duplicate_of_a_builtin_name(dists):
    dists.add("shadowplug", "shadowplug_mod", FAKE_SGD.replace('"fake_sgd"', '"adamw"'))
    with pytest.raises(PluginError) as info:
        registry.get_plugin_manager().registry()
    msg = str(info.value)
    assert "'adamw'" in msg and "'optim'" in msg and "'shadowplug'" in msg


def test_configuration_page_is_generated_from_the_builtin_plugins(capsys):
    """docs/configuration.md is `zeroplug docs` as it is, whatever third-party plugins are
    installed beside (the example tier's package, in CI)."""
    from pathlib import Path

    from zeroplug.cli import main
    assert main(["docs"]) == 0
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert capsys.readouterr().out == page, "regenerate: zeroplug docs > docs/configuration.md"
    assert 'plugin = "compressed"' not in page
