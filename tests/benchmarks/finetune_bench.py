"""LoRA against full fine-tuning of a TinyLlama-shaped model under zeroplug stage 3.

The model is built from a config (22 layers, hidden 2048, intermediate 5632, 32 heads,
4 KV heads; nothing downloaded), bf16, activation checkpointing (non-reentrant), sequence
2048, micro batch 4, random tokens. Modes:

  lora          peft LoRA r=16 on q, k, v, o projections; only the adapters train
  full          every weight trains, optimizer states on the GPU
  full_offload  every weight trains, optimizer states in CPU memory ([offload.optimizer] cpu)

Prints one JSON line per mode: tokens/s (median step after warm-up, and over all timed
steps), peak GPU memory (max_memory_allocated), host RSS, optimizer-state bytes.

    python tests/benchmarks/finetune_bench.py --modes lora,full,full_offload --steps 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(layers: int, hidden: int):
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def run(mode: str, args) -> dict:
    import zeroplug
    from zeroplug.flat import storage_bytes
    from zeroplug.observe.memory import host_rss_bytes
    model = build(args.layers, args.hidden)
    if mode == "lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    cfg = {"zero": {"plugin": "stage3"}, "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "auto" if mode == "full_offload" else "adamw", "lr": 1e-4},
           "scheduler": {"plugin": "none"},
           "batch": {"micro_batch_size": args.micro_batch, "gradient_clipping": 1.0, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if mode == "full_offload":
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    engine = zeroplug.initialize(model, cfg, device="cuda")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(0, 32000, (args.micro_batch, args.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.partitioner.wait_optimizer()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    timed = times[2:]
    tokens = args.micro_batch * args.seq
    masters = engine.partitioner.master_params()
    states = [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    out = {"mode": mode, "trainable": trainable, "params": sum(p.numel() for p in model.parameters()),
           "tokens_per_s_median": tokens / statistics.median(timed), "tokens_per_s_total": tokens * len(timed) / sum(timed),
           "step_s": [round(x, 3) for x in times], "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
           "host_rss_gib": host_rss_bytes() / 2**30,
           "optimizer_state_bytes": storage_bytes(masters) + storage_bytes(states), "loss": loss.item()}
    engine.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="lora,full,full_offload")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    for mode in args.modes.split(","):
        print(json.dumps(run(mode, args)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
