"""Host-device copy speed of this machine's GPU link: 100 MiB bf16 copies from pinned and from
pageable host memory, each direction alone and both directions at once (two streams).

    python3 tests/benchmarks/pcie_copy.py [--mib 100] [--repeats 10]

The ceiling for what stage 3 + CPU offload moves per step (parameters up, gradients down).
"""
from __future__ import annotations

import argparse
import time

import torch


def timed(fn, repeats: int) -> float:
    """Seconds per call of ``fn`` (one untimed call first), synchronised."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA device")
        return 2
    n = a.mib * 2**20 // 2
    nbytes = n * 2
    up, down = (torch.empty(n, dtype=torch.bfloat16).pin_memory() for _ in range(2))
    pageable = torch.empty(n, dtype=torch.bfloat16)
    dev_a, dev_b = (torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    s_up, s_down = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s_up):
            dev_a.copy_(up, non_blocking=True)
        with torch.cuda.stream(s_down):
            down.copy_(dev_b, non_blocking=True)

    rows = [("host to device, pinned", nbytes, lambda: dev_a.copy_(up, non_blocking=True), a.repeats),
            ("device to host, pinned", nbytes, lambda: down.copy_(dev_b, non_blocking=True), a.repeats),
            ("host to device, pageable", nbytes, lambda: dev_a.copy_(pageable), max(1, a.repeats // 3)),
            ("both directions at once, pinned", 2 * nbytes, both, a.repeats)]
    print(f"{torch.cuda.get_device_name()}, {a.mib} MiB bf16 per copy")
    print("| copy | GB/s |\n| --- | ---: |")
    for name, moved, fn, reps in rows:
        print(f"| {name} | {moved / timed(fn, reps) / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
