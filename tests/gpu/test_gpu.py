"""GPU tests: skipped without CUDA. Run on the device machines."""
import os
import subprocess
import sys

import pytest
import torch

from tests.support.paths import child_env
from tests.support.toy import ToyNet, engine_losses, reference_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("prec,tol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_single_gpu_matches_torch(stage, prec, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, _ = reference_losses(ToyNet, 20, 8, device="cuda")
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500}, "precision": {"plugin": prec},
           "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8}, "monitor": {"plugin": "none"}}
    losses, engine = engine_losses(ToyNet, 20, 8, cfg, device="cuda")
    assert engine.run.device.type == "cuda"
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) <= tol


@pytest.mark.parametrize("n", [2, 4])
def test_nccl_equivalence(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                          os.path.join(HERE, "gpu_equivalence.py")], env=child_env(), capture_output=True, text=True,
                         timeout=600)
    print(out.stdout[-4000:], out.stderr[-2000:])
    assert out.returncode == 0 and "ALL OK" in out.stdout


@pytest.mark.parametrize("stage", ["stage0", "stage2", "stage3"])
def test_offload_states_frees_gpu_and_resumes_exactly(stage):
    import zeroplug
    from tests.support.toy import batches

    def run(offload):
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        (torch.ones(64, 64, device="cuda", dtype=torch.bfloat16) @ torch.ones(64, 64, device="cuda",
                                                                              dtype=torch.bfloat16)).sum().item()
        baseline = torch.cuda.memory_allocated()      # cuBLAS workspace etc.: not the engine's
        torch.manual_seed(0)
        cfg = {"zero": {"plugin": stage, "stage3_param_persistence_threshold": 0},
               "precision": {"plugin": "bf16"}, "monitor": {"plugin": "none"}}
        engine = zeroplug.initialize(ToyNet(d=256, hidden=1024), cfg, device="cuda")
        losses = []
        for i, (x, y) in enumerate(batches(4, 8)):
            loss = engine(x.cuda(), y.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if offload and i == 1:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated() - baseline
                engine.offload_states()
                after = torch.cuda.memory_allocated() - baseline
                assert after <= 0.01 * before, (before, after)
                assert zeroplug.get_state_devices(engine, "optim_states") == {torch.device("cpu")}
                engine.reload_states()
                assert zeroplug.get_state_devices(engine, "hp_params") == {torch.device("cuda", 0)}
                # stage 3 holds no low-precision parameters between steps (gathers cast the master)
                lp = set() if stage == "stage3" else {torch.device("cuda", 0)}
                assert zeroplug.get_state_devices(engine, "lp_params") == lp
        return losses

    # Note: the run without offloading goes first: it creates cuBLAS's workspaces (kept by
    # their handles, so part of the next run's baseline), which the engine's first
    # fp32/bf16 GEMMs would otherwise allocate inside the measured window.
    plain = run(False)
    assert run(True) == plain


@pytest.mark.parametrize("params", ["cpu", "none"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_offload_on_gpu_matches_in_memory_and_overlap_is_exact(prec, params):
    """Stage 3 with the optimizer (and parameters) in pinned host memory, stepped by
    cpu_adam: the same training as on the GPU; the overlapped step equals the serial one
    bit for bit (CUDA streams, events and the worker thread for real)."""
    torch.backends.cuda.matmul.allow_tf32 = False

    def cfg(offload, overlap=True):
        c = {"zero": {"plugin": "stage3", "reduce_bucket_size": 2000, "sub_group_size": 3000,
                      "stage3_param_persistence_threshold": 100},
             "precision": {"plugin": prec}, "batch": {"micro_batch_size": 8, "gradient_clipping": 0.5},
             "optimizer": {"plugin": "adamw" if not offload else "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
             "monitor": {"plugin": "none"}}
        if offload:
            c["offload"] = {"optimizer": {"plugin": "cpu", "overlap_step": overlap}, "param": {"plugin": params}}
        return c

    ref, _ = engine_losses(lambda: ToyNet(d=64, hidden=200), 12, 8, cfg(False), device="cuda")
    serial, e0 = engine_losses(lambda: ToyNet(d=64, hidden=200), 12, 8, cfg(True, False), device="cuda")
    over, e1 = engine_losses(lambda: ToyNet(d=64, hidden=200), 12, 8, cfg(True, True), device="cuda")
    assert e0.offload_optimizer.overlapped_steps == 0
    if params == "cpu":      # world 1 with parameters on the GPU has no stage-3 hooks: serial
        assert e1.offload_optimizer.overlapped_steps == 12
    assert serial == over
    e1.partitioner.wait_optimizer()          # the last step may still be running
    for a, b in zip(e0.partitioner.master_params(), e1.partitioner.master_params()):
        assert torch.equal(a, b)
    tol = 1e-5 if prec == "fp32" else 2e-2
    assert max(abs(a - b) / abs(b) for a, b in zip(serial, ref)) <= tol


@pytest.mark.parametrize("params", ["cpu", "none"])
def test_gpu_lane_steps_on_the_gpu_and_resumes_exactly(params, tmp_path):
    """gpu_step_ratio on a GPU: its sub-groups are streamed through torch's fused AdamW on
    CUDA; training follows the CPU-only step; moments loaded from a checkpoint get pinned
    and training resumes bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    import zeroplug
    from tests.support.toy import batches

    def cfg(ratio):
        return {"zero": {"plugin": "stage3", "reduce_bucket_size": 2000, "sub_group_size": 3000,
                         "stage3_param_persistence_threshold": 100},
                "precision": {"plugin": "bf16"}, "batch": {"micro_batch_size": 8, "gradient_clipping": 0.5},
                "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
                "offload": {"optimizer": {"plugin": "cpu", "gpu_step_ratio": ratio, "gpu_step_chunk": 2048},
                            "param": {"plugin": params}},
                "monitor": {"plugin": "none"}}

    def net():
        return ToyNet(d=64, hidden=200)

    base, e0 = engine_losses(net, 12, 8, cfg(0.0), device="cuda")
    lane, e1 = engine_losses(net, 12, 8, cfg(0.5), device="cuda")
    e1.partitioner.wait_optimizer()
    off = e1.offload_optimizer
    assert e0.offload_optimizer.lane is None and off.lane is not None
    assert off.lane.elements > 0 and off.lane.chunk <= 2048
    for k in off.lane_groups:
        st = e1.optimizer.state[e1.partitioner.master_params()[k]]
        assert st["exp_avg"].is_pinned() and st["exp_avg_sq"].is_pinned()
    assert max(abs(a - b) / abs(b) for a, b in zip(lane, base)) <= 2e-2

    data = [(x.cuda(), y.cuda()) for x, y in batches(6, 8)]

    def train(eng, part):
        for x, y in part:
            eng.backward(eng(x, y))
            eng.step()
        eng.partitioner.wait_optimizer()

    torch.manual_seed(0)
    eng = zeroplug.initialize(net(), cfg(0.5), device="cuda")
    train(eng, data)
    straight = [t.detach().clone() for t in eng.partitioner.master_params()]
    eng.close()
    torch.manual_seed(0)
    eng = zeroplug.initialize(net(), cfg(0.5), device="cuda")
    train(eng, data[:3])
    eng.save_checkpoint(str(tmp_path))
    eng.close()
    eng = zeroplug.initialize(net(), cfg(0.5), device="cuda")
    eng.load_checkpoint(str(tmp_path))
    train(eng, data[3:])
    for k in eng.offload_optimizer.lane_groups:
        assert eng.optimizer.state[eng.partitioner.master_params()[k]]["exp_avg"].is_pinned()
    for a, b in zip(straight, eng.partitioner.master_params()):
        assert torch.equal(a, b)
    eng.close()
