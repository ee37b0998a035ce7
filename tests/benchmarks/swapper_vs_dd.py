"""The NVMe swapper against dd, on one disk, in one run.

    python tests/benchmarks/swapper_vs_dd.py --path /local_nvme --gib 4

1. ``dd if=/dev/zero of=F bs=64M count=N oflag=direct`` (write) and
   ``dd if=F of=/dev/null bs=64M iflag=direct`` (read): the disk's sequential speed
   with direct I/O (page cache dropped first where allowed: root only).
2. ``AsyncSwapper`` writing then reading the same number of bytes as tensors of
   ``--tensor-mib`` MiB of random data (not zeros), for a few (block_size, queue_depth,
   thread_count) settings; every read is checked against what was written.

Prints a table with GB/s (10^9 bytes/s, the best of --repeat runs) and the ratio to
dd, and the best setting.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper

MiB = 1 << 20
SETTINGS = [  # block_size, queue_depth, thread_count
    (1 * MiB, 8, 4),
    (1 * MiB, 32, 16),     # the defaults
    (8 * MiB, 8, 8),
    (32 * MiB, 8, 8),
]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_dd(path: str, count: int) -> tuple[float, float]:
    f = os.path.join(path, "dd.bin")
    nbytes = count * 64 * MiB
    try:
        drop_caches()
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct"],
                       check=True, capture_output=True)
        w = nbytes / (time.perf_counter() - t)
        drop_caches()
        t = time.perf_counter()
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True)
        r = nbytes / (time.perf_counter() - t)
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return w, r


def run_swapper(path: str, tensors: list[torch.Tensor], n: int, block: int, qd: int, threads: int,
                buffer_count: int, direct: bool) -> tuple[float, float, bool]:
    size = tensors[0].numel()
    outs = [torch.empty_like(tensors[0]) for _ in range(n)]   # checked after the clock stops
    with AsyncSwapper(path, buffer_count=buffer_count, buffer_size=size, element_size=1, block_size=block,
                      queue_depth=qd, thread_count=threads, direct=direct) as sw:
        drop_caches()
        t = time.perf_counter()
        for i in range(n):
            sw.write(i, tensors[i % len(tensors)])
        sw.wait_all()
        w = n * size / (time.perf_counter() - t)
        drop_caches()
        t = time.perf_counter()
        for i in range(n):
            sw.read(i, outs[i])
        sw.wait_all()
        r = n * size / (time.perf_counter() - t)
        ok = all(torch.equal(outs[i], tensors[i % len(tensors)]) for i in range(n))
        direct_used = sw.direct
    return w, r, ok and direct_used == direct


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=tempfile.gettempdir(), help="directory on the disk to test")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB written and read by each measurement")
    ap.add_argument("--tensor-mib", type=int, default=256, help="size of each tensor (MiB)")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--buffered", action="store_true", help="swapper without O_DIRECT (for comparison)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the best is shown")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="swapbench-", dir=args.path)
    try:
        total = int(args.gib * (1 << 30))
        tmib = max(1, min(args.tensor_mib, total // MiB))
        n = max(1, total // (tmib * MiB))
        count = max(1, total // (64 * MiB))
        print(f"path {args.path}; {n} tensors x {tmib} MiB = {n * tmib / 1024:.2f} GiB; dd {count} x 64 MiB; "
              f"drop_caches {'ok' if drop_caches() else 'not allowed'}; cuda {torch.cuda.is_available()}")
        dds = [run_dd(work, count) for _ in range(args.repeat)]
        dw, dr = max(d[0] for d in dds), max(d[1] for d in dds)
        # a few distinct random tensors, cycled (random bytes: nothing compressible)
        tensors = [torch.randint(-2**31, 2**31 - 1, (tmib * MiB // 4,), dtype=torch.int32).view(torch.uint8)
                   for _ in range(min(n, 3))]
        rows = [("dd bs=64M direct", dw, dr, True)]
        for block, qd, threads in SETTINGS:
            runs = [run_swapper(work, tensors, n, block, qd, threads, args.buffer_count, not args.buffered)
                    for _ in range(args.repeat)]
            w, r, ok = max(x[0] for x in runs), max(x[1] for x in runs), all(x[2] for x in runs)
            rows.append((f"swapper bs={block // MiB}M qd={qd} t={threads}", w, r, ok))
        print(f"{'':34} {'write GB/s':>10} {'vs dd':>6} {'read GB/s':>10} {'vs dd':>6}  check")
        for name, w, r, ok in rows:
            print(f"{name:34} {w / 1e9:>10.2f} {w / dw:>6.2f} {r / 1e9:>10.2f} {r / dr:>6.2f}  "
                  f"{'ok' if ok else 'MISMATCH'}")
        best = max(rows[1:], key=lambda x: x[1] + x[2])
        print(f"best: {best[0]} (write {best[1] / dw:.2f}x, read {best[2] / dr:.2f}x dd)")
        return 0 if all(r[3] for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
