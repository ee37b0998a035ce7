"""Train a Hugging Face model with the ``transformers.Trainer``, on zeroplug (ZeRO stage 3).

    python examples/hf_trainer.py                           # one process (CPU, or one GPU)
    torchrun --nproc-per-node 2 examples/hf_trainer.py      # two ranks (gloo on CPU, NCCL on GPUs)
    python examples/hf_trainer.py --config zero.toml        # any zeroplug TOML or DeepSpeed JSON

A small Llama built from its config (nothing is downloaded) learns the bytes of the Python
standard library's sources. The only line that differs from a plain Trainer script is
``ZeroplugTrainer(..., zeroplug_config=...)`` (and ``zeroplug.init`` around the model,
which builds it already sharded).
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import zeroplug
from zeroplug.plugins.workload.data import stdlib_corpus
from zeroplug.integrations.transformers import ZeroplugTrainer

STAGE3 = {"zero": {"plugin": "stage3"}}


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``seq`` bytes; the labels are the inputs (the model shifts them)."""

    def __init__(self, data: bytes, seq: int):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.windows = tokens[: len(tokens) // seq * seq].view(-1, seq)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--config", default=None, help="a zeroplug TOML or DeepSpeed JSON (default: stage 3)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (on a GPU)")
    a = p.parse_args()
    config = a.config or STAGE3

    corpus = stdlib_corpus(max_bytes=600_000)
    split = len(corpus) * 9 // 10
    train, held_out = ByteWindows(corpus[:split], 64), ByteWindows(corpus[split:], 64)

    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=4, max_grad_norm=1.0,
        logging_steps=5, eval_strategy="steps", eval_steps=20, per_device_eval_batch_size=16,
        save_steps=20, save_total_limit=2, bf16=a.bf16, use_cpu=not torch.cuda.is_available(),
        report_to=[], disable_tqdm=True, seed=0)
    # Note: TrainingArguments first: under torchrun it sets up the process group, over which
    # zeroplug.init shards the model while it is built.
    with zeroplug.init(config):
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))

    trainer = ZeroplugTrainer(model=model, args=args, train_dataset=train,
                              eval_dataset=torch.utils.data.Subset(held_out, range(64)), zeroplug_config=config)
    trainer.train()
    final = os.path.join(a.out, "final")
    trainer.save_model(final)                       # a folder that from_pretrained loads
    if args.process_index == 0:
        reloaded = LlamaForCausalLM.from_pretrained(final)
        prompt = torch.tensor([list(b"def ")])
        text = reloaded.generate(prompt, max_new_tokens=40, do_sample=False)[0]
        print(f"saved to {final}; it writes: {bytes(text.tolist()).decode('utf-8', 'replace')!r}")


if __name__ == "__main__":
    main()
