"""pytest-benchmark: the reference workload's training step per ZeRO stage and offload tier.

    pytest tests/benchmarks/test_bench_train_step.py --benchmark-enable [--benchmark-json out.json]

The model is the reference GPT (shared/WORKLOAD.md): at the ``gpu`` size the 1.3B preset,
micro batch 8, sequence 1,024, bf16, activation checkpointing on every block, AdamW lr 1e-4,
clipping 1.0, random tokens, 5 timed steps after 2 warm-ups; smaller GPTs of the same
architecture at the ``cpu`` and ``smallest`` sizes (fp32); ``ZEROPLUG_BENCH_MODEL=2.7B`` picks another
preset at the ``gpu`` size. The ``fsdp2`` rows are the peer (PyTorch FSDP2, fully_shard per block,
bf16 parameters, fp32 reduction) measured in the same run. Each row's ``extra_info``: tokens/s,
peak GPU and host memory, the engine's step phases and the ratio to plain PyTorch measured in
the same run (the ``torch`` row). The NVMe row runs at the ``gpu`` size only with
``ZEROPLUG_BENCH_NVME=1`` (a 1.3B step moves ~30 GB through the disk), in ``ZEROPLUG_BENCH_PATH``.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from tests.benchmarks.bench_common import bench_path, bench_size

from zeroplug.plugins.workload.models import GPT, GPTConfig, get_preset

SIZE = bench_size()
MODEL, MICRO_BATCH, SEQ, STEPS, WARMUP = {
    "smallest": (GPTConfig(256, 64, n_layer=2, d_model=64, n_head=2), 2, 64, 2, 1),
    "cpu": (GPTConfig(50_304, 128, n_layer=4, d_model=256, n_head=4), 4, 128, 3, 2),
    "gpu": (get_preset(os.environ.get("ZEROPLUG_BENCH_MODEL", "1.3B"), activation_checkpointing=True),
            8, 1024, 5, 2),
}[SIZE]

_CPU = {"plugin": "cpu"}
CASES = {
    "torch": None,
    "fsdp2-no-reshard": None,      # the peer of stage 2
    "fsdp2": None,                 # the peer of stage 3
    "stage0": {"zero": {"plugin": "stage0"}},
    "stage1": {"zero": {"plugin": "stage1"}},
    "stage2": {"zero": {"plugin": "stage2"}},
    "stage3": {"zero": {"plugin": "stage3"}},
    "stage2-offload_optimizer_cpu": {"zero": {"plugin": "stage2"}, "offload": {"optimizer": _CPU}},
    "stage3-offload_cpu": {"zero": {"plugin": "stage3"}, "offload": {"optimizer": _CPU, "param": _CPU}},
    "stage3-offload_optimizer_nvme": {"zero": {"plugin": "stage3"},
                                      "offload": {"optimizer": {"plugin": "nvme"}, "param": _CPU}},
}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(MODEL)


def make_batch(device):
    x = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH, SEQ + 1), device=device)
    return x[:, :-1], x[:, 1:]


def config_for(case: str, device: torch.device) -> dict | str:
    if CASES[case] is None:       # a baseline: plain PyTorch or FSDP2
        return case
    cfg = {"batch": {"micro_batch_size": MICRO_BATCH, "gradient_clipping": 1.0, "steps_per_print": 1},
           "precision": {"plugin": "bf16" if device.type == "cuda" else "fp32"},
           "optimizer": {"plugin": "auto" if "offload" in case else "adamw", "lr": 1e-4},
           "scheduler": {"plugin": "none"}, "monitor": {"plugin": "none"},
           **{k: {kk: dict(vv) if isinstance(vv, dict) else vv for kk, vv in v.items()}
              for k, v in CASES[case].items()}}
    if "offload" in case and SIZE == "gpu":   # what docs/benchmarks.md's offload rows used
        cfg["zero"].update(reduce_bucket_size=1e8, sub_group_size=1e8)
    if "nvme" in case:
        cfg["offload"]["optimizer"]["nvme_path"] = bench_path()
    return cfg


@pytest.mark.parametrize("case", list(CASES))
def test_train_step(zeroplug_step, case):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if "nvme" in case and SIZE == "gpu" and not os.environ.get("ZEROPLUG_BENCH_NVME"):
        pytest.skip("1.3B on NVMe: ~14 s a step; set ZEROPLUG_BENCH_NVME=1 to run it")
    result = zeroplug_step(build_model, make_batch, config=config_for(case, device), steps=STEPS,
                           warmup=WARMUP, device=device, label=case,
                           baseline=None if case == "torch" else "torch")
    assert result.losses and all(math.isfinite(x) for x in result.losses)
    assert abs(result.losses[0] - math.log(MODEL.vocab_size)) < 1.0    # a GPT at init: ~ln(vocab)
    assert result.tokens_per_step == MICRO_BATCH * SEQ
    if CASES[case] is not None:
        assert set(result.phases) >= {"forward", "backward", "optimizer"}
