"""offload_states / reload_states / get_state_devices, on CPU through the nvme
path (on a CPU run "cpu" is where the states already are); GPU versions in test_gpu.py."""
import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches
from tests.support.toy import train_steps as _train

STATES = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


def _cfg(stage, prec="bf16"):
    return {"zero": {"plugin": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
            "precision": {"plugin": prec}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
            "monitor": {"plugin": "none"}}


def _snapshot(engine):
    from zeroplug.offload_states import engine_state_tensors
    return {k: [t.detach().clone() for t in v if t.untyped_storage().size() > 0]
            for k, v in engine_state_tensors(engine).items()}


def _roundtrip(rank, world, stage, include, tmp):
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), _cfg(stage))
    data = batches(8, 4)
    _train(engine, data, 2)
    # a forward in eval leaves stage-3 prefetches behind: the seed's "still in flight" case
    engine.eval()
    with torch.no_grad():
        engine(*next(batches(1, 4, seed=7)))
    engine.train()
    before = _snapshot(engine)
    engine.offload_states(include=include, device="nvme", nvme_path=tmp)
    engine.offload_states(include=include, device="nvme", nvme_path=tmp)    # twice: harmless
    names = include or STATES
    freed = {n: all(t.untyped_storage().size() == 0 for t in before_t)
             for n, before_t in _snapshot_tensors(engine, names).items()}
    with pytest.raises(zeroplug.StateError):
        engine(*next(batches(1, 4)))
    engine.reload_states()
    engine.reload_states()                                                   # nothing offloaded: harmless
    after = _snapshot(engine)
    same = all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))
    losses = _train(engine, data, 2)
    return same, freed, losses


def _snapshot_tensors(engine, names):
    from zeroplug.offload_states import engine_state_tensors
    ts = engine_state_tensors(engine)
    return {n: ts[n] for n in names}


def _reference(rank, world, stage):
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), _cfg(stage))
    data = batches(8, 4)
    return _train(engine, data, 2) and _train(engine, data, 2)


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("include", [None, ["optim_states"], ["hp_params", "lp_params"], ["lp_grads"],
                                     ["contiguous_grad_buffer"]])
def test_roundtrip_exact_and_training_continues(stage, include, tmp_path):
    same, freed, losses = _roundtrip(0, 1, stage, include, str(tmp_path))
    assert same, "reloaded states differ from before"
    assert all(freed.values()), f"not freed: {freed}"
    assert losses == _reference(0, 1, stage)
    assert list(tmp_path.iterdir()) == [], "swap files left behind"


def test_get_state_devices_reports_truth(tmp_path):
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), _cfg("stage2"))
    _train(engine, batches(2, 4), 1)
    assert zeroplug.get_state_devices(engine, zeroplug.OffloadStateTypeEnum.optim_states) == {torch.device("cpu")}
    engine.offload_states(include=["optim_states"], device=zeroplug.OffloadDeviceEnum.nvme, nvme_path=str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 1          # a private directory for this engine
    assert zeroplug.get_state_devices(engine, "optim_states") == {torch.device("cpu")}
    engine.reload_states()
    with pytest.raises(zeroplug.ZeroplugError, match="unknown state"):
        zeroplug.get_state_devices(engine, "weights")


def _two_engines(rank, world, tmp):
    """An actor and a critic alternate: each offloads while the other trains."""
    torch.manual_seed(0)
    actor = zeroplug.initialize(ToyNet(), _cfg("stage3"))
    critic = zeroplug.initialize(ToyNet(), _cfg("stage2"))
    data_a, data_c = batches(6, 4, seed=1), batches(6, 4, seed=2)
    la, lc = [], []
    for _ in range(3):
        critic.offload_states(device="nvme", nvme_path=tmp)
        la += _train(actor, data_a, 1)
        actor.offload_states(device="nvme", nvme_path=tmp)
        critic.reload_states()
        lc += _train(critic, data_c, 1)
        actor.reload_states()
    return la, lc


def test_two_engines_alternate(tmp_path):
    la, lc = run_ranks(_two_engines, 2, str(tmp_path))[0]
    torch.manual_seed(0)
    a = zeroplug.initialize(ToyNet(), _cfg("stage3"))
    c = zeroplug.initialize(ToyNet(), _cfg("stage2"))
    ra = _train(a, batches(6, 4, seed=1), 3)
    rc = _train(c, batches(6, 4, seed=2), 3)
    # two ranks each see the same 4-sample batch, so the mean equals one rank's run
    assert la == pytest.approx(ra, rel=1e-6) and lc == pytest.approx(rc, rel=1e-6)
