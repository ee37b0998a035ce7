#!/usr/bin/env python
"""Does the kind of host memory change cpu_adam's speed (in training, against alone)?

    python -m tests.benchmarks.cpu_adam_memory --n 5e8 --piece 5.03e7 --sub-group 1e8

Steps the same sub-grouped shard (the 1.3B offload run's layout: unit pieces of
``--piece`` elements, sub-groups of ``--sub-group``, bf16 copy written into the pieces)
with its buffers allocated in different ways, all in one run:

  plain       torch.empty (malloc; 4 KiB pages unless THP is "always")
  registered  torch.empty + cudaHostRegister (what the cpu tier does for pinning)
  thp         anonymous mmap + madvise(MADV_HUGEPAGE) (2 MiB pages)
  thp+reg     thp, then cudaHostRegister

each with an fp32 and a bf16 gradient. Prints Mparams/s (median of --repeats steps).
"""
from __future__ import annotations

import argparse
import gc
import mmap
import statistics
import time
from pathlib import Path

import torch

from tests.benchmarks.cpu_adam_table import load_cpu_adam

_KEEP: list = []      # mmaps backing thp tensors


def alloc(n: int, dtype, kind: str) -> torch.Tensor:
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if kind.startswith("thp"):
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        _KEEP.append(mm)
        t = torch.frombuffer(mm, dtype=dtype, count=n)
    else:
        t = torch.empty(n, dtype=dtype)
    t.zero_()
    if kind.endswith("reg") and torch.cuda.is_available():
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0:       # it can fail for mmap-ed memory (thp+reg)
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed: {err}")
    return t


def run(cpu_adam, n, piece, sub_group, kind, gdt, repeats):
    master = alloc(n, torch.float32, kind)
    master.normal_()
    grad = alloc(n, gdt, kind)
    grad.normal_()
    lp = alloc(n, torch.bfloat16, kind)
    groups, off = [], 0
    while off < n:
        b = min(n, off + sub_group)
        groups.append((master[off:b], grad[off:b], [lp[x:min(b, x + piece)] for x in range(off, b, piece)]))
        off = b
    opt = cpu_adam.CPUAdam([t for t, _, _ in groups], lr=1e-4, weight_decay=0.01)
    for t, _, _ in groups:      # states in the same kind of memory
        st = opt.state[t]
        st["step"] = torch.tensor(0.0)
        st["exp_avg"] = alloc(t.numel(), torch.float32, kind) if kind != "plain" else torch.zeros_like(t)
        st["exp_avg_sq"] = alloc(t.numel(), torch.float32, kind) if kind != "plain" else torch.zeros_like(t)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for t, g, pieces in groups:
            opt.step_param(t, grad=g, lp_out=pieces, grad_multiplier=0.5)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    print(f"{kind:>10}  grad={str(gdt).split('.')[1]:>8}  {n / med / 1e6:8.0f} Mparams/s  "
          f"({med:.3f} s per step of {n / 1e6:.0f}M)", flush=True)
    if kind.endswith("reg") and torch.cuda.is_available():
        for t in (master, grad, lp):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    del opt, groups, master, grad, lp
    _KEEP.clear()
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=float, default=5e8)
    p.add_argument("--piece", type=float, default=5.03e7)
    p.add_argument("--sub-group", type=float, default=1e8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="plain,registered,thp,thp+reg")
    a = p.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"threads={torch.get_num_threads()} thp={thp.read_text().strip() if thp.exists() else '?'} "
          f"torch={torch.__version__}", flush=True)
    cpu_adam = load_cpu_adam()
    for kind in a.kinds.split(","):
        for gdt in (torch.float32, torch.bfloat16):
            try:
                run(cpu_adam, int(a.n), int(a.piece), int(a.sub_group), kind, gdt, a.repeats)
            except RuntimeError as e:
                print(f"{kind:>10}  grad={str(gdt).split('.')[1]:>8}  skipped: {e}", flush=True)
                _KEEP.clear()
                gc.collect()


if __name__ == "__main__":
    main()
