"""The GPU lane of the offloaded step (``gpu_step_ratio``, plugins/offload_cpu/gpu_lane.py).

On CPU the lane runs with synchronous copies and torch's CPU fused AdamW: these tests
check its bookkeeping (which sub-groups, step counts, chunks, model-dtype pieces,
checkpoints, the overlapped step). tests/test_gpu.py runs it on a GPU."""
import logging

import pytest
import torch

import zeroplug
from distributed import run_ranks
from toy import ToyNet, batches, engine_losses
from zeroplug.plugins.offload_cpu.gpu_lane import assign

STEPS = 6


def test_assign_shares_and_interleaves():
    sizes = [10] * 10
    assert assign(sizes, 0.0) == set()
    assert assign(sizes, 1.0) == set(range(10))
    half = assign(sizes, 0.5)
    assert len(half) == 5 and half != set(range(5))      # dealt out, not the first half
    third = assign(sizes, 0.3)
    assert len(third) == 3
    big = assign([100, 1, 1, 1, 1], 0.5)
    assert sum([100, 1, 1, 1, 1][k] for k in big) in (100, 4)      # one lane takes the big one


def _cfg(stage, prec, ratio, world, overlap=True, chunk=64):
    return {"zero": {"plugin": stage, "reduce_bucket_size": 500, "sub_group_size": 300,
                     "stage3_param_persistence_threshold": 30},
            "precision": {"plugin": prec},
            "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
            "batch": {"micro_batch_size": 8 // world, "gradient_clipping": 0.5},
            "offload": {"optimizer": {"plugin": "cpu", "gpu_step_ratio": ratio, "gpu_step_chunk": 1024,
                                      "overlap_step": overlap}},
            "monitor": {"plugin": "none"}}


def _run(rank, world):
    out = {}
    for stage in ("stage1", "stage2", "stage3"):
        for prec in ("fp32", "bf16"):
            for ratio in (0.0, 0.5):
                losses, eng = engine_losses(ToyNet, STEPS, 8, _cfg(stage, prec, ratio, world), rank, world)
                eng.partitioner.wait_optimizer()      # the last overlapped step has finished
                off = eng.offload_optimizer
                out[(stage, prec, ratio)] = (losses, [t.detach().clone() for t in eng.partitioner.master_params()],
                                             sorted(off.lane_groups), off.lane.elements if off.lane else 0)
                eng.close()
    for overlap in (False, True):
        losses, eng = engine_losses(ToyNet, STEPS, 8, _cfg("stage3", "bf16", 0.5, world, overlap), rank, world)
        eng.partitioner.wait_optimizer()
        out[("overlap", overlap)] = (losses, [t.detach().clone() for t in eng.partitioner.master_params()],
                                     eng.consolidated_state_dict())
        eng.close()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def results(request):
    return run_ranks(_run, request.param)


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_lane_follows_the_cpu_step(results, stage, prec):
    for res in results:
        l0, m0, g0, e0 = res[(stage, prec, 0.0)]
        l1, m1, g1, e1 = res[(stage, prec, 0.5)]
        assert g0 == [] and e0 == 0
        assert g1 and e1 > 0                         # the lane stepped its sub-groups every step
        total = sum(t.numel() for t in m1)
        assert e1 == STEPS * sum(m1[k].numel() for k in g1)
        assert 0.3 * total <= e1 / STEPS <= 0.7 * total
        # different kernels (torch's fused AdamW, cpu_adam): the same values to rounding
        tol = 1e-5 if prec == "fp32" else 2e-2
        assert l1 == pytest.approx(l0, rel=tol, abs=tol)
        for a, b in zip(m0, m1):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_lane_overlapped_equals_serial(results):
    for res in results:
        (l0, m0, sd0), (l1, m1, sd1) = res[("overlap", False)], res[("overlap", True)]
        assert l0 == l1
        for a, b in zip(m0, m1):
            assert torch.equal(a, b)
    if results[0][("overlap", False)][2] is not None:
        for k, v in results[0][("overlap", False)][2].items():
            assert torch.equal(v, results[0][("overlap", True)][2][k]), k


def _train(eng, data):
    for x, y in data:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
    eng.partitioner.wait_optimizer()


def test_checkpoint_resumes_exactly_with_the_lane(tmp_path):
    data = list(batches(6, 8))
    cfg = _cfg("stage3", "bf16", 0.5, 1)
    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    _train(eng, data)
    straight = [t.detach().clone() for t in eng.partitioner.master_params()]
    eng.close()

    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    _train(eng, data[:3])
    eng.save_checkpoint(str(tmp_path))
    eng.close()
    torch.manual_seed(1)
    eng = zeroplug.initialize(ToyNet(), cfg)
    eng.load_checkpoint(str(tmp_path))
    _train(eng, data[3:])
    for a, b in zip(straight, eng.partitioner.master_params()):
        assert torch.equal(a, b)
    eng.close()


def test_lane_needs_cpu_adam(caplog):
    cfg = _cfg("stage2", "fp32", 0.5, 1)
    cfg["optimizer"]["plugin"] = "adamw"
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        losses, eng = engine_losses(ToyNet, 2, 8, cfg)
    assert eng.offload_optimizer.lane is None
    assert "gpu_step_ratio = 0.5 ignored: it needs optimizer cpu_adam" in caplog.text
    eng.close()


def test_auto_is_off_on_cpu():
    losses, eng = engine_losses(ToyNet, 2, 8, _cfg("stage2", "fp32", "auto", 1))
    assert eng.offload_optimizer.lane is None
    eng.close()
