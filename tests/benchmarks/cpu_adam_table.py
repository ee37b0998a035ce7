#!/usr/bin/env python
"""CPU-Adam throughput table: torch's AdamW paths vs zeroplug's cpu_adam vs the roofline.

    python tests/benchmarks/cpu_adam_table.py --n 268435456 --repeats 5 [--json out.json]

Everything is measured in one run on one machine: the memory-bandwidth roofline (a large
``dst.copy_(src)`` with all threads, GB/s counting read + write, whose hidden write-allocate
read makes it a low ceiling; and in-place ``a.add_(b)`` / ``a.mul_(1)`` /
``a.addcmul_(b, c)``, the best of them, which have Adam's
read-modify-write pattern and no write-allocate traffic: the honest ceiling),
then each optimizer path: one warm-up call (compilation and state allocation excluded),
``--repeats`` timed calls, the median reported.

Bytes per element (what the roofline divides by):
  fp32 step        read p, g, m, v (16) + write p, m, v (12)               = 28 B
  offload update   read bf16 g (2) + p, m, v (12); write p, m, v (12) +
                   bf16 lp copy (2)                                         = 28 B
                   (+2 B of write-allocate for the lp copy unless the CPU
                   streams the stores: not counted)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch

BYTES_FP32_STEP = 28
BYTES_OFFLOAD = 2 + 12 + 12 + 2


def load_cpu_adam():
    try:
        from zeroplug.plugins.optim.cpu_adam import optimizer as cpu_adam  # type: ignore

        return cpu_adam
    except ImportError:  # load the files as a bare package (optim/__init__.py is not run)
        pkg = types.ModuleType("_zeroplug_optim")
        pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "plugins" / "optim" / "cpu_adam")]
        sys.modules[pkg.__name__] = pkg
        return importlib.import_module("_zeroplug_optim.optimizer")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def timed(fn, repeats: int) -> tuple[float, float]:
    """(seconds of the warm-up call, median seconds of ``repeats`` calls)."""
    t = time.perf_counter()
    fn()
    warm = time.perf_counter() - t
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return warm, statistics.median(ts)


def bandwidth(repeats: int, gib: float) -> dict:
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n)
    dst = torch.empty_like(src)
    dst.zero_()  # first touch outside the timing
    _, t_copy = timed(lambda: dst.copy_(src), repeats)
    _, t_add = timed(lambda: dst.add_(src), repeats)
    _, t_mul = timed(lambda: dst.mul_(1.0), repeats)
    third = torch.randn(n)
    _, t_fma = timed(lambda: dst.addcmul_(src, third, value=1e-12), repeats)
    del src, dst, third
    gc.collect()
    out = {
        "copy_GBps": 8 * n / t_copy / 1e9,  # read src + write dst (+ unseen write-allocate)
        "inplace_add_GBps": 12 * n / t_add / 1e9,  # read a, b + write a
        "inplace_mul_GBps": 8 * n / t_mul / 1e9,  # read a + write a
        "inplace_addcmul_GBps": 16 * n / t_fma / 1e9,  # read a, b, c + write a
    }
    # Adam updates p, m, v in place: no write-allocate traffic, like these three; more
    # streams can draw more bandwidth per core, so the best of them is the ceiling.
    out["inplace_GBps"] = max(
        out["inplace_add_GBps"], out["inplace_mul_GBps"], out["inplace_addcmul_GBps"]
    )
    return out


def make_torch_step(n: int, **kw):
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, **kw)
    return opt.step, (p, opt)


def make_torch_offload(n: int):
    """What torch offers for the offload update: convert, fused step, copy out."""
    p = torch.nn.Parameter(torch.randn(n))
    g16 = (torch.randn(n) * 1e-2).to(torch.bfloat16)
    lp = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)

    def fn():
        p.grad = g16.float()
        opt.step()
        lp.copy_(p.detach())

    return fn, (p, g16, lp, opt)


def make_cpu_adam(mod, n: int, impl: str, offload: bool):
    p = torch.nn.Parameter(torch.randn(n))
    if offload:
        g = (torch.randn(n) * 1e-2).to(torch.bfloat16)
        lp = torch.empty(n, dtype=torch.bfloat16)
    else:
        g = torch.randn(n) * 1e-2
        lp = None
    opt = mod.CPUAdam([p], lr=1e-4, weight_decay=0.01, impl=impl)
    return (lambda: opt.step_param(p, g, lp)), (p, g, lp, opt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=64 * 1024 * 1024, help="elements per tensor")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-gib", type=float, default=1.0, help="size of the copy roofline")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--json", type=str, default=None, help="also write results here")
    ap.add_argument("--skip-loop", action="store_true", help="skip the slow for-loop AdamW")
    ap.add_argument("--sequential", action="store_true",
                    help="time one path at a time (less memory: ~4 tensors of N live, "
                         "instead of ~8 paths x 4 tensors when interleaved)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = load_cpu_adam()
    n = args.n
    # interleaved: ~8 paths live at once, ~17 bytes per element each
    need = max(8 * 17 * n, int(args.copy_gib * 3 * (1 << 30)))
    avail = mem_available()
    if not args.sequential and avail and need > 0.7 * avail:
        print(f"note: interleaving needs ~{need / 2**30:.0f} GiB, {avail / 2**30:.0f} GiB "
              "available: timing one path at a time (--sequential)")
        args.sequential = True

    machine = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cxx": shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"),
        "loadavg_start": os.getloadavg(),
    }
    bw = bandwidth(args.repeats, args.copy_gib)

    cases = []
    if not args.skip_loop:
        cases.append(("torch AdamW for-loop", "fp32",
                      lambda: make_torch_step(n, foreach=False, fused=False)))
    cases += [
        ("torch AdamW foreach", "fp32", lambda: make_torch_step(n, foreach=True)),
        ("torch AdamW fused", "fp32", lambda: make_torch_step(n, fused=True)),
        ("cpu_adam fp32 step", "fp32", lambda: make_cpu_adam(mod, n, "auto", False)),
        ("cpu_adam fp32 step [compile]", "fp32", lambda: make_cpu_adam(mod, n, "compile", False)),
        ("torch fused offload (g.float, step, lp.copy_)", "offload", lambda: make_torch_offload(n)),
        ("cpu_adam offload (bf16 g -> bf16 lp)", "offload",
         lambda: make_cpu_adam(mod, n, "auto", True)),
        ("cpu_adam offload [eager]", "offload", lambda: make_cpu_adam(mod, n, "eager", True)),
    ]
    rows, live = [], []
    for name, kind, make in cases:
        row = {"name": name, "kind": kind}
        rows.append(row)
        try:
            fn, keep = make()
            t = time.perf_counter()
            fn()  # warm-up: state allocation, kernel compilation
            row["warmup_seconds"] = time.perf_counter() - t
            if name.startswith("cpu_adam"):
                row["path"] = keep[-1].implementation(
                    torch.bfloat16 if kind == "offload" else torch.float32,
                    torch.bfloat16 if kind == "offload" else None,
                    n,
                )
            if args.sequential:
                _, t = timed(fn, args.repeats)
                row["times"] = [t]
                del keep, fn
                gc.collect()
            else:
                live.append((row, fn, keep))
        except Exception as e:  # a path that cannot run here is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(limit=2)
    # Interleaved: every repeat times each path once, so drifting load or memory
    # placement hits all paths alike.
    for row, _, _ in live:
        row["times"] = []
    for _ in range(args.repeats):
        for row, fn, _ in live:
            t = time.perf_counter()
            fn()
            row["times"].append(time.perf_counter() - t)
    del live
    gc.collect()
    for row in rows:
        if "times" in row:
            t = statistics.median(row["times"])
            row.update(seconds=t, mparams_per_s=n / t / 1e6)

    roof = {
        "fp32": bw["copy_GBps"] * 1e9 / BYTES_FP32_STEP / 1e6,
        "offload": bw["copy_GBps"] * 1e9 / BYTES_OFFLOAD / 1e6,
    }
    roof_inplace = {
        "fp32": bw["inplace_GBps"] * 1e9 / BYTES_FP32_STEP / 1e6,
        "offload": bw["inplace_GBps"] * 1e9 / BYTES_OFFLOAD / 1e6,
    }
    by_name = {r["name"]: r for r in rows}
    fused = by_name.get("torch AdamW fused", {}).get("mparams_per_s")
    fused_off = by_name.get("torch fused offload (g.float, step, lp.copy_)", {}).get(
        "mparams_per_s")
    for r in rows:
        if "mparams_per_s" in r:
            r["vs_copy_roofline"] = r["mparams_per_s"] / roof[r["kind"]]
            r["vs_inplace_roofline"] = r["mparams_per_s"] / roof_inplace[r["kind"]]
            base = fused if r["kind"] == "fp32" else fused_off
            if base:
                r["vs_torch_fused"] = r["mparams_per_s"] / base
    machine["loadavg_end"] = os.getloadavg()
    status = mod.compile_status()

    # ---- print
    print(f"# CPU-Adam, N = {n:,} fp32 elements, median of {args.repeats}")
    print(f"machine: {machine['cpu']}; {machine['logical_cpus']} logical CPUs, "
          f"{machine['torch_threads']} torch threads; torch {machine['torch']}"
          f"{' (CUDA ' + machine['cuda'] + ')' if machine['cuda'] else ''}; "
          f"C++ compiler: {machine['cxx'] or 'none'}; "
          f"load avg {machine['loadavg_start'][0]:.2f} -> {machine['loadavg_end'][0]:.2f}")
    print(f"roofline: copy {bw['copy_GBps']:.1f} GB/s (r+w) -> {roof['fp32']:.0f} Mparams/s "
          f"at {BYTES_FP32_STEP} B/elem; in-place (max of a.add_(b) "
          f"{bw['inplace_add_GBps']:.1f}, a.mul_(1) {bw['inplace_mul_GBps']:.1f}, "
          f"a.addcmul_(b, c) {bw['inplace_addcmul_GBps']:.1f}) "
          f"{bw['inplace_GBps']:.1f} GB/s -> {roof_inplace['fp32']:.0f} Mparams/s")
    print()
    print("| path | kind | Mparams/s | vs torch fused | vs copy roofline "
          "| vs in-place roofline | impl |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        if "error" in r:
            err = r["error"].replace("|", "/").replace("\n", " ")[:120]
            print(f"| {r['name']} | {r['kind']} | error | | | | {err} |")
            continue
        vs = f"{r['vs_torch_fused']:.2f}x" if "vs_torch_fused" in r else ""
        impl = r.get("path", "")
        print(f"| {r['name']} | {r['kind']} | {r['mparams_per_s']:.0f} | {vs} | "
              f"{100 * r['vs_copy_roofline']:.0f}% | "
              f"{100 * r['vs_inplace_roofline']:.0f}% | {impl} |")
    print(f"| roofline: copy, {BYTES_FP32_STEP} B/elem | | {roof['fp32']:.0f} | | 100% | | |")
    print(f"| roofline: in-place, {BYTES_FP32_STEP} B/elem | | "
          f"{roof_inplace['fp32']:.0f} | | | 100% | |")
    print()
    print("(vs torch fused: fp32 rows against torch AdamW fused; offload rows against the "
          "torch fused offload composition)")
    if status["failed"]:
        print("compile failures (eager fallback used):")
        for k, e in status["failed"].items():
            print(f"  {k}: {e[:300]}")
    if args.json:
        out = {"n": n, "repeats": args.repeats, "machine": machine, "bandwidth": bw,
               "roofline_mparams_per_s": {"copy": roof, "inplace_add": roof_inplace},
               "rows": rows, "compile_status": status}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
