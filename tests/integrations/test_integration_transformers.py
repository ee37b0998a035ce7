"""ZeroplugTrainer against the plain ``transformers.Trainer`` on a tiny Llama built from config.

Run as a script under torchrun, this file is also the 2-rank half of the tests:
``python -m torch.distributed.run --nproc-per-node 2 tests/integrations/test_integration_transformers.py OUT``
(the repository root on PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import zeroplug  # noqa: E402
from zeroplug.errors import ConfigError  # noqa: E402
from zeroplug.integrations.transformers import ZeroplugTrainer  # noqa: E402

from tests.support.paths import child_env  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=20, seq=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, TINY["vocab_size"], (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Logged(TrainerCallback):
    def __init__(self):
        self.loss, self.eval_loss = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss.append(logs["loss"])
        if logs and "eval_loss" in logs:
            self.eval_loss.append(logs["eval_loss"])


def training_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=3, max_steps=6,
                learning_rate=1e-3, weight_decay=0.1, warmup_steps=1, logging_steps=1, report_to=[],
                save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def train(cls, model, args, resume=None, **kw):
    log = Logged()
    trainer = cls(model=model, args=args, train_dataset=Tokens(), callbacks=[log], **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, log


def rel(a, b) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer: 20 samples of 2 per micro-batch, 3 per window (the last window of
    each epoch has one), an evaluation every 3 steps."""
    args = training_args(tmp_path_factory.mktemp("plain"), eval_strategy="steps", eval_steps=3)
    log = Logged()
    Trainer(model=tiny_model(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=2),
            callbacks=[log]).train()
    return log


@pytest.mark.parametrize("stage", ["stage0", "stage2"])     # stage 3: the torchrun test
def test_follows_the_plain_trainer(tmp_path, plain, stage):
    args = training_args(tmp_path, eval_strategy="steps", eval_steps=3)
    log = Logged()
    trainer = ZeroplugTrainer(model=tiny_model(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=2),
                              callbacks=[log], zeroplug_config={"zero": {"plugin": stage}})
    trainer.train()
    assert len(log.loss) == 6 and trainer.engine.global_step == 6
    assert rel(plain.loss, log.loss) < 1e-5
    assert rel(plain.eval_loss, log.eval_loss) < 1e-5


def test_checkpoints_rotate_and_resume_exactly(tmp_path):
    cfg = {"zero": {"plugin": "stage2"}}
    args = training_args(tmp_path, save_strategy="steps", save_steps=2, save_total_limit=2)
    full, log = train(ZeroplugTrainer, tiny_model(), args, zeroplug_config=cfg)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]      # checkpoint-2 rotated away
    ckpt = tmp_path / "checkpoint-4"
    assert (ckpt / "zeroplug" / "latest").read_text().strip() == "global_step4"
    weights = full.engine.consolidated_state_dict()

    resumed, log2 = train(ZeroplugTrainer, tiny_model(), training_args(tmp_path), zeroplug_config=cfg, resume=str(ckpt))
    assert log2.loss == log.loss[4:]
    again = resumed.engine.consolidated_state_dict()
    assert all(torch.equal(weights[k], again[k]) for k in weights)

    full.save_model(str(tmp_path / "final"))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final")).state_dict()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_load_best_model_at_end(tmp_path):
    args = training_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                         save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer = ZeroplugTrainer(model=tiny_model(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=2),
                              zeroplug_config={"zero": {"plugin": "stage2"}})
    trainer.train()
    best = trainer.state.best_model_checkpoint
    saved = LlamaForCausalLM.from_pretrained(best).state_dict()
    now = trainer.engine.consolidated_state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in now)


def test_an_fp16_step_skipped_for_overflow_keeps_the_schedule(tmp_path):
    """A loss scale of 2^40 overflows fp16: those steps are skipped, and the Trainer's
    schedule advances only with the steps taken (as with its own fp16)."""
    args = training_args(tmp_path, max_steps=4, fp16=True)
    cfg = {"precision": {"plugin": "fp16", "initial_scale_power": 40}}
    trainer, _ = train(ZeroplugTrainer, tiny_model(), args, zeroplug_config=cfg)
    engine = trainer.engine
    assert engine.skipped_steps >= 1 and engine.global_step == 4
    assert trainer.lr_scheduler.last_epoch == engine.lr_step == 4 - engine.skipped_steps


