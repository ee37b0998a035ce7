"""Offload on a multi-GPU host against DeepSpeed, one fresh ``torchrun`` per row.

  python3 tests/benchmarks/offload_hosts.py                      # every GPU of the host, 1.3B
  python3 tests/benchmarks/offload_hosts.py --budget-s 500       # skip rows that would not finish
  python3 tests/benchmarks/offload_hosts.py --prime               # first: fill a fresh machine's caches
  python3 tests/benchmarks/offload_hosts.py --gpus 2 --model char-tiny --seq 128 --steps 4   # CPU smoke test

Rows (DeepSpeed's JSON in tests/benchmarks/deepspeed_configs/, passed as-is): stage 3 + CPU
offload and stage 2 + optimizer offload on all N GPUs of the host, and stage 3 + CPU offload
on one GPU. Each row runs zeroplug, then DeepSpeed, then zeroplug again (``--again 0``: once; run-to-run
agreement), each as its own ``torchrun --standalone --nproc-per-node n
tests/benchmarks/deepspeed_json_bench.py --rows ROW``: zeroplug with torchrun's environment
unchanged (``OMP_NUM_THREADS=1``), DeepSpeed with ``OMP_NUM_THREADS`` = cores / ranks (what
its own launcher sets). Per run: ``--steps`` steps (default 10), the first two warm-up; the
median, min and max step after them, the spread max / min, tokens/s per GPU (micro batch x
sequence / median step, rank 0's) and the ratio to DeepSpeed's run of the same row in this
call. DeepSpeed rows print ``not installed`` where ``import deepspeed`` fails.

``--budget-s``: before each run the driver estimates its time (the last run of the same row
and engine, else ``--estimate-s``) and skips it when it would end past the budget; a run
is also killed at the budget. Prints a markdown table; JSON to $OUT/offload_hosts.json when
OUT is set. Without CUDA the rows run on the CPU (gloo), for a smoke test of the driver.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "deepspeed_json_bench.py")
ROOT = os.path.dirname(os.path.dirname(HERE))
WARMUP = 2


def gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def stats(times: list[float], tokens_per_step: int) -> dict:
    t = times[WARMUP:] if len(times) > WARMUP else times[-1:]
    med = statistics.median(t)
    return {"median_s": med, "min_s": min(t), "max_s": max(t), "spread": max(t) / min(t),
            "tokens_per_s_per_gpu": tokens_per_step / med, "timed_steps": len(t)}


def run_one(row: str, engine: str, ranks: int, args, deadline: float, steps: int = 0, extra=()) -> dict:
    """One fresh torchrun of ``deepspeed_json_bench.py`` for ``row`` on ``ranks`` ranks."""
    out = tempfile.mkdtemp(prefix="offload_hosts-")
    env = dict(os.environ, OUT=out, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)            # torchrun sets 1 for every rank (zeroplug's case)
    if engine == "deepspeed":
        env["OMP_NUM_THREADS"] = str(max(1, cores() // ranks))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", BENCH,
           "--rows", row, "--steps", str(steps or args.steps), "--model", args.model, "--seq", str(args.seq),
           "--engine", engine, *extra]
    t0 = time.time()
    res = {"row": row, "engine": engine, "gpus": ranks, "omp_num_threads": env.get("OMP_NUM_THREADS", "1 (torchrun)")}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        res.update(status="killed at the budget", wall_s=time.time() - t0, log_tail=text[-3000:])
        shutil.rmtree(out, ignore_errors=True)
        return res
    res["wall_s"] = time.time() - t0
    res["plan_lines"] = [ln.strip() for ln in text.splitlines() if "cpu plan:" in ln]
    try:
        with open(os.path.join(out, "deepspeed_json_bench.json")) as f:
            data = json.load(f)
        r = data["rows"][0]
        res.update(status="ok", device=data.get("gpu"), torch_threads=r.get("torch_threads"), times=r["times"],
                   init_s=r.get("init_s"), peak_gpu_gib=r.get("peak_gpu_gib"),
                   full_gc_passes_s=r.get("full_gc_passes_s"),
                   **stats(r["times"], r["tokens_per_s_per_gpu"] * r["steady_step_s"]))
    except (OSError, ValueError, KeyError, IndexError):
        res.update(status=f"failed (exit {proc.returncode})", log_tail=text[-3000:])
    shutil.rmtree(out, ignore_errors=True)
    return res


def plan_rows(args) -> list[tuple[str, int, str]]:
    """(row, ranks, engine) in run order: each row's zeroplug, DeepSpeed, zeroplug runs."""
    n = args.gpus
    rows = [("s3_offload", n), ("s2_offload", n)] + ([("s3_offload", 1)] if n > 1 else [])
    if args.rows:
        rows = [(r, n) for r in args.rows]
    out = []
    for row, ranks in rows:
        out += [(row, ranks, "zeroplug"), (row, ranks, "deepspeed")] + [(row, ranks, "zeroplug")] * (args.again > 0)
    return out


