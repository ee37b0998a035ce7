"""``zeroplug.init`` (stage 3): building a model already partitioned, and consolidating it.

How the construction peak is measured: torch's CPU allocator reports every allocation
and free to the profiler (``torch.profiler.profile(profile_memory=True)``); the raw
``[memory]`` records of the run (bytes, +alloc / -free, in time order) give the live
tensor bytes at every moment, and their running maximum is the peak above the live
bytes at the start. That counts exactly the tensor storages and nothing else, unlike
RSS (glibc keeps freed pages, the peak cannot be reset, and imports and the Python heap
add noise) or tracemalloc (blind to torch's allocator). The same measurement of a plain
build shows the whole model, which proves the method sees these allocations.

The bound: while module k is built, ranks hold the shards of modules 0..k-1, module
k's full parameters (its constructor initialises them whole, consuming the RNG as a
plain build does) and, while slicing, module k's shard: at most this rank's shard of
the whole model plus the largest module. ``ALLOC_SLACK`` covers small bookkeeping
tensors.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches, peak_bytes

WORLD = 2
LAYERS, WIDTH = 8, 1024          # 8 x Linear(1024, 1024): 33.6 MB of fp32 parameters
ALLOC_SLACK = 64 * 1024
STEPS, GLOBAL_BATCH, LR, WD = 3, 8, 1e-2, 0.01
PARAM_ATOL = 1e-5                # fp32: rounding-order differences only


def big_model():
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _config(precision="fp32", **zero):
    return {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0, **zero},
            "precision": {"plugin": precision},
            "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WD},
            "batch": {"micro_batch_size": GLOBAL_BATCH // WORLD, "steps_per_print": 10_000},
            "monitor": {"plugin": "none"}}


def _state(sd):
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def construction(rank, world):
    import zeroplug
    out = {}
    cfg = _config()

    def build_partitioned():
        torch.manual_seed(0)
        with zeroplug.init(cfg):
            return big_model()

    def build_plain():
        torch.manual_seed(0)
        return big_model()

    model, out["peak_init"] = peak_bytes(build_partitioned)
    plain, out["peak_plain"] = peak_bytes(build_plain)
    out["param_numels"] = [p.data.numel() for p in model.parameters()]
    out["param_storage"] = sum(p.untyped_storage().size() for p in model.parameters())
    groups = {id(p._zp_group): p._zp_group for p in model.parameters()}
    out["groups"] = [(g.layout.total, g.shard.numel(), g.shard.element_size()) for g in groups.values()]
    out["largest_layer_bytes"] = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                                     for m in plain.modules())
    out["plain_bytes"] = sum(p.numel() * p.element_size() for p in plain.parameters())
    # the same initial values as the plain build, once consolidated
    engine = zeroplug.initialize(model, cfg)
    sd = engine.consolidated_state_dict()
    out["init_equal"] = None if sd is None else (
        set(sd) == set(plain.state_dict())
        and all(torch.equal(sd[k], v) for k, v in plain.state_dict().items()))
    out["freed_after_consolidate"] = all(u.full.untyped_storage().size() == 0
                                         for u in engine.partitioner.units)
    del engine, model

    # ToyNet (embedding, nested containers, LayerNorm) in bf16: equal to plain .to(bf16)
    cfg16 = _config("bf16")
    torch.manual_seed(0)
    with zeroplug.init(cfg16):
        toy = ToyNet()
    torch.manual_seed(0)
    ref = ToyNet().to(torch.bfloat16)
    sd = zeroplug.initialize(toy, cfg16).consolidated_state_dict()
    out["toy_bf16_equal"] = None if sd is None else (
        set(sd) == set(ref.state_dict())
        and all(v.dtype == torch.bfloat16 and torch.equal(sd[k], v) for k, v in ref.state_dict().items()))
    return out


def saving(rank, world, outdir):
    """Train ToyNet (built by zeroplug.init) a few steps, then consolidate and save."""
    import zeroplug
    cfg = _config()
    torch.manual_seed(0)
    with zeroplug.init(cfg):
        model = ToyNet()
    engine = zeroplug.initialize(model, cfg)
    per = GLOBAL_BATCH // world
    for x, y in batches(STEPS, GLOBAL_BATCH):
        loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
    out = {}
    sd = engine.consolidated_state_dict()
    out["state"] = sd
    path = os.path.join(outdir, "model.pt")
    out["saved"] = engine.save_16bit_model(path)
    out["freed"] = all(u.full.untyped_storage().size() == 0 for u in engine.partitioner.units)
    # training goes on after a consolidation: one more step, still in sync on every rank
    x, y = next(iter(batches(1, GLOBAL_BATCH, seed=7)))
    engine.backward(engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]))
    engine.step()

    # bf16: the saved file holds model-dtype (16-bit) tensors
    cfg16 = _config("bf16")
    torch.manual_seed(0)
    with zeroplug.init(cfg16):
        toy = ToyNet()
    e16 = zeroplug.initialize(toy, cfg16)
    out["saved16"] = e16.save_16bit_model(os.path.join(outdir, "model16.pt"))

    # refusing to gather when told not to
    refuse = zeroplug.initialize(ToyNet(), _config(stage3_gather_16bit_weights_on_model_save=False))
    try:
        refuse.consolidated_state_dict()
        out["refused"] = False
    except RuntimeError:
        out["refused"] = True
    return out


@pytest.fixture(scope="module")
def built():
    return run_ranks(construction, WORLD)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("save16")
    return run_ranks(saving, WORLD, str(d)), d


def test_parameters_are_empty_and_shards_partition_them(built):
    per_rank = [r["groups"] for r in built]
    for rank, r in enumerate(built):
        assert all(n == 0 for n in r["param_numels"])
        assert r["param_storage"] == 0
        assert len(r["groups"]) == LAYERS            # one group per Linear (weight + bias)
        for total, shard, _ in r["groups"]:
            assert shard == math.ceil(total / WORLD)
    for i in range(LAYERS):
        assert sum(g[i][1] for g in per_rank) >= per_rank[0][i][0]


def test_construction_peak_is_shard_plus_largest_layer(built):
    for rank, r in enumerate(built):
        shard_bytes = sum(n * size for _, n, size in r["groups"])
        bound = shard_bytes + r["largest_layer_bytes"] + ALLOC_SLACK
        assert r["peak_init"] <= bound, (
            f"rank {rank}: building under zeroplug.init peaked at {r['peak_init'] / 2**20:.2f} MiB > shard "
            f"{shard_bytes / 2**20:.2f} MiB + largest layer {r['largest_layer_bytes'] / 2**20:.2f} MiB")
        # the measurement does see allocations: a plain build peaks at the whole model
        assert r["peak_plain"] >= r["plain_bytes"]
        assert r["peak_init"] < 0.7 * r["plain_bytes"]


def test_initial_values_equal_plain_build(built):
    assert built[0]["init_equal"] is True
    assert built[1]["init_equal"] is None            # consolidated on rank 0 only
    assert built[0]["toy_bf16_equal"] is True
    assert all(r["freed_after_consolidate"] for r in built)


def _reference():
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches(STEPS, GLOBAL_BATCH):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_consolidated_state_dict_and_save_16bit_model(saved):
    results, d = saved
    ref = _reference()
    r0, r1 = results
    assert r1["state"] is None and r1["saved"] is False and r1["saved16"] is False
    assert r0["saved"] is True and r0["saved16"] is True
    assert all(r["freed"] for r in results)
    sd = r0["state"]
    assert set(sd) == set(ref)
    for k, v in ref.items():
        assert sd[k].dtype == torch.float32
        assert (sd[k] - v).abs().max().item() <= PARAM_ATOL, k
    loaded = torch.load(d / "model.pt", weights_only=True)
    assert set(loaded) == set(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)
    loaded16 = torch.load(d / "model16.pt", weights_only=True)
    assert set(loaded16) == set(ref)
    assert all(v.dtype == torch.bfloat16 for v in loaded16.values())
    assert all(r["refused"] for r in results)
