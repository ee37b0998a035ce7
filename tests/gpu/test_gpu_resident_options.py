"""``[offload.optimizer] gpu_resident_ratio`` (cpu tier): its validation and what a run
without a GPU does with it. The resident path itself: tests/gpu/test_gpu_lane.py."""
import logging
from pathlib import Path

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, engine_losses


def _cfg(resident, **extra):
    return {"zero": {"plugin": "stage3", "reduce_bucket_size": 500, "sub_group_size": 300},
            "precision": {"plugin": "bf16"},
            "optimizer": {"plugin": "cpu_adam", "lr": 1e-2},
            "batch": {"micro_batch_size": 8},
            "offload": {"optimizer": {"plugin": "cpu", "gpu_resident_ratio": resident, **extra}},
            "monitor": {"plugin": "none"}}


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half"])
def test_ratio_out_of_range_is_refused(bad):
    with pytest.raises(zeroplug.ConfigError, match="gpu_resident_ratio"):
        zeroplug.initialize(ToyNet(), _cfg(bad))


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a run without CUDA does")
def test_ignored_without_cuda_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        l1, e1 = engine_losses(ToyNet, 3, 8, _cfg(0.5))
    assert "gpu_resident_ratio = 0.5 ignored: it needs a CUDA training device" in caplog.text
    off = e1.offload_optimizer
    assert off.resident_groups == set() and off.lane is None and off.capabilities.in_memory
    l0, e0 = engine_losses(ToyNet, 3, 8, _cfg(0.0))
    assert l1 == l0                      # the run is the one without the option
    e0.close()
    e1.close()


def test_default_keeps_every_state_on_the_host():
    losses, eng = engine_losses(ToyNet, 2, 8, _cfg(0.0))
    off = eng.offload_optimizer
    assert off.resident_groups == set() and off.capabilities.in_memory
    eng.close()


def test_documented():
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    row = next((line for line in text.splitlines() if "gpu_resident_ratio" in line), "")
    assert "0.0" in row and "GPU memory" in row
