"""The one-line ports' pieces: Lightning's strategy names, TrainingArguments(deepspeed=...), accelerate's placeholders."""
from __future__ import annotations

import json

import pytest

from zeroplug.errors import ConfigError


def test_lightning_strategy_names(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from zeroplug.integrations.lightning import STRATEGY_NAMES, ZeroplugStrategy
    assert set(STRATEGY_NAMES) <= set(StrategyRegistry.available_strategies())
    for name, want in [("zeroplug_stage_3", {"zero": {"plugin": "stage3"}}),
                       ("zeroplug_stage_2_offload", {"zero": {"plugin": "stage2"},
                                                     "offload": {"optimizer": {"plugin": "cpu"}}})]:
        t = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       default_root_dir=tmp_path)
        assert isinstance(t.strategy, ZeroplugStrategy) and t.strategy.zeroplug_config == want


def test_training_arguments_deepspeed_is_the_zeroplug_config(tmp_path):
    from transformers import HfArgumentParser

    from zeroplug.integrations.transformers import ZeroplugTrainingArguments
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    args, = HfArgumentParser(ZeroplugTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--deepspeed", str(ds), "--report_to", "none"])
    assert args.deepspeed is None and args.zeroplug_deepspeed == str(ds)


def test_plain_training_arguments_deepspeed_says_what_to_change(tmp_path):
    import torch
    from transformers import TrainingArguments

    from zeroplug.integrations.transformers import ZeroplugTrainer
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    args.deepspeed = "ds.json"          # what a DeepSpeed install would have let through
    with pytest.raises(ConfigError, match="ZeroplugTrainingArguments"):
        ZeroplugTrainer(model=torch.nn.Linear(2, 2), args=args)


def test_accelerate_placeholders_importable():
    import zeroplug.integrations.accelerate  # noqa: F401
    from accelerate.utils import DummyOptim, DummyScheduler
    assert DummyOptim.__name__ == "DummyOptim" and DummyScheduler.__name__ == "DummyScheduler"


def test_accelerate_dummy_optimizer_and_scheduler_take_the_config(tmp_path):
    """accelerate's placeholders (the DeepSpeed config names the optimizer and scheduler): the
    config's AdamW and WarmupDecayLR run, their "auto" values filled from the placeholders."""
    import torch

    from zeroplug.integrations.accelerate import Accelerator, PreparedModel
    from accelerate.utils import DummyOptim, DummyScheduler
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                                            "warmup_max_lr": "auto"}}}
    acc = Accelerator(zeroplug_config=ds, cpu=True)
    model = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader([(torch.randn(4), torch.randn(2)) for _ in range(8)], batch_size=2)
    opt = DummyOptim(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = DummyScheduler(opt, total_num_steps=40, warmup_num_steps=4)
    m, o, dl, s = acc.prepare(model, opt, loader, sched)
    assert isinstance(m, PreparedModel) and acc.unwrap_model(m) is model
    engine = acc.engine
    assert engine.config.slot("optimizer").options.lr == 0.05
    assert engine.config.slot("optimizer").options.weight_decay == 0.1
    sopt = engine.config.slot("scheduler").options
    assert (sopt.total_num_steps, sopt.warmup_num_steps) == (40, 4)
    for x, y in dl:
        loss = torch.nn.functional.mse_loss(m(x), y)
        acc.backward(loss)
        o.step()
        o.zero_grad()
    assert engine.global_step == 4
