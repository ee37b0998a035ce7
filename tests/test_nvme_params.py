"""Stage 3 parameter shards on "NVMe" beyond max_in_cpu (issue E): training equals the
run with parameters in host memory exactly; reads go ahead of use; files are removed."""
import os

import pytest
import torch

import zeroplug
from distributed import run_ranks
from toy import ToyNet, engine_losses


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
        ps = eng.partitioner.pswap
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


def test_checkpoint_with_params_on_nvme(tmp_path):
    from toy import batches, train_steps
    swap, ck = str(tmp_path / "swap"), str(tmp_path / "ck")
    os.makedirs(swap)

    def build(tier):
        torch.manual_seed(0)
        return zeroplug.initialize(ToyNet(), _cfg(1, swap, tier))

    e = build("nvme")
    full = train_steps(e, batches(6, 8), 6)
    e.close()
    e = build("nvme")
    data = batches(6, 8)
    first = train_steps(e, data, 3)
    e.save_checkpoint(ck)
    e.close()
    for tier in ("nvme", "cpu"):
        e2 = build(tier)
        e2.load_checkpoint(ck)
        rest = batches(6, 8)
        for _ in range(3):
            next(rest)
        assert first + train_steps(e2, rest, 3) == full, tier
        e2.close()
    assert os.listdir(swap) == []
