"""Training with the optimizer states on "NVMe" (swap files in a temporary directory)
equals the in-memory run exactly, stages 1-3 on 1 and 2 ranks."""
import os
from pathlib import Path

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, Wide, engine_losses, peak_bytes, wide_steps

STAGES = ["stage1", "stage2", "stage3"]


def _cfg(stage, tier, world, path=None, pipelined=True, prec="fp32"):
    cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 400, "sub_group_size": 900},
           "precision": {"plugin": prec}, "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": 8 // world, "gradient_clipping": 0.5}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": tier}}}
    if tier == "nvme":
        cfg["offload"]["optimizer"].update(nvme_path=path, buffer_count=2,
                                           pipeline_read=pipelined, pipeline_write=pipelined)
    return cfg


def _job(rank, world, path):
    out = {}
    for stage in STAGES:
        for prec in ("fp32", "bf16"):
            ref, e0 = engine_losses(ToyNet, 8, 8, _cfg(stage, "cpu", world, prec=prec), rank, world)
            for pipelined in (True, False):
                losses, eng = engine_losses(ToyNet, 8, 8, _cfg(stage, "nvme", world, path, pipelined, prec),
                                            rank, world)
                part = eng.partitioner
                assert eng.offload_optimizer.swap is not None and len(part.master_params()) > 1
                # between steps every sub-group's master and moments live only in files, but
                # for the ones the last step kept in memory (reuse_resident, the default)
                gone = [t for k, t in enumerate(part.master_params()) if k in eng.offload_optimizer.swap.swapped]
                freed = len(part.master_params()) - len(gone) == eng.offload_optimizer.swap.kept() > 0
                freed = freed and all(t.untyped_storage().size() == 0 for t in gone)
                moments = [v for t in gone for v in eng.optimizer.state[t].values() if v.dim() > 0]
                freed = freed and moments and all(v.untyped_storage().size() == 0 for v in moments)
                sd = eng.consolidated_state_dict()
                sd0 = e0.consolidated_state_dict()
                same_params = sd is None or all(torch.equal(sd[k], sd0[k]) for k in sd)
                eng.close()
                out[(stage, prec, pipelined)] = (losses == ref, same_params, freed)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_equals_in_memory_exactly(world, tmp_path):
    res = run_ranks(_job, world, str(tmp_path))
    for rank_res in res:
        for key, (same_losses, same_params, freed) in rank_res.items():
            assert same_losses, f"losses differ {key}"
            assert same_params, f"parameters differ {key}"
            assert freed, f"states not swapped out between steps {key}"
    assert os.listdir(tmp_path) == [], "swap files left behind after close()"


def test_param_nvme_needs_the_optimizer_offloaded(tmp_path):
    cfg = _cfg("stage3", "none", 1)
    cfg["offload"]["param"] = {"plugin": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(zeroplug.ConfigError, match="needs the optimizer offloaded too"):
        zeroplug.load_config(cfg)


def test_nvme_checkpoint_resume_exact_and_cross_tier(tmp_path):
    """Save with the optimizer on NVMe, resume on NVMe and on the cpu tier: the losses
    continue exactly as an uninterrupted run's."""
    from tests.support.toy import batches, train_steps
    swap, ck = str(tmp_path / "swap"), str(tmp_path / "ck")
    os.makedirs(swap)

    def build(tier):
        torch.manual_seed(0)
        return zeroplug.initialize(ToyNet(), _cfg("stage2", tier, 1, swap))

    e = build("nvme")
    full = train_steps(e, batches(8, 8), 8)
    e.close()
    eng = build("nvme")
    data = batches(8, 8)
    first = train_steps(eng, data, 4)
    eng.save_checkpoint(ck)
    eng.close()
    assert os.listdir(swap) == []
    for tier in ("nvme", "cpu"):
        eng2 = build(tier)
        eng2.load_checkpoint(ck)
        rest = batches(8, 8)
        for _ in range(4):
            next(rest)
        assert first + train_steps(eng2, rest, 4) == full, tier
        eng2.close()
    assert os.listdir(swap) == []


# --- checkpoints stream through one sub-group at a time ----------------------------------
#
# How host memory is measured: torch's CPU allocator reports every allocation and free to
# the profiler (profile_memory=True); the running sum of the raw "[memory]" records is the
# live tensor bytes, its maximum the peak above the start (as in test_partitioned_init.py).
# That sees a swapped-out sub-group being read back (its storages are resized from 0 bytes)
# and every copy, and nothing else. A memory-mapped checkpoint file counts as allocated
# there too (its pages are the page cache, not anonymous memory): the load bound adds the
# largest file mapped at once.

W, LAYERS = 512, 6
SG = W * W + W                  # one Linear(512, 512): one unit, one sub-group
SG_BYTES = 12 * SG              # its fp32 master + exp_avg + exp_avg_sq


def _wide_cfg(tier, path):
    cfg = {"zero": {"plugin": "stage2", "reduce_bucket_size": SG, "sub_group_size": SG},
           "optimizer": {"plugin": "adamw", "lr": 1e-3}, "batch": {"micro_batch_size": 4},
           "monitor": {"plugin": "none"}, "offload": {"optimizer": {"plugin": tier}}}
    if tier == "nvme":
        # nothing resident between steps (reuse_resident keeps 2 sub-groups: test_nvme_reuse.py)
        cfg["offload"]["optimizer"].update(nvme_path=path, buffer_count=2, reuse_resident=False)
    return cfg


def _state_bytes(engine):
    """Host bytes the masters and optimizer states hold now (each storage once)."""
    part = engine.partitioner
    ts = list(part.master_params()) + [v for t in part.master_params()
                                       for v in engine.optimizer.state[t].values() if v.dim() > 0]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in ts}.values())


