"""tests/benchmarks/deepspeed_resume.py's CPU half: its arguments and its zeroplug continuation.

The script's DeepSpeed half needs CUDA and DeepSpeed; here a checkpoint in DeepSpeed's layout
(tests/support/deepspeed_ckpt.py) of the script's model, trained by torch AdamW, stands in for it, and
the script's own ``run_zeroplug`` must continue it as torch does.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.support.deepspeed_ckpt import write_deepspeed_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed_resume.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("deepspeed_resume", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(script, capsys):
    a = script.parse_args(["--stage", "3"])
    assert (a.stage, a.zp_stage, a.precision) == (3, 3, "bf16")
    assert script.parse_args(["--stage", "3", "--zp-stage", "1"]).zp_stage == 1
    cfg = script.ds_config(a, 2)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"]
    assert cfg["train_micro_batch_size_per_gpu"] * 2 == cfg["train_batch_size"]
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--steps", "0"])
    assert e.value.code == 2
    assert "--steps and --more" in capsys.readouterr().err


def test_zeroplug_half_continues_a_deepspeed_checkpoint(script, tmp_path):
    a = script.parse_args(["--steps", "3", "--more", "3", "--global-batch", "4", "--seq", "16", "--layers", "1",
                           "--width", "64", "--precision", "fp32", "--lr", "1e-2"])
    batches = script.global_batches(a, a.steps + a.more)
    model = script.build_model(a, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    ref = []
    for i, (x, y) in enumerate(batches):
        if i == a.steps:
            write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2, global_steps=a.steps)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= a.steps:
            ref.append(loss.item())
    zp = script.run_zeroplug(a, tmp_path, batches, 0, 1, device="cpu")
    result = script.compare(ref, zp, 1e-5)
    assert result["pass"], result
