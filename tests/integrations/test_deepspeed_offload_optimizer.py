"""A DeepSpeed JSON with Adam/AdamW and an offloaded optimizer runs cpu_adam (as DeepSpeed
runs DeepSpeedCPUAdam) with the same hyperparameters; an explicit choice wins; and the
path of an optimizer without a fused copy holds a bounded GPU buffer."""
import json
from pathlib import Path

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet, engine_losses
from zeroplug.comm import Comm
from zeroplug.plugins.offload_cpu import host
from zeroplug.slots import RunContext

BENCH_CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed_configs"
PARAMS = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}


def _ds(kind, params=None, offload="cpu", stage=2):
    z = {"stage": stage}
    if offload:
        z["offload_optimizer"] = {"device": offload, **({"nvme_path": "/tmp"} if offload == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": kind, "params": {**PARAMS, **(params or {})}},
            "zero_optimization": z}


@pytest.mark.parametrize("kind, params, offload, plugin, adamw_mode", [
    ("AdamW", {}, "cpu", "auto", True),
    ("Adam", {}, "cpu", "auto", True),                       # DeepSpeed's Adam is AdamW by default
    ("Adam", {"adam_w_mode": False}, "cpu", "cpu_adam", False),
    ("AdamW", {"adam_w_mode": False}, "cpu", "auto", True),  # type AdamW forces adamw mode (DeepSpeed too)
    ("AdamW", {}, "nvme", "auto", True),
    # torch_adam (DeepSpeed's way around building its kernels; accelerate's configs set it):
    # the same update, and zeroplug builds nothing, so offloaded states still get cpu_adam
    ("AdamW", {"torch_adam": True}, "cpu", "auto", True),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, "cpu", "cpu_adam", False),
    ("AdamW", {}, None, "adamw", None),
])
def test_adam_with_offload_maps_to_cpu_adam(kind, params, offload, plugin, adamw_mode):
    cfg = zeroplug.load_config(_ds(kind, params, offload))
    choice = cfg.slot("optimizer")
    assert choice.name == plugin
    o = choice.options
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay) == (1e-4, (0.9, 0.95), 1e-6, 0.1)
    assert getattr(o, "adamw_mode", None) == adamw_mode


def test_explicit_choice_wins():
    cfg = zeroplug.load_config(_ds("AdamW"), overrides=["--optimizer.plugin=adamw"])
    assert cfg.slot("optimizer").name == "adamw"
    cfg = zeroplug.load_config(_ds("AdamW"), overrides=["--optimizer.threads=3"])
    assert cfg.slot("optimizer").name == "auto" and cfg.slot("optimizer").options.threads == 3


@pytest.mark.parametrize("path", sorted(BENCH_CONFIGS.glob("*offload*.json")), ids=lambda p: p.name)
def test_benchmark_configs_build_cpu_adam_for_a_gpu_run(path, monkeypatch):
    """The benchmark's DeepSpeed JSONs, as a GPU run builds their optimizer: cpu_adam over the
    offloaded masters, with the JSON's hyperparameters (and the fused per-sub-group step)."""
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")       # no kernel build here
    ds = json.loads(path.read_text())
    cfg = zeroplug.load_config(ds)
    run = RunContext(device=torch.device("cuda"), comm=Comm(), config=cfg)
    choice = cfg.slot("optimizer")
    opt = choice.impl(choice.options, run).build([torch.zeros(10)], torch.device("cpu"))
    assert type(opt).__name__ == "CPUAdam" and hasattr(opt, "step_group")
    g = opt.param_groups[0]
    p = ds["optimizer"]["params"]
    assert (g["lr"], g["eps"], g["weight_decay"], g["adamw_mode"]) == (p["lr"], p["eps"], p["weight_decay"], True)
    assert list(g["betas"]) == list(p["betas"])


def test_unfused_publish_uses_a_bounded_device_buffer(monkeypatch):
    """torch's AdamW over offloaded masters publishes through a device fp32 buffer. It was a
    ring of two whole sub-groups (sub_group_size 1e9: 8 GB of GPU memory beside a 1.3B
    model); it is one chunk, and the chunks land where the whole copy did."""
    monkeypatch.setattr(host, "PUBLISH_CHUNK", 1000)
    cfg = {"zero": {"plugin": "stage2", "reduce_bucket_size": 1500, "sub_group_size": int(1e9)},
           "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
           "batch": {"micro_batch_size": 4}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": "cpu"}}}
    _, eng = engine_losses(ToyNet, 1, 4, cfg)
    tier = eng.offload_optimizer
    assert not hasattr(eng.optimizer, "step_group")         # the unfused path
    largest = max(b - a for a, b in tier.ranges)
    assert largest > 3 * 1000
    for k, (a, b) in enumerate(tier.ranges):
        tier.masters[k].copy_(torch.randn(b - a, generator=torch.Generator().manual_seed(k)))
        tier.publish_chunks(tier.masters[k], a, b)
        for u, x, y, s in tier.pieces(a, b):
            assert torch.equal(u.shard[x:y], tier.masters[k][s:s + y - x].to(u.shard.dtype))
    staged = sum(t.numel() * t.element_size() for t in tier.staging)
    assert staged == 4 * 1000 < 2 * 4 * largest              # the old ring: 2 x 4 bytes x sub-group


@pytest.mark.parametrize("ratio, resident", [(1.0, 0.0), (0.3, 0.7), (0.0, 1.0)])
def test_offload_ratio_keeps_the_rest_on_the_gpu(ratio, resident):
    """DeepSpeed's offload_optimizer.ratio is the share of the optimizer states offloaded; the
    rest stays in GPU memory and is stepped there: the cpu tier's gpu_resident_ratio."""
    ds = _ds("AdamW", stage=3)
    ds["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    cfg = zeroplug.load_config(ds)
    tier = cfg.slot("offload.optimizer")
    assert tier.name == "cpu" and tier.options.gpu_resident_ratio == pytest.approx(resident)


@pytest.mark.parametrize("offload, ratio, says", [
    ("cpu", 1.5, "between 0 and 1"),
    ("cpu", "auto", "between 0 and 1"),
    ("cpu", None, "between 0 and 1"),
    ("nvme", 0.5, "a partial offload needs offload_optimizer on the cpu"),
])
def test_offload_ratio_bad_values(offload, ratio, says):
    ds = _ds("AdamW", offload=offload, stage=3)
    ds["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    with pytest.raises(zeroplug.ConfigError, match=says) as e:
        zeroplug.load_config(ds)
    assert "zero_optimization.offload_optimizer.ratio" in str(e.value)