LABELS = {"s3_offload": "stage 3 + CPU offload", "s2_offload": "stage 2 + optimizer offload",
          "s3": "stage 3", "s2": "stage 2"}


def table(results: list[dict]) -> str:
    lines = ["| run | GPUs | engine | OMP_NUM_THREADS | tokens/s per GPU | median step s | min s | max s | "
             "spread max/min | vs DeepSpeed |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        ds = next((d for d in results if d["engine"] == "deepspeed" and d["row"] == r["row"]
                   and d["gpus"] == r["gpus"] and d.get("status") == "ok"), None)
        label = LABELS.get(r["row"], r["row"])
        if r.get("status") != "ok":
            lines.append(f"| {label} | {r['gpus']} | {r['engine']} | {r['omp_num_threads']} | {r.get('status')} "
                         f"| | | | | |")
            continue
        ratio = (f"{r['tokens_per_s_per_gpu'] / ds['tokens_per_s_per_gpu']:.2f}x" if ds is not None else "-")
        lines.append(f"| {label} | {r['gpus']} | {r['engine']} | {r['omp_num_threads']} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
                     f"{r['spread']:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="ranks of the N-GPU rows (default: every GPU; 2 on a CPU)")
    p.add_argument("--rows", nargs="*", default=None, help="only these rows (deepspeed_json_bench.py's names) at N")
    p.add_argument("--model", default="1.3B")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--again", type=int, default=1, choices=(0, 1),
                   help="1: each row's zeroplug run again after DeepSpeed's (run-to-run agreement); 0: once")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip runs that would end later than this")
    p.add_argument("--estimate-s", type=float, default=60.0, help="a run's expected time before one was timed")
    p.add_argument("--engines", default="zeroplug,deepspeed", help="comma list: which engines run")
    p.add_argument("--prime", action="store_true",
                   help="only fill this machine's caches, no table: one short zeroplug run per row (3 steps, "
                        "initialize waiting for cpu_adam's kernel build) measures and caches the CPU plan and "
                        "builds the kernel, so that the table's runs all find them (a machine's first run pays "
                        "for both)")
    args = p.parse_args()
    args.gpus = args.gpus or gpu_count() or 2
    if args.prime:
        start = time.time()
        seen = set()
        for row, ranks, _ in plan_rows(args):
            if (row, ranks) in seen:
                continue
            seen.add((row, ranks))
            r = run_one(row, "zeroplug", ranks, args, start + args.budget_s, steps=3,
                        extra=["--set", "optimizer.while_building=wait"])
            print(f"primed {row} on {ranks} ranks: {r.get('status')} in {r.get('wall_s', 0):.0f} s", flush=True)
            for line in r.get("plan_lines", [])[:8]:
                print("   " + line, flush=True)
            if r.get("status") != "ok":
                print(r.get("log_tail", ""), flush=True)
        return
    have_ds = importlib.util.find_spec("deepspeed") is not None
    engines = set(args.engines.split(","))
    start = time.time()
    deadline = start + args.budget_s
    results: list[dict] = []
    last: dict = {}
    for row, ranks, engine in plan_rows(args):
        base = {"row": row, "engine": engine, "gpus": ranks,
                "omp_num_threads": str(max(1, cores() // ranks)) if engine == "deepspeed" else "1 (torchrun)"}
        if engine not in engines:
            continue
        if engine == "deepspeed" and not have_ds:
            results.append({**base, "status": "not installed"})
            continue
        guess = last.get((row, ranks, engine), args.estimate_s)
        if time.time() + guess > deadline:
            results.append({**base, "status": f"skipped (about {guess:.0f} s left to run, budget spent)"})
            continue
        r = run_one(row, engine, ranks, args, deadline)
        last[(row, ranks, engine)] = r.get("wall_s", guess)
        results.append(r)
        summary = {k: v for k, v in r.items() if k not in ("times", "log_tail")}
        print("RUN " + json.dumps(summary), flush=True)
        if r.get("status") != "ok":
            print(r.get("log_tail", ""), flush=True)
        for line in r.get("plan_lines", [])[:8]:
            print("   " + line, flush=True)
    import torch
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{args.model}, {dev}, {cores()} cores, DeepSpeed's JSON as-is, {args.steps} steps (median after "
          f"{WARMUP} warm-up), total {time.time() - start:.0f} s")
    print(table(results))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "offload_hosts.json"), "w") as f:
            json.dump({"device": dev, "cores": cores(), "model": args.model, "steps": args.steps,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
