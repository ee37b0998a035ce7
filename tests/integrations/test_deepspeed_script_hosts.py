"""Script styles that reach DeepSpeed through a host library, ported by their import line (or one
word) to zeroplug: transformers' run_clm (``--deepspeed ds.json``), accelerate's DeepSpeed example,
a Lightning script with ``strategy="deepspeed_stage_3"``. Each script (tests/integrations/deepspeed_scripts/)
runs as users run it, on 1 and 2 CPU ranks, and its losses equal plain torch's.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "deepspeed_scripts"
STEPS, GLOBAL_BATCH = 4, 4

HF_DS_JSON = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
}
ACCELERATE_DS_JSON = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                      "zero_optimization": {"stage": 2}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, ranks: int, args: list[str], out: Path, env=None, torchrun: bool = True) -> list[float]:
    out.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
              "--master-port", str(_port())] if ranks > 1 and torchrun else [sys.executable]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    e.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([*launch, str(SCRIPTS / script), "--output_dir", str(out), *args], env=e,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads((out / "losses.json").read_text())


# --- plain torch references --------------------------------------------------------------------

def _gpt2():
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed
    set_seed(42)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config)


def gpt2_reference(lr: float, clip: float) -> list[float]:
    model = _gpt2()
    ids = torch.randint(0, 97, (64, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for k in range(STEPS):
        x = ids[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def plain_trainer_reference(tmp_path, args: list[str]) -> list[float]:
    """The same run_clm calls with transformers' own Trainer (no DeepSpeed, no zeroplug) in one
    process: plain torch AdamW under the Trainer's loss normalization and clipping."""
    from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator
    from tests.integrations.deepspeed_scripts.hf_run_clm_style import Blocks, DataTrainingArguments, ModelArguments
    _, data_args, targs = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments)) \
        .parse_args_into_dataclasses(["--output_dir", str(tmp_path / "plain"), *args])
    model = _gpt2()
    trainer = Trainer(model=model, args=targs, data_collator=default_data_collator,
                      train_dataset=Blocks(data_args.max_train_samples, data_args.block_size, 97))
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def lightning_reference() -> list[float]:
    import lightning as L

    from tests.integrations.deepspeed_scripts.lightning_style import LitLM
    L.seed_everything(42)
    model = LitLM()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 61, (64, 8), generator=g), torch.randint(0, 61, (64, 8), generator=g)
    opt = model.configure_optimizers()
    # Note: Lightning's distributed strategies (DeepSpeed's, DDP, zeroplug's) give the loader a
    # DistributedSampler shuffled by the global seed; its permutation does not depend on the
    # world size, so step k's global batch is the permutation's k-th slice on any number of ranks.
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(42))
    losses = []
    for k in range(STEPS):
        sl = perm[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH]
        loss = model.training_step((x[sl], y[sl]), k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# --- the scripts ----------------------------------------------------------------------------------

RANKS = [1, pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("ranks", RANKS)
def test_hf_run_clm_style(tmp_path, ranks):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(HF_DS_JSON))
    args = ["--max_steps", str(STEPS), "--learning_rate", "1e-3", "--lr_scheduler_type", "constant",
            "--weight_decay", "0.0", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
            "--report_to", "none", "--save_strategy", "no", "--seed", "42", "--use_cpu"]
    got = run("hf_run_clm_style.py", ranks, ["--deepspeed", str(ds), "--per_device_train_batch_size",
                                             str(GLOBAL_BATCH // ranks), *args], tmp_path / "out")
    want = plain_trainer_reference(tmp_path, ["--per_device_train_batch_size", str(GLOBAL_BATCH), *args])
    assert len(got) == STEPS and got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("ranks", RANKS)
def test_accelerate_style(tmp_path, ranks):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ACCELERATE_DS_JSON))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds),
           "ACCELERATE_USE_CPU": "true"}
    got = run("accelerate_style.py", ranks, ["--per_device_train_batch_size", str(GLOBAL_BATCH // ranks),
                                             "--max_train_steps", str(STEPS)], tmp_path / "out", env)
    assert got == pytest.approx(gpt2_reference(1e-3, 0.0), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("ranks", RANKS)
def test_lightning_style(tmp_path, ranks):
    got = run("lightning_style.py", ranks, ["--devices", str(ranks), "--batch_size", str(GLOBAL_BATCH // ranks),
                                            "--max_steps", str(STEPS)], tmp_path / "out", torchrun=False)
    assert got == pytest.approx(lightning_reference(), rel=1e-5, abs=1e-6)
