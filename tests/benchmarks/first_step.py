"""Where the first steps' time goes: synchronised phases of every step, and a sampling
profile of every Python thread during the first steps and a steady one.

    python3 tests/benchmarks/first_step.py --system s2_offload [--steps 5] [--model 1.3B]
    python3 tests/benchmarks/first_step.py --system torch        # plain PyTorch: CUDA's own warm-up

``--system``: ``torch`` (autocast bf16, fused AdamW), ``fsdp2``, a row of
``deepspeed_json_bench.py`` (``s2_offload``, ``s3_offload``, ``s3``: DeepSpeed's JSON as it
is), or ``stage2`` / ``stage3`` (bf16, AdamW on the GPU). The sampler reads every thread's
Python stack each ``--interval`` seconds (the main thread, the optimizer's worker, the
kernel warm-up, autograd's threads while they run Python hooks) and charges the wall time
since the previous sample to the innermost frames in zeroplug or torch; a thread inside a
C++ call shows as the Python frame that made it. torch.profiler is not used: one run of it
over the first step of an offloaded run ended in a segmentation fault.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

import torch

CONFIGS = Path(__file__).parent / "deepspeed_configs"
JSON_ROWS = {"s3_offload": "zero3_offload.json", "s2_offload": "zero2_offload.json", "s3": "zero3.json"}


def describe(frame, depth: int = 3) -> str:
    """The innermost ``depth`` frames in zeroplug or torch (else the innermost one)."""
    out, f = [], frame
    while f is not None and len(out) < depth:
        name = f.f_code.co_filename
        if "zeroplug" in name or "/torch/" in name or "/plugins/" in name or "/core/" in name \
                or "benchmarks" in name or "workload" in name:
            out.append(f"{'/'.join(name.split('/')[-2:])}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    if not out:
        c = frame.f_code
        out.append(f"{c.co_filename.split('/')[-1]}:{frame.f_lineno} {c.co_name}")
    return " <- ".join(out)


class Sampler(threading.Thread):
    """Charges wall time to (thread, stack) pairs while running."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="first-step-sampler")
        self.interval, self.halt = interval, threading.Event()
        self.time: collections.Counter = collections.Counter()

    def run(self) -> None:
        last = time.perf_counter()
        while not self.halt.is_set():
            time.sleep(self.interval)
            now = time.perf_counter()
            dt, last = now - last, now
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == self.ident:
                    continue
                self.time[(names.get(tid, f"thread-{tid % 10000}"), describe(frame))] += dt

    def report(self, title: str, top: int) -> None:
        self.halt.set()
        self.join()
        by_thread: dict[str, list] = collections.defaultdict(list)
        for (thread, stack), s in self.time.items():
            by_thread[thread].append((s, stack))
        print(f"--- {title}: wall time by thread and stack (s) ---")
        for thread, items in sorted(by_thread.items()):
            items.sort(reverse=True)
            if items[0][0] < 0.02:
                continue
            print(f"  [{thread}] {sum(s for s, _ in items):.2f} s sampled")
            for s, stack in items[:top]:
                if s >= 0.01:
                    print(f"    {s:6.2f}  {stack}")


def build(system: str, model_name: str, device, ds_set=(), overrides=()):
    from zeroplug.benchmarking.measure import make_runner
    from zeroplug.plugins.workload.models import GPT, get_preset
    mcfg = get_preset(model_name, activation_checkpointing=True)

    def model():
        torch.manual_seed(0)
        return GPT(mcfg)

    def batch(dev):
        x = torch.randint(0, mcfg.vocab_size, (8, 1025), device=dev)
        return x[:, :-1], x[:, 1:]

    if system in ("torch", "fsdp2", "fsdp2-no-reshard"):
        return make_runner(model, batch, system, device)
    if system in JSON_ROWS:
        config = json.loads((CONFIGS / JSON_ROWS[system]).read_text())
        for item in ds_set:         # KEY=VALUE, KEY dotted into the JSON, VALUE as JSON
            key, _, value = item.partition("=")
            *path, last = key.split(".")
            node = config
            for k in path:
                node = node.setdefault(k, {})
            node[last] = json.loads(value)
    else:
        config = {"zero": {"plugin": system}, "precision": {"plugin": "bf16"},
                  "optimizer": {"plugin": "adamw", "lr": 1e-4}, "scheduler": {"plugin": "none"},
                  "batch": {"micro_batch_size": 8, "gradient_clipping": 1.0}, "monitor": {"plugin": "none"}}
    if overrides:
        import zeroplug
        config = zeroplug.load_config(config, list(overrides))
    return make_runner(model, batch, config, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default="s2_offload")
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sample", default="1,2,last", help="steps to sample (1-based; 'last')")
    ap.add_argument("--interval", type=float, default=0.002)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE",
                    help="with a JSON row: set a DeepSpeed key (dotted), e.g. zero_optimization.sub_group_size=1e8")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a zeroplug override on top, e.g. offload.optimizer.overlap_step=false")
    ap.add_argument("--log", action="store_true", help="zeroplug's INFO lines (kernel warm-up, threads)")
    args = ap.parse_args()
    if args.log:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sample = {args.steps if s == "last" else int(s) for s in args.sample.split(",")}
    t0 = time.perf_counter()
    sampler = Sampler(args.interval)
    sampler.start()
    runner = build(args.system, args.model, device, args.ds, args.set)
    sampler.report(f"{args.system}: build + initialize", args.top)
    init_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    engine = getattr(runner, "engine", None)
    times = []
    for i in range(1, args.steps + 1):
        b = runner.batches()
        sampler = Sampler(args.interval) if i in sample else None
        if sampler:
            sampler.start()
        t = [time.perf_counter()]
        if engine is not None:
            loss = engine(*b[0])
            sync()
            t.append(time.perf_counter())
            engine.backward(loss)
            sync()
            t.append(time.perf_counter())
            engine.step()
            sync()
        else:
            runner.step(b)
            t.append(t[0])
            t.append(t[0])
        t.append(time.perf_counter())
        times.append(t[-1] - t[0])
        print(f"step {i}: {t[-1] - t[0]:.3f} s (forward {t[1] - t[0]:.3f}, backward {t[2] - t[1]:.3f}, "
              f"step {t[3] - t[2]:.3f})", flush=True)
        if sampler:
            sampler.report(f"{args.system}: step {i}", args.top)
    steady = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1]
    res = {"system": args.system, "ds": args.ds, "model": args.model, "init_s": init_s, "times": times,
           "tokens_per_s": 8 * 1024 / steady,
           "first_over_steady": times[0] / steady, "second_over_steady": times[1] / steady if len(times) > 1 else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print("RESULT " + json.dumps(res), flush=True)
    runner.close()


if __name__ == "__main__":
    main()
