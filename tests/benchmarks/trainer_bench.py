"""ZeroplugTrainer against zeroplug's own loop: tokens/s of the same model, config and data.

The model is TinyLlama-shaped, built from a config (22 layers, hidden 2048, intermediate
5632, 32 heads, 4 KV heads, vocab 32,000; nothing downloaded), bf16, activation
checkpointing (non-reentrant), sequence 2048, micro batch 4, random tokens. The config is a
DeepSpeed JSON as the Hugging Face Trainer takes it ("auto" wherever it may be): ZeRO stage 3,
optimizer and parameters offloaded to pinned CPU memory. Both modes resolve it through the
Trainer's arguments (``trainer_config``), so they run the same engine configuration:

  own      ``engine(**batch).loss; engine.backward(loss); engine.step()`` over the batches
  trainer  ``ZeroplugTrainer(...).train()``: the Trainer's loop, data loader, logging

Each mode runs in a process of its own (one model in memory at a time). tokens/s =
micro batch x seq x timed steps / their wall time, timed from the end of the warm-up steps
to the end of the last one (synchronised at both ends only, so an overlapped CPU step
counts as it does in training). Prints one JSON line per mode, then the ratio.

    python tests/benchmarks/trainer_bench.py                   # an H100: about 3 minutes
    python tests/benchmarks/trainer_bench.py --layers 2 --hidden 64 --seq 64 --vocab 256   # a CPU check
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

DEEPSPEED = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(a, device):
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75),
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        max_position_embeddings=a.seq, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def training_args(a, device):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=1,
        max_steps=a.steps, learning_rate=1e-4, weight_decay=0.0, warmup_steps=0, lr_scheduler_type="constant",
        max_grad_norm=1.0, bf16=device.type == "cuda", use_cpu=device.type != "cuda", logging_steps=10_000,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_pin_memory=True, seed=0)


class Clock:
    """Wall time from the end of step ``warmup`` to the end of the last step."""

    def __init__(self, warmup: int, steps: int, device):
        self.warmup, self.steps, self.device, self.t0, self.t1 = warmup, steps, device, None, None

    def step_done(self, step: int) -> None:
        if step in (self.warmup, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if step == self.warmup:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()


def run(mode: str, a) -> dict:
    import zeroplug
    from zeroplug.integrations.transformers import ZeroplugTrainer, trainer_config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = training_args(a, device)
    model = build_model(a, device)
    data = RandomTokens(a.micro_batch * a.steps, a.seq, a.vocab)
    clock = Clock(a.warmup, a.steps, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if mode == "own":
        from transformers import Trainer
        raw = trainer_config(DEEPSPEED, args)       # the configuration ZeroplugTrainer runs ...
        decay = set(Trainer.get_decay_parameter_names(None, model))     # ... over the same groups
        groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.0},
                  {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
        engine = zeroplug.initialize(model, raw, device=device, model_parameters=groups)
        loader = torch.utils.data.DataLoader(data, batch_size=a.micro_batch, pin_memory=device.type == "cuda")
        for step, batch in enumerate(loader, 1):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            clock.step_done(step)
    else:
        from transformers import TrainerCallback

        class Timing(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.step_done(state.global_step)

        trainer = ZeroplugTrainer(model=model, args=args, train_dataset=data, callbacks=[Timing()],
                                  zeroplug_config=DEEPSPEED)
        trainer.train()
        engine = trainer.engine
    timed = a.steps - a.warmup
    out = {"mode": mode, "tokens_per_s": a.micro_batch * a.seq * timed / (clock.t1 - clock.t0),
           "timed_steps": timed, "seconds": round(clock.t1 - clock.t0, 3), "device": str(device),
           "config": {k: engine.config.slot(k).name for k in ("zero", "precision", "optimizer", "offload.optimizer",
                                                              "offload.param")}}
    if device.type == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    engine.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="own,trainer")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", default="/tmp/zeroplug_trainer_bench")
    ap.add_argument("--one", help=argparse.SUPPRESS)     # run one mode in this process
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run(a.one, a)), flush=True)
        return
    results = {}
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode] + [x for x in sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"mode {mode} failed (exit {proc.returncode})")
        results[mode] = json.loads(lines[-1][len("RESULT "):])
        print(json.dumps(results[mode]), flush=True)
    if "own" in results and "trainer" in results:
        ratio = results["trainer"]["tokens_per_s"] / results["own"]["tokens_per_s"]
        print(f"ZeroplugTrainer {results['trainer']['tokens_per_s']:,.0f} tokens/s, own loop "
              f"{results['own']['tokens_per_s']:,.0f} tokens/s: ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