def test_resume_needs_a_zeroplug_checkpoint(tmp_path):
    trainer = ZeroplugTrainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=Tokens())
    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(ConfigError, match="no zeroplug/ folder"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize("field, value", [("deepspeed", {"zero_optimization": {"stage": 3}}),
                                          ("fsdp", "full_shard"), ("torch_compile", True),
                                          ("optim", "adafactor"), ("ddp_bucket_cap_mb", 25)])
def test_refuses_options_it_cannot_honour(tmp_path, field, value):
    args = training_args(tmp_path)
    setattr(args, field, value)     # set afterwards: TrainingArguments(deepspeed=) needs DeepSpeed
    with pytest.raises(ConfigError, match=field):
        ZeroplugTrainer(model=tiny_model(), args=args, train_dataset=Tokens())


def test_refuses_an_optimizer_of_its_own(tmp_path):
    model = tiny_model()
    with pytest.raises(ConfigError, match="optimizers"):
        ZeroplugTrainer(model=model, args=training_args(tmp_path), train_dataset=Tokens(),
                        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


@pytest.mark.parametrize("config, names", [
    ({"optimizer": {"lr": 0.01}}, ["optimizer.lr", "TrainingArguments.learning_rate"]),
    ({"batch": {"gradient_accumulation_steps": 4}}, ["batch.gradient_accumulation_steps",
                                                     "TrainingArguments.gradient_accumulation_steps"]),
    ({"precision": {"plugin": "bf16"}}, ["precision.plugin", "bf16"]),
    ({"optimizer": {"plugin": "sgd"}}, ["optimizer.plugin", "adamw_torch_fused"]),
    ({"scheduler": {"plugin": "warmup", "warmup_num_steps": 10}}, ["[scheduler]", "lr_scheduler_type"]),
])
def test_a_value_given_twice_must_agree(tmp_path, config, names):
    with pytest.raises(ConfigError) as err:
        ZeroplugTrainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=Tokens(),
                        zeroplug_config=config)
    for name in names:
        assert name in str(err.value)


def test_deepspeed_json_for_the_trainer_as_is(tmp_path):
    """A DeepSpeed JSON written for the Hugging Face Trainer: "auto" everywhere it may be."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = training_args(tmp_path, max_grad_norm=0.5, adam_beta2=0.95)
    trainer = ZeroplugTrainer(model=tiny_model(), args=args, train_dataset=Tokens(), zeroplug_config=str(path))
    raw = trainer.zeroplug_raw
    assert raw["zero"]["plugin"] == "stage2" and "scheduler" not in raw
    assert raw["precision"] == {"plugin": "fp32"}         # bf16 "auto" follows bf16=False
    assert raw["optimizer"] == {"plugin": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                "weight_decay": 0.1}
    assert raw["batch"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 3, "train_batch_size": 6,
                            "gradient_clipping": 0.5}

    # offloaded optimizer states: DeepSpeed's AdamW becomes optimizer.plugin = "auto" (cpu_adam on a
    # GPU run), which computes AdamW as the Trainer's optim does
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    trainer = ZeroplugTrainer(model=tiny_model(), args=args, train_dataset=Tokens(), zeroplug_config=ds)
    assert trainer.zeroplug_raw["optimizer"]["plugin"] == "auto"


def test_a_real_deepspeed_json_trains(tmp_path, plain):
    """LLaMA-Factory's ZeRO-3 JSON for the Trainer (tests/integrations/data/deepspeed, see SOURCES), as it is."""
    path = os.path.join(os.path.dirname(__file__), "data", "deepspeed", "llamafactory_ds_z3.json")
    trainer, log = train(ZeroplugTrainer, tiny_model(), training_args(tmp_path, max_steps=2), zeroplug_config=path)
    assert trainer.engine.config.slot("zero").name == "stage3"
    assert trainer.engine.config.slot("precision").name == "fp32"       # "enabled": "auto", no bf16/fp16
    assert rel(plain.loss[:2], log.loss) < 1e-5


# --- two ranks under torchrun ---------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_stage3_under_torchrun(tmp_path):
    """Stage 3 on 2 ranks (gloo), models built in zeroplug.init from from_pretrained and from
    config, against the plain Trainer (DDP); a checkpoint resumed exactly; save_model loaded
    back with from_pretrained."""
    env = child_env(ZEROPLUG_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", __file__, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert rel(r["plain"], r["zeroplug"]) < 1e-3
    assert r["resumed"] == r["zeroplug"][2:]
    assert r["resume_weight_diff"] == 0.0
    assert r["saved_weight_diff"] == 0.0


STAGE3 = {"zero": {"plugin": "stage3", "stage3_param_persistence_threshold": 0}}


def _ranks_main(out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)

    def args(sub, **kw):
        return training_args(os.path.join(out, sub), gradient_accumulation_steps=2, max_steps=4,
                             ddp_backend="gloo", **kw)
    plain_args = args("plain")            # sets up the process group
    rank = dist.get_rank()
    init = os.path.join(out, "init")
    if rank == 0:
        tiny_model().save_pretrained(init)
    dist.barrier()
    _, plain = train(Trainer, LlamaForCausalLM.from_pretrained(init), plain_args)

    with zeroplug.init(STAGE3):
        model = LlamaForCausalLM.from_pretrained(init)
    first, log = train(ZeroplugTrainer, model, args("zp", save_strategy="steps", save_steps=2),
                       zeroplug_config=STAGE3)
    weights = first.engine.consolidated_state_dict()
    first.save_model(os.path.join(out, "final"))

    with zeroplug.init(STAGE3):
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    second, resumed = train(ZeroplugTrainer, model, args("zp"), zeroplug_config=STAGE3,
                            resume=os.path.join(out, "zp", "checkpoint-2"))
    again = second.engine.consolidated_state_dict()
    if rank == 0:
        saved = LlamaForCausalLM.from_pretrained(os.path.join(out, "final")).state_dict()
        result = {"plain": plain.loss, "zeroplug": log.loss, "resumed": resumed.loss,
                  "resume_weight_diff": max((weights[k] - again[k]).abs().max().item() for k in weights),
                  "saved_weight_diff": max((weights[k] - saved[k]).abs().max().item() for k in weights)}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("ZEROPLUG_DEVICE", "cpu")
    _ranks_main(sys.argv[1])
    from tests.support.distributed import leave_without_teardown
    leave_without_teardown()
