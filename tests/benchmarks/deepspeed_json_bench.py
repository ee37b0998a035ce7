"""DeepSpeed's own JSON configs, as they are, on the reference workload (shared/WORKLOAD.md).

  python tests/benchmarks/deepspeed_json_bench.py                       # one H100: the offloaded rows
  python tests/benchmarks/deepspeed_json_bench.py --rows s2_offload --steps 5
  torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py  # 2 GPUs: per-GPU rows
  python tests/benchmarks/deepspeed_json_bench.py --engine deepspeed    # DeepSpeed itself, same JSON

Each row builds the 1.3B GPT, passes the JSON in tests/benchmarks/deepspeed_configs/ to
``zeroplug.initialize`` untouched (no overrides: what a user launching DeepSpeed's config
gets, torchrun's OMP_NUM_THREADS=1 included) and prints tokens/s per GPU (median step after
two warm-up steps), peak GPU memory, the time from ``initialize`` to the end of step 1, and
the first step against the steady one, beside DeepSpeed 0.19.8's figures on the same
machines (quoted). ``--engine deepspeed`` runs DeepSpeed itself (when installed) on the same
JSON and prints the same columns, so the peer is measured in the same call; its CPU Adam is
built just in time on a machine's first run. Rows run one after the other in this process, so
only the first pays a cold kernel build; run the script twice to see a machine whose
kernel cache is warm (the second run is what every later run on the machine gets).
Raw results go to $OUT/deepspeed_json_bench.json when OUT is set. Without CUDA it runs on
the CPU (gloo under torchrun): a smoke test of the script at a small ``--model`` preset.
tests/benchmarks/offload_hosts.py runs it once per row in fresh processes.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

import zeroplug
from zeroplug.observe.memory import GB
from zeroplug.plugins.workload.models import GPT, get_preset

CONFIGS = Path(__file__).parent / "deepspeed_configs"
ROWS = {  # name: (JSON, what, DeepSpeed 0.19.8 on one H100, on 2 x H200 per GPU)
    "s3_offload": ("zero3_offload.json", "stage 3 + CPU offload (params + optimizer)",
                   "7.7k tokens/s", "3.2k tokens/s/GPU"),
    "s2_offload": ("zero2_offload.json", "stage 2 + CPU optimizer offload", "9.8k tokens/s, 8.3 GiB", "-"),
    "s3": ("zero3.json", "stage 3", "-", "-"),
}
DS_INIT = "DeepSpeed: initialize 34-71 s (its CPU Adam built once per machine)"


def run_row(name: str, args, rank: int, world: int) -> dict:
    path = CONFIGS / ROWS[name][0]
    ds = json.loads(path.read_text())
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mcfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_init = time.perf_counter()
    engine, model = build_engine(args.engine, path, ds, mcfg, args.set)
    init_s = time.perf_counter() - t_init
    micro = ds["train_micro_batch_size_per_gpu"]
    g = torch.Generator(device=dev).manual_seed(rank)
    times = []
    full_gc = []                  # seconds of each full (generation 2) pass of Python's collector

    def on_gc(phase, info, _t=[0.0]):
        if info.get("generation") == 2:
            if phase == "start":
                _t[0] = time.perf_counter()
            else:
                full_gc.append(time.perf_counter() - _t[0])
    gc.callbacks.append(on_gc)
    for i in range(args.steps):
        if args.trace_stalls:    # every thread's stack each N s while a step runs: where a slow step waits
            faulthandler.dump_traceback_later(args.trace_stalls, repeat=True)
        x = torch.randint(0, mcfg.vocab_size, (micro, args.seq), device=dev, generator=g)
        y = torch.randint(0, mcfg.vocab_size, (micro, args.seq), device=dev, generator=g)
        sync()
        t0 = time.perf_counter()
        loss = engine(x, y)
        t_fwd = sync_time(args.phases)
        engine.backward(loss)
        t_bwd = sync_time(args.phases)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
        if args.phases and rank == 0:
            print(f"step {i + 1} phases (synchronised): forward {t_fwd - t0:.3f} s, backward {t_bwd - t_fwd:.3f} s, "
                  f"step {t0 + times[-1] - t_bwd:.3f} s", flush=True)
        if args.trace_stalls:
            faulthandler.cancel_dump_traceback_later()
        if rank == 0 and args.log:
            print(f"step {i + 1}: {times[-1]:.3f} s", flush=True)
    gc.callbacks.remove(on_gc)
    if args.timeline and cuda:      # where the GPU's time goes in a few more steps (rank 0's)
        from zeroplug.benchmarking.timeline import Timeline, format_summary
        with Timeline(dev) as tl:
            for _ in range(args.timeline):
                x = torch.randint(0, mcfg.vocab_size, (micro, args.seq), device=dev, generator=g)
                engine.backward(engine(x, x))
                engine.step()
        if rank == 0:
            print(format_summary(tl.summary(args.timeline), f"timeline ({name}, {args.engine}): "), flush=True)
    steady = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    total_after_warmup = sum(times[2:]) if len(times) > 2 else times[-1]
    res = {"row": name, "config": path.name, "world": world, "model": args.model, "steps": args.steps,
           "engine": args.engine, "optimizer": type(getattr(engine, "basic_optimizer", engine.optimizer)).__name__,
           "torch_threads": torch.get_num_threads(),
           "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
           "init_s": init_s, "first_step_s": times[0], "init_to_step1_s": init_s + times[0],
           "steady_step_s": steady, "first_over_steady": times[0] / steady,
           "tokens_per_s_per_gpu": micro * args.seq / steady,
           "tokens_per_s_per_gpu_total": micro * args.seq * max(1, len(times) - 2) / total_after_warmup,
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / GB if cuda else 0.0, "times": times,
           "loss_last": float(loss.detach().float()), "full_gc_passes_s": [round(t, 4) for t in full_gc]}
    if args.engine == "deepspeed":
        engine.destroy()
    else:
        engine.close()
    del engine, model, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def build_engine(kind: str, path: Path, ds: dict, mcfg, overrides=()):
    """The JSON as-is: zeroplug's engine, or DeepSpeed's own (``--engine deepspeed``, when
    DeepSpeed is installed; its CPU Adam is built just in time on a machine's first run).
    ``overrides``: zeroplug KEY=VALUE settings over the JSON (``--set``; not as-is then)."""
    if kind == "deepspeed":
        from zeroplug.benchmarking.measure import deepspeed_engine
        return deepspeed_engine(lambda: GPT(mcfg), ds)
    config = zeroplug.load_config(str(path), list(overrides)) if overrides else str(path)
    if ds["zero_optimization"]["stage"] == 3:
        with zeroplug.init(config):
            model = GPT(mcfg)
    else:
        model = GPT(mcfg)
    return zeroplug.initialize(model, config), model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(wanted: bool) -> float:
    if wanted:
        sync()
    return time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=None,
                   help="default: s3_offload s2_offload on one GPU; s3 s3_offload s2_offload under torchrun")
    p.add_argument("--steps", type=int, default=8, help="steps per row (two warm-up steps + timed ones)")
    p.add_argument("--model", default="1.3B")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--engine", choices=["zeroplug", "deepspeed"], default="zeroplug",
                   help="deepspeed: run DeepSpeed itself on the same JSON (when installed), for a measured peer")
    p.add_argument("--log", "--info", action="store_true",
                   help="zeroplug's INFO lines (kernel warm-up, threads) and each step's time "
                        "(--info under torchrun, which reads --log as its own --log-dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a zeroplug setting over the JSON (offload.optimizer.gpu_step_ratio=0); not as-is then")
    p.add_argument("--phases", action="store_true",
                   help="synchronise after forward and backward and print each phase's time (slows the step)")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="CUDA: N more steps under torch.profiler; rank 0 prints where the GPU's time goes "
                        "(compute, collectives, copies, idle, the longest compute gaps)")
    p.add_argument("--trace-stalls", type=float, default=0.0, metavar="S",
                   help="print every thread's stack each S seconds while a step runs (finds what a slow step waits on)")
    args = p.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    world = 1
    if "LOCAL_RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank() if world > 1 else 0
    rows = args.rows or (["s3", "s3_offload", "s2_offload"] if world > 1 else ["s3_offload", "s2_offload"])
    results = []
    for name in rows:
        r = run_row(name, args, rank, world)
        results.append(r)
        if rank == 0:
            print("RESULT " + json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
    if rank != 0:
        return
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{args.model}, {world} x {gpu}, DeepSpeed JSON as-is, engine {args.engine}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}; {DS_INIT}")
    print("| run | optimizer | threads | tokens/s per GPU | peak GPU GiB | initialize -> end of step 1 s | "
          "first / steady step s | DeepSpeed 0.19.8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        ds = ROWS[r["row"]][2 if world == 1 else 3]
        print(f"| {ROWS[r['row']][1]} | {r['optimizer']} | {r['torch_threads']} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {r['peak_gpu_gib']:.1f} | {r['init_to_step1_s']:.1f} | "
              f"{r['first_step_s']:.2f} / {r['steady_step_s']:.2f} ({r['first_over_steady']:.1f}x) | {ds} |")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "deepspeed_json_bench.json"), "w") as f:
            json.dump({"gpu": gpu, "world": world, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
