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
