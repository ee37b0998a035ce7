"""The speculative step on a GPU: step time with ``speculative_step`` false against true.

Runs DeepSpeed's JSON of each row (tests/benchmarks/deepspeed_configs/, the reference
workload's 1.3B GPT) once per variant, a fresh engine each (one after the other in this
process), ``--steps`` steps each,
and prints per row and variant: the median, min and max step (forward + backward + step,
synchronised), tokens/s per GPU, the ratio to the row's ``false`` variant, and the tier's
counters (steps speculated and kept, sub-groups kept, rollbacks) with the grad norms seen.

Variants: ``off`` (speculative_step = false), ``on`` (true) and ``auto`` (the default), all
with ``batch.gradient_clipping`` = ``--clip`` (default 0: no clipping, so every guess holds;
DeepSpeed's JSON says 1.0, and random tokens give norms above it, which makes every
speculation roll back: ``--clip 1.0`` measures that cost). Run from the repo root:

    python3 -m tests.benchmarks.speculative_step_gpu                          # s2_offload, s3_offload
    python3 -m tests.benchmarks.speculative_step_gpu --rows s2_offload --clip 1.0
    torchrun --nproc-per-node 4 -m tests.benchmarks.speculative_step_gpu     # per-GPU, 4 ranks

Under torchrun every rank runs the same variants in the same order (one process group for
all of them); rank 0 prints. Without CUDA it runs on the CPU at ``--model char-tiny`` (a
smoke test). Raw results go to $OUT/speculative_step_gpu.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from tests.benchmarks.deepspeed_json_bench import CONFIGS, ROWS, build_engine

from zeroplug.plugins.workload.models import get_preset  # noqa: E402

VARIANTS = {"off": "false", "on": "true", "auto": "auto"}


def run(row: str, variant: str, args, rank: int) -> dict:
    path = CONFIGS / ROWS[row][0]
    ds = json.loads(path.read_text())
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mcfg = get_preset(args.model, activation_checkpointing=True)
    seq = min(args.seq, mcfg.seq_len)
    torch.manual_seed(0)
    sets = [f"offload.optimizer.speculative_step={VARIANTS[variant]}", f"batch.gradient_clipping={args.clip}"]
    engine, model = build_engine("zeroplug", path, ds, mcfg, sets)
    micro = ds["train_micro_batch_size_per_gpu"]
    g = torch.Generator(device=dev).manual_seed(rank)
    times, norms = [], []
    for _ in range(args.steps):
        x = torch.randint(0, mcfg.vocab_size, (micro, seq), device=dev, generator=g)
        y = torch.randint(0, mcfg.vocab_size, (micro, seq), device=dev, generator=g)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        norms.append(round(float(engine.last_metrics["grad_norm"]), 3))
    spec = engine.offload_optimizer.speculation
    steady = times[2:] or times
    out = {"row": row, "variant": variant, "clip": args.clip, "times": times, "grad_norms": norms,
           "median_s": statistics.median(steady), "min_s": min(steady), "max_s": max(steady),
           "tokens_per_s_per_gpu": micro * seq / statistics.median(steady),
           "speculated_steps": spec.speculated_steps if spec else 0,
           "speculated_groups": spec.speculated_groups if spec else 0,
           "rollbacks": spec.rollbacks if spec else 0,
           "copy_gib": spec.host_bytes() / 2**30 if spec else 0.0}
    engine.close()
    del engine, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=["s2_offload", "s3_offload"])
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=["off", "on", "auto"])
    p.add_argument("--steps", type=int, default=10, help="steps per variant (the first two are warm-up)")
    p.add_argument("--clip", type=float, default=0.0, help="batch.gradient_clipping for every variant")
    p.add_argument("--model", default=None, help="model preset (default 1.3B on CUDA, char-tiny on the CPU)")
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    args.model = args.model or ("1.3B" if torch.cuda.is_available() else "char-tiny")
    world = 1
    if "LOCAL_RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank() if world > 1 else 0
    results = []
    for row in args.rows:
        for variant in args.variants:
            results.append(run(row, variant, args, rank))
            if rank == 0:
                r = results[-1]
                print(f"{row} {variant}: step times {[round(t, 3) for t in r['times']]}, grad norms "
                      f"{r['grad_norms']}", flush=True)
    if rank == 0:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        print(f"\n{args.model}, {world} rank(s), {dev}, gradient_clipping {args.clip}, "
              f"{args.steps} steps (median of steps 3+)")
        print(f"{'row':<11} {'variant':<7} {'median s':>9} {'min':>7} {'max':>7} {'tok/s/GPU':>10} "
              f"{'x off':>6} {'kept steps':>10} {'kept sg':>8} {'rollbacks':>9} {'copy GiB':>8}")
        for r in results:
            base = next((b for b in results if b["row"] == r["row"] and b["variant"] == "off"), r)
            print(f"{r['row']:<11} {r['variant']:<7} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} "
                  f"{r['tokens_per_s_per_gpu']:10.0f} {r['median_s'] / base['median_s']:6.2f} "
                  f"{r['speculated_steps']:10d} {r['speculated_groups']:8d} {r['rollbacks']:9d} "
                  f"{r['copy_gib']:8.2f}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "speculative_step_gpu.json").write_text(json.dumps(results, indent=1))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
