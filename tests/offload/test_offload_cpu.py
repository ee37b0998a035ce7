"""CPU offload tier: offload on/off give the same training; the host-memory plan."""
import logging

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, engine_losses

STAGES = ["stage1", "stage2", "stage3"]
# fp32: the same arithmetic in another place; bf16: the masters are the same, but the
# order of fp32 accumulation of bf16 gradients may differ by a rounding
TOL = {"fp32": 1e-6, "bf16": 2e-3}


def _cfg(stage, prec, offload, gas=1, world=1, params=False, optimizer="adamw"):
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500, "sub_group_size": 700},
           "precision": {"plugin": prec}, "optimizer": {"plugin": optimizer, "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8 // world // gas, "gradient_accumulation_steps": gas,
                     "gradient_clipping": 0.5},
           "monitor": {"plugin": "none"}}
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    if params:
        cfg["offload"]["param"] = {"plugin": "cpu"}
    return cfg


def _all(rank, world):
    out = {}
    for stage in STAGES:
        for prec, gas in (("fp32", 1), ("bf16", 1), ("fp32", 2)):
            for off in (False, True):
                losses, eng = engine_losses(ToyNet, 10, 8, _cfg(stage, prec, off, gas, world), rank, world)
                if off:
                    assert eng.partitioner.offload is not None and not eng.partitioner.alias
                    assert eng.optimizer.param_groups[0]["params"][0].device.type == "cpu"
                    assert len(eng.optimizer.param_groups) > 1          # sub-groups step one by one
                out[(stage, prec, gas, off)] = (losses, eng.consolidated_state_dict())
            if gas == 1:     # cpu_adam: grad_scale and the model-dtype copy inside its own pass
                losses, eng = engine_losses(ToyNet, 10, 8, _cfg(stage, prec, True, 1, world, optimizer="cpu_adam"),
                                            rank, world)
                assert type(eng.optimizer).__name__ == "CPUAdam"
                out[(stage, prec, 1, "cpu_adam")] = (losses, eng.consolidated_state_dict())
    for prec in ("fp32", "bf16"):     # stage 3 with the parameters offloaded too
        losses, eng = engine_losses(ToyNet, 10, 8, _cfg("stage3", prec, True, 1, world, params=True), rank, world,
                                    use_init=prec == "bf16")
        part = eng.partitioner
        assert part.params_offloaded and all(u.sharded_params for u in part.units)
        assert all(u.state == "free" for u in part.units if not u.persistent)
        out[("stage3-param", prec)] = (losses, eng.consolidated_state_dict())
        losses, eng = engine_losses(ToyNet, 10, 8, _cfg("stage3", prec, True, 1, world, params=True,
                                                        optimizer="cpu_adam"), rank, world)
        out[("stage3-param-cpu_adam", prec)] = (losses, eng.consolidated_state_dict())
    return out


@pytest.fixture(scope="module", params=[1, 2])
def results(request):
    return request.param, run_ranks(_all, request.param)[0]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("prec,gas", [("fp32", 1), ("bf16", 1), ("fp32", 2)])
def test_offload_matches_in_memory(results, stage, prec, gas):
    world, res = results
    (l0, sd0), (l1, sd1) = res[(stage, prec, gas, False)], res[(stage, prec, gas, True)]
    tol = TOL[prec]
    assert max(abs(a - b) / abs(a) for a, b in zip(l0, l1)) <= tol
    for k in sd0:
        assert torch.allclose(sd0[k].float(), sd1[k].float(), rtol=0, atol=tol if prec == "fp32" else 2e-2), k


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_cpu_adam_offload_matches_in_memory(results, stage, prec):
    """cpu_adam on the offloaded shards (clip factor as grad_scale, model-dtype copy written
    by its kernel) against torch AdamW in GPU-style memory."""
    world, res = results
    (l0, sd0), (l1, sd1) = res[(stage, prec, 1, False)], res[(stage, prec, 1, "cpu_adam")]
    tol = TOL[prec]
    assert max(abs(a - b) / abs(a) for a, b in zip(l0, l1)) <= tol
    for k in sd0:
        assert torch.allclose(sd0[k].float(), sd1[k].float(), rtol=0, atol=tol if prec == "fp32" else 2e-2), k


@pytest.mark.parametrize("optimizer", ["adamw", "cpu_adam"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_param_offload_matches_in_memory(results, prec, optimizer):
    world, res = results
    key = ("stage3-param", prec) if optimizer == "adamw" else ("stage3-param-cpu_adam", prec)
    (l0, sd0), (l1, sd1) = res[("stage3", prec, 1, False)], res[key]
    assert max(abs(a - b) / abs(a) for a, b in zip(l0, l1)) <= TOL[prec]
    for k in sd0:
        assert torch.allclose(sd0[k].float(), sd1[k].float(), rtol=0, atol=TOL[prec] if prec == "fp32" else 2e-2), k


def test_param_offload_needs_optimizer_offload():
    cfg = _cfg("stage3", "fp32", False)
    cfg["offload"] = {"param": {"plugin": "cpu"}}
    with pytest.raises(zeroplug.ConfigError, match=r"\[offload.optimizer\] plugin = \"cpu\""):
        zeroplug.load_config(cfg)


def test_plan_reports_and_fails_early_with_the_limit(caplog):
    cfg = _cfg("stage2", "bf16", True)
    cfg["offload"]["optimizer"]["host_memory_limit_gb"] = 1e-6      # ~1 KiB: far too small
    with pytest.raises(zeroplug.ZeroplugError) as err:
        zeroplug.initialize(ToyNet(), cfg)
    msg = str(err.value)
    assert "offload.optimizer" in msg and "host_memory_limit_gb" in msg and "GiB" in msg
    assert isinstance(err.value, MemoryError)
    with caplog.at_level(logging.INFO, logger="zeroplug"):
        cfg["offload"]["optimizer"]["host_memory_limit_gb"] = 1.0
        zeroplug.initialize(ToyNet(), cfg)
    assert any("GiB of" in r.message and "host memory per rank" in r.message for r in caplog.records)


def test_plan_uses_available_memory_by_default(monkeypatch):
    import zeroplug.plugins.offload_cpu as tier
    monkeypatch.setattr(tier, "host_available_bytes", lambda: 1024)
    with pytest.raises(zeroplug.ZeroplugError, match="available host memory"):
        zeroplug.initialize(ToyNet(), _cfg("stage1", "fp32", True))


def test_cli_reports_host_memory_error_without_traceback(tmp_path):
    import subprocess
    import sys
    cfg = tmp_path / "z.toml"
    cfg.write_text('[offload.optimizer]\nplugin = "cpu"\nhost_memory_limit_gb = 1e-6\n[zero]\nplugin = "stage2"\n')
    out = subprocess.run([sys.executable, "-m", "zeroplug.cli", "train", "--config", str(cfg), "--steps", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error:" in out.stderr and "Traceback" not in out.stderr
