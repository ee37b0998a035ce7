"""engine.close() lets every state go: a process can build engine after engine (a tuner, a
benchmark suite, a hyperparameter search) without keeping the earlier ones' memory."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zeroplug
from zeroplug.models import GPT, GPTConfig


@pytest.mark.parametrize("zero", ["stage0", "stage2", "stage3"])
def test_closed_engine_is_freed(zero):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=2))
    engine = zeroplug.initialize(model, {"zero": {"plugin": zero}, "monitor": {"plugin": "none"},
                                         "batch": {"micro_batch_size": 2}}, device="cpu")
    x = torch.randint(0, 64, (2, 16))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    refs = [weakref.ref(o) for o in (engine, engine.partitioner, engine.optimizer, model)]
    masters = [weakref.ref(t) for t in engine.partitioner.master_params()]
    engine.close()
    del engine, model, loss
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4
    assert all(r() is None for r in masters)
