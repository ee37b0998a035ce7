"""pytest-benchmark: Mparams/s of cpu_adam against torch's AdamW (foreach, fused).

    pytest tests/benchmarks/test_bench_cpu_adam.py --benchmark-enable

N elements per tensor: 1M (``smallest``), 4M (``cpu``), 268M (``gpu``: a GPU
machine's CPU; ``ZEROPLUG_BENCH_N`` overrides). Each row's ``extra_info``: Mparams/s, peak host memory
and the ratio to torch's fused AdamW measured in the same run. The one-shot table with the
memory-bandwidth rooflines is ``python tests/benchmarks/cpu_adam_table.py``.
"""
from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from tests.benchmarks.bench_common import bench_size, record_ratio
from tests.benchmarks.cpu_adam_table import load_cpu_adam

from zeroplug.benchmarking.measure import peak_host_bytes, reset_peak_host

N = int(float(os.environ.get("ZEROPLUG_BENCH_N", 0))) or {"smallest": 1 << 20, "cpu": 4 << 20,
                                                          "gpu": 1 << 28}[bench_size()]
ROUNDS = 5 if N <= (1 << 24) else 3
ca = load_cpu_adam()


def _setup(kind: str):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, generator=gen))
    g = torch.randn(N, generator=gen) * 1e-2
    if kind in ("torch_foreach", "torch_fused"):
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, **{kind[len("torch_"):]: True})
        return opt.step, p
    opt = ca.CPUAdam([p], lr=1e-4, weight_decay=0.01)
    if kind == "cpu_adam":
        return (lambda: opt.step_param(p, g)), p
    # the full offload update: bf16 gradient in, bf16 model copy out, one pass
    g16 = g.to(torch.bfloat16)
    lp = torch.empty(N, dtype=torch.bfloat16)

    def fn():
        opt.step_param(p, g16, lp_out=lp)

    fn.lp = lp
    return fn, p


def _rate(kind: str) -> float:
    """Mparams/s of ``kind`` by a plain timing loop (the baseline, when its row was deselected)."""
    fn, _ = _setup(kind)
    fn()
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return N / statistics.median(times) / 1e6


@pytest.mark.parametrize("kind", ["torch_fused", "torch_foreach", "cpu_adam", "cpu_adam_offload"])
def test_adamw_step_throughput(benchmark, baselines, kind):
    reset_peak_host()
    fn, p = _setup(kind)
    fn()  # warm-up: state allocation and (cpu_adam) kernel compilation stay out of timing
    before = p.detach().clone()
    benchmark.extra_info["n"] = N
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=0, iterations=1)
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), before)
    if kind == "cpu_adam_offload":
        assert torch.equal(fn.lp, p.detach().to(torch.bfloat16))
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is None:          # --benchmark-disable: a correctness check only
        return
    rate = N / stats.median / 1e6
    if kind == "torch_fused":
        baselines[("cpu_adam", N)] = rate
    benchmark.extra_info["baseline"] = "torch_fused"
    benchmark.extra_info["peak_host_bytes"] = peak_host_bytes()
    record_ratio(benchmark, baselines, ("cpu_adam", N), "Mparams_per_s", rate, lambda: _rate("torch_fused"))
