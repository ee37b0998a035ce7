"""Stage 2 on one rank with the optimizer on the CPU: the next forward overlaps the step
(plugins/zero/step_window.py). Values equal the serial step's bit for bit, and a read of a
parameter outside any module's forward (an EMA after engine.step()) waits for its unit."""
import pytest
import torch

import zeroplug
from toy import ToyNet, batches

STEPS = 6


def _cfg(overlap, sub_group_size=300):
    return {"zero": {"plugin": "stage2", "reduce_bucket_size": 200, "sub_group_size": sub_group_size},
            "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
            "batch": {"micro_batch_size": 8, "gradient_clipping": 0.5, "steps_per_print": 10_000},
            "offload": {"optimizer": {"plugin": "cpu", "overlap_step": overlap}},
            "monitor": {"plugin": "none"}, "scheduler": {"plugin": "none"}}


def _run(overlap, ema_after_step=False):
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), _cfg(overlap))
    losses, emas = [], []
    ema = [p.detach().float().clone() for p in engine.module.parameters()]
    for x, y in batches(STEPS, 8):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if ema_after_step:      # read every parameter right after the step, outside any forward
            for e, p in zip(ema, engine.module.parameters()):
                e.mul_(0.9).add_(p.detach().float(), alpha=0.1)
            emas.append([e.clone() for e in ema])
    pending = engine.offload_optimizer.overlapped_steps
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.close()
    return losses, params, emas, pending


def test_overlapped_equals_serial():
    l0, p0, _, n0 = _run(False)
    l1, p1, _, n1 = _run(True)
    assert n0 == 0 and n1 == STEPS          # every step ran overlapped
    assert l0 == l1
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


def test_reads_after_the_step_see_the_new_values():
    _, _, e0, _ = _run(False, ema_after_step=True)
    _, _, e1, n1 = _run(True, ema_after_step=True)
    assert n1 == STEPS
    for s0, s1 in zip(e0, e1):
        for a, b in zip(s0, s1):
            assert torch.equal(a, b)


def test_a_parameter_waits_until_its_unit_is_published():
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), _cfg(True))
    x, y = next(batches(1, 8))
    engine.backward(engine(x, y))
    engine.step()
    window = engine.partitioner.step_window
    assert engine.partitioner.offload.pending and window.open      # step() returned mid-step
    head = engine.module.head.weight
    assert type(head).__name__ == "SteppingParam"
    assert head.shape == (37, 24)                 # metadata: no wait
    head.detach()                                 # a read: waits for its unit only
    assert type(head) is torch.nn.Parameter and window.open
    engine(x, y)                                  # the forward waits for the rest
    assert not window.open
    engine.close()


@pytest.mark.parametrize("stage,expected", [(2, int(1e8)), (3, int(1e9))])
def test_auto_sub_group_size(stage, expected):
    from zeroplug.plugins.zero.masters import unit_groups
    cfg = _cfg(True, "auto")
    cfg["zero"]["plugin"] = f"stage{stage}"
    cfg["zero"]["reduce_bucket_size"] = int(6e7)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)])   # 134M
    if stage == 3:
        with zeroplug.init(cfg):
            model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)])
    engine = zeroplug.initialize(model, cfg)
    groups = unit_groups(engine.partitioner)
    sizes = [sum(u.hi - u.lo for u in g) for g in groups]
    assert max(sizes) <= expected and (len(groups) > 1) == (expected < sum(sizes))
    engine.close()
