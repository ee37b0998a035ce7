"""transformers' ``run_clm.py`` with ``--deepspeed ds.json``, as the script calls the Trainer.

Ported by its import line only (``Trainer`` / ``TrainingArguments``); the command line keeps
``--deepspeed ds.json``, which configures zeroplug. Tiny GPT-2 from a config, a synthetic
tokenized corpus cut into ``block_size`` blocks (nothing downloaded). Rank 0 writes the
logged training losses to ``<output_dir>/losses.json``.
"""
import json
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, default_data_collator, set_seed

# was: from transformers import Trainer, TrainingArguments
from zeroplug.integrations.transformers import ZeroplugTrainer as Trainer, ZeroplugTrainingArguments as TrainingArguments


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2")
    config_overrides: str = field(default="n_layer=2,n_embd=32,n_head=2,vocab_size=97,n_positions=64,"
                                          "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0")


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16)
    max_train_samples: int = field(default=64)


class Blocks(torch.utils.data.Dataset):
    """The tokenized corpus grouped into blocks, as run_clm's group_texts leaves it."""

    def __init__(self, n, block_size, vocab, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, block_size), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = AutoConfig.for_model(model_args.model_type)
    config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    train_dataset = Blocks(data_args.max_train_samples, data_args.block_size, config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      data_collator=default_data_collator)
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(training_args.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    sys.exit(main())
