"""The third-party optimizer plugin of docs/plugins.md, as written there, registered and run
at stages 1-3 (and stage 3 with CPU offload) against the same optimizer on whole parameters:
sign(g) is element-wise, so the sharded steps compute the same values (one rank: bit for bit)."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, batches
from zeroplug import registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _example():
    code = re.search(r"```python\n(# myplug/__init__.py\n.*?)```", DOC.read_text(), re.S).group(1)
    module = types.ModuleType("myplug")
    sys.modules["myplug"] = module          # dataclasses look their module up while the class is made
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (3, True)])
def test_documented_optimizer_plugin_trains(stage, offload):
    plug = _example()
    pm = registry.PluginManager()
    pm.register(plug, "myplug")
    cfg = {"zero": {"plugin": f"stage{stage}"}, "optimizer": {"plugin": "signsgd", "lr": 1e-2},
           "batch": {"micro_batch_size": 4}, "monitor": {"plugin": "none"}}
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), cfg, plugin_manager=pm)
    torch.manual_seed(0)
    ref = ToyNet()
    opt = plug.SignSGD(ref.parameters(), lr=1e-2)
    for x, y in batches(3, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        want = ref(x, y)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == want.item()
    state = engine.consolidated_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k
