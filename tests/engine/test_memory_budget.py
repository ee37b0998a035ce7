"""Model-state memory at stages 2 and 3 against ZeRO's floor, from torch's CPU allocator
(the profiler's memory records): the bytes held between steps (``engine.memory_report()``)
plus the peak of a whole step (forward, backward, optimizer step) above them.

P trainable parameters, W ranks, bf16 model, fp32 masters, Adam: the floor is 16 P / W
(fp32 master, fp32 gradient, two fp32 moments).

- Stage 3: at most 16 P / W plus one prefetch window (the unit in use and the next one,
  in bf16) and the reduction buckets in flight (two ranks: three fp32 buckets).
- Stage 2: at most 16 P / W plus the buckets and the unsharded bf16 parameters (2 P).

Both also allow the CPU optimizer's and norm's per-tensor temporaries (two units' fp32
bytes; observed 1.5 to 2 on one rank) and a few KB of activations. The model states alone
(what ``memory_report()`` counts, sampled through the step) must stay within the first
terms; on two ranks only they are checked (see the note in ``_measure``).

Between steps no fp32 gradient exists (12 P / W, plus 2 P at stage 2): each unit's is
allocated as its reduction lands and freed after the step. On one rank (no reduction, no
accumulation) the gradients stay bf16 until the step widens them a slice at a time, so the
floor there is 14 P: 2 bytes of gradient, not 4.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import Wide, peak_bytes

WIDTH, LAYERS, BATCH = 256, 24, 2
UNIT = WIDTH * WIDTH + WIDTH        # one Linear: one unit
P = LAYERS * UNIT
ACTIVATION_SLACK = 64 * 1024        # a 2 x 256 batch: activations are a few KB per layer


def _config(stage):
    return {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": UNIT,
                     "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
            "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw"},
            "batch": {"micro_batch_size": BATCH, "steps_per_print": 10_000}, "monitor": {"plugin": "none"}}


def _model_state_peak(engine, fn) -> int:
    """The most bytes ``engine.memory_report()`` counts on the device during ``fn()``,
    sampled after every module's forward and every parameter's gradient (the partitioner's
    own hook runs first)."""
    peak = 0

    def sample(*_):
        nonlocal peak
        peak = max(peak, sum(engine.memory_report()["device"].values()))
    hooks = [m.register_forward_hook(sample) for m in engine.module.modules()]
    hooks += [p.register_post_accumulate_grad_hook(sample) for p in engine.module.parameters()]
    try:
        fn()
        sample()
    finally:
        for h in hooks:
            h.remove()
    return peak


def _measure(rank, world, stage):
    import zeroplug
    torch.manual_seed(0)
    engine = zeroplug.initialize(Wide(WIDTH, LAYERS), _config(stage))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)

    def step():
        engine.backward(engine(x))
        engine.step()
    step()                          # optimizer states exist from here on
    rest = engine.memory_report()["device"]
    states = _model_state_peak(engine, step)
    # Note: on two ranks gloo's worker threads copy through temporaries of their own (NCCL
    # does not) and free buffers when their scheduling lets them: the allocator's peak is
    # read on one rank, the model states' on both
    _, peak = peak_bytes(step) if world == 1 else (None, None)
    return rest, states, peak, len(engine.partitioner.units)


@pytest.mark.parametrize("world,stage", [(1, 2), (1, 3), (2, 2), (2, 3)])
def test_step_peak_within_the_floor(world, stage):
    # one rank keeps autograd's bf16 gradients (exact; widened slice by slice in the step)
    floor = 12 * P / world + (2 * P if world == 1 else 4 * P / world)
    window = 2 * 2 * UNIT if stage == 3 else 0              # the unit in use and the next, bf16
    buckets = 0 if world == 1 else 3 * 4 * UNIT             # three fp32 buckets in flight
    temporaries = 2 * 4 * UNIT
    lp = 2 * P if stage == 2 else 0
    for rest, states, peak, units in run_ranks(_measure, world, stage):
        assert units == LAYERS
        pad = units * (world - 1) * 16                      # padding: < W elements per unit
        # between steps: fp32 master and Adam's moments, no gradient, no bucket, no window
        assert rest["gradients"] == rest["buckets"] == rest["prefetch"] == 0, rest
        assert rest["master"] + rest["optimizer"] <= 12 * P / world + pad, rest
        assert rest["lp_params"] == lp, rest
        # the model states at their most (the gradients complete, the buckets and the window)
        assert floor + lp <= states <= floor + lp + window + buckets + pad, (states, states / P)
        if peak is not None:        # and all that the allocator saw
            held = sum(rest.values()) + peak
            budget = floor + lp + window + buckets + temporaries + pad + ACTIVATION_SLACK
            assert held <= budget, (held, budget, held / P)
