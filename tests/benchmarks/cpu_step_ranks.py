"""How fast the host steps the optimizer when every local rank steps at once: cpu_adam's
throughput per rank alone and with all ranks together, beside the host's memory bandwidth
measured the same two ways. Names the ceiling of an offloaded step on a multi-GPU host.

    python3 tests/benchmarks/cpu_step_ranks.py --ranks 4 --n 3.25e8 --threads 11
    python3 tests/benchmarks/cpu_step_ranks.py --ranks 2 --n 2e6 --threads 1 --repeats 2   # smoke test

The host's cores (this process's affinity) are split into ``--ranks`` disjoint contiguous
sets, as the CPU plan splits them; each rank is a process bound to its set, with
``--threads`` optimizer threads. Each rank holds an fp32 shard of ``--n`` parameters in
sub-groups of ``--sub-group`` (the 1.3B workload on 4 ranks: 3.25e8), fp32 gradients (what
several ranks reduce in) and a bf16 copy written in the same pass, as the cpu tier steps.

1. ``alone``: one rank at a time steps its shard ``--repeats`` times (median).
2. ``together``: every rank at once, started by a barrier.

Per mode: each rank's G params/s, their sum, the bytes the steps move (30 per parameter:
read the fp32 gradient, master and two moments, write those three and the bf16 copy) over
the slowest rank's time, and the host's in-place bandwidth (``a.addcmul_(b, c)``: read
three, write one, no write-allocate) measured the same way (alone per rank, all together).
When the together step moves about what the together bandwidth allows, the ranks' steps
are bound by the host's memory, not by threads or by zeroplug.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

BYTES_PER_PARAM = 30          # read g, p, m, v (16); write p, m, v (12) + bf16 copy (2)
BYTES_PER_ADDCMUL = 16        # read a, b, c; write a


def core_sets(ranks: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    return [cpus[r * per:(r + 1) * per] or cpus[-1:] for r in range(ranks)]


def worker(rank: int, cpus: list[int], args, barrier, queue) -> None:
    os.sched_setaffinity(0, cpus)
    import torch
    torch.set_num_threads(args.threads)
    from zeroplug.plugins.optim.cpu_adam import CPUAdam

    n, sg = int(args.n), int(args.sub_group)
    sizes = [min(sg, n - i) for i in range(0, n, sg)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes]
    grads = [torch.randn(s) * 1e-3 for s in sizes]
    lps = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    opt = CPUAdam(params, lr=1e-4, weight_decay=0.01, threads=args.threads)
    opt.warm_up(opt.kernel_variants([torch.float32], torch.bfloat16))
    bw = [torch.rand(min(n, int(args.bw_n))) for _ in range(3)]

    def step() -> float:
        t0 = time.perf_counter()
        for p, g, lp in zip(params, grads, lps):
            opt.step_param(p, g, lp_out=lp)
        return time.perf_counter() - t0

    def addcmul() -> float:
        t0 = time.perf_counter()
        bw[0].addcmul_(bw[1], bw[2], value=1e-9)
        return time.perf_counter() - t0

    step()
    addcmul()                       # first touches and the kernel's first call
    out = {}
    for mode in ("alone", "together"):
        for what, fn in (("step", step), ("addcmul", addcmul)):
            times = []
            for _ in range(args.repeats):
                if mode == "together":
                    barrier.wait()
                else:                   # one rank at a time: each waits for its turn
                    for r in range(args.ranks):
                        barrier.wait()
                        if r == rank:
                            times.append(fn())
                    continue
                times.append(fn())
            out[f"{mode}_{what}"] = statistics.median(times)
    queue.put((rank, out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n", type=float, default=3.25e8, help="parameters per rank")
    ap.add_argument("--sub-group", type=float, default=1e8)
    ap.add_argument("--threads", type=int, default=0, help="optimizer threads per rank (0: cores per rank - 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bw-n", type=float, default=1e8, help="elements of each bandwidth tensor")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    sets = core_sets(args.ranks)
    if args.threads <= 0:
        args.threads = max(1, len(sets[0]) - 1)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, sets[r], args, barrier, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    n, bw_n = int(args.n), min(int(args.n), int(args.bw_n))
    rows = {}
    print(f"{args.ranks} ranks x {n:,} parameters, {args.threads} threads each, cores "
          + " ".join(f"{s[0]}-{s[-1]}" for s in sets))
    print("| mode | G params/s per rank (min-max) | sum G params/s | step GB/s (30 B/param) | in-place GB/s | step / in-place |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for mode in ("alone", "together"):
        rates = [n / results[r][f"{mode}_step"] / 1e9 for r in range(args.ranks)]
        bws = [bw_n * BYTES_PER_ADDCMUL / results[r][f"{mode}_addcmul"] / 1e9 for r in range(args.ranks)]
        if mode == "alone":     # one rank at a time: what the host gives each; the sum is what all would get
            step_gbs, bw = sum(rates) * BYTES_PER_PARAM, sum(bws)
        else:                   # all at once: the slowest rank's time bounds the step
            slowest = max(results[r]["together_step"] for r in range(args.ranks))
            step_gbs = args.ranks * n * BYTES_PER_PARAM / slowest / 1e9
            bw = args.ranks * bw_n * BYTES_PER_ADDCMUL / max(results[r]["together_addcmul"] for r in range(args.ranks)) / 1e9
        rows[mode] = {"per_rank": rates, "sum": sum(rates), "step_gbs": step_gbs, "inplace_gbs": bw}
        print(f"| {mode} | {statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f}) | {sum(rates):.2f} | "
              f"{step_gbs:.0f} | {bw:.0f} | {step_gbs / bw:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "n": n, "threads": args.threads, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
