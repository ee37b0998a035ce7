"""Hierarchical sharding (``zero.shard_group_size``): shard within groups, replicate across.

4 CPU ranks (gloo) as 2 groups of 2, and 2 ranks as 2 groups of 1, train like single-process
torch AdamW at stages 1-3 (the tolerances of test_stage_equivalence.py, same data and
batch slicing); the collectives are recorded at the dispatcher (every c10d op names its
process group) to show that parameter all-gathers and reduce-scatters stay within a group
and only the gradients' all-reduce crosses groups; checkpoints of either layout load at
another world size and group size. One spawn per world size runs every case in turn.
"""
from __future__ import annotations

import pytest
import torch

from zeroplug.benchmarking.wire import Collectives, spans_hosts

from tests.stages.test_stage_equivalence import (CLIP, GLOBAL_BATCH, LR, STEPS, TOL, WEIGHT_DECAY, data,
                                                 make_config, reference)
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, build_engine, global_step

CPU = {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}}
# (stage, precision, clip, gas, zeroplug.init, tables added to the config)
CASES = {
    "stage1-fp32": (1, "fp32", 0.0, 1, False, {}),
    "stage2-fp32": (2, "fp32", 0.0, 1, False, {}),
    "stage3-fp32": (3, "fp32", 0.0, 1, False, {}),
    "stage1-bf16": (1, "bf16", 0.0, 1, False, {}),
    "stage2-bf16-clip-gas2": (2, "bf16", CLIP, 2, False, {}),
    "stage3-bf16": (3, "bf16", 0.0, 1, False, {}),
    "stage3-fp16-clip-gas2": (3, "fp16", CLIP, 2, False, {}),
    "stage3-bf16-init-prefetch": (3, "bf16", 0.0, 1, True, {"zero": {"stage3_prefetch_bucket_size": 100_000}}),
    "stage3-fp32-no-reduce-scatter": (3, "fp32", 0.0, 1, False, {"zero": {"reduce_scatter": False}}),
    "stage3-fp32-offload-cpu-clip": (3, "fp32", CLIP, 1, False, {"offload": CPU}),
    "stage2-bf16-offload-cpu": (2, "bf16", 0.0, 1, False, {"offload": {"optimizer": {"plugin": "cpu"}}}),
}
# ZeRO++ hpZ (zero_hpz_partition_size = 2) on 4 ranks: states sharded 4 ways, a secondary
# parameter shard in each group of 2 (stage3_max_reuse_distance = 0: the backward gathers again,
# from the secondary shards)
HPZ = {"zero": {"zero_hpz_partition_size": 2}}
HPZ_CASES = {
    "hpz-stage3-fp32": (3, "fp32", 0.0, 1, False, HPZ),
    "hpz-stage3-fp32-no-reuse": (3, "fp32", 0.0, 1, False, {"zero": {**HPZ["zero"], "stage3_max_reuse_distance": 0}}),
    "hpz-stage3-bf16-init-prefetch-no-reuse": (3, "bf16", 0.0, 1, True, {"zero": {
        **HPZ["zero"], "stage3_prefetch_bucket_size": 100_000, "stage3_max_reuse_distance": 0}}),
    "hpz-stage3-fp16-clip-gas2": (3, "fp16", CLIP, 2, False, HPZ),
    "hpz-stage3-bf16-low-precision-shards": (3, "bf16", 0.0, 1, False, {"zero": {
        **HPZ["zero"], "stage3_low_precision_shards": True, "stage3_max_reuse_distance": 0}}),
}
K = 4          # steps before the checkpoint (of STEPS)


def _config(stage, precision, clip, gas, world, group, tables):
    cfg = make_config(stage, precision, clip, gas, None, world)
    for k, v in tables.items():
        cfg.setdefault(k, {}).update(v)
    if isinstance(group, str):          # "hpzN": ZeRO++ hpZ in groups of N
        cfg["zero"]["zero_hpz_partition_size"] = int(group[3:])
    elif group is not None:
        cfg["zero"]["shard_group_size"] = group
    return cfg


def _train(engine, rank, world, gas, steps):
    comm = getattr(engine, "zeroplug_engine", engine).run.comm      # (the DeepSpeed wrapper's)
    losses = [global_step(engine, x, y, rank, world, gas, comm) for x, y in [data()[i] for i in steps]]
    return losses


