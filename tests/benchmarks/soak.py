"""Soak run: does a long run leak host memory, file descriptors or disk?

The built-in job (the GPT preset on the standard library's sources) with ZeRO stage 3,
optimizer states and parameters offloaded to the CPU, a checkpoint every ``--every``
steps with ``keep_last``; host RSS, open file descriptors, threads and the checkpoint
directory's size are sampled every ``--sample`` steps. After the warm-up (the first
``--warmup`` steps) it prints the least-squares slope of each (per 1,000 steps) and the
largest disk use against the bound keep_last allows ((keep_last + 1) checkpoints: the
new one is complete before the oldest goes).

Not part of the test suite (it runs for minutes)::

    python tests/benchmarks/soak.py                       # CPU, 2,000 steps
    python tests/benchmarks/soak.py --device cuda         # on a GPU machine
    python tests/benchmarks/soak.py --check               # exit 1 if anything grows

``--check`` fails when RSS grows by more than 2 MiB or descriptors by more than 1 per
1,000 steps after the warm-up, or the disk use exceeds the bound.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import zeroplug
from zeroplug.plugins.workload.data import ByteBatches, stdlib_corpus
from zeroplug.observe.memory import host_rss_bytes
from zeroplug.plugins.workload.models import GPT, get_preset

MiB = 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--sample", type=int, default=20, help="sample every N steps")
    p.add_argument("--warmup", type=int, default=200, help="steps left out of the slopes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="char-tiny")
    p.add_argument("--dir", help="checkpoint directory (default: a temporary one, removed at the end)")
    p.add_argument("--json", help="also write the samples and the summary here")
    p.add_argument("--check", action="store_true", help="exit 1 when something grows")
    args = p.parse_args(argv)

    ck = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zeroplug-soak-"))
    config = {"zero": {"plugin": "stage3"},
              "precision": {"plugin": "bf16" if args.device == "cuda" else "fp32"},
              "optimizer": {"plugin": "cpu_adam", "lr": 3e-4},
              "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}},
              "batch": {"micro_batch_size": 8, "steps_per_print": 10**9},
              "checkpoint": {"keep_last": args.keep_last},
              "monitor": {"plugin": "none"}}
    torch.manual_seed(0)
    mcfg = get_preset(args.model)
    engine = zeroplug.initialize(GPT(mcfg), config, device=args.device)
    data = ByteBatches(stdlib_corpus(max_bytes=2_000_000), 8, mcfg.seq_len, device=args.device)
    samples = []
    t0 = time.perf_counter()
    ckpt_size = 0
    for step in range(1, args.steps + 1):
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()
        if step % args.every == 0:
            path = engine.save_checkpoint(ck, client_state={"step": step, "data": data.state_dict()})
            ckpt_size = max(ckpt_size, tree_bytes(Path(path)))
        if step % args.sample == 0:
            if args.device == "cuda":
                torch.cuda.synchronize()
            samples.append({"step": step, "rss": host_rss_bytes(), "fds": open_fds(),
                            "threads": threading.active_count(), "disk": tree_bytes(ck),
                            "seconds": time.perf_counter() - t0})
            if step % (args.sample * 25) == 0:
                s = samples[-1]
                print(f"step {step}: rss {s['rss'] / MiB:.1f} MiB, fds {s['fds']}, threads {s['threads']}, "
                      f"disk {s['disk'] / MiB:.1f} MiB, {s['seconds']:.0f}s", flush=True)
    engine.close()

    late = [s for s in samples if s["step"] > args.warmup]
    xs = [s["step"] for s in late]
    summary = {
        "steps": args.steps, "device": args.device, "model": args.model,
        "rss_slope_mib_per_1000_steps": slope(xs, [s["rss"] / MiB for s in late]) * 1000,
        "fds_slope_per_1000_steps": slope(xs, [s["fds"] for s in late]) * 1000,
        "threads_slope_per_1000_steps": slope(xs, [s["threads"] for s in late]) * 1000,
        "rss_mib_after_warmup": [late[0]["rss"] / MiB, late[-1]["rss"] / MiB] if late else None,
        "fds_after_warmup": [late[0]["fds"], late[-1]["fds"]] if late else None,
        "disk_max_mib": max(s["disk"] for s in samples) / MiB,
        "disk_bound_mib": (args.keep_last + 1) * ckpt_size / MiB,
        "checkpoint_mib": ckpt_size / MiB,
        "checkpoints_left": sorted(d.name for d in ck.iterdir() if d.is_dir()),
        "seconds": samples[-1]["seconds"] if samples else 0.0,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    if not args.dir:
        shutil.rmtree(ck, ignore_errors=True)
    ok = (summary["rss_slope_mib_per_1000_steps"] <= 2.0 and summary["fds_slope_per_1000_steps"] <= 1.0
          and summary["disk_max_mib"] <= summary["disk_bound_mib"] * 1.01
          and len(summary["checkpoints_left"]) <= args.keep_last)
    if args.check and not ok:
        print("soak: something grows (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
