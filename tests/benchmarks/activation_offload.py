"""Activation offload on the reference workload: step time and device memory with the
checkpointed blocks' inputs in pinned host memory ([activation_checkpointing] plugin = "cpu")
against keeping them on the GPU ("none").

    python3 tests/benchmarks/activation_offload.py                  # 1.3B, micro batch 8, seq 1024
    python3 tests/benchmarks/activation_offload.py --model 2.7B --offload cpu --micro-batch 16

WORKLOAD.md's method: bf16, AdamW (lr 1e-4), clipping 1.0, non-reentrant checkpointing of
every block, random tokens; each row a fresh process, rows interleaved (none, cpu, none, cpu,
...), 2 warm-up steps then ``--steps`` timed ones (synchronised). Per row: median / min / max
step, ``max_memory_allocated`` over the timed steps, the bytes allocated at the end of the
forward above those before it (what the forward leaves for the backward), the bytes offloaded
per step and how they came back (kept on the device / fetched at their use / fetched ahead).
Last lines: each mode's median over its rows and the ratios; the target is a step at most
1.10x the on-GPU one (``--check`` exits 1 past it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1024 ** 3


def row(args) -> dict:
    import torch

    import zeroplug
    from zeroplug.plugins.workload.models import GPT, get_preset

    cuda = torch.cuda.is_available()       # else a smoke run on the CPU (no memory figures)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def allocated():
        return torch.cuda.memory_allocated(dev) if cuda else 0
    cfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(cfg)
    config = {"batch": {"micro_batch_size": args.micro_batch, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6},
              "zero": {"plugin": args.zero}, "precision": {"plugin": "bf16" if cuda else "fp32"},
              "optimizer": {"plugin": "auto", "lr": 1e-4}, "monitor": {"plugin": "none"},
              "activation_checkpointing": {"plugin": args.row}}
    if args.row == "cpu":
        config["activation_checkpointing"].update(buffer_count=args.buffer_count,
                                                  min_offload_bytes=args.min_offload_bytes)
    if args.offload != "none":
        config["offload"] = {"optimizer": {"plugin": args.offload}}
        config["zero"].update(reduce_bucket_size=100_000_000, sub_group_size=100_000_000)
    engine = zeroplug.initialize(model, config, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    times, after_forward = [], []
    for i in range(2 + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), device=dev, generator=g)
        if i == 2:
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            stats0 = dict(getattr(engine.activations, "stats", {}))
        sync()
        t0 = time.perf_counter()
        before = allocated()
        loss = engine(x[:, :-1], x[:, 1:])
        held = allocated() - before     # no sync: what the allocator has handed out
        engine.backward(loss)
        engine.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            after_forward.append(held)
    stats = {k: (v - stats0.get(k, 0)) / args.steps for k, v in getattr(engine.activations, "stats", {}).items()}
    out = {"mode": args.row, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
           "peak_gpu": torch.cuda.max_memory_allocated(dev) if cuda else 0, "after_forward": statistics.median(after_forward),
           "loss": float(loss), "per_step": stats, "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--zero", default="stage0", help="the ZeRO stage (default stage0: one GPU)")
    ap.add_argument("--offload", default="none", choices=["none", "cpu"], help="optimizer offload")
    ap.add_argument("--buffer-count", type=int, default=2, help="the cpu store's buffer_count")
    ap.add_argument("--min-offload-bytes", type=int, default=1 << 20, help="the cpu store's min_offload_bytes")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    ap.add_argument("--rounds", type=int, default=2, help="rows per mode, interleaved (default 2)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the cpu step is over 1.10x")
    ap.add_argument("--row", choices=["none", "cpu"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row:
        print("ROW " + json.dumps(row(args)), flush=True)
        return 0
    rows = []
    for _ in range(args.rounds):
        for mode in ("none", "cpu"):
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--row", mode]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")), None)
            if p.returncode or line is None:
                print(f"{mode}: failed (exit {p.returncode})\n{p.stderr[-3000:]}", file=sys.stderr)
                return 2
            r = json.loads(line[4:])
            rows.append(r)
            s = r["per_step"]
            moved = (f"  offloaded {s['offloaded_bytes'] / GiB:.2f} GiB/step in {s['offloaded']:.0f} tensors "
                     f"(kept {s['kept']:.0f}, fetched {s['fetched']:.0f}, ahead {s['prefetched']:.0f})" if s else "")
            print(f"{mode:>4}: step median {r['median_s'] * 1e3:.1f} ms (min {r['min_s'] * 1e3:.1f}, max "
                  f"{r['max_s'] * 1e3:.1f}); peak GPU {r['peak_gpu'] / GiB:.2f} GiB; forward leaves "
                  f"{r['after_forward'] / GiB:.2f} GiB; loss {r['loss']:.4f}{moved}", flush=True)
    print(f"device: {rows[0]['device']}; {args.model}, micro batch {args.micro_batch} x {args.seq}, {args.zero}, "
          f"optimizer offload {args.offload}, buffer_count {args.buffer_count}")
    med = {m: statistics.median(r["median_s"] for r in rows if r["mode"] == m) for m in ("none", "cpu")}
    peak = {m: statistics.median(r["peak_gpu"] for r in rows if r["mode"] == m) for m in ("none", "cpu")}
    fwd = {m: statistics.median(r["after_forward"] for r in rows if r["mode"] == m) for m in ("none", "cpu")}
    ratio = med["cpu"] / med["none"]
    print(f"step: cpu {med['cpu'] * 1e3:.1f} ms / none {med['none'] * 1e3:.1f} ms = {ratio:.3f}x (target <= 1.10)")
    print(f"peak GPU: cpu {peak['cpu'] / GiB:.2f} GiB, none {peak['none'] / GiB:.2f} GiB "
          f"({(peak['none'] - peak['cpu']) / GiB:+.2f} GiB less with cpu)")
    print(f"left by the forward: cpu {fwd['cpu'] / GiB:.2f} GiB, none {fwd['none'] / GiB:.2f} GiB "
          f"({(fwd['none'] - fwd['cpu']) / GiB:+.2f} GiB less with cpu)")
    return 1 if args.check and ratio > 1.10 else 0


if __name__ == "__main__":
    sys.exit(main())