def test_nvme_checkpoint_peak_host_memory_is_one_sub_group(tmp_path):
    import json
    swap = tmp_path / "swap"
    swap.mkdir()
    res = {}
    for tier in ("nvme", "cpu"):
        torch.manual_seed(0)
        e = zeroplug.initialize(Wide(W, LAYERS), _wide_cfg(tier, str(swap)))
        assert len(e.partitioner.master_params()) == LAYERS
        wide_steps(e, W, 1, 2)
        held = _state_bytes(e)
        path, save_peak = peak_bytes(lambda: e.save_checkpoint(tmp_path / tier))
        after = wide_steps(e, W, 2, 2)
        torch.manual_seed(5)
        e2 = zeroplug.initialize(Wide(W, LAYERS), _wide_cfg(tier, str(swap)))
        _, load_peak = peak_bytes(lambda: e2.load_checkpoint(tmp_path / tier))
        assert wide_steps(e2, W, 2, 2) == after, tier            # and the load is exact
        res[tier] = dict(held=held, save=save_peak, load=load_peak, path=path)
        if tier == "nvme":     # the in-memory export (no part writer) for comparison: all in + a copy
            _, res["nvme_all_in"] = peak_bytes(lambda: e.partitioner.checkpoint_state(e.optimizer))
        e.close()
        e2.close()
    total = LAYERS * SG_BYTES
    print({k: (round(v["held"] / SG_BYTES, 2), round(v["save"] / SG_BYTES, 2), round(v["load"] / SG_BYTES, 2))
           if isinstance(v, dict) else round(v / SG_BYTES, 2) for k, v in res.items()})
    nv, cpu = res["nvme"], res["cpu"]
    # nvme: nothing resident between steps; a save brings in one sub-group at a time
    assert nv["held"] == 0
    assert 0.9 * SG_BYTES <= nv["save"] <= 1.5 * SG_BYTES
    # the cpu tier holds every sub-group all along (its save adds only views: ~0)
    assert cpu["held"] >= total and cpu["save"] < 0.05 * SG_BYTES
    assert nv["held"] + nv["save"] <= (cpu["held"] + cpu["save"]) / 4
    # all sub-groups in and copied (what a save did before): 2x every state
    assert res["nvme_all_in"] >= 2 * total
    # load: one sub-group plus the largest file mapped at once
    files = json.loads((Path(nv["path"]) / "manifest.json").read_text())["files"]
    biggest = max(e["size"] for e in files.values())
    assert nv["load"] <= 1.5 * SG_BYTES + biggest and nv["load"] < cpu["load"] / 2
    # the layout: one part file per sub-group, each in the manifest with its size and sha256
    parts = sorted(n for n, e in files.items() if "part" in e)
    assert parts == [f"rank_00000.sg{k:05d}.pt" for k in range(LAYERS)]
    assert all(files[n]["size"] == (Path(nv["path"]) / n).stat().st_size and len(files[n]["sha256"]) == 64
               for n in parts)
    assert sorted(os.listdir(res["cpu"]["path"])) == ["manifest.json", "rank_00000.pt"]
    assert os.listdir(swap) == []


