"""Smaller optimizer states through the engine: checkpoints keep them in their own form and
load across forms, the 2-rank sharded step equals one rank's, and the host bytes are
accounted (memory_report, estimate, tune)."""
from __future__ import annotations

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches

GB = 8          # global batch


def config(state_dtype: str, stage: int = 2, tier: str = "cpu", **zero) -> dict:
    return {"batch": {"micro_batch_size": GB, "steps_per_print": 1000},
            "zero": {"plugin": f"stage{stage}", **zero},
            "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01, "state_dtype": state_dtype,
                          "while_building": "wait"},
            "offload": {"optimizer": {"plugin": tier}}, "monitor": {"plugin": "none"}}


def _train(engine, steps: int, seed: int, rank: int = 0, world: int = 1) -> list[float]:
    out = []
    for x, y in batches(steps, GB, seed=seed):
        n = GB // world
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def _states(engine) -> dict:
    """Each optimizer tensor's states, by its position (cloned)."""
    out = {}
    for i, g in enumerate(engine.optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            out[(i, j)] = {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.optimizer.state[p].items()}
    return out


def _params(engine) -> dict:
    sd = engine.consolidated_state_dict()      # rank 0's (None on the others)
    return {k: v.detach().clone() for k, v in sd.items()} if sd is not None else {}


def _engine(state_dtype, **kw):
    torch.manual_seed(0)
    return zeroplug.initialize(ToyNet(), config=config(state_dtype, **kw))


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_checkpoint_round_trip_keeps_the_states_form(tmp_path, state_dtype):
    """Saved and loaded with the same layout: the states come back bit for bit in their own
    dtype (8-bit codes and absmax for int8), stored so on disk, and training continues on
    exactly the path of the run that saved."""
    a = _engine(state_dtype)
    _train(a, 3, seed=1)
    a.save_checkpoint(str(tmp_path), tag="t")
    saved = _states(a)
    cont_a = _train(a, 2, seed=2)
    after_a = _params(a)
    a.close()
    raw = torch.load(tmp_path / "t" / "rank_00000.pt", weights_only=True)
    keys = raw["model"]["optim_keys"]
    want = {"bf16": {"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16"},
            "int8": {"exp_avg": "int8", "exp_avg_sq": "uint8"}}[state_dtype]
    assert keys == want
    b = _engine(state_dtype)
    b.load_checkpoint(str(tmp_path), tag="t")
    loaded = _states(b)
    assert loaded.keys() == saved.keys()
    for pos in saved:
        assert loaded[pos].keys() == saved[pos].keys()
        for k, v in saved[pos].items():
            assert torch.equal(loaded[pos][k], v), (pos, k)
    assert _train(b, 2, seed=2) == cont_a
    after_b = _params(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)
    b.close()


def _decoded(engine) -> dict:
    """Each optimizer tensor's moments as fp32 values."""
    from zeroplug.quantized_states import dequantize
    out = {}
    for pos, st in _states(engine).items():
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key]
            out[(pos, key)] = dequantize(v.reshape(-1), st[key + "_absmax"]) if v.dtype in (torch.int8, torch.uint8) \
                else v.float().reshape(-1)
    return out


@pytest.mark.parametrize("src,dst", [("fp32", "int8"), ("int8", "fp32"), ("bf16", "int8"), ("int8", "bf16"),
                                     ("fp32", "bf16")])
def test_checkpoint_loads_across_state_dtypes(tmp_path, src, dst):
    """The stated conversion: the loading run holds its own form (int8 codes from fp32 states:
    quantised; fp32 from int8: decoded), each moment within one quantisation step (int8: 1.5%
    of its block's absmax, bf16: 2^-8 relative) of the saved values."""
    a = _engine(src)
    _train(a, 3, seed=1)
    a.save_checkpoint(str(tmp_path), tag="t")
    want = _decoded(a)
    a.close()
    b = _engine(dst)
    b.load_checkpoint(str(tmp_path), tag="t")
    got = _decoded(b)
    for pos, st in _states(b).items():
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[dst]
        assert st["exp_avg"].dtype == dt and ("exp_avg_absmax" in st) == (dst == "int8")
    for k, v in want.items():
        if "int8" in (src, dst):
            tol = 0.015 * v.abs().max().clamp(min=1e-30)     # coarser than the per-block bound: whole tensor
            assert (got[k] - v).abs().max() <= tol, k
        else:
            torch.testing.assert_close(got[k], v, rtol=2 ** -8, atol=0)
    _train(b, 1, seed=2)
    b.close()


def _rank_run(rank, world, state_dtype, stage, steps):
    torch.manual_seed(0)
    engine = zeroplug.initialize(ToyNet(), config=config(state_dtype, stage=stage, sub_group_size=1000))
    losses = _train(engine, steps, seed=3, rank=rank, world=world)
    params = _params(engine)
    engine.close()
    return losses, params


@pytest.mark.parametrize("state_dtype", ["int8"])
def test_two_ranks_equal_one_rank(state_dtype):
    """The sharded step (2 ranks, gloo; stage 2, each rank's shard in sub-groups of its own)
    against one rank: the same losses and parameters to fp32 rounding. Blocks are counted per
    sub-group, so the two layouts quantise differently where a block's elements differ: the
    tolerance is the int8 states' effect over 4 steps, far below a wrong step's."""
    one = run_ranks(_rank_run, 1, state_dtype, 2, 4)[0]
    two = run_ranks(_rank_run, 2, state_dtype, 2, 4, timeout=600)
    mean = [(x + y) / 2 for x, y in zip(two[0][0], two[1][0])]     # each rank's loss is its half's
    for a, b in zip(one[0], mean):
        assert abs(a - b) <= 1e-3 * abs(a), (one[0], mean)
    for k, v in one[1].items():
        torch.testing.assert_close(two[0][1][k], v, rtol=0, atol=2e-3)


