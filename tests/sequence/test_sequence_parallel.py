"""Sequence parallelism (``[sequence] plugin = "ulysses"``) trains like one process on whole
sequences: degree 2 (and 4, slow) at ZeRO stages 0-3, the reference GPT and a Hugging Face Llama,
with and without tiles and activation checkpoints in host memory, on samples of uneven length
with padding and ignored labels (tests/sequence/cases.py).

One spawn per world size runs every case in turn (spawning costs seconds on a small box); a
module-scoped fixture keeps the results and the tests compare.

Tolerance (fp32): the slices' losses are summed in another order than one mean over the whole
sequence, the attention of a head runs on another rank, and tiles sum gradients chunk by chunk:
rounding only. 1e-5 relative on the losses, 1e-5 absolute on the parameters after two SGD steps
of lr 0.1 (a gradient error of 1e-4 would show as 1e-5). Observed: about 1e-7 and 1e-8.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks

from .cases import config, max_abs, max_rel, reference, samples, train

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

# name -> (kind, config arguments, activation checkpointing in the model)
CASES_2 = {
    **{f"{kind}-stage{s}": (kind, dict(stage=s, degree=2), False) for kind in ("gpt", "llama") for s in (0, 1, 2, 3)},
    **{f"{kind}-stage3-tiled-host": (kind, dict(stage=3, degree=2, tiled=True, host=True), True)
       for kind in ("gpt", "llama")},
    "llama-stage1-tiled": ("llama", dict(stage=1, degree=2, tiled=True), False),
    "gpt-stage2-checkpointed": ("gpt", dict(stage=2, degree=2), True),
}
CASES_4 = {
    **{f"llama-stage{s}": ("llama", dict(stage=s, degree=4), False) for s in (1, 2, 3)},   # key-value heads repeated
    "gpt-stage2-tiled-host": ("gpt", dict(stage=2, degree=4, tiled=True, host=True), True),
    # two groups of two: the data-parallel mean over samples of different token counts
    "gpt-stage3-dp2": ("gpt", dict(stage=3, degree=2), False),
    "llama-stage1-dp2-tiled": ("llama", dict(stage=1, degree=2, tiled=True), False),
}


def _deepspeed_json(world: int) -> dict:
    """A DeepSpeed config of the ALST tutorial's shape: sequence_parallel_size, the batch counting
    data-parallel ranks (world / sequence_parallel_size)."""
    return {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2}, "sequence_parallel_size": world,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10_000}


def _run_all(rank, world, cases, extras):
    from zeroplug.errors import ConfigError
    out = {}
    for name, (kind, args, ckpt) in cases.items():
        out[name] = train(rank, world, kind, config(**args), ckpt)
    if "deepspeed" in extras:
        out["deepspeed"] = train(rank, world, "llama", _deepspeed_json(world))
    if "heads" in extras:       # a degree that does not divide the heads: one line, at initialize
        import zeroplug
        from zeroplug.plugins.workload.models import GPT, GPTConfig
        try:
            zeroplug.initialize(GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=1, d_model=24, n_head=3)),
                                config(stage=1, degree=2), device="cpu")
            out["heads"] = None
        except ConfigError as exc:
            out["heads"] = str(exc)
    if "no-attention" in extras:     # nothing to exchange heads in: one line, at initialize
        import zeroplug

        from tests.support.toy import ToyNet
        try:
            zeroplug.initialize(ToyNet(), config(stage=1, degree=2), device="cpu")
            out["no-attention"] = None
        except ConfigError as exc:
            out["no-attention"] = str(exc)
    if "loader" in extras:
        out["loader"] = _loader(rank, world)
    return out


def _loader(rank, world):
    """ShardedLoader: each rank loads its own samples; the group's ranks yield their slices of
    every rank's sample in turn."""
    import zeroplug
    from zeroplug.plugins.sequence import for_engine, shard_batch

    from .cases import build
    engine = zeroplug.initialize(build("llama"), config(stage=1, degree=world), device="cpu")
    sp = for_engine(engine)
    mine = samples("llama", world)[rank]
    got = list(sp.loader([mine]))
    engine.close()
    want = [shard_batch(s, rank, world) for s in samples("llama", world)]
    return all(set(g) == set(w) and all(torch.equal(g[k], w[k]) for k in w) for g, w in zip(got, want)) and \
        len(got) == world


@pytest.fixture(scope="module")
def two():
    return run_ranks(_run_all, 2, CASES_2, ("deepspeed", "heads", "no-attention", "loader"), timeout=900)


@pytest.fixture(scope="module")
def four():
    return run_ranks(_run_all, 4, CASES_4, (), timeout=1500)


def _check(results, name, kind, groups):
    ref_losses, ref_state = reference(kind, groups)
    r0 = results[0][name]
    assert max_rel(r0["losses"], ref_losses) <= LOSS_RTOL, (r0["losses"], ref_losses)
    assert max_abs(r0["state"], ref_state) <= PARAM_ATOL
    # every rank of a group returns the group's loss (its sample's mean), not its slice's
    per_group = len(results) // groups
    for g in range(groups):
        own = [results[r][name]["own_loss"] for r in range(g * per_group, (g + 1) * per_group)]
        assert max(own) - min(own) <= 1e-6 * abs(own[0]), own


@pytest.mark.parametrize("name", list(CASES_2))
def test_degree_2(two, name):
    kind, args, _ = CASES_2[name]
    _check(two, name, kind, groups=1)
    if args.get("host"):
        assert two[0][name]["offloaded"] > 0       # the checkpointed inputs did go to host memory


def test_deepspeed_json_with_sequence_parallel_size(two):
    """A DeepSpeed JSON with sequence_parallel_size trains; its batch counts the data-parallel ranks."""
    _check(two, "deepspeed", "llama", groups=1)


def test_degree_not_dividing_heads(two):
    msg = two[0]["heads"]
    assert msg is not None and "sequence.sequence_parallel_size = 2" in msg and "3 attention heads" in msg
    assert "\n" not in msg


def test_model_without_attention(two):
    msg = two[0]["no-attention"]
    assert msg is not None and "has no attention zeroplug can exchange" in msg and "\n" not in msg


def test_sharded_loader(two):
    assert two[0]["loader"] and two[1]["loader"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_degree_4(four, name):
    kind, args, _ = CASES_4[name]
    _check(four, name, kind, groups=4 // args["degree"])
    if args.get("host"):
        assert four[0][name]["offloaded"] > 0
