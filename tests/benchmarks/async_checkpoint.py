"""Training stall per checkpoint save: synchronous against asynchronous (``async_save``).

  python tests/benchmarks/async_checkpoint.py --model 1.3B --zero stage3
  python tests/benchmarks/async_checkpoint.py --model 1.3B --zero stage3 --offload cpu
  python tests/benchmarks/async_checkpoint.py --model 125M --steps-between 3   # a quick look

The reference workload (shared/WORKLOAD.md: micro batch 8, sequence 1,024, bf16, AdamW,
activation checkpointing, random tokens) on one GPU. After warm-up the median step time
``T`` is measured over ``--base-steps`` steps. Then saves of each kind alternate (sync,
async, sync, ...; ``--saves`` of each) into ``--dir``, each followed by training steps:

* sync: the stall is the save call's wall time (training waits for the write), measured
  as (save + 1 step) - T;
* async: the save call returns early; the engine waits for the copy into host memory at
  the next step, and the writer thread competes with training until the file is
  installed. The stall is (save + the N steps until the save has finished, at least
  ``--steps-between``) - N x T: every second training lost to the save.

Every checkpoint is removed once measured (one on disk at a time). The first async save
also allocates and page-locks the host buffers that later saves reuse: it is reported on
its own row and the median is taken over the others. Prints a table (and the JSON with
``--out``); the target is an async stall of at most 10% of the sync one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

import zeroplug
from zeroplug.plugins.workload.models import GPT, get_preset, param_count


def _config(args) -> dict:
    cfg = {"batch": {"micro_batch_size": args.micro_batch, "gradient_clipping": 1.0, "steps_per_print": 10**9},
           "zero": {"plugin": args.zero}, "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "adamw", "lr": 1e-4}, "monitor": {"plugin": "none"}}
    if args.offload:
        cfg["offload"] = {"optimizer": {"plugin": args.offload}}
        cfg["optimizer"]["plugin"] = "auto"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--zero", default="stage3")
    ap.add_argument("--offload", default=None, help="offload.optimizer tier (cpu), none by default")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--base-steps", type=int, default=10)
    ap.add_argument("--steps-between", type=int, default=4, help="training steps after each save, at least")
    ap.add_argument("--saves", type=int, default=3, help="saves of each kind")
    ap.add_argument("--dir", default="/tmp/zeroplug-async-ckpt")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")   # cpu: a smoke run

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    cfg = _config(args)
    mcfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    if args.zero == "stage3":
        with zeroplug.init(cfg):
            model = GPT(mcfg)
    else:
        model = GPT(mcfg)
    engine = zeroplug.initialize(model, cfg, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)

    def step() -> None:
        x = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        y = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        sync()

    for _ in range(2):
        step()
    base = []
    for _ in range(args.base_steps):
        t0 = time.perf_counter()
        step()
        base.append(time.perf_counter() - t0)
    T = statistics.median(base)

    shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    for i in range(args.saves):
        for kind in ("sync", "async"):
            tag = f"{kind}{i}"
            sync()
            t0 = time.perf_counter()
            path = engine.save_checkpoint(args.dir, tag=tag, async_save=kind == "async")
            call = time.perf_counter() - t0
            n, first_step = 0, None
            while n < (1 if kind == "sync" else args.steps_between) or engine.background_saves.in_flight():
                s0 = time.perf_counter()
                step()
                first_step = time.perf_counter() - s0 if first_step is None else first_step
                n += 1
            engine.background_saves.wait()
            total = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in os.scandir(path))
            rows.append({"kind": kind, "index": i, "save_call_s": call, "first_step_s": first_step,
                         "steps": n, "window_s": total, "stall_s": total - n * T, "bytes": size})
            shutil.rmtree(path)
    engine.close()

    def med(kind, skip_first):
        xs = [r["stall_s"] for r in rows if r["kind"] == kind and not (skip_first and r["index"] == 0)]
        return statistics.median(xs) if xs else float("nan")
    sync_stall = med("sync", False)
    async_stall = med("async", args.saves > 1)
    print(f"model {args.model} ({param_count(mcfg) / 1e9:.2f}B), zero {args.zero}, offload {args.offload or 'none'}, "
          f"{torch.cuda.get_device_name(dev) if cuda else 'CPU'}; median step T = {T:.3f} s; checkpoint "
          f"{rows[0]['bytes'] / 2**30:.2f} GiB")
    print(f"{'save':<8} {'call s':>8} {'1st step s':>10} {'steps':>5} {'window s':>9} {'stall s':>8} "
          f"{'stall / sync':>12}")
    for r in rows:
        print(f"{r['kind'] + str(r['index']):<8} {r['save_call_s']:8.3f} {r['first_step_s']:10.3f} {r['steps']:5d} "
              f"{r['window_s']:9.3f} {r['stall_s']:8.3f} {r['stall_s'] / sync_stall:12.1%}")
    ratio = async_stall / sync_stall
    print(f"median stall per save: sync {sync_stall:.3f} s, async {async_stall:.3f} s "
          f"({'without the first, which allocates the host buffers; ' if args.saves > 1 else ''}"
          f"{ratio:.1%} of sync; target <= 10%: {'met' if ratio <= 0.10 else 'NOT met'})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "zero": args.zero, "offload": args.offload, "step_s": T,
                       "sync_stall_s": sync_stall, "async_stall_s": async_stall, "ratio": ratio, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
