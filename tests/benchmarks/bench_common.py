"""Sizes and in-run baselines shared by the benchmark suites (see conftest.py)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

SIZES = ("smallest", "cpu", "gpu")


def bench_size() -> str:
    size = os.environ.get("ZEROPLUG_BENCH_SIZE") or ("gpu" if torch.cuda.is_available() else "cpu")
    if size not in SIZES:
        raise pytest.UsageError(f"ZEROPLUG_BENCH_SIZE={size!r}: choose one of {', '.join(SIZES)}")
    return size


def bench_path() -> str:
    path = os.environ.get("ZEROPLUG_BENCH_PATH") or tempfile.gettempdir()
    os.makedirs(path, exist_ok=True)
    return path


def record_ratio(benchmark, baselines: dict, key, rate_name: str, rate: float, measure_baseline) -> None:
    """Store ``rate`` in ``extra_info`` with its ratio to the baseline ``key``."""
    if key not in baselines:
        baselines[key] = measure_baseline()
    benchmark.extra_info[rate_name] = round(rate, 3)
    benchmark.extra_info[f"baseline_{rate_name}"] = round(baselines[key], 3)
    benchmark.extra_info["ratio_to_baseline"] = round(rate / baselines[key], 4)
