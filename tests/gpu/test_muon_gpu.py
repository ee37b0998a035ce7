"""Muon on the GPU: zeroplug's sharded Muon against torch.optim.Muon + AdamW on CUDA, and
zeroplug's DeepSpeed rule against DeepSpeed 0.19.8's own Muon on the same seed (where
``import deepspeed`` works). Skipped without CUDA.

    python3 -m pytest -q tests/gpu/test_muon_gpu.py
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.optim.muon_cases import config, data, reference
from tests.support.toy import ToyNet, build_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 6


def _zeroplug(cfg):
    engine = build_engine(ToyNet, cfg, device="cuda")
    losses = []
    for x, y in data(STEPS):
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("stage,offload", [(3, False), (3, True), (2, True)])
def test_muon_on_cuda_matches_torch(stage, offload):
    """Newton-Schulz in fp32 on both sides (the CPU reference); CUDA's matmuls differ from the
    CPU's in rounding only: 1e-4."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = reference(STEPS, ns_fp32=True)
    got, _ = _zeroplug(config(stage, offload=offload, ns_dtype="fp32"))
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-4


def test_deepspeed_rule_follows_deepspeed():
    """DeepSpeed 0.19.8's Muon (stage 2, one GPU, fp32) against zeroplug's rule "deepspeed" on
    the same model, data and split; their Newton-Schulz runs in bf16 / fp16: 2e-2 on losses."""
    deepspeed = pytest.importorskip("deepspeed")
    from zeroplug.param_groups import param_groups
    from zeroplug.plugins.optim.muon import split
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"),
                      RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    opt = {"lr": 1e-2, "muon_lr": 0.02, "adam_lr": 1e-2, "momentum": 0.95, "weight_decay": 0.01}
    torch.manual_seed(0)
    model = ToyNet()
    _, which = split(model, param_groups(model))
    original = deepspeed.set_optimizer_flags

    def tagged(config_class, module):
        original(config_class, module)
        for n, p in module.named_parameters():
            p.use_muon = which[n]
    deepspeed.set_optimizer_flags = tagged
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Muon", "params": opt}})
    finally:
        deepspeed.set_optimizer_flags = original
    ds = []
    for x, y in data(STEPS):
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        ds.append(loss.item())
    import zeroplug
    cfg = zeroplug.load_config({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "Muon", "params": opt}})
    assert cfg.slot("optimizer").options.rule == "deepspeed"
    ours, _ = _zeroplug({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
                         "optimizer": {"type": "Muon", "params": opt}})
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, ds)) <= 2e-2, (ours, ds)
