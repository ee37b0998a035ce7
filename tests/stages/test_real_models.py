"""The models users bring, at every stage, with and without CPU offload, on 1 and 2 ranks,
against plain torch (single process, torch.optim.AdamW over the global batch).

Llama (tied embeddings), GPT-2 (tied), T5 (encoder-decoder, shared embedding used by both
stacks), Mixtral (mixture of experts), BERT (masked LM), and a model of our own with
top-1 routed experts that are modules of their own (some get no tokens on some ranks: no
gradient there, a gradient on the other rank), a LayerNorm called twice, and the head's
weight used outside its module's forward in the loss. One spawn per world size; the ranks
run every case and rank 0 returns the losses and the consolidated final weights.

Tolerances (fp32): losses within 1e-5 relative over the steps (only the order of sums
differs: per-rank means averaged vs one full-batch mean, fused vs for-loop AdamW);
weights within 1e-3 absolute (Adam moves a weight whose gradient is near zero by up to
lr = 1e-2 per step whatever the gradient's size; observed at most 1.5e-4).
"""
from __future__ import annotations

import pytest
import torch

from tests.support import real_models as R
from tests.support.distributed import run_ranks

pytest.importorskip("transformers")

STEPS = 3
MODELS = ("llama", "gpt2", "t5", "mixtral", "bert", "moe")
CASES = [(name, stage, offload) for name in MODELS for stage in (0, 1, 2, 3) for offload in ("none", "cpu")]
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-3


def _all_cases(rank, world):
    out = {}
    for name, stage, offload in CASES:
        out[(name, stage, offload)] = R.zeroplug_losses(rank, world, name, R.config(stage, world, offload), STEPS)
    return out


@pytest.fixture(scope="module")
def references():
    return {name: R.torch_losses(name, STEPS) for name in MODELS}


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["world1", "world2"])
def results(request):
    return request.param, run_ranks(_all_cases, request.param)[0]


@pytest.mark.parametrize("name,stage,offload", CASES, ids=[f"{n}-stage{s}-{o}" for n, s, o in CASES])
def test_follows_plain_torch(results, references, name, stage, offload):
    world, res = results
    losses, sd = res[(name, stage, offload)]
    ref_losses, ref_sd = references[name]
    assert R.max_rel(losses, ref_losses) <= LOSS_RTOL, (losses, ref_losses)
    assert set(sd) == set(ref_sd)
    assert R.max_abs(sd, ref_sd) <= PARAM_ATOL
    assert losses[-1] < losses[0]       # it trains
