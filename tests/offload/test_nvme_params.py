"""Stage 3 parameter shards on "NVMe" beyond max_in_cpu: training equals the
run with parameters in host memory exactly; reads go ahead of use; files are removed."""
import os
from pathlib import Path

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, Wide, engine_losses, peak_bytes, wide_steps


def _cfg(world, swap, param_tier, opt_tier="cpu", max_in_cpu=500):
    cfg = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 30, "sub_group_size": 900},
           "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8 // world, "gradient_clipping": 0.5}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": opt_tier}, "param": {"plugin": param_tier}}}
    if opt_tier == "nvme":
        cfg["offload"]["optimizer"]["nvme_path"] = swap
    if param_tier == "nvme":
        cfg["offload"]["param"].update(nvme_path=swap, max_in_cpu=max_in_cpu)
    return cfg


def _job(rank, world, swap):
    ref, e0 = engine_losses(ToyNet, 8, 8, _cfg(world, swap, "cpu"), rank, world)
    out = {}
    for opt_tier in ("cpu", "nvme"):
        losses, eng = engine_losses(ToyNet, 8, 8, _cfg(world, swap, "nvme", opt_tier), rank, world)
        ps = eng.offload_param.pswap
        kept = [u for u in eng.partitioner.units if not u.persistent and u.index not in ps.on_nvme]
        on_nvme_freed = all(eng.partitioner.units[i].shard.untyped_storage().size() == 0 for i in ps.on_nvme)
        sd, sd0 = eng.consolidated_state_dict(), e0.consolidated_state_dict()
        out[opt_tier] = (losses == ref, sd is None or all(torch.equal(sd[k], sd0[k]) for k in sd),
                         len(ps.on_nvme), sum(u.shard.numel() for u in kept), on_nvme_freed,
                         eng.partitioner.prefetch_count)
        eng.close()
    e0.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_params_on_nvme_equal_host_params(world, tmp_path):
    for res in run_ranks(_job, world, str(tmp_path)):
        for opt_tier, (same_losses, same_params, n_nvme, kept, freed, prefetched) in res.items():
            assert same_losses and same_params, opt_tier
            assert n_nvme > 0 and kept <= 500, "max_in_cpu not honoured"
            assert freed, "shards on NVMe kept in host memory between uses"
            assert prefetched > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("opt_tier", ["cpu", "nvme"])
@pytest.mark.parametrize("saved_by", ["nvme", "cpu"])
def test_checkpoint_with_params_on_nvme(tmp_path, saved_by, opt_tier):
    """Resume is exact with parameter shards on NVMe, and a checkpoint moves between the
    nvme and cpu param tiers both ways (and consolidates from its files alone)."""
    from tests.support.toy import batches, train_steps
    from zeroplug.checkpoint import consolidate
    swap, ck = str(tmp_path / "swap"), str(tmp_path / "ck")
    os.makedirs(swap)

    def build(tier):
        torch.manual_seed(0)
        return zeroplug.initialize(ToyNet(), _cfg(1, swap, tier, opt_tier))

    e = build("nvme")
    full = train_steps(e, batches(6, 8), 6)
    e.close()
    e = build(saved_by)
    data = batches(6, 8)
    first = train_steps(e, data, 3)
    path = e.save_checkpoint(ck)
    whole = e.consolidated_state_dict()
    if saved_by == "nvme":      # the shards are out again after the save
        ps = e.offload_param.pswap
        assert ps.on_nvme and ps.resident == set()
        assert all(e.partitioner.units[i].shard.untyped_storage().size() == 0 for i in ps.on_nvme)
    e.close()
    sd = consolidate(ck)
    assert all(torch.equal(sd[k], whole[k]) for k in whole)
    if saved_by == "nvme":      # the shards on NVMe went into part files
        assert any(".sg" in n for n in os.listdir(path))
    for tier in ("nvme", "cpu"):
        e2 = build(tier)
        e2.load_checkpoint(ck)
        if tier == "nvme":
            assert e2.offload_param.pswap.resident == set()
        rest = batches(6, 8)
        for _ in range(3):
            next(rest)
        assert first + train_steps(e2, rest, 3) == full, (saved_by, tier)
        e2.close()
    assert os.listdir(swap) == []


