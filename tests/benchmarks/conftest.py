"""Sizes and in-run baselines for the benchmark suites.

``ZEROPLUG_BENCH_SIZE`` picks the sizes: ``smallest`` (seconds: what CI runs), ``cpu`` (the
default without CUDA: a minute or two on a laptop), ``gpu`` (the default with CUDA: the
reference workload of shared/WORKLOAD.md and H100-class sizes). ``ZEROPLUG_BENCH_PATH`` is the
directory the swap and disk benchmarks write to (default: the system's temporary directory).

Under ``--benchmark-enable`` every benchmark runs with all of torch's CPU threads (the unit
tests' conftest pins one); under ``--benchmark-disable`` each runs once, as a quick test.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_common import bench_size  # noqa: E402

bench_size()     # a wrong ZEROPLUG_BENCH_SIZE stops the run at collection

_ALL_THREADS = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def _benchmark_threads(request):
    """All CPU threads while a benchmark is timed (restored after)."""
    opt = request.config.getoption
    enabled = not opt("benchmark_disable", False) or opt("benchmark_enable", False)
    before = torch.get_num_threads()
    if enabled:
        torch.set_num_threads(int(os.environ.get("ZEROPLUG_BENCH_THREADS", 0)) or _ALL_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def baselines() -> dict:
    """In-run baseline figures, by suite: the baseline's test stores its rate; the others
    divide by it (and measure it themselves when it was deselected)."""
    return {}
