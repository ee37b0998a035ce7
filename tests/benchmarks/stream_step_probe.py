"""Can the GPU step part of an offloaded optimizer while the CPU steps the rest?

Host-resident fp32 master, gradient and Adam moments (pinned), N elements each:
  cpu     : torch's fused AdamW on the CPU (memory bound, like cpu_adam)
  stream  : the states go H2D in chunks, torch's fused AdamW on the GPU, master / m / v
            (and a bf16 copy) come back D2H; the host only launches work
  both    : the two at once, on separate halves of the data (CPU in a thread: ATen's
            kernel releases the GIL)

  python tests/benchmarks/stream_step_probe.py --n 200000000
Prints seconds and ns per element for each; "both" near max(cpu, stream) means the
two lanes do not contend (for memory bandwidth or the GIL).
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def states(n: int, pin: bool):
    out = [torch.rand(n, dtype=torch.float32) for _ in range(4)]
    out.append(torch.zeros(n, dtype=torch.bfloat16))
    if pin:
        for t in out:
            torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return out


def cpu_step(s, threads: int) -> float:
    p, g, m, v, lp = s
    torch.set_num_threads(threads)
    step = torch.tensor(5.0)
    t0 = time.perf_counter()
    torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    lp.copy_(p)
    return time.perf_counter() - t0


class Streamer:
    def __init__(self, chunk: int, nbuf: int, dev):
        self.chunk, self.dev = chunk, dev
        self.bufs = [[torch.empty(chunk, dtype=torch.float32, device=dev) for _ in range(4)]
                     + [torch.empty(chunk, dtype=torch.bfloat16, device=dev)] for _ in range(nbuf)]
        self.free = [None] * nbuf
        self.h2d, self.d2h = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        self.step = torch.tensor(5.0, device=dev)

    def enqueue(self, s) -> torch.cuda.Event:
        p, g, m, v, lp = s
        n, i, last = p.numel(), 0, None
        for a in range(0, n, self.chunk):
            b = min(n, a + self.chunk)
            j = i % len(self.bufs)
            bp, bg, bm, bv, blp = (t[:b - a] for t in self.bufs[j])
            with torch.cuda.stream(self.h2d):
                if self.free[j] is not None:
                    self.h2d.wait_event(self.free[j])
                for d, h in ((bp, p), (bg, g), (bm, m), (bv, v)):
                    d.copy_(h[a:b], non_blocking=True)
                ev_in = self.h2d.record_event()
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(ev_in)
                torch._fused_adamw_([bp], [bg], [bm], [bv], [], [self.step], lr=1e-4, beta1=0.9,
                                    beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
                blp.copy_(bp)
                for d, h in ((p, bp), (m, bm), (v, bv), (lp, blp)):
                    d[a:b].copy_(h, non_blocking=True)
                self.free[j] = last = self.d2h.record_event()
            i += 1
        return last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000_000)
    ap.add_argument("--chunk", type=int, default=1 << 24)
    ap.add_argument("--nbuf", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    a, b = states(args.n, True), states(args.n, True)
    st = Streamer(args.chunk, args.nbuf, dev)
    res = {}
    for r in range(args.repeats + 1):
        t_cpu = cpu_step(a, args.threads)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st.enqueue(b).synchronize()
        t_stream = time.perf_counter() - t0
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("cpu", cpu_step(a, args.threads)))
        t0 = time.perf_counter()
        th.start()
        ev = st.enqueue(b)
        ev.synchronize()
        t_s_both = time.perf_counter() - t0
        th.join()
        t_both = time.perf_counter() - t0
        if r == 0:
            continue        # warm-up
        for k, v in (("cpu", t_cpu), ("stream", t_stream), ("both", t_both),
                     ("both:cpu", box["cpu"]), ("both:stream", t_s_both)):
            res.setdefault(k, []).append(v)
    print(f"n={args.n:,} chunk={args.chunk:,} nbuf={args.nbuf} threads={args.threads}")
    for k, v in res.items():
        m = sorted(v)[len(v) // 2]
        print(f"{k:12s} {m:.4f} s  {m / args.n * 1e9:.3f} ns/elem")


if __name__ == "__main__":
    main()
