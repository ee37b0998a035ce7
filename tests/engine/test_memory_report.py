"""engine.memory_report(): the bytes each stage holds between steps, per category, against
budgets computed from the parameter count (bf16 model, fp32 master, Adam; CPU, 1 and 2 ranks).

P parameters, W ranks; every unit is padded to a multiple of W elements (at most W - 1 each).

=========  ==========  ===========  ====================  =========
stage      lp params   master       gradients             optimizer
=========  ==========  ===========  ====================  =========
0          2P          4P           2P (flat)             8P
1          2P          4P / W       2P (flat)             8P / W
2          2P          4P / W       0                     8P / W
3          0           4P / W       0                     8P / W
=========  ==========  ===========  ====================  =========

The fp32 gradients exist from each unit's reduction until the step, and are freed after
it; stage 3 gathers from the fp32 master (no bf16 shard, also on one rank). Buckets and the
prefetch window are empty between steps. So between steps stage 3 holds 12 P / W, stage 2
that plus 2 P: under the floor of 16 P / W (+ 2 P) that test_memory_budget.py checks at
the step's peak.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import Wide

WIDTH, LAYERS = 128, 6


def _report(rank, world, stage):
    import zeroplug
    cfg = {"zero": {"plugin": f"stage{stage}", "stage3_param_persistence_threshold": 0},
           "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw"},
           "batch": {"micro_batch_size": 2, "steps_per_print": 10_000}, "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(Wide(WIDTH, LAYERS), cfg)
    x = torch.randn(2, WIDTH).to(torch.bfloat16)
    engine.backward(engine(x))
    engine.step()
    return engine.memory_report(), len(engine.partitioner.all_units)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_persistent_bytes_per_category(stage, world):
    P = LAYERS * (WIDTH * WIDTH + WIDTH)
    W = world
    shard = lambda b: b * P / W                                          # noqa: E731
    want = {
        "lp_params": 2 * P if stage < 3 else 0,
        "master": 4 * P if stage == 0 else shard(4),
        "gradients": 2 * P if stage < 2 else 0,
        "optimizer": 8 * P if stage == 0 else shard(8),
        "buckets": 0, "prefetch": 0,
    }
    for report, units in run_ranks(_report, world, stage):
        pad = units * (W - 1) * 16          # at most W - 1 padding elements per unit, 16 bytes each
        assert report["host"] == {}
        for name, budget in want.items():
            got = report["device"][name]
            assert budget <= got <= budget + pad, (name, got, budget)


def test_the_line_is_printed_once_after_the_first_step(capsys):
    import zeroplug
    engine = zeroplug.initialize(Wide(WIDTH, 2), {"precision": {"plugin": "bf16"}, "monitor": {"plugin": "stdout"},
                                                  "batch": {"micro_batch_size": 2, "steps_per_print": 1}})
    x = torch.randn(2, WIDTH).to(torch.bfloat16)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "memory after the first step" in ln]
    assert len(lines) == 1 and "16.0 bytes per trainable parameter" in lines[0]


def _lp_shards(rank, world, keep):
    import zeroplug
    torch.manual_seed(0)
    cfg = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0,
                    "stage3_low_precision_shards": keep},
           "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
           "batch": {"micro_batch_size": 2, "steps_per_print": 10_000, "gradient_accumulation_steps": 2},
           "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(Wide(WIDTH, LAYERS), cfg)
    losses = []
    for i in range(6):
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(10 * i + rank)).to(torch.bfloat16)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.memory_report()["device"]["lp_params"]


@pytest.mark.parametrize("world", [1, 2])
def test_stage3_gathers_from_the_master_as_from_a_bf16_shard(world):
    """Gathering the fp32 master cast to bf16 gives the bits a bf16 shard would hold: the same
    losses, over accumulation windows, with 2 P / W bytes fewer."""
    P = LAYERS * (WIDTH * WIDTH + WIDTH)
    cast = run_ranks(_lp_shards, world, False)
    kept = run_ranks(_lp_shards, world, True)
    for (lc, lp_cast), (lk, lp_kept) in zip(cast, kept):
        assert lc == lk
        assert lp_cast == 0
        assert 2 * P / world <= lp_kept <= 2 * P / world + LAYERS * (world - 1) * 2
