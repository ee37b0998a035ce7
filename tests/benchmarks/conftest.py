"""Sizes and in-run baselines for the benchmark suites.

``ZEROPLUG_BENCH_SIZE`` picks the sizes: ``smallest`` (seconds: what CI runs, and the default
under ``--benchmark-disable``, the plain test run), ``cpu`` (the default without CUDA: a minute
or two on a laptop), ``gpu`` (the default with CUDA: the reference workload of
shared/WORKLOAD.md and H100-class sizes). ``ZEROPLUG_BENCH_PATH`` is the
directory the swap and disk benchmarks write to (default: the system's temporary directory).

Under ``--benchmark-enable`` every benchmark runs with all of torch's CPU threads (the unit
tests' conftest pins one); under ``--benchmark-disable`` each runs once, as a quick test.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.benchmarks.bench_common import bench_size


def _enabled(config) -> bool:
    return not config.getoption("benchmark_disable", False) or config.getoption("benchmark_enable", False)


def pytest_configure(config):
    if not _enabled(config):     # the plain test run: each benchmark once, at the smallest size
        os.environ.setdefault("ZEROPLUG_BENCH_SIZE", "smallest")
    bench_size()                 # a wrong ZEROPLUG_BENCH_SIZE stops the run here

_ALL_THREADS = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def _benchmark_threads(request, monkeypatch):
    """All CPU threads while a benchmark is timed (restored after); cpu_adam too (the unit
    tests' conftest pins it to one thread through ZEROPLUG_CPU_ADAM_THREADS)."""
    before = torch.get_num_threads()
    if _enabled(request.config):
        threads = os.environ.get("ZEROPLUG_BENCH_THREADS")
        torch.set_num_threads(int(threads or 0) or _ALL_THREADS)
        if threads:
            monkeypatch.setenv("ZEROPLUG_CPU_ADAM_THREADS", threads)
        else:
            monkeypatch.delenv("ZEROPLUG_CPU_ADAM_THREADS", raising=False)   # the rank's cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def baselines() -> dict:
    """In-run baseline figures, by suite: the baseline's test stores its rate; the others
    divide by it (and measure it themselves when it was deselected)."""
    return {}
