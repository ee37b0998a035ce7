#!/usr/bin/env python
"""Does a cpu_adam kernel call block other Python threads (the GIL), and what does releasing it cost?

    python -m tests.benchmarks.cpu_adam_gil --n 2e8

For inductor's default binding and the C++ wrapper (``cpp_wrapper``, which releases the
GIL): the median kernel time (calls interleaved) and, while a worker thread runs 10
calls, the longest stall of a main thread that only counts loop iterations (about one
kernel call when the GIL is held, microseconds when it is released).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from tests.benchmarks.cpu_adam_table import load_cpu_adam


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--n", type=float, default=2e8)
    a.add_argument("--repeats", type=int, default=9)
    args = a.parse_args()
    ca = load_cpu_adam()
    kernels = sys.modules[ca.__name__.rsplit(".", 1)[0] + ".kernels"]
    fn = kernels._KERNELS[(True, True)]
    variants = {"default": torch.compile(fn, dynamic=True, fullgraph=True),
                "cpp_wrapper": torch.compile(fn, dynamic=True, fullgraph=True, options={"cpp_wrapper": True})}
    n = int(args.n)
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    lp = torch.empty(n, dtype=torch.bfloat16)
    sc = kernels.scalars(dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, adamw=True),
                          1.0, True, 0.5)
    for f in variants.values():
        f(p, g, m, v, lp, sc)
    times = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, f in variants.items():
            t = time.perf_counter()
            f(p, g, m, v, lp, sc)
            times[k].append(time.perf_counter() - t)
    print(f"threads={torch.get_num_threads()} n={n / 1e6:.0f}M torch={torch.__version__}")
    for k, f in variants.items():
        worker = threading.Thread(target=lambda: [f(p, g, m, v, lp, sc) for _ in range(10)])
        last, stall = time.perf_counter(), 0.0
        worker.start()
        while worker.is_alive():
            now = time.perf_counter()
            stall, last = max(stall, now - last), now
            time.sleep(0)
        med = statistics.median(times[k])
        print(f"{k:>12}: {med * 1e3:7.1f} ms per call = {n / med / 1e6:6.0f} Mparams/s; "
              f"longest main-thread stall while a worker steps: {stall * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