def run_cases(rank, world, group, ckpt_dir, loads):
    """Every case with ``shard_group_size = group``; the collectives of a stage-3 run with
    and without groups; a stage-3 checkpoint saved after K steps (then the rest trained,
    the reference of the loads); and for each (source world, source group) in ``loads``,
    that checkpoint loaded with ``group`` here and trained to the end."""
    out = {"cases": {}, "wire": {}, "crossing": {}, "ref": {}, "loaded": {}}
    cases = dict(CASES, **(HPZ_CASES if world == 4 else {}))
    for name, (stage, precision, clip, gas, use_init, zero) in cases.items():
        cfg = _config(stage, precision, clip, gas, world, None if name in HPZ_CASES else group, zero)
        e = build_engine(ToyNet, cfg, use_init)
        losses = _train(e, rank, world, gas, range(STEPS))
        sd = e.consolidated_state_dict()
        out["cases"][name] = {"losses": losses, "state": sd, "skipped": e.skipped_steps,
                              "layout_world": e.partitioner.layout_world,
                              "secondary": sum(u.secondary is not None for u in e.partitioner.all_units)}
        e.close()
    no_reuse = {"zero": {"stage3_max_reuse_distance": 0}}     # the backward gathers again
    runs = {group: (group, {}), None: (None, {})}
    if world == 4:
        runs.update({"hpz2": ("hpz2", no_reuse), "flat, no reuse": (None, no_reuse)})
    for key, (g, tables) in runs.items():
        e = build_engine(ToyNet, _config(3, "bf16", 0.0, 1, world, g, tables), False)
        _train(e, rank, world, 1, range(1))
        with Collectives() as rec:
            _train(e, rank, world, 1, range(1, 2))
        out["wire"][key] = [(c.op, c.ranks) for c in rec.calls]
        out["crossing"][key] = rec.sent_bytes(lambda ranks: spans_hosts(ranks, 2))
        e.close()
    if world == 4:
        out["deepspeed"], out["bad"] = _deepspeed_and_bad_size(rank, world)
        out["need"] = {g: _refused_save(rank, world, g, f"{ckpt_dir}/full{g}") for g in (group, None)}
    for g in (group,) + (("hpz2",) if world == 4 else ()):
        e = build_engine(ToyNet, _config(3, "fp32", 0.0, 1, world, g, {}), False)
        _train(e, rank, world, 1, range(K))
        e.save_checkpoint(f"{ckpt_dir}/w{world}g{g}")
        out["ref"][g] = _train(e, rank, world, 1, range(K, STEPS))
        e.close()
    for src in loads:
        e = build_engine(ToyNet, _config(3, "fp32", 0.0, 1, world, group, {}), False)
        torch.manual_seed(123)      # (the load, not the seed, must give the values)
        e.load_checkpoint(f"{ckpt_dir}/w{src[0]}g{src[1]}")
        out["loaded"][src] = _train(e, rank, world, 1, range(K, STEPS))
        e.close()
    return out if rank == 0 else None


def _deepspeed_and_bad_size(rank, world):
    """A DeepSpeed config with ZeRO++'s zero_hpz_partition_size = 2 (read as groups of 2), and
    zero.shard_group_size = 3, which does not divide 4 ranks."""
    from zeroplug.errors import ConfigError
    ds = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
          "steps_per_print": 10_000, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}}
    e = build_engine(ToyNet, ds, False)
    ds_run = {"losses": _train(e, rank, world, 1, range(STEPS)), "state": e.consolidated_state_dict(),
              "skipped": e.skipped_steps, "layout_world": e.partitioner.layout_world}
    e.close()
    # MiCS as DeepSpeed scripts write it: the model built inside MiCS_Init, then initialize
    import zeroplug.deepspeed as deepspeed
    mics = dict(ds, zero_optimization={"stage": 3, "mics_shard_size": 2})
    torch.manual_seed(0)
    with deepspeed.zero.MiCS_Init(config_dict_or_path=mics):
        model = ToyNet()
    e, *_ = deepspeed.initialize(model=model, config=mics)
    mics_run = {"losses": _train(e, rank, world, 1, range(STEPS)), "state": e.consolidated_state_dict(),
                "skipped": e.skipped_steps, "layout_world": e.zeroplug_engine.partitioner.layout_world}
    e.destroy()
    try:
        build_engine(ToyNet, _config(2, "fp32", 0.0, 1, world, 3, {}), False)
        bad = None
    except ConfigError as exc:
        bad = (str(exc), exc.key)
    return {"hpz": ds_run, "mics": mics_run}, bad


def _refused_save(rank, world, group, path):
    """The size a stage-3 save says it needs, with rank 0's disk reported full (the free-space
    check refuses it before writing, naming the size)."""
    from zeroplug.checkpoint import CheckpointError
    from zeroplug.checkpoint import directory
    e = build_engine(ToyNet, _config(3, "fp32", 0.0, 1, world, group, {}), False)
    _train(e, rank, world, 1, range(1))
    real, directory.free_bytes = directory.free_bytes, lambda d: 1
    try:
        e.save_checkpoint(path)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    finally:
        directory.free_bytes = real
    e.close()
    return message


