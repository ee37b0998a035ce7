"""engine.close() lets every state go: a process can build engine after engine (a tuner, a
benchmark suite, a hyperparameter search) without keeping the earlier ones' memory."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zeroplug
from zeroplug.plugins.workload.models import GPT, GPTConfig


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


def test_gc_frozen_for_the_run_and_thawed_at_close():
    """batch.freeze_gc: what is alive at the end of initialize leaves the collector's full
    passes (gc.freeze); close() gives it back; "auto" leaves a CPU run's collector alone."""
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=16, n_head=2))
    auto = zeroplug.initialize(model, {"batch": {"micro_batch_size": 1}})
    assert gc.get_freeze_count() == 0
    auto.close()
    engine = zeroplug.initialize(model, {"batch": {"micro_batch_size": 1, "freeze_gc": True}})
    try:
        assert gc.get_freeze_count() > 1000        # torch's and the model's objects
        x = torch.randint(0, 64, (1, 16))
        engine.backward(engine(x, x))
        engine.step()
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
