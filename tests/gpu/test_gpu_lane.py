"""The GPU lane of the offloaded step (``gpu_step_ratio``, plugins/offload_cpu/gpu_lane.py).

On CPU the lane runs with synchronous copies and torch's CPU fused AdamW: these tests
check its bookkeeping (which sub-groups, step counts, chunks, model-dtype pieces,
checkpoints, the overlapped step). tests/gpu/test_gpu.py runs it on a GPU."""
import logging

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches, engine_losses
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


# -- resident sub-groups (gpu_resident_ratio) ------------------------------------------------
# On a GPU these run as they are; on a CPU the tier's device check is overridden, so the same
# code keeps the "resident" states in separate CPU tensors (stale host copies, export/import,
# offload_states) and CI tests the bookkeeping.

@pytest.fixture
def resident_anywhere(monkeypatch):
    from zeroplug.plugins.offload_cpu import CPUOffload
    monkeypatch.setattr(CPUOffload, "resident_device_ok", lambda self: True)


def _resident_cfg(stage, step_ratio, resident, offload_param=False):
    cfg = _cfg(stage, "bf16", step_ratio, 1)
    cfg["offload"]["optimizer"]["gpu_resident_ratio"] = resident
    if offload_param:
        cfg["offload"]["param"] = {"plugin": "cpu"}
    return cfg


def _masters(eng):
    """The masters as checkpoints see them (resident ones copied down first)."""
    from zeroplug.tiers import all_exported
    eng.partitioner.wait_optimizer()
    with all_exported(eng.offload_optimizer, eng.optimizer):
        return [t.detach().clone() for t in eng.partitioner.master_params()]


@pytest.mark.parametrize("stage,offload_param", [("stage2", False), ("stage3", False), ("stage3", True)])
def test_resident_equals_streamed_lane(resident_anywhere, stage, offload_param):
    l0, e0 = engine_losses(ToyNet, STEPS, 8, _resident_cfg(stage, 1.0, 0.0, offload_param))
    m0 = _masters(e0)
    e0.close()
    for resident in (1.0, 0.5):
        l1, e1 = engine_losses(ToyNet, STEPS, 8, _resident_cfg(stage, 1.0, resident, offload_param))
        off = e1.offload_optimizer
        e1.partitioner.wait_optimizer()
        assert off.lane.resident and not off.capabilities.in_memory
        assert off.lane.elements == STEPS * sum(t.numel() for t in e1.partitioner.master_params())
        k = min(off.lane.resident)
        # the host copy is stale between steps: the states live on the device
        assert not torch.equal(off.masters[k].view(-1), off.lane.resident[k][0].cpu())
        m1 = _masters(e1)
        assert l1 == l0                  # the same kernel on the same inputs: bit for bit
        for a, b in zip(m0, m1):
            assert torch.equal(a, b)
        e1.close()


def test_resident_beside_cpu_adam_follows_the_cpu_step(resident_anywhere):
    l0, e0 = engine_losses(ToyNet, STEPS, 8, _resident_cfg("stage3", 0.0, 0.0))
    m0 = _masters(e0)
    e0.close()
    l1, e1 = engine_losses(ToyNet, STEPS, 8, _resident_cfg("stage3", 0.0, 0.5))
    off = e1.offload_optimizer
    assert off.lane.resident and off.lane_groups == set(off.lane.resident)
    assert l1 == pytest.approx(l0, rel=2e-2, abs=2e-2)
    for a, b in zip(m0, _masters(e1)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    e1.close()


def _trained_masters(cfg, data) -> list[torch.Tensor]:
    """The masters after training on ``data`` without interruption (seed 0)."""
    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    _train(eng, data)
    out = _masters(eng)
    eng.close()
    return out


def test_checkpoint_resumes_exactly_with_resident_states(resident_anywhere, tmp_path):
    data = list(batches(6, 8))
    cfg = _resident_cfg("stage3", 0.5, 0.5, offload_param=True)
    straight = _trained_masters(cfg, data)

    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    _train(eng, data[:3])
    eng.save_checkpoint(str(tmp_path))       # resident states copied down into the checkpoint
    eng.close()
    for warm in (False, True):
        torch.manual_seed(1)
        eng = zeroplug.initialize(ToyNet(), cfg)
        if warm:        # resident states exist already: the load copies them up
            _train(eng, list(batches(1, 8, seed=99)))
            assert eng.offload_optimizer.lane.resident
        eng.load_checkpoint(str(tmp_path))
        _train(eng, data[3:])
        assert eng.offload_optimizer.lane.resident
        for a, b in zip(straight, _masters(eng)):
            assert torch.equal(a, b)
        eng.close()


def test_offload_states_round_trip_with_resident_states(resident_anywhere, tmp_path):
    data = list(batches(6, 8))
    cfg = _resident_cfg("stage3", 0.0, 0.5)
    straight = _trained_masters(cfg, data)

    torch.manual_seed(0)
    eng = zeroplug.initialize(ToyNet(), cfg)
    _train(eng, data[:3])
    lane = eng.offload_optimizer.lane
    device = "cpu" if torch.cuda.is_available() else "nvme"
    eng.offload_states(device=device, nvme_path=str(tmp_path))
    assert all(t.untyped_storage().size() == 0 for ts in lane.resident.values() for t in ts)
    eng.reload_states()
    assert all(t.untyped_storage().size() > 0 for ts in lane.resident.values() for t in ts)
    _train(eng, data[3:])
    for a, b in zip(straight, _masters(eng)):
        assert torch.equal(a, b)
    eng.close()


def test_auto_steps_on_the_gpu_only_for_one_rank_per_host(monkeypatch):
    """"auto" streams a share to the GPU beside the overlapped stage-3 step of a GPU run with
    one rank on the host; with several local ranks (torchrun's LOCAL_WORLD_SIZE) it is 0."""
    from zeroplug.plugins.offload_cpu import AUTO_GPU_STEP_RATIO
    cfg = _cfg("stage3", "fp32", "auto", 1)
    cfg["offload"]["param"] = {"plugin": "cpu"}
    losses, eng = engine_losses(ToyNet, 1, 8, cfg)
    tier = eng.offload_optimizer
    assert tier.layout.gathers_per_unit and tier.gpu_step_ratio() == 0.0     # a CPU run
    monkeypatch.setattr(tier, "cuda", True)                                   # the rule on a GPU
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert tier.gpu_step_ratio() == AUTO_GPU_STEP_RATIO
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert tier.gpu_step_ratio() == 0.0
    monkeypatch.setattr(tier, "cuda", False)
    eng.close()
