"""One rank, no accumulation: the gradients stay in the model dtype until the step
(plugins/zero/lp_grads.py), and training follows the fp32-gradient path bit for bit."""
from __future__ import annotations

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, batches


def _engine(stage, clip=0.0, accumulation=1, implementation="auto", keep_lp=True):
    torch.manual_seed(0)
    cfg = {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": 300},
           "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01, "implementation": implementation},
           "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": accumulation,
                     "gradient_clipping": clip, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}, "scheduler": {"plugin": "none"}}
    if stage == 3:
        with zeroplug.init(cfg):
            model = ToyNet()
    else:
        model = ToyNet()
    engine = zeroplug.initialize(model, cfg)
    if not keep_lp:
        engine.partitioner.lp_grads = None       # the fp32 master-gradient path, for comparison
    return engine


def _train(engine, steps=4):
    losses = []
    for x, y in batches(steps, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.partitioner.gathered_params():
        params = [p.detach().clone() for p in engine.module.parameters()]
    return losses, params


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_same_values_as_fp32_master_gradients(stage, clip):
    ours, ref = _engine(stage, clip), _engine(stage, clip, keep_lp=False)
    assert ours.partitioner.lp_grads is not None
    losses, params = _train(ours)
    ref_losses, ref_params = _train(ref)
    if clip == 0.0:     # the same fused kernel on the same widened values: identical
        assert losses == ref_losses
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b)
    else:               # the norm is summed in another order: clipping factors differ in the last bits
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=1e-2)   # one bf16 ulp at most


def test_gradients_held_in_bf16_until_the_step():
    engine = _engine(2)
    x, y = next(batches(1, 4))
    engine.backward(engine(x, y))
    held = engine.partitioner.lp_grads.tensors()
    n = sum(p.numel() for p in engine.module.parameters())
    assert held and all(g.dtype == torch.bfloat16 for g in held)
    assert sum(g.numel() for g in held) == n
    assert all(u.master.grad is None for u in engine.partitioner.units)     # no fp32 gradient yet
    engine.step()
    assert engine.partitioner.lp_grads.tensors() == []
    assert all(u.master.grad is None for u in engine.partitioner.units)


@pytest.mark.parametrize("kw", [{"accumulation": 2}, {"implementation": "foreach"}])
def test_fp32_master_gradients_where_bf16_would_round(kw):
    # accumulation would add in bf16; a non-fused optimizer has its gradients multiplied in place
    assert _engine(2, **kw).partitioner.lp_grads is None


def test_two_backward_calls_in_one_window_add_up_in_fp32():
    # accumulation 1, but backward twice before the step: the gradients add as fp32 master
    # gradients would (the second is added to a widened copy of the first)
    def run(engine):
        data = batches(4, 4)
        for _ in range(2):
            for _ in range(2):
                x, y = next(data)
                engine.backward(engine(x, y))
            engine.step()
        with engine.partitioner.gathered_params():
            return [p.detach().clone() for p in engine.module.parameters()]
    for a, b in zip(run(_engine(2)), run(_engine(2, keep_lp=False))):
        assert torch.equal(a, b)