def _reshape_job(rank, world, swap, ck, save):
    from tests.support.toy import batches, train_steps
    torch.manual_seed(0)
    e = zeroplug.initialize(ToyNet(), _cfg(world, swap, "nvme", "nvme", max_in_cpu=0))
    data = batches(6, 8)
    if save:
        train_steps(e, data, 3)
        e.save_checkpoint(ck)
    else:
        e.load_checkpoint(ck)
        for _ in range(3):
            next(data)
    out = train_steps(e, data, 3)
    e.close()
    return out


@pytest.mark.slow
def test_nvme_params_checkpoint_reshapes(tmp_path):
    """Saved by 2 ranks with every shard on NVMe, resumed by 2 exactly, and by 1 within
    rounding (one rank sums the gradient norm's parts in another order: the clipping factor
    may differ in its last bit)."""
    swap, ck = str(tmp_path / "swap"), str(tmp_path / "ck")
    os.makedirs(swap)
    ref = run_ranks(_reshape_job, 2, swap, ck, True)[0]
    assert run_ranks(_reshape_job, 1, swap, ck, False)[0] == pytest.approx(ref, rel=1e-6)
    assert run_ranks(_reshape_job, 2, swap, ck, False)[0] == ref


# --- a save streams one unit's parameter shards at a time ---------------------------------
# Host memory as in test_nvme_training.py: the running sum of the profiler's "[memory]"
# records (every allocation and free of torch's CPU allocator), its maximum the peak.

W, LAYERS = 512, 6
UNIT = W * W + W                # one Linear(512, 512): one unit, one sub-group


def test_save_with_params_on_nvme_holds_one_unit(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0, "sub_group_size": UNIT},
           "optimizer": {"plugin": "adamw", "lr": 1e-3}, "batch": {"micro_batch_size": 4},
           "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": "cpu"},
                       "param": {"plugin": "nvme", "nvme_path": str(swap), "max_in_cpu": 0}}}
    torch.manual_seed(0)
    e = zeroplug.initialize(Wide(W, LAYERS), cfg)
    part = e.partitioner
    assert len(e.offload_param.pswap.on_nvme) == LAYERS
    unit_bytes = UNIT * part.units[0].shard.element_size()
    wide_steps(e, W, 1, 2)
    path, save = peak_bytes(lambda: e.save_checkpoint(tmp_path / "ck"))
    after = wide_steps(e, W, 2, 2)
    torch.manual_seed(5)
    e2 = zeroplug.initialize(Wide(W, LAYERS), cfg)
    wide_steps(e2, W, 3, 1)         # optimizer states exist: the load fills them in place
    _, load = peak_bytes(lambda: e2.load_checkpoint(tmp_path / "ck"))
    assert wide_steps(e2, W, 2, 2) == after
    # what a save did before: every shard in (and everything copied)
    _, all_in = peak_bytes(lambda: part.checkpoint_state(e.optimizer))
    biggest = max(f.stat().st_size for f in Path(path).iterdir())
    print({"unit": unit_bytes, "save": save, "load": load, "all_in": all_in, "biggest file": biggest})
    assert 0.9 * unit_bytes <= save <= 1.5 * unit_bytes
    assert all_in >= LAYERS * unit_bytes
    # load: one unit's shard + the part files mapped (ShardSet maps the next before it lets
    # the previous go: two at once), not every shard
    assert load <= 1.5 * unit_bytes + 2 * biggest
    assert load < all_in / 3
    e.close()
    e2.close()


def test_cpu_adam_with_shards_on_nvme_takes_the_clip_factor(tmp_path):
    """With parameter shards on NVMe, cpu_adam steps without writing the model-dtype copy
    itself (the tier publishes through the param tier): the unscale x clip factor still
    reaches it, so training equals the run with the shards in host memory."""
    out = {}
    for tier in ("cpu", "nvme"):
        cfg = _cfg(1, str(tmp_path), tier, max_in_cpu=0)
        cfg["optimizer"]["plugin"] = "cpu_adam"
        cfg["batch"]["gradient_clipping"] = 0.05            # every step clipped
        losses, eng = engine_losses(ToyNet, 4, 8, cfg)
        eng.partitioner.wait_optimizer()        # the host-memory run's last step overlaps
        out[tier] = (losses, [t.detach().clone() for t in eng.partitioner.master_params()])
        eng.close()
    assert out["nvme"][0] == out["cpu"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["nvme"][1], out["cpu"][1]))
