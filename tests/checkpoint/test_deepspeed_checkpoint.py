"""DeepSpeed ZeRO checkpoints (stages 1-3) continue under zeroplug exactly.

The fixture (tests/support/deepspeed_ckpt.py) writes DeepSpeed's on-disk layout from a model and a
stepped torch AdamW; zeroplug loads it at another world size and stage and its next steps'
losses equal torch's own continuation. The real DeepSpeed check (a checkpoint DeepSpeed
writes on a GPU host) is tests/benchmarks/deepspeed_resume.py.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import zeroplug
from zeroplug.checkpoint import CheckpointError
from zeroplug.checkpoint.deepspeed_files import load_deepspeed_file

from tests.support.deepspeed_ckpt import write_deepspeed_checkpoint
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches

GLOBAL_BATCH = 4
LR, WD = 1e-2, 0.01
BEFORE, AFTER = 3, 3


def torch_run():
    """Plain torch AdamW: the state after BEFORE steps and the losses of the AFTER steps."""
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = batches(BEFORE + AFTER, GLOBAL_BATCH)
    for _ in range(BEFORE):
        x, y = next(data)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    saved = ToyNet()
    saved.load_state_dict(model.state_dict())
    saved_opt = torch.optim.AdamW(saved.parameters(), lr=LR, weight_decay=WD)
    saved_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # state_dict() holds the live tensors
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return saved, saved_opt, losses


def config(stage, world, precision="fp32"):
    return {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": 600, "sub_group_size": 700},
            "batch": {"micro_batch_size": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                      "gradient_clipping": 0.0},
            "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WD},
            "scheduler": {"plugin": "none"}, "precision": {"plugin": precision},
            "monitor": {"plugin": "none"}}


def _continue(rank, world, ckpt, stage, precision, explicit):
    torch.manual_seed(123)                   # other initial values: everything comes from the checkpoint
    engine = zeroplug.initialize(ToyNet(), config(stage, world, precision))
    if explicit:
        from zeroplug.checkpoint.deepspeed_format import load_deepspeed_checkpoint
        path, client = load_deepspeed_checkpoint(engine, ckpt)
    else:
        path, client = engine.load_checkpoint(ckpt)
    st = engine.optimizer.state
    steps = {float(s["step"]) for s in st.values() if "step" in s}
    counters = (engine.global_step, engine.lr_step, engine.skipped_steps, sorted(steps))
    sd = engine.consolidated_state_dict()
    per = GLOBAL_BATCH // world
    losses = []
    data = batches(BEFORE + AFTER, GLOBAL_BATCH)
    for _ in range(BEFORE):
        next(data)
    for x, y in data:
        loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        engine.run.comm.all_reduce(t)
        losses.append(t.item() / world)
    return {"losses": losses, "counters": counters, "client": client, "sd": sd, "path": path}


@pytest.fixture(scope="module")
def reference():
    return torch_run()


@pytest.mark.parametrize("ds_stage,ds_world,zp_stage,zp_world", [
    (2, 2, 2, 1), (1, 3, 3, 1), (3, 2, 1, 1), (3, 3, 2, 1),
    pytest.param(2, 3, 3, 2, marks=pytest.mark.slow), pytest.param(3, 2, 2, 2, marks=pytest.mark.slow)])
def test_continues_exactly(tmp_path, reference, ds_stage, ds_world, zp_stage, zp_world):
    model, opt, ref_losses = reference
    write_deepspeed_checkpoint(tmp_path, model, opt, ds_stage, ds_world, dtype=torch.bfloat16,
                               global_steps=BEFORE, sub_group_size=600, client_state={"epoch": 7},
                               lr_scheduler={"last_batch_iteration": BEFORE - 1})
    out = run_ranks(_continue, zp_world, str(tmp_path), zp_stage, "fp32", ds_stage == 1)
    r0 = out[0]
    assert r0["counters"][:3] == (BEFORE, BEFORE, 0)
    assert r0["counters"][3] == [float(BEFORE)]
    assert r0["client"] == {"epoch": 7}
    assert r0["path"].endswith(f"global_step{BEFORE}")
    # the fp32 masters are the checkpoint's exactly (the engine trains in fp32 here)
    for k, v in model.state_dict().items():
        assert torch.equal(r0["sd"][k], v), k
    assert r0["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


def saved_states(ckpt_dir) -> dict:
    """{param name: {"master": t, "exp_avg": t, ...}} read back from a zeroplug checkpoint."""
    from zeroplug.checkpoint.loading import ShardSet, read_manifest, resolve
    path = resolve(ckpt_dir)
    shards = ShardSet(path, read_manifest(path))
    out: dict = {}
    for model in shards:
        for name, pieces in model["pieces"].items():
            shape = shards.meta["params"][name]["shape"]
            for pc in pieces:
                full = shards.piece_states(name, pc)
                vals = {"master": full.get("master", pc.get("param")), **full.get("optim", {})}
                for key, v in vals.items():
                    t = out.setdefault(name, {}).setdefault(key, torch.zeros(torch.Size(shape).numel()))
                    t[pc["start"]:pc["end"]] = v.float()
    return {n: {k: t.view(shards.meta["params"][n]["shape"]) for k, t in d.items()} for n, d in out.items()}


def test_moments_and_step_loaded(tmp_path, reference):
    """Adam's moments and step land on the right elements (stage 3 on 3 ranks into stage 1, bf16)."""
    model, opt, _ = reference
    write_deepspeed_checkpoint(tmp_path / "ds", model, opt, 3, 3, global_steps=BEFORE, sub_group_size=600,
                               fused_adam_step=True)
    torch.manual_seed(5)
    engine = zeroplug.initialize(ToyNet(), config(1, 1, "bf16"))
    engine.load_checkpoint(tmp_path / "ds")
    assert {float(s["step"]) for s in engine.optimizer.state.values()} == {float(BEFORE)}
    sd = engine.consolidated_state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v.to(torch.bfloat16)), k      # the parameters: the masters rounded
    engine.save_checkpoint(tmp_path / "zp")
    got = saved_states(tmp_path / "zp")
    for name, p in model.named_parameters():
        assert torch.equal(got[name]["master"], p.detach()), name
        assert torch.equal(got[name]["exp_avg"], opt.state[p]["exp_avg"]), name
        assert torch.equal(got[name]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), name


