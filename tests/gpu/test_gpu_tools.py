"""GPU: the engine's step phases from CUDA events, the activation probe and `zeroplug tune` on
a small preset (skipped without CUDA; seconds on the device machines)."""
from __future__ import annotations

import gc

import pytest
import torch

import zeroplug
from zeroplug.cli import main
from zeroplug.plugins.workload.models import GPT, GPTConfig
from zeroplug.tools.probe import load_spec, measure_activations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_phases_on_cuda_are_event_timed_and_positive():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=128, n_layer=2, d_model=128, n_head=4)
    engine = zeroplug.initialize(GPT(cfg), {"zero": {"plugin": "stage2"}, "precision": {"plugin": "bf16"},
                                            "batch": {"micro_batch_size": 4, "steps_per_print": 1},
                                            "monitor": {"plugin": "none"}}, device="cuda")
    for _ in range(3):
        x = torch.randint(0, 512, (4, 128), device="cuda")
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    phases = {k: v for k, v in engine.last_metrics.items() if k.startswith("phase_")}
    assert phases["phase_forward"] > 0 and phases["phase_backward"] > 0 and phases["phase_optimizer"] > 0
    assert sum(phases.values()) < 10 * engine.last_metrics["step_time"] + 0.05
    engine.close()
    del engine, loss
    gc.collect()


def test_activation_probe_on_cuda_grows_with_depth_and_batch():
    spec = load_spec("125M", checkpointing=False)
    small = measure_activations(spec, 1, 256, torch.device("cuda"), torch.bfloat16)
    big = measure_activations(spec, 2, 256, torch.device("cuda"), torch.bfloat16)
    assert small.per_layer > 0 and small.fixed > 0
    assert big.total == pytest.approx(2 * small.total, rel=0.25)


def test_tune_on_cuda_picks_a_candidate_and_writes_it(tmp_path):
    out = tmp_path / "zero.toml"
    rc = main(["tune", "--model", "125M", "--micro-batch", "2", "--seq", "256", "--steps", "2", "--warmup", "1",
               "--max-candidates", "3", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "chosen: the fastest" in text and "measured on cuda" in text
    cfg = zeroplug.load_config(str(out))
    assert cfg.slot("precision").name == "bf16"