@pytest.fixture(scope="module")
def references():
    return {clip: reference(clip) for clip in (0.0, CLIP)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """4 ranks in groups of 2 (loading the checkpoint of 2 ranks in groups of 1), and
    2 ranks in groups of 1 (loading the 4-rank one), each spawned once."""
    root = str(tmp_path_factory.mktemp("hier"))
    two = run_ranks(run_cases, 2, 1, root, [], timeout=900)[0]
    four = run_ranks(run_cases, 4, 2, root, [(2, 1)], timeout=1500)[0]
    back = run_ranks(run_cases, 2, None, root, [(4, 2), (4, "hpz2")], timeout=900)[0]
    return {"2x1": two, "4x2": four, "2": back}


def _check(res, ref_losses, ref_state, precision, what):
    loss_rtol, param_atol, param_mean_atol = TOL[precision]
    assert res["skipped"] == 0, f"{what}: {res['skipped']} steps skipped"
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses))
    assert worst <= loss_rtol, f"{what}: relative loss difference {worst:.3g} > {loss_rtol:g}"
    assert res["losses"][-1] < res["losses"][0] * 0.9
    assert set(res["state"]) == set(ref_state)
    for k, ref in ref_state.items():
        diff = (res["state"][k].float() - ref).abs()
        assert diff.max().item() <= param_atol, f"{what}: {k} differs by {diff.max().item():.3g}"
        assert diff.mean().item() <= param_mean_atol, f"{what}: {k} differs by {diff.mean().item():.3g} on average"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["4x2", "2x1"])
def test_matches_torch_adamw(layout, case, spawned, references):
    stage, precision, clip, *_ = CASES[case]
    res = spawned[layout]["cases"][case]
    assert res["layout_world"] == int(layout[2])        # the states really are sharded N ways
    _check(res, *references[clip], precision, f"{layout} {case}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HPZ_CASES))
def test_hpz_matches_torch_adamw(case, spawned, references):
    """ZeRO++ hpZ on 4 ranks: the states sharded 4 ways, every gathered unit with a secondary
    shard in its group of 2."""
    stage, precision, clip, *_ = HPZ_CASES[case]
    res = spawned["4x2"]["cases"][case]
    assert res["layout_world"] == 4 and res["secondary"] > 0
    _check(res, *references[clip], precision, f"hpZ {case}")


@pytest.mark.slow
def test_hpz_gathers_after_the_first_stay_in_the_group(spawned):
    """hpZ, one step with nothing kept gathered from forward to backward: the forward's
    all-gathers go across all 4 ranks (the masters changed in the step before), the backward's
    only within the group {0, 1}; gradients are reduce-scattered across all 4."""
    wire = spawned["4x2"]["wire"]["hpz2"]
    gathers = [r for op, r in wire if "allgather" in op]
    assert set(gathers) == {(0, 1, 2, 3), (0, 1)}, wire
    assert gathers.count((0, 1)) >= gathers.count((0, 1, 2, 3)) // 2, gathers
    assert {r for op, r in wire if "reduce_scatter" in op} == {(0, 1, 2, 3)}, wire
    # what crosses the groups: less than flat stage 3's the same way (no backward gather crosses)
    hpz, flat = spawned["4x2"]["crossing"]["hpz2"], spawned["4x2"]["crossing"]["flat, no reuse"]
    assert hpz < 0.9 * flat, (hpz, flat)


@pytest.mark.slow
def test_gathers_stay_within_the_group(spawned):
    """Rank 0 of 4 in groups of 2: parameter all-gathers and reduce-scatters only in its
    group {0, 1}; the gradients' all-reduce across groups in {0, 2}; without groups the same
    run gathers over all 4 (the recording sees what it claims to)."""
    wire = spawned["4x2"]["wire"]
    ops = {}
    for op, ranks in wire[2]:
        ops.setdefault(op, set()).add(ranks)
    gathers = [r for op, r in wire[2] if "allgather" in op]
    assert len(gathers) >= 4, wire[2]
    assert set(gathers) == {(0, 1)}, ops
    assert {r for op, r in wire[2] if "reduce_scatter" in op} == {(0, 1)}, ops
    assert (0, 2) in ops.get("allreduce_", set()), ops
    # nothing but the all-reduces (gradients, and the loss the test itself sums) leaves the group
    assert {op for op, r in wire[2] if r not in ((0, 1),)} <= {"allreduce_"}, ops
    flat = {r for op, r in wire[None] if "allgather" in op}
    assert flat == {(0, 1, 2, 3)}, flat
    # what crosses the groups (ring model): each rank's gradient shard, not every gather
    hier, flat = spawned["4x2"]["crossing"][2], spawned["4x2"]["crossing"][None]
    assert 0 < hier < flat / 2, (hier, flat)


@pytest.mark.slow
def test_checkpoints_load_at_another_world_and_group_size(spawned):
    four, two, back = spawned["4x2"], spawned["2x1"], spawned["2"]
    # 2 ranks in groups of 1 -> 4 ranks in groups of 2; 4 in groups of 2 -> 2 ranks, one group
    for got, want, what in ((four["loaded"][(2, 1)], two["ref"][1], "2x1 -> 4x2"),
                            (back["loaded"][(4, 2)], four["ref"][2], "4x2 -> 2"),
                            (back["loaded"][(4, "hpz2")], four["ref"]["hpz2"], "4 hpZ 2 -> 2")):
        assert len(got) == STEPS - K
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (what, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["hpz", "mics"])
def test_deepspeed_keys_train_in_groups(spawned, references, key):
    """DeepSpeed's zero_hpz_partition_size = 2 (zeroplug.initialize: hpZ, states sharded 4 ways)
    and mics_shard_size = 2 (a model built in deepspeed.zero.MiCS_Init, then deepspeed.initialize:
    states sharded 2 ways) on 4 ranks, like torch AdamW."""
    res = spawned["4x2"]["deepspeed"][key]
    assert res["layout_world"] == (4 if key == "hpz" else 2)
    _check(res, *references[0.0], "fp32", key)


@pytest.mark.slow
def test_group_size_must_divide_the_world(spawned):
    message, key = spawned["4x2"]["bad"]
    assert key == "zero.shard_group_size"
    assert "does not divide the 4 ranks" in message and "divisor of 4" in message


def _translate(zero: dict):
    from zeroplug.convert import from_deepspeed
    notes: list[str] = []
    raw = from_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, notes)
    return raw.get("zero", {}), notes


