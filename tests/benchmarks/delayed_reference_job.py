"""The built-in job (``zeroplug train`` defaults: char-tiny GPT, AdamW lr 2e-3, betas 0.9 / 0.95,
weight decay 0.1, warmup_cosine 30 / 300 linear, clipping 1.0, micro batch 16) in plain torch,
with a one-step delayed update after ``--warmup`` exact steps: the algorithm of the cpu tier's
``delayed_update`` without zeroplug (tests/offload/test_offload_delayed.py checks that zeroplug follows
it step for step). Prints the held-out loss at the end (docs/benchmarks.md, "Delayed parameter
update").

  python3 tests/benchmarks/delayed_reference_job.py --seq 64 --max-bytes 400000 [--warmup 40]
      [--variant predict]   (forward on p_t + (p_t - p_(t-1)) instead of p_t)
"""
import argparse
import math
import time

import torch

from zeroplug.plugins.workload.data import ByteBatches, stdlib_corpus
from zeroplug.plugins.workload.models import GPT, get_preset


def builtin_job(steps: int, seq: int, max_bytes, micro_batch: int, seed: int = 0):
    """The built-in job's parts: (lr_at(step), the model, its batches, held_out() loss)."""
    def lr_at(step, base=2e-3, w=30):
        if step < w:
            return base * step / w
        prog = min(1.0, (step - w + 1) / max(1, steps - w))
        return base * (1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * prog)))

    mcfg = get_preset("char-tiny")
    torch.manual_seed(seed)
    model = GPT(mcfg)
    data = ByteBatches(stdlib_corpus(max_bytes=max_bytes), micro_batch, min(seq, mcfg.seq_len),
                       seed=seed, rank=0, world_size=1, device="cpu")

    def held_out() -> float:
        model.eval()
        with torch.no_grad():
            x, y = data.eval_batch(64)
            loss = model(x, y).float().item()
        model.train()
        return loss

    return lr_at, model, data, held_out


def add_job_arguments(ap: argparse.ArgumentParser) -> None:
    """The built-in job's size and the delay's warm-up (shared with delayed_compensation_job.py)."""
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=None, help="exact steps before the delay (default: all exact)")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_job_arguments(ap)
    ap.add_argument("--variant", choices=["plain", "predict"], default="plain")
    a = ap.parse_args()
    warmup = a.steps if a.warmup is None else a.warmup

    lr_at, model, data, held_out = builtin_job(a.steps, a.seq, a.max_bytes, a.micro_batch)
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    before = [m.detach().clone() for m in masters]        # the masters before the last update
    opt = torch.optim.AdamW(masters, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def publish(extrapolate: bool = False) -> None:
        with torch.no_grad():
            for p, m, q in zip(model.parameters(), masters, before):
                p.copy_(2 * m - q if extrapolate else m)

    start, pending, t0 = held_out(), False, time.time()
    for t in range(a.steps):
        x, y = next(data)
        model(x, y).backward()
        if pending:                 # the boundary: the previous update reaches the module
            publish(a.variant == "predict")
        for p, m in zip(model.parameters(), masters):
            m.grad, p.grad = p.grad, None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        with torch.no_grad():
            for q, m in zip(before, masters):
                q.copy_(m)
        opt.step()
        pending = t >= warmup
        if not pending:
            publish()
    publish()
    print(f"warmup={warmup} variant={a.variant}: held-out loss start {start:.4f} -> end {held_out():.4f} "
          f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