def test_int8_checkpoint_into_other_blocks(tmp_path):
    """int8 states saved with one sub-group layout and loaded with another (other block
    borders, as after a change of world size or sub_group_size): decoded and encoded again,
    each moment within one quantisation step of the saved values, and training goes on."""
    a = _engine("int8")
    _train(a, 3, seed=1)
    a.save_checkpoint(str(tmp_path), tag="t")
    want = {}
    for (pos, key), v in _decoded(a).items():      # by element of the model: concatenated
        want.setdefault(key, []).append(v)
    a.close()
    b = _engine("int8", sub_group_size=1000)
    assert len(b.optimizer.param_groups) > 1
    b.load_checkpoint(str(tmp_path), tag="t")
    got = {}
    for (pos, key), v in _decoded(b).items():
        got.setdefault(key, []).append(v)
    for key in want:
        w, g = torch.cat(want[key]), torch.cat(got[key])
        assert w.numel() == g.numel()
        assert (g - w).abs().max() <= 0.015 * w.abs().max(), key
    _train(b, 1, seed=2)
    b.close()


@pytest.mark.parametrize("src,dst", [("int8", "int8"), ("fp32", "int8"), ("int8", "bf16")])
def test_nvme_tier_checkpoints_small_states(tmp_path, src, dst):
    """The nvme tier keeps the small states in its swap files between steps and streams them
    through checkpoints one sub-group at a time: an int8 round trip is exact, and a load
    across forms converts each sub-group before it goes back to its file."""
    def nvme(state_dtype, swap):
        torch.manual_seed(0)
        cfg = config(state_dtype, sub_group_size=1000)
        (tmp_path / swap).mkdir()
        cfg["offload"] = {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path / swap), "buffer_count": 2}}
        return zeroplug.initialize(ToyNet(), config=cfg)
    a = nvme(src, "swap_a")
    _train(a, 3, seed=1)
    a.save_checkpoint(str(tmp_path / "ck"), tag="t")
    cont_a = _train(a, 2, seed=2)
    a.close()
    b = nvme(dst, "swap_b")
    b.load_checkpoint(str(tmp_path / "ck"), tag="t")
    cont_b = _train(b, 2, seed=2)
    if src == dst:
        assert cont_b == cont_a
    else:
        assert all(abs(x - y) <= 0.02 * abs(x) for x, y in zip(cont_a, cont_b)), (cont_a, cont_b)
    b.close()


def test_memory_report_counts_the_small_states():
    """engine.memory_report()'s optimizer bytes per master element: 8 (fp32), 4 (bf16),
    2 + 8 per 256 (int8: codes and absmax), as the tiers reserve (state_bytes)."""
    from zeroplug.quantized_states import nblocks, state_bytes
    for form in ("fp32", "bf16", "int8"):
        e = _engine(form)
        n = sum(p.numel() for g in e.optimizer.param_groups for p in g["params"])
        blocks = sum(nblocks(p.numel()) for g in e.optimizer.param_groups for p in g["params"])
        rep = e.memory_report()
        got = rep["device"]["optimizer"] + rep["host"].get("optimizer", 0)
        want = {"fp32": 8 * n, "bf16": 4 * n, "int8": 2 * n + 8 * blocks}[form]
        assert got == want, form
        assert abs(got / n - state_bytes(form)) < 0.05
        e.close()


def test_estimate_prints_each_state_form(capsys):
    """`zeroplug estimate`: a row per form of the offloaded states; the host column falls by
    4 (bf16) and ~6 (int8) bytes per parameter."""
    from zeroplug.cli import main
    assert main(["estimate", "--params", "1e9"]) == 0
    rows = {tuple(line.split()[:2]): float(line.split()[3]) for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["2"], ["3"])}
    gib = 1e9 / 2**30
    assert rows[("2", "optim")] - rows[("2", "optim/bf16")] == pytest.approx(4 * gib, abs=0.01)
    assert rows[("2", "optim")] - rows[("2", "optim/int8")] == pytest.approx((8 - 2 - 8 / 256) * gib, abs=0.01)
    assert ("3", "param+optim/int8") in rows
    assert main(["estimate", "--params", "1e9", "--state-dtype", "fp32"]) == 0
    assert "optim/int8" not in capsys.readouterr().out


def test_tune_proposes_smaller_states_when_fp32_states_do_not_fit():
    """A candidate that does not fit the host with fp32 states is proposed with the first
    smaller form that fits (bf16, then int8), and its config carries optimizer.state_dtype."""
    from zeroplug.tools.probe import Activations
    from zeroplug.tools.tune import GiB, Candidate, Machine, config_for, estimate, reject_reason, smaller_states
    n = int(9e9)
    acts = Activations(0.0, how="none")
    for host_gib, want in ((400, "fp32"), (128, "bf16"), (110, "int8"), (60, None)):
        m = Machine(torch.device("cuda"), "test GPU", 80 * GiB, host_gib * GiB, None, 0.0)
        c = Candidate(2, 3, "cpu", "cpu")
        estimate(c, n, acts, m)
        why = reject_reason(c, m)
        if why:
            why = smaller_states(c, n, acts, m, why)
        if want is None:
            assert why and "host memory" in why and c.states == "fp32"
            continue
        assert why is None and c.states == want, (host_gib, c.states, why)
        cfg = config_for(c, 8, m, 1e-4, False)
        assert cfg["optimizer"].get("state_dtype", "fp32") == want
        assert ("int8 states" in c.name) == (want == "int8")