def test_cpu_checkpoint_into_nvme_and_back_exact(tmp_path):
    """A cpu-tier checkpoint loads into the nvme tier (fresh, or trained with its own states
    on NVMe) and training continues exactly; the nvme tier's part files are verified."""
    from tests.support.toy import batches, train_steps
    from zeroplug.checkpoint import CheckpointError
    swap, ck = str(tmp_path / "swap"), tmp_path / "ck"
    os.makedirs(swap)

    def build(tier, stage="stage3", seed=0):
        torch.manual_seed(seed)
        return zeroplug.initialize(ToyNet(), _cfg(stage, tier, 1, swap, prec="bf16"))

    def rest(engine):
        data = batches(8, 8)
        for _ in range(4):
            next(data)
        return train_steps(engine, data, 4)

    full = train_steps(build("cpu"), batches(8, 8), 8)
    e = build("cpu")
    first = train_steps(e, batches(8, 8), 4)
    e.save_checkpoint(ck / "cpu")
    e.close()
    for trained in (False, True):
        e2 = build("nvme", seed=3)
        if trained:         # live moments on NVMe are overwritten in place
            train_steps(e2, batches(2, 8, seed=9), 2)
        e2.load_checkpoint(ck / "cpu")
        # in files, but for the sub-groups the last step kept in memory (reuse_resident)
        swp = e2.offload_optimizer.swap
        assert len(swp.swapped) == len(e2.partitioner.master_params()) - (swp.kept() if trained else 0)
        assert all(t.untyped_storage().size() == 0 for k, t in enumerate(e2.partitioner.master_params())
                   if k in swp.swapped)
        path = Path(e2.save_checkpoint(ck / "nvme"))   # for the way back: nvme -> cpu, stage 3 -> 2
        assert len(list(path.glob("rank_00000.sg*.pt"))) == len(e2.partitioner.master_params())
        assert first + rest(e2) == full, trained
        e2.close()
    e3 = build("cpu", stage="stage2", seed=4)
    e3.load_checkpoint(ck / "nvme")
    assert first + rest(e3) == full
    # module only into nvme: the masters follow the loaded weights, moments start fresh
    e4 = build("nvme", stage="stage2", seed=4)
    e4.load_checkpoint(ck / "cpu", load_module_only=True)
    ref = build("cpu", stage="stage2", seed=4)
    ref.load_checkpoint(ck / "cpu", load_module_only=True)
    assert rest(e4) == rest(ref)
    # a damaged part file is named
    tag = Path(e4.save_checkpoint(ck / "nvme2"))
    e4.close()
    part = sorted(tag.glob("rank_00000.sg*.pt"))
    assert len(part) == len(e4.partitioner.master_params()) > 1
    data = bytearray(part[0].read_bytes())
    data[len(data) // 2] ^= 1
    part[0].write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{part[0].name} is corrupt \(sha256"):
        build("cpu").load_checkpoint(ck / "nvme2")
    assert os.listdir(swap) == []


def test_aio_table_sets_swapper_defaults(tmp_path, caplog):
    """DeepSpeed's [aio] table configures the nvme tier (its own keys win); unknown aio keys
    and an [aio] nothing uses are reported."""
    import logging
    aio = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 3}
    cfg = zeroplug.load_config({"aio": aio, "zero": {"plugin": "stage2"},
                                "offload": {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path),
                                                          "queue_depth": 16}}})
    o = cfg.slot("offload.optimizer").options
    assert (o.block_size, o.queue_depth, o.thread_count) == (65536, 16, 3)
    with pytest.raises(zeroplug.ConfigError, match=r"aio\.queue_dept\. Did you mean 'queue_depth'"):
        zeroplug.load_config({"aio": {"queue_dept": 4}})
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        zeroplug.load_config({"aio": {"block_size": 65536}})
    assert any("[aio] is set but no selected plugin uses it" in r.getMessage() for r in caplog.records)
    from zeroplug.convert import from_deepspeed
    raw = from_deepspeed({"aio": {"block_size": 1048576, "thread_count": 2},
                          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                  "nvme_path": str(tmp_path)}}})
    assert zeroplug.load_config(raw).slot("offload.optimizer").options.thread_count == 2
