"""Convergence of cpu_adam's smaller optimizer states (optimizer.state_dtype) against fp32
states: the same training run with fp32, bf16 and int8 moments, the losses side by side.

    python3 tests/benchmarks/state_dtype_convergence.py cpu
        the built-in job (`zeroplug train`'s default workload: char-tiny on the stdlib corpus,
        300 steps) on the CPU, cpu_adam stepping the states; prints the held-out loss at the
        start and the end and the last training loss of each run.

    python3 tests/benchmarks/state_dtype_convergence.py gpu
        the 1.3B workload (shared/WORKLOAD.md: micro batch 8, sequence 1,024, bf16, AdamW lr
        1e-4, clipping 1.0, activation checkpointing) on one GPU with the optimizer offloaded
        to the CPU (stage 2), 200 steps of the stdlib corpus; prints the training loss every
        10 steps of the three runs side by side (the curves) and the held-out losses.

Each run is its own `python -m zeroplug.cli train` process with the same seed, so the runs
see the same batches in the same order; only the states' form differs. ``--out DIR`` keeps
each run's output there.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

DTYPES = ("fp32", "bf16", "int8")
STEP = re.compile(r"step=(\d+) loss=([0-9.]+)")
HELD = re.compile(r"held-out loss: start ([0-9.]+) -> end ([0-9.]+)")
LAST = re.compile(r"train loss: first step ([0-9.]+) -> last step ([0-9.]+)")


def command(mode: str, dtype: str) -> list[str]:
    base = [sys.executable, "-m", "zeroplug.cli", "train", "--no-save", "--seed", "0", f"--optimizer.state_dtype={dtype}"]
    if mode == "cpu":
        return base + ["--steps", "300", "--device", "cpu", "--optimizer.plugin=cpu_adam"]
    return base + ["--steps", "200", "--device", "cuda", "--model", "1.3B", "--seq", "1024",
                   "--activation-checkpointing", "--batch.micro_batch_size=8", "--batch.gradient_clipping=1.0", "--batch.steps_per_print=10",
                   "--precision.plugin=bf16", "--zero.plugin=stage2", "--offload.optimizer.plugin=cpu",
                   "--optimizer.plugin=auto", "--optimizer.lr=1e-4", "--scheduler.plugin=none"]


def run(mode: str, dtype: str, out: str | None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(command(mode, dtype), capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if out:
        with open(os.path.join(out, f"{mode}_{dtype}.log"), "w") as f:
            f.write(text)
    if proc.returncode != 0:
        raise SystemExit(f"{dtype}: exit {proc.returncode}\n{text[-3000:]}")
    held, last = HELD.search(text), LAST.search(text)
    return {"seconds": time.perf_counter() - t0, "held": (float(held[1]), float(held[2])),
            "last": float(last[2]), "curve": {int(s): float(v) for s, v in STEP.findall(text)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("cpu", "gpu"))
    ap.add_argument("--out", help="keep each run's output in this directory")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated (default fp32,bf16,int8)")
    a = ap.parse_args()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    dtypes = a.dtypes.split(",")
    res = {}
    for d in dtypes:
        res[d] = run(a.mode, d, a.out)
        print(f"{d}: done in {res[d]['seconds']:.0f} s", flush=True)
    ref = res.get("fp32")
    print("\n| state_dtype | held-out loss, start | held-out loss, end | vs fp32 | last training loss | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d in dtypes:
        r = res[d]
        rel = f"{100 * (r['held'][1] / ref['held'][1] - 1):+.2f}%" if ref else "-"
        print(f"| {d} | {r['held'][0]:.4f} | {r['held'][1]:.4f} | {rel} | {r['last']:.4f} | {r['seconds']:.0f} |")
    steps = sorted(set().union(*(r["curve"] for r in res.values())))
    if a.mode == "gpu" and steps:
        print("\ntraining loss (the curves)\n")
        print("| step | " + " | ".join(dtypes) + " |")
        print("| --- |" + " --- |" * len(dtypes))
        for s in steps:
            print(f"| {s} | " + " | ".join(f"{res[d]['curve'].get(s, float('nan')):.4f}" for d in dtypes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
