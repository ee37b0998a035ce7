"""1.3B, stage 3, optimizer and parameters offloaded to the CPU: the exact step (the cpu
tier's defaults) against ``delayed_update`` on one GPU (shared/WORKLOAD.md's reference model).

  python3 tests/benchmarks/offload_speed.py speed [--steps 14] [--warmup 4]
  python3 tests/benchmarks/offload_speed.py curve [--steps 200] [--warmup 40]

``speed``: tokens/s (median of the synchronised step times after the delayed path started,
or after two steps for the exact one) and the engine's own phases of each step (forward,
backward, wait_gradients, optimizer, other; CUDA events, docs/benchmarks.md "Step
phases"), exact then delayed, in one process. ``curve``: the training loss of the same
``--steps`` batches (fixed seeds; real text: the Python standard library's sources,
byte-level ids) for both, and with ``--out DIR`` a CSV and a PNG. ``--out DIR`` (default:
``$OUT`` when set) also keeps each mode's raw result as JSON; without either the script only
prints. DeepSpeed 0.19.8 on this workload: 7.7k tokens/s (docs/benchmarks.md, not measured
here).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time

import torch

import zeroplug
from zeroplug.plugins.workload.models import GPT, get_preset, param_count

DEEPSPEED_TOKENS_PER_S = 7_700


def config(delayed: bool, warmup: int, mb: int, lr: float) -> dict:
    off = {"plugin": "cpu"}
    if delayed:
        off.update(delayed_update=True, delayed_update_warmup=warmup)
    return {"batch": {"micro_batch_size": mb, "gradient_clipping": 1.0, "steps_per_print": 1},
            "zero": {"plugin": "stage3", "reduce_bucket_size": 1e8, "sub_group_size": 1e8},
            "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "auto", "lr": lr},
            "offload": {"optimizer": off, "param": {"plugin": "cpu"}},
            "monitor": {"plugin": "none"}}


class Phases:
    """Collects the engine's phase_* metrics of every step (steps_per_print = 1)."""
    def __init__(self):
        self.rows: list[dict] = []

    @zeroplug.hookimpl
    def zeroplug_step_end(self, engine, metrics):
        if metrics.get("print"):
            self.rows.append({k: v for k, v in metrics.items() if k.startswith("phase_") or k in ("step", "loss")})


def batches(n: int, mb: int, seq: int, vocab: int, dev, text: bool):
    g = torch.Generator().manual_seed(1234)
    if text:
        from zeroplug.plugins.workload.data import stdlib_corpus
        ids = torch.frombuffer(bytearray(stdlib_corpus(max_bytes=64 << 20)),
                               dtype=torch.uint8).long()
    for _ in range(n):
        if text:
            at = torch.randint(0, ids.numel() - seq - 1, (mb,), generator=g)
            w = torch.stack([ids[a:a + seq + 1] for a in at.tolist()])
            yield w[:, :-1].to(dev), w[:, 1:].to(dev)
        else:
            x = torch.randint(0, vocab, (mb, seq + 1), generator=g)
            yield x[:, :-1].to(dev), x[:, 1:].to(dev)


def run(args, delayed: bool, text: bool) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = config(delayed, args.warmup, args.micro_batch, args.lr)
    mcfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    with zeroplug.init(cfg, device=dev):
        model = GPT(mcfg)
    engine = zeroplug.initialize(model, cfg, device=dev)
    phases = Phases()
    name = f"offload-speed-phases-{id(phases):x}"
    engine.plugin_manager.attach(phases, name)
    times, losses = [], []
    for x, y in batches(args.steps, args.micro_batch, args.seq, mcfg.vocab_size, dev, text):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tier = engine.offload_optimizer
    n_delayed = tier.delayed.steps if getattr(tier, "delayed", None) is not None else 0
    engine.plugin_manager.detach(name)
    engine.close()
    first = args.steps - n_delayed + 1 if delayed else 2       # steady delayed steps (their boundary waits)
    steady = times[first:] or times[-1:]
    med = statistics.median(steady)
    ph = [r for r in phases.rows[first:]]
    mean_ph = {k: round(statistics.mean(r.get(k, 0.0) for r in ph), 4) for k in (ph[0] if ph else {}) if k.startswith("phase_")}
    return {"mode": "delayed_update" if delayed else "exact", "params": param_count(mcfg), "step_s": med,
            "tokens_per_s": args.micro_batch * args.seq / med, "delayed_steps": n_delayed, "phases": mean_ph,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
            "times": times, "losses": losses}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["speed", "curve"])
    p.add_argument("--model", default="1.3B")
    p.add_argument("--steps", type=int, default=None, help="speed: 14; curve: 200")
    p.add_argument("--warmup", type=int, default=None, help="delayed_update_warmup (speed: 4; curve: 40)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--modes", default="exact,delayed")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="directory for the raw JSON (and the curve's CSV and PNG); default $OUT, else print only")
    args = p.parse_args()
    curve = args.what == "curve"
    args.steps = args.steps or (200 if curve else 14)
    args.warmup = args.warmup if args.warmup is not None else (40 if curve else 4)
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
    results = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        r = run(args, mode == "delayed", text=curve)
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"RESULT {args.what} {r['mode']:>14} {args.model} step={r['step_s']:.3f}s "
              f"tokens/s={r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / DEEPSPEED_TOKENS_PER_S:.2f}x DeepSpeed 7.7k) "
              f"delayed_steps={r['delayed_steps']} peakGPU={r['peak_gpu_gib']:.1f}GiB wall={r['wall_s']:.0f}s "
              f"last_loss={r['losses'][-1]:.4f}", flush=True)
        print("PHASES", r["mode"], json.dumps(r["phases"]), flush=True)
        if out:
            with open(os.path.join(out, f"{args.what}_{r['mode']}.json"), "w") as f:
                json.dump(r, f, indent=1)
    print("\n| mode | s/step | tokens/s | vs DeepSpeed 7.7k | " + " | ".join(
        k[6:] for k in results[0]["phases"]) + " |")
    for r in results:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / DEEPSPEED_TOKENS_PER_S:.2f}x | "
              + " | ".join(f"{v:.3f}" for v in r["phases"].values()) + " |")
    if curve:
        for r in results:
            tail = r["losses"][-20:]
            print(f"{r['mode']}: mean loss of the last 20 steps {statistics.mean(tail):.4f}")
    if curve and out:
        with open(os.path.join(out, "loss_curve.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step"] + [r["mode"] for r in results])
            for i in range(args.steps):
                w.writerow([i + 1] + [r["losses"][i] for r in results])
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(7, 4))
            for r in results:
                ax.plot(range(1, args.steps + 1), r["losses"], label=r["mode"], lw=1)
            ax.axvline(args.warmup, color="grey", ls=":", lw=1)
            ax.set(xlabel="step", ylabel="training loss", title=f"{args.model}, stage 3 + CPU offload")
            ax.legend()
            fig.savefig(os.path.join(out, "loss_curve.png"), dpi=120, bbox_inches="tight")
        except ImportError:
            print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
