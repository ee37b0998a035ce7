"""pytest-benchmark: Mparams/s of cpu_adam vs torch.optim.AdamW (foreach / fused).

CPU-sized by default (N = 4M elements, a quick plain test under --benchmark-disable);
``ZEROPLUG_BENCH_N=268435456`` for the real size.  Run with
``pytest tests/benchmarks/test_bench_cpu_adam.py --benchmark-enable``; the one-shot table
with the roofline is ``python tests/benchmarks/cpu_adam_table.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

N = int(float(os.environ.get("ZEROPLUG_BENCH_N", 4 * 1024 * 1024)))


def _load():
    try:
        from zeroplug.plugins.optim import cpu_adam

        return cpu_adam
    except Exception:  # load the files as a bare package (optim/__init__.py is not run)
        pkg = types.ModuleType("_zeroplug_optim")
        pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "plugins" / "optim")]
        sys.modules[pkg.__name__] = pkg
        return importlib.import_module("_zeroplug_optim.cpu_adam")


ca = _load()


def _setup(kind: str):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, generator=gen))
    g = torch.randn(N, generator=gen) * 1e-2
    if kind == "torch_foreach":
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=True)
        return opt.step, p
    if kind == "torch_fused":
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
        return opt.step, p
    opt = ca.CPUAdam([p], lr=1e-4, weight_decay=0.01)
    if kind == "cpu_adam":
        return (lambda: opt.step_param(p, g)), p
    # full offload update: bf16 gradient in, bf16 model copy out, one pass
    g16 = g.to(torch.bfloat16)
    lp = torch.empty(N, dtype=torch.bfloat16)

    def fn():
        opt.step_param(p, g16, lp_out=lp)

    fn.lp = lp
    return fn, p


@pytest.mark.parametrize("kind", ["torch_foreach", "torch_fused", "cpu_adam", "cpu_adam_offload"])
def test_adamw_step_throughput(benchmark, kind):
    fn, p = _setup(kind)
    fn()  # warm-up: state allocation and (cpu_adam) kernel compilation stay out of timing
    before = p.detach().clone()
    benchmark.extra_info["n"] = N
    benchmark.pedantic(fn, rounds=5 if N <= (1 << 24) else 3, warmup_rounds=0, iterations=1)
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), before)
    if kind == "cpu_adam_offload":
        assert torch.equal(fn.lp, p.detach().to(torch.bfloat16))
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        benchmark.extra_info["Mparams_per_s"] = N / stats.stats.median / 1e6
