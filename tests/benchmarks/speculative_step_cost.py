"""What the speculative step (``[offload.optimizer] speculative_step``) costs on the CPU.

One sub-group stepped by cpu_adam the way the cpu tier steps it (``step_group`` with the
model-dtype copy written in the same pass), three ways:

    plain        the ordinary step
    speculative  the copy of master + Adam's moments (speculative.Backup.save), then the step:
                 what a sub-group stepped during the backward costs
    rollback     the restore from that copy, then the step again: what a clipped or
                 overflowed speculation adds at the step

Prints a table: median milliseconds per call, Gelements/s and the ratio to plain, and the
host memory the copy holds per element. The step is bound by host memory bandwidth, so
the ratios are the ratios of bytes moved (about 28 bytes per element for plain with a
bf16 gradient; the copy reads and writes 12 more each). Run from the repo root:

    python3 tests/benchmarks/speculative_step_cost.py [--numel 16000000] [--repeat 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroplug.flat import set_grad
from zeroplug.plugins.offload_cpu.speculative import Backup
from zeroplug.plugins.optim.cpu_adam import CPUAdam


def timed(fn, repeat: int) -> float:
    fn()                                     # warm-up (compiles the kernel variant once)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=16_000_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--grad-dtype", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()
    n = args.numel
    gdt = torch.bfloat16 if args.grad_dtype == "bf16" else torch.float32
    master = torch.randn(n)
    set_grad(master, (torch.randn(n) * 1e-3).to(gdt))
    opt = CPUAdam([{"params": [master]}], lr=1e-3, weight_decay=0.01)
    opt.init_group_states(0)
    lp = torch.empty(n, dtype=torch.bfloat16)
    backup = Backup()
    state = opt.state[master]

    def plain():
        opt.step_group(0, lp_out=lp, grad_multiplier=1.0)

    def speculative():
        backup.save(master, state)
        opt.step_group(0, lp_out=lp, grad_multiplier=1.0)

    def rollback():
        backup.restore(master, state)
        opt.step_group(0, lp_out=lp, grad_multiplier=0.5)

    rows = [(name, timed(fn, args.repeat)) for name, fn in
            (("plain", plain), ("speculative", speculative), ("rollback", rollback))]
    base = rows[0][1]
    print(f"cpu_adam step_group, {n:,} elements, {args.grad_dtype} gradient, bf16 copy written in the pass, "
          f"{torch.get_num_threads()} threads ({opt.implementation(gdt, torch.bfloat16, n, 0.5)} kernel)")
    print(f"{'variant':<12} {'ms':>9} {'Gelem/s':>9} {'x plain':>8}")
    for name, t in rows:
        print(f"{name:<12} {t * 1e3:9.1f} {n / t / 1e9:9.2f} {t / base:8.2f}")
    print(f"host memory of the copy: {backup.nbytes() / n:.0f} bytes per element (master 4 + exp_avg 4 + "
          f"exp_avg_sq 4; the step counter is a scalar)")


if __name__ == "__main__":
    main()
