"""An offload tier allocates the optimizer's states inside ``initialize`` (OffloadTier.prepare),
so the first step allocates none: the moments exist before step 1 and step 1 keeps the very
same tensors; the nvme tier keeps creating them as each sub-group comes in."""
from __future__ import annotations

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, batches, train_steps


def _moments(engine) -> list[torch.Tensor]:
    return [v for st in engine.optimizer.state.values() for k, v in st.items() if k.startswith("exp_avg")]


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
@pytest.mark.parametrize("optimizer", ["cpu_adam", "adamw"])
def test_cpu_tier_states_exist_before_the_first_step(stage, optimizer):
    torch.manual_seed(0)
    cfg = {"zero": {"plugin": stage, "sub_group_size": 4096}, "optimizer": {"plugin": optimizer},
           "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(ToyNet(), cfg)
    before = _moments(engine)
    if optimizer == "adamw":         # torch's optimizers create theirs in their first step
        assert before == []
        return
    numel = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert len(engine.optimizer.param_groups) > 1           # several sub-groups
    assert sum(t.numel() for t in before) == 2 * numel       # every sub-group's m and v
    train_steps(engine, batches(1, 8), 1)
    after = _moments(engine)
    assert [t.data_ptr() for t in after] == [t.data_ptr() for t in before]
    assert any(t.abs().sum() > 0 for t in after)             # and the step used them
    engine.close()


def test_prepared_states_train_as_lazily_created_ones():
    """Values are unchanged: the same run with states created in the first step (the nvme
    tier's way, through the optimizer's own lazy path) gives the same losses."""
    def losses(prepare: bool):
        torch.manual_seed(0)
        cfg = {"zero": {"plugin": "stage2"}, "offload": {"optimizer": {"plugin": "cpu"}},
               "optimizer": {"plugin": "cpu_adam"}, "monitor": {"plugin": "none"}}
        engine = zeroplug.initialize(ToyNet(), cfg)
        if not prepare:
            engine.optimizer.state.clear()
        out = train_steps(engine, batches(4, 8), 4)
        engine.close()
        return out
    assert losses(True) == losses(False)


def test_nvme_tier_creates_states_as_sub_groups_come_in(tmp_path):
    torch.manual_seed(0)
    cfg = {"zero": {"plugin": "stage2"}, "optimizer": {"plugin": "cpu_adam"},
           "offload": {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path)}}, "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(ToyNet(), cfg)
    assert _moments(engine) == []
    engine.close()


def test_host_ring_for_device_shards_is_allocated_in_initialize(monkeypatch):
    """Where the model-dtype shards live on the GPU (stages 1-2), cpu_adam writes their new
    values into a host ring that the uploads read; ``prepare`` allocates (and page-locks) it,
    not the first step. The device check is forced here: this machine has no GPU."""
    from zeroplug.plugins.offload_cpu.host import HostTier
    monkeypatch.setattr(HostTier, "lp_on_device", lambda self, a, b: True)
    torch.manual_seed(0)
    cfg = {"zero": {"plugin": "stage2", "sub_group_size": 4096}, "optimizer": {"plugin": "cpu_adam"},
           "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(ToyNet(), cfg)
    tier = engine.offload_optimizer
    largest = max(b - a for a, b in tier.ranges)
    assert [(t.numel(), t.dtype) for t in tier.host_staging] == [(largest, tier.layout.param_dtype)] * 2
    engine.close()
