"""cpu_adam's offloaded update with Adam's moments in fp32, bf16 and int8 (optimizer.state_dtype):
Mparams/s of the one-pass update the cpu tier calls (bf16 gradient in, grad_scale, bf16 copy
out) on one flat sub-group, each form timed interleaved with the others.

    python3 tests/benchmarks/state_dtype_step.py [--n 100000000] [--repeats 5] [--impl auto]
        [--fp32-impls native,compile] [--bf16-impls native,compile] [--int8-impls native,compile]
        [--cold-build]

Bytes per element moved: fp32 states 28 (read p, bf16 g, m, v; write p, m, v, bf16 lp),
bf16 states 20, int8 states 16 + the absmax (the compiled int8 kernel reads the codes and the
gradient twice: 20). Prints one row per form: Mparams/s, the time per step and the ratio
to the first fp32 row; fp32 once per implementation of --fp32-impls (default: --impl; native:
the fused C kernel, which fp32 states take only with impl="native"), bf16 and int8 once per
implementation of --bf16-impls / --int8-impls
(native: the fused C kernel that ``auto`` takes; native-scalar, int8 only: the same kernel
built with scalar table loads instead of AVX-512 gathers, called directly; compile: the
torch.compile'd kernel (two passes for int8); eager), side by side in one run. The first call of each form builds its kernel (excluded).

``--cold-build`` first times, each in a fresh Python process with empty zeroplug and inductor
caches (temporary directories), what a fresh machine builds before its steps run at full speed:
the native kernel's build, load and self-check (one library for every variant and thread
count), and the compiled fp32 kernel's build and probe for the offload update's variant
(AdamW, bf16 gradient, bf16 copy) at this run's thread count and one fewer (the counts
cpu_adam's warm-up builds: the serial and the overlapped step's).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam import native as cpu_adam_native
from zeroplug.plugins.optim.cpu_adam.kernels import compile_status, scalars
from zeroplug.quantized_states import empty_state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000_000, help="elements of the sub-group (default 1e8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", default="auto", choices=["auto", "compile", "eager", "native"],
                    help="the fp32 states' implementation (when --fp32-impls is not given)")
    ap.add_argument("--fp32-impls", default=None,
                    help="comma-separated fp32 implementations to time (native, compile, eager, auto)")
    ap.add_argument("--cold-build", action="store_true",
                    help="first time the native and the compiled fp32 kernels' builds from empty caches")
    ap.add_argument("--bf16-impls", default="native,compile",
                    help="comma-separated bf16 implementations to time (native, compile, eager, auto)")
    ap.add_argument("--int8-impls", default="native,compile",
                    help="comma-separated int8 implementations to time (native, native-scalar, compile, eager, auto)")
    a = ap.parse_args()
    if a.cold_build:
        for what, secs in cold_builds(torch.get_num_threads()).items():
            print(f"cold build, {what}: {secs:.1f} s")
    n = a.n
    g = torch.randn(n).bfloat16()
    lp = torch.empty(n, dtype=torch.bfloat16)
    runs = {}
    fp32 = [impl for impl in (a.fp32_impls or a.impl).split(",") if impl]
    forms = [(f"fp32 ({impl})", "fp32", impl) for impl in fp32]
    forms += [(f"bf16 ({impl})", "bf16", impl) for impl in a.bf16_impls.split(",") if impl]
    forms += [(f"int8 ({impl})", "int8", impl) for impl in a.int8_impls.split(",") if impl]
    for form, state_dtype, impl in forms:
        p = torch.randn(n)
        if impl == "native-scalar":
            runs[form] = _scalar_lookups(p, g, lp)
            continue
        opt = CPUAdam([p], lr=1e-4, weight_decay=0.1, impl=impl, state_dtype=state_dtype)
        opt.init_group_states(0)
        runs[form] = functools.partial(opt.step_param, p, grad=g, lp_out=lp, grad_multiplier=0.5)
    for step in runs.values():
        step()                              # builds / compiles / loads the kernel
    times = {form: [] for form in runs}
    for _ in range(a.repeats):
        for form, step in runs.items():
            t = time.perf_counter()
            step()
            times[form].append(time.perf_counter() - t)
    print(f"cpu_adam offload update, {n:,} elements, {torch.get_num_threads()} threads, median of {a.repeats}")
    print(f"| state_dtype | Mparams/s | ms per step | vs {next(iter(times))} | host bytes per element (states) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(next(iter(times.values())))
    for form, ts in times.items():
        med = statistics.median(ts)
        state = {"fp32": 8, "bf16": 4, "int8": 2 + 8 / 256}[form.split()[0]]
        print(f"| {form} | {n / med / 1e6:,.0f} | {1e3 * med:.1f} | {base / med:.2f}x | {state:.2f} |")
    print("compiled variants:", compile_status())
    return 0


# Each runs in a fresh interpreter with empty caches; prints the seconds the build took.
_NATIVE_COLD = """
import time, torch
from zeroplug.plugins.optim.cpu_adam import native as cpu_adam_native
t = time.perf_counter()
cpu_adam_native.LOADER.get(strict=True)         # build, load, self-check
print(time.perf_counter() - t)
"""
_COMPILED_COLD = """
import sys, time, torch
from zeroplug.plugins.optim.cpu_adam import kernels as cpu_adam_kernels
t = time.perf_counter()
for threads in sorted({int(sys.argv[1]), max(1, int(sys.argv[1]) - 1)}, reverse=True):
    cpu_adam_kernels.COMPILED.get((True, torch.bfloat16, torch.bfloat16), strict=True, threads=threads)
print(time.perf_counter() - t)
"""


def cold_builds(threads: int) -> dict:
    """Seconds to a usable kernel from empty caches: the native one, the compiled fp32 one."""
    out = {}
    counts = f"{threads} and {threads - 1} threads" if threads > 1 else "1 thread"
    for what, code in (("native kernel (build, load, self-check)", _NATIVE_COLD),
                       (f"compiled fp32 kernel (AdamW, bf16 grad, bf16 copy; {counts}: build, probe)",
                        _COMPILED_COLD)):
        with tempfile.TemporaryDirectory(prefix="zeroplug-cold-") as d:
            env = dict(os.environ, ZEROPLUG_CACHE_DIR=os.path.join(d, "zeroplug"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"))
            r = subprocess.run([sys.executable, "-c", code, str(threads)], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"cold build of the {what} failed: {r.stderr[-2000:]}")
            out[what] = float(r.stdout.strip().splitlines()[-1])
    return out


def _scalar_lookups(p, g, lp):
    """The native kernel built with scalar table loads, called as cpu_adam calls it."""
    nat = cpu_adam_native.Native(cpu_adam_native.build(("-DZP_GATHER=0",)))
    cpu_adam_native.self_check(nat)
    st = [*empty_state(p.numel(), torch.int8), *empty_state(p.numel(), torch.uint8)]
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, adamw=True)
    calls = [0]

    def step():
        calls[0] += 1
        nat.step(p, g, st, lp, scalars(hp, float(calls[0]), True, 0.5), True, torch.get_num_threads())
    return step


if __name__ == "__main__":
    raise SystemExit(main())