def test_deepspeed_group_keys():
    zero, notes = _translate({"stage": 3, "mics_shard_size": 8})
    assert zero["shard_group_size"] == 8 and not any("mics" in n for n in notes)
    zero, notes = _translate({"stage": 3, "zero_hpz_partition_size": 8})
    assert zero["zero_hpz_partition_size"] == 8 and "shard_group_size" not in zero
    assert not any("hpz" in n for n in notes), notes
    for off in ({"mics_shard_size": -1}, {"zero_hpz_partition_size": 1}, {}):
        zero, notes = _translate({"stage": 3, **off})
        assert {"shard_group_size", "zero_hpz_partition_size"}.isdisjoint(zero)
        assert not any("shard" in n or "hpz" in n for n in notes), notes
    zero, notes = _translate({"stage": 2, "zero_hpz_partition_size": 8})      # DeepSpeed: stage 3 only
    assert {"shard_group_size", "zero_hpz_partition_size"}.isdisjoint(zero)
    assert any("ignored at stage 2" in n for n in notes), notes


@pytest.mark.parametrize("zero, key", [
    ({"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 8}, "zero_optimization.zero_hpz_partition_size"),
    ({"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 4}, "zero_optimization.zero_hpz_partition_size"),
    ({"stage": 3, "mics_shard_size": 0}, "zero_optimization.mics_shard_size"),
    ({"stage": 3, "zero_hpz_partition_size": "two"}, "zero_optimization.zero_hpz_partition_size"),
])
def test_deepspeed_group_keys_refused(zero, key):
    from zeroplug.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        _translate(zero)
    assert err.value.key == key


@pytest.mark.slow
def test_free_space_check_counts_one_copy(spawned):
    """A grouped run writes each shard once (group 0's ranks): the free-space check before a
    save asks for what a flat run of the same model asks for, not once per group."""
    import re
    need = spawned["4x2"]["need"]
    sizes = {}
    for g, message in need.items():
        m = re.search(r"needs about ([\d.]+) (bytes|KiB|MiB|GiB)", message or "")
        assert m, message
        sizes[g] = float(m.group(1)) * {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    assert abs(sizes[2] - sizes[None]) <= 0.05 * sizes[None], need


@pytest.mark.parametrize("tables", [
    {"zero": {"plugin": "stage3", "zero_hpz_partition_size": 2, "shard_group_size": 2}},
    {"zero": {"plugin": "stage3", "zero_hpz_partition_size": 2}, "offload": {"optimizer": {"plugin": "cpu"}}},
])
def test_hpz_refuses_what_it_does_not_combine_with(tables):
    import zeroplug
    from zeroplug.errors import ConfigError
    cfg = {"optimizer": {"plugin": "adamw"}, "monitor": {"plugin": "none"}, **tables}
    with pytest.raises(ConfigError) as err:
        zeroplug.initialize(ToyNet(), cfg)
    assert err.value.key == "zero.zero_hpz_partition_size"
