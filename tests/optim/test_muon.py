"""Muon + AdamW through every stage against one process of torch.optim.Muon + torch.optim.AdamW.

One spawn per world size runs every case (muon_cases.run_cases); the tests compare.

Tolerances. The sharded step is the reference's arithmetic on the same values: the momentum
and AdamW are element-wise, and the matrix each owner rank orthogonalises is the whole
momentum matrix, so the only difference from one process is the order of the gradient sums
(a mean over ranks of per-rank means). With Newton-Schulz in fp32 on both sides
(``ns_dtype = "fp32"``, the reference's iteration swapped for the same one in fp32) that
stays at fp32 rounding: observed 2.4e-7 on losses and 4.9e-7 on parameters after 6 steps;
bounds 1e-5. torch.optim.Muon itself iterates in bf16 (8 mantissa bits): a gradient that
differs in its last fp32 bits may round to another bf16 value, and five iterations carry
that into other entries of the result, so the orthogonalised update differs by a few bf16
ulps (2**-8 relative) of its entries. One step moves a weight by lr x adjusted lr x |O|
~ 0.02 x 1.4 x 0.2 = 6e-3, so a few ulps are ~1e-4 per step, and training carries them on:
observed 8.1e-4 on parameters and 1e-4 on losses after 6 steps on 2 ranks; bounds 5e-3 and
2e-3 (relative).
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from tests.optim.muon_cases import config, data, reference, run_cases, train
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, build_engine

STEPS = 6
EXACT = (1e-5, 1e-5)            # (loss relative, parameter absolute): Newton-Schulz in fp32
BF16 = (2e-3, 5e-3)             # torch.optim.Muon's bf16 iterations
BF16_MODEL = (2e-2, 6e-2)       # bf16 parameters and gradients (tests/stages/test_stage_equivalence.py's bounds)

CASES = {
    **{f"stage{s}{'-offload' if o else ''}-fp32ns": dict(stage=s, offload=o, ns_dtype="fp32")
       for s in (1, 2, 3) for o in (False, True)},
    "stage3-bf16ns": dict(stage=3),
    "stage2-offload-bf16ns": dict(stage=2, offload=True),
    "stage3-bf16model": dict(stage=3, precision="bf16", ns_dtype="fp32"),
    "stage1-clip-gas2-fp32ns": dict(stage=1, gas=2, clip=0.5, ns_dtype="fp32"),
    "stage2-fp16model": dict(stage=2, precision="fp16", ns_dtype="fp32"),
}
# DeepSpeed's rule (its Newton-Schulz and Adam): checked against DeepSpeed itself on the GPU
# (docs/benchmarks.md); here sharded against one rank of the same rule, whole tensors
DEEPSPEED_RULE = {"stage3-dsrule-standard": dict(stage=3, rule="deepspeed", ns_method="standard",
                                                 betas=(0.9, 0.95), eps=1e-10),
                  "stage2-offload-dsrule-gram": dict(stage=2, offload=True, rule="deepspeed", ns_method="gram",
                                                     betas=(0.9, 0.95), eps=1e-10)}
CASES.update(DEEPSPEED_RULE)
ONE_RANK = ("stage1-fp32ns", "stage3-offload-fp32ns", "stage3-bf16ns", "stage1-clip-gas2-fp32ns", *DEEPSPEED_RULE)

# run in the default suite (one spawn); the rest with -m slow (a second spawn)
DEFAULT = ("stage1-fp32ns", "stage2-fp32ns", "stage3-fp32ns", "stage3-offload-fp32ns", "stage3-bf16ns",
           "stage1-clip-gas2-fp32ns", "stage3-dsrule-standard")
_RESULTS: dict = {}


def results(world, case):
    slow = case not in DEFAULT
    if (world, slow) not in _RESULTS:
        names = [k for k in CASES if (k not in DEFAULT) == slow and (world > 1 or k in ONE_RANK)]
        _RESULTS[(world, slow)] = run_ranks(run_cases, world, {k: CASES[k] for k in names}, STEPS)[0]
    return _RESULTS[(world, slow)][case]


_REFS: dict = {}


def ref(clip, ns_fp32):
    if (clip, ns_fp32) not in _REFS:
        _REFS[(clip, ns_fp32)] = reference(STEPS, clip, ns_fp32)
    return _REFS[(clip, ns_fp32)]


def tolerance(kw):
    if kw.get("precision") in ("bf16", "fp16"):
        return BF16_MODEL
    return EXACT if kw.get("ns_dtype") == "fp32" else BF16


def check(res, kw, name):
    losses, state = ref(kw.get("clip", 0.0), kw.get("ns_dtype") == "fp32")
    loss_tol, param_tol = tolerance(kw)
    assert res["skipped"] == 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], losses))
    assert worst <= loss_tol, f"{name}: losses differ by {worst:.3g} (relative) > {loss_tol:g}"
    for k, want in state.items():
        diff = (res["state"][k].float() - want).abs().max().item()
        assert diff <= param_tol, f"{name}: parameter {k} differs by {diff:.3g} > {param_tol:g}"


@pytest.mark.parametrize("case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_muon_matches_torch(world, case):
    if world == 1 and case not in ONE_RANK:
        pytest.skip("one rank: a few cases (nothing is exchanged)")
    if case in DEEPSPEED_RULE:
        if world == 1:
            pytest.skip("the one-rank run is the reference")
        got, want = results(world, case), results(1, case)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
        assert worst <= BF16[0], f"{case}: losses differ by {worst:.3g}"
        for k, v in want["state"].items():
            diff = (got["state"][k] - v).abs().max().item()
            assert diff <= BF16[1], f"{case}: {k} differs by {diff:.3g}"
        return
    check(results(world, case), CASES[case], f"{world} ranks, {case}")


def test_split_follows_tags_and_groups():
    """The default rule, a parameter's use_muon tag, and a group's use_muon."""
    from zeroplug.param_groups import param_groups
    from zeroplug.plugins.optim.muon import split
    model = ToyNet()
    _, which = split(model, param_groups(model))
    assert which == {n: p.ndim >= 2 and not n.startswith(("emb", "head")) for n, p in model.named_parameters()}
    model.blocks[0][0].weight.use_muon = False         # DeepSpeed's tag
    _, which = split(model, param_groups(model))
    assert which["blocks.0.0.weight"] is False and which["blocks.0.2.weight"] is True
    groups = param_groups(model, [{"params": [model.head.weight], "use_muon": True},
                                  {"params": [p for n, p in model.named_parameters() if n != "head.weight"]}])
    out, which = split(model, groups)
    assert which["head.weight"] is True and which["emb.weight"] is False
    assert len(out.settings) == 3     # the head's group (Muon), the rest's two halves
    with pytest.raises(Exception, match="use_muon"):
        split(model, param_groups(model, [{"params": list(model.parameters()), "use_muon": True}]))


def _resume(directory, stage, offload, steps_done):
    engine = build_engine(ToyNet, config(stage, offload=offload, ns_dtype="fp32"))
    engine.load_checkpoint(directory, tag="t")
    losses = []
    for x, y in data(STEPS)[steps_done:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.consolidated_state_dict()


def _save(rank, world, directory):
    losses, _, engine = train(rank, world, config(3, world=world, ns_dtype="fp32"), 3)
    engine.save_checkpoint(directory, tag="t")
    return losses


@pytest.mark.parametrize("stage,offload", [(1, False), (3, True)])
def test_checkpoint_resumes_at_another_world_size(stage, offload):
    """Saved by 2 ranks at stage 3 after 3 steps, resumed on 1 rank: the uninterrupted run."""
    want_losses, want = ref(0.0, True)
    with tempfile.TemporaryDirectory() as d:
        first = run_ranks(_save, 2, d)[0]
        rest, state = _resume(d, stage, offload, 3)
    got = first + rest
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want_losses)) <= EXACT[0]
    for k, v in want.items():
        assert (state[k] - v).abs().max().item() <= EXACT[1], k


def test_offload_states_round_trip():
    """engine.offload_states / reload_states between steps change nothing."""
    want_losses, want = ref(0.0, True)
    engine = build_engine(ToyNet, config(3, ns_dtype="fp32"))
    losses = []
    for i, (x, y) in enumerate(data(STEPS)):
        if i == 3:
            engine.offload_states()
            engine.reload_states()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= EXACT[0]
    state = engine.consolidated_state_dict()
    for k, v in want.items():
        assert (state[k] - v).abs().max().item() <= EXACT[1], k


def test_muon_states_are_one_buffer():
    """Muon's tensors hold one fp32 momentum buffer, AdamW's two moments (4 and 8 bytes)."""
    engine = build_engine(ToyNet, config(3))
    x, y = data(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    for g in engine.optimizer.param_groups:
        for t in g["params"]:
            keys = {k for k, v in engine.optimizer.state[t].items() if torch.is_tensor(v) and v.dim() > 0}
            assert keys == ({"momentum_buffer"} if g["use_muon"] else {"exp_avg", "exp_avg_sq"})


def test_nvme_offload(tmp_path):
    """The optimizer states in swap files between steps (the nvme tier): the same values."""
    want_losses, want = ref(0.0, True)
    cfg = config(3, ns_dtype="fp32")
    cfg["offload"] = {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path)}}
    losses, state, engine = train(0, 1, cfg, STEPS)
    engine.close()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= EXACT[0]
    for k, v in want.items():
        assert (state[k] - v).abs().max().item() <= EXACT[1], k
