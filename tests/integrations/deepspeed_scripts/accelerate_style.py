"""accelerate's DeepSpeed example (``examples/by_feature/deepspeed_with_config_support.py``), its calls.

Ported by its import line only (``Accelerator``); launched as ``accelerate launch
--use_deepspeed --deepspeed_config_file ds.json`` would (``ACCELERATE_USE_DEEPSPEED``,
``ACCELERATE_DEEPSPEED_CONFIG_FILE`` in the environment), under torchrun or alone. Tiny
GPT-2, synthetic token blocks. Rank 0 writes the per-step losses (averaged over the ranks)
to ``<output_dir>/losses.json``.
"""
import argparse
import json
import os

import torch

# was: from accelerate import Accelerator
from zeroplug.integrations.accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, set_seed
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--max_train_steps", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (64, 16), generator=g)
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    train_dataloader = torch.utils.data.DataLoader(data, batch_size=args.per_device_train_batch_size, shuffle=False)
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    # as the example: DeepSpeed's optimizer / scheduler when its config names them
    optimizer_cls = (torch.optim.AdamW if accelerator.state.deepspeed_plugin is None
                     or "optimizer" not in accelerator.state.deepspeed_plugin.deepspeed_config else DummyOptim)
    optimizer = optimizer_cls(optimizer_grouped_parameters, lr=args.learning_rate)
    if accelerator.state.deepspeed_plugin is None or "scheduler" not in accelerator.state.deepspeed_plugin.deepspeed_config:
        lr_scheduler = get_scheduler(name="constant", optimizer=optimizer, num_warmup_steps=0,
                                     num_training_steps=args.max_train_steps)
    else:
        lr_scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=0)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    model.train()
    losses, step = [], 0
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach().reshape(1)).mean().item())
        step += 1
        if step >= args.max_train_steps * args.gradient_accumulation_steps:
            break
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        assert set(state) == set(unwrapped.state_dict())
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
