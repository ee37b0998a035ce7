"""Scripts written for DeepSpeed, ported by their import lines only (tests/integrations/deepspeed_scripts/):
DeepSpeedExamples' CIFAR script, DeepSpeed-Chat's supervised fine-tuning (step 1), OpenRLHF's
DeepSpeed strategy and a plain script on ``deepspeed.comm``. Each runs as DeepSpeed's launcher
runs it (tests/support/deepspeed_launch.py), on 1 and 2 CPU ranks (gloo), and the losses it prints
equal plain torch's: the same model, torch.optim.AdamW, the same schedule and clipping, each
optimizer step over every rank's micro batches (DDP's average), within 1e-4 relative (fp32;
the flat buffers and fused kernels round differently in the last bits).

The scripts of hosts (transformers' Trainer, accelerate, Lightning) are
tests/integrations/test_deepspeed_script_hosts.py.
"""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from tests.support.deepspeed_launch import launch

SCRIPTS = Path(__file__).parent / "deepspeed_scripts"
TOL = dict(rtol=1e-4, atol=1e-5)
WORLDS = [1, pytest.param(2, marks=pytest.mark.slow)]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_order(n: int, world: int, epoch: int, seed: int = 0) -> list[list[int]]:
    """The indices each rank's DistributedSampler(shuffle=True, seed=seed) yields in ``epoch``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [perm[r::world] for r in range(world)]


def ddp_reference(model, opt, sched, clip, steps, loss_fn) -> list[list[float]]:
    """Plain torch: per optimizer step, the mean loss of its micro batches (every rank's, every
    accumulation step), clipped, stepped; each micro batch's loss before the step."""
    out = []
    for micro in steps:
        losses = [loss_fn(model, mb) for mb in micro]
        (sum(losses) / len(losses)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        out.append([loss.item() for loss in losses])
    return out


# --- DeepSpeedExamples' CIFAR ------------------------------------------------------------------

def cifar_reference(world: int, epochs: int = 2) -> list[float]:
    cifar = load("cifar_style")
    data = cifar.synthetic_cifar(32)
    torch.manual_seed(1138)
    net = cifar.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.log(s + 1) / math.log(4) if s < 4 else 1.0)
    micro = 8 // world
    steps = []
    for epoch in range(epochs):
        order = rank_order(32, world, epoch)
        for i in range(len(order[0]) // micro):
            steps.append([data[order[r][i * micro:(i + 1) * micro]] for r in range(world)])
    per_step = ddp_reference(net, opt, sched, 1.0, steps,
                             lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    return [s[0] for s in per_step]           # rank 0's, as the script prints


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [2])
def test_cifar_script(world, stage):
    out = launch(SCRIPTS / "cifar_style.py", world, ["--stage", str(stage), "--epochs", "2"])
    printed = [float(v) for v in re.findall(r"^\[ *\d+, *\d+\] loss: +([\d.]+)$", out[0], re.M)]
    assert len(printed) == 8 and "Finished Training" in out[0]
    torch.testing.assert_close(printed, cifar_reference(world), **TOL)


# --- DeepSpeed-Chat's supervised fine-tuning (step 1) ------------------------------------------------

def tiny_gpt2_dir(root: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    path = root / "tiny-gpt2"
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def dschat_reference(model_dir: Path, world: int, gas: int = 2, micro: int = 4, samples: int = 32):
    from transformers import AutoModelForCausalLM, get_scheduler
    sft = load("dschat_sft_style")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(sft.get_optimizer_grouped_parameters(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    per_rank = samples // world // micro
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=1,
                          num_training_steps=math.ceil(per_rank / gas))
    data = sft.PromptDataset(samples, 16, 97)
    order = rank_order(samples, world, 0)

    def batch(r, i):
        items = [data[j] for j in order[r][i * micro:(i + 1) * micro]]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}
    steps = [[batch(r, s * gas + a) for r in range(world) for a in range(gas)] for s in range(per_rank // gas)]
    losses = ddp_reference(model, opt, sched, 1.0, steps, lambda m, b: m(**b, use_cache=False).loss)
    return losses, model.state_dict()


@pytest.mark.parametrize("world", WORLDS)
def test_dschat_sft_script(world, tmp_path):
    model_dir = tiny_gpt2_dir(tmp_path)
    out = launch(SCRIPTS / "dschat_sft_style.py", world,
                 ["--model_name_or_path", str(model_dir), "--zero_stage", "3", "--print_loss",
                  "--output_dir", str(tmp_path / "out")])
    want, final = dschat_reference(model_dir, world)
    for rank, text in enumerate(out):
        printed = {int(s): float(v) for s, v in
                   re.findall(rf"^Epoch: 0, Step: (\d+), Rank: {rank}, loss = ([\d.eE+-]+)$", text, re.M)}
        assert sorted(printed) == list(range(2 * len(want)))
        got = [printed[s] for s in sorted(printed)]
        torch.testing.assert_close(got, [want[s // 2][rank * 2 + s % 2] for s in sorted(printed)], **TOL)
    assert "ppl: " in out[0]
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)   # gathered at stage 3
    assert saved.keys() <= final.keys() and len(saved) >= 10
    for n, v in saved.items():
        torch.testing.assert_close(v, final[n], **TOL)


# --- OpenRLHF's DeepSpeed strategy ---------------------------------------------------------------------

def openrlhf_reference(world: int, steps: int = 4, batch: int = 8, micro: int = 2):
    from transformers import get_scheduler
    orl = load("openrlhf_style")
    config = orl.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    orl.DeepspeedStrategy(seed=42).set_seed(42)
    model = orl.CriticModel(config)
    model.value_head.weight.data.normal_(mean=0.0, std=1 / (config.hidden_size + 1))    # rank 0's draw
    opt = torch.optim.AdamW(orl.get_optimizer_grouped_parameters(model, 0.01), lr=5e-3, betas=(0.9, 0.95))
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=1, num_training_steps=steps,
                          scheduler_specific_kwargs={"min_lr": 5e-4})
    data = orl.ValueDataset(steps * batch, 16, 97)
    order = rank_order(len(data), world, 0, seed=42)
    gas = batch // micro // world

    def mb(r, i):
        ids, mask, target = (torch.stack(t) for t in zip(*(data[j] for j in order[r][i * micro:(i + 1) * micro])))
        return ids, mask, target
    plan = [[mb(r, s * gas + a) for r in range(world) for a in range(gas)] for s in range(steps)]
    return ddp_reference(model, opt, sched, 1.0, plan,
                         lambda m, b: ((m(b[0], b[1]).float() - b[2]) ** 2).mean()), gas


def micro_losses(text: str, rank: int) -> dict[int, float]:
    return {int(i): float(v) for i, v in re.findall(rf"^micro_step=(\d+) rank={rank} loss=([\d.eE+-]+)$", text, re.M)}


@pytest.mark.parametrize("world", WORLDS)
def test_openrlhf_strategy_script(world, tmp_path):
    args = ["--ckpt_path", str(tmp_path / "ckpt")]
    first = launch(SCRIPTS / "openrlhf_style.py", world, args)
    resumed = launch(SCRIPTS / "openrlhf_style.py", world, [*args, "--load_checkpoint"])
    want, gas = openrlhf_reference(world)
    assert "consumed_samples: 16" in resumed[0]
    for rank in range(world):
        got, again = micro_losses(first[rank], rank), micro_losses(resumed[rank], rank)
        assert sorted(got) == list(range(4 * gas)) and sorted(again) == list(range(2 * gas, 4 * gas))
        torch.testing.assert_close([got[i] for i in sorted(got)],
                                   [want[i // gas][rank * gas + i % gas] for i in sorted(got)], **TOL)
        torch.testing.assert_close([again[i] for i in sorted(again)], [got[i] for i in sorted(again)], **TOL)


# --- a plain script on deepspeed.comm ---------------------------------------------------------------

def comm_reference(steps: int = 4, batch: int = 8) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_comm_script(world, tmp_path):
    import json
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1},
                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}}}))
    out = launch(SCRIPTS / "comm_style.py", world, ["--deepspeed", "--deepspeed_config", str(ds)])
    assert f"collectives ok on {world} ranks (gloo)" in out[0]
    printed = [float(v) for v in re.findall(r"^step \d+ loss ([\d.eE+-]+)$", out[0], re.M)]
    torch.testing.assert_close(printed, comm_reference(), **TOL)