@pytest.mark.parametrize("variant", ["elastic", "bf16_optimizer", "fused_step"])
def test_layout_variants(tmp_path, reference, variant):
    model, opt, ref_losses = reference
    write_deepspeed_checkpoint(tmp_path, model, opt, 2 if variant != "bf16_optimizer" else 1, 2,
                               global_steps=BEFORE, elastic=variant == "elastic",
                               bf16_optimizer=variant == "bf16_optimizer", fused_adam_step=variant == "fused_step")
    out = _continue(0, 1, str(tmp_path), 2, "fp32", False)
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


class TiedNet(ToyNet):
    """The head shares the embedding's weight (as GPT-2's lm_head does)."""

    def __init__(self):
        super().__init__()
        self.head.weight = self.emb.weight


def test_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = batches(BEFORE + AFTER, GLOBAL_BATCH)
    for _ in range(BEFORE):
        x, y = next(data)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    write_deepspeed_checkpoint(tmp_path, model, opt, 3, 2, global_steps=BEFORE)
    ref = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    torch.manual_seed(9)
    engine = zeroplug.initialize(TiedNet(), config(2, 1))
    engine.load_checkpoint(tmp_path)
    data = batches(BEFORE + AFTER, GLOBAL_BATCH)
    for _ in range(BEFORE):
        next(data)
    got = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    from zeroplug.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert sd["head.weight"] is sd["emb.weight"]


def test_torch_scheduler_state_reaches_zeroplug_deepspeed(tmp_path, reference):
    """A torch LR scheduler DeepSpeed saved (``lr_scheduler`` of the model states) is restored
    into the scheduler given to ``zeroplug.deepspeed.initialize``."""
    import zeroplug.deepspeed as deepspeed
    model, opt, _ = reference
    saved = torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(ToyNet().parameters(), lr=LR), step_size=2)
    for _ in range(BEFORE):
        saved.optimizer.step()
        saved.step()
    write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2, global_steps=BEFORE, lr_scheduler=saved.state_dict())
    net = ToyNet()
    adam = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=2)
    engine, _, _, lr_scheduler = deepspeed.initialize(model=net, optimizer=adam, lr_scheduler=sched,
                                                      config={"train_micro_batch_size_per_gpu": 4,
                                                              "zero_optimization": {"stage": 1}})
    path, client = engine.load_checkpoint(str(tmp_path))
    assert path.endswith(f"global_step{BEFORE}") and lr_scheduler.last_epoch == BEFORE
    assert lr_scheduler.get_last_lr() == pytest.approx(saved.get_last_lr())


def test_fp16_loss_scale_restored(tmp_path, reference):
    model, opt, _ = reference
    write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2, dtype=torch.float16, global_steps=BEFORE,
                               fp16_scaler=True)
    engine = zeroplug.initialize(ToyNet(), config(2, 1, "fp16"))
    engine.load_checkpoint(tmp_path)
    st = engine.precision.state_dict()
    assert st["scale"] == 2.0 ** 16 and st["cur_hysteresis"] == 2 and st["clean_steps"] == 4


def test_load_module_only_and_no_optimizer(tmp_path, reference):
    model, opt, _ = reference
    write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2, global_steps=BEFORE)
    engine = zeroplug.initialize(ToyNet(), config(2, 1))
    engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert engine.global_step == BEFORE
    assert not any(engine.optimizer.state.values())
    sd = engine.consolidated_state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_other_model_refused(tmp_path, reference):
    model, opt, _ = reference
    write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2)
    engine = zeroplug.initialize(ToyNet(d=32), config(2, 1))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        engine.load_checkpoint(tmp_path)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_unknown_pickled_class_refused_unread(tmp_path, reference):
    """A file naming anything outside the allow-list is refused before it is unpickled."""
    model, opt, _ = reference
    d = write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2, client_state={"evil": Evil()})
    with pytest.raises(CheckpointError, match=r"pickles (posix|os)\.system.*refused"):
        load_deepspeed_file(d / "mp_rank_00_model_states.pt")
    engine = zeroplug.initialize(ToyNet(), config(2, 1))
    with pytest.raises(CheckpointError, match="refused"):
        engine.load_checkpoint(tmp_path)


def test_other_loss_scaler_class_read_as_attributes(tmp_path, reference):
    """A loss-scaler class of another DeepSpeed release: attributes only, nothing of its code."""
    from tests.support import deepspeed_ckpt
    model, opt, _ = reference

    class LossScaleState:
        def __init__(self):
            self.cur_scale = 4.0

        def __setstate__(self, state):      # not ours to run: the stand-in has no such method
            raise AssertionError("ran the pickled class's code")

    LossScaleState.__qualname__ = "LossScaleState"
    deepspeed_ckpt._CLASSES["deepspeed.runtime.fp16.loss_scaler"].append(LossScaleState)
    try:
        d = write_deepspeed_checkpoint(tmp_path, model, opt, 2, 1, client_state={"scaler": LossScaleState()})
    finally:
        deepspeed_ckpt._CLASSES["deepspeed.runtime.fp16.loss_scaler"].remove(LossScaleState)
    got = load_deepspeed_file(d / "mp_rank_00_model_states.pt")["scaler"]
    assert type(got).__name__ == "LossScaleState" and got.cur_scale == 4.0


def test_incomplete_checkpoint_refused(tmp_path, reference):
    model, opt, _ = reference
    d = write_deepspeed_checkpoint(tmp_path, model, opt, 2, 3)
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    engine = zeroplug.initialize(ToyNet(), config(2, 1))
    with pytest.raises(CheckpointError, match="rank 1 is missing"):
        engine.load_checkpoint(tmp_path)


def test_broken_rank_file_leaves_the_engine_as_it_was(tmp_path, reference):
    model, opt, _ = reference
    d = write_deepspeed_checkpoint(tmp_path, model, opt, 2, 3)
    f = d / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    from tests.support.deepspeed_ckpt import deepspeed_names
    with deepspeed_names():         # the test's own file, rewritten with its stand-in classes
        sd = torch.load(f, weights_only=False)
        sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = torch.zeros(5)     # a wrong size
        torch.save(sd, f)
    engine = zeroplug.initialize(ToyNet(), config(2, 1))
    before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    with pytest.raises(CheckpointError, match="zero_pp_rank_2.*fp32 partition has 5 elements"):
        engine.load_checkpoint(tmp_path)
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_error_line(tmp_path, reference, capsys):
    from zeroplug.cli import main
    model, opt, _ = reference
    d = write_deepspeed_checkpoint(tmp_path, model, opt, 2, 2)
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"garbage")
    assert main(["export", str(tmp_path), str(tmp_path / "out.safetensors"), "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "zero_pp_rank_1" in err[0]
