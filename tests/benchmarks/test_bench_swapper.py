"""pytest-benchmark: the NVMe swapper against ``dd`` with O_DIRECT, on the same directory.

    ZEROPLUG_BENCH_PATH=/local_nvme pytest tests/benchmarks/test_bench_swapper.py --benchmark-enable

A round writes then reads back ``GIB`` of random data: ``dd bs=64M oflag=direct`` /
``iflag=direct`` (the in-run baseline), then the swapper at its defaults and at the
smaller setting (1 MiB blocks, queue depth 8, 4 threads), every read checked against
what was written. 64 MiB (``smallest``), 512 MiB (``cpu``), 4 GiB (``gpu``). Page caches
are dropped between the write and the read where that is allowed (root). ``extra_info``:
write and read GB/s (10^9 B/s), the ratio of each to dd's and the peak host memory. The
one-shot table over more settings is ``python tests/benchmarks/swapper_vs_dd.py``.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

import pytest
import torch
from tests.benchmarks.bench_common import bench_path, bench_size
from tests.benchmarks.swapper_vs_dd import MiB, run_dd, run_swapper

from zeroplug.benchmarking.measure import peak_host_bytes, reset_peak_host

GIB, TENSOR_MIB, ROUNDS = {"smallest": (1 / 16, 16, 2), "cpu": (0.5, 64, 3), "gpu": (4.0, 256, 2)}[bench_size()]
TOTAL = int(GIB * (1 << 30))
CASES = {"dd": None, "swapper-defaults": (1 * MiB, 32, 16), "swapper-1M-qd8-t4": (1 * MiB, 8, 4)}


@pytest.fixture(scope="module")
def workdir():
    if shutil.which("dd") is None:
        pytest.skip("dd is not installed")
    d = tempfile.mkdtemp(prefix="zeroplug-swapbench-", dir=bench_path())
    try:
        run_dd(d, 1)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(f"dd with O_DIRECT fails in {bench_path()} ({exc.stderr.decode().strip()[:80]}); "
                    "set ZEROPLUG_BENCH_PATH to a directory on a disk")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def tensors():
    n = max(1, TOTAL // (TENSOR_MIB * MiB))
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(-2**31, 2**31 - 1, (TENSOR_MIB * MiB // 4,), dtype=torch.int32, generator=g)
            .view(torch.uint8) for _ in range(min(n, 3))]
    return pool, n


def _round(case, workdir, tensors):
    """(write, read) bytes/s of one round trip; the swapper's reads are checked."""
    if case == "dd":
        return run_dd(workdir, max(1, TOTAL // (64 * MiB)))
    pool, n = tensors
    block, qd, threads = CASES[case]
    w, r, ok = run_swapper(workdir, pool, n, block, qd, threads, buffer_count=4, direct=True)
    assert ok, "a swapped tensor read back differs from what was written (or O_DIRECT was not used)"
    return w, r


@pytest.mark.parametrize("case", list(CASES))
def test_swap_round_trip(benchmark, baselines, workdir, tensors, case):
    reset_peak_host()
    rates: list[tuple[float, float]] = []
    benchmark.pedantic(lambda: rates.append(_round(case, workdir, tensors)), rounds=ROUNDS, iterations=1)
    assert rates and all(w > 0 and r > 0 for w, r in rates)
    if benchmark.disabled:
        return
    w = statistics.median(x[0] for x in rates) / 1e9
    r = statistics.median(x[1] for x in rates) / 1e9
    if case == "dd":
        baselines["swap"] = (w, r)
    elif "swap" not in baselines:
        dd = [_round("dd", workdir, tensors) for _ in range(ROUNDS)]
        baselines["swap"] = (statistics.median(x[0] for x in dd) / 1e9, statistics.median(x[1] for x in dd) / 1e9)
    dw, dr = baselines["swap"]
    benchmark.extra_info.update(bytes=TOTAL, path=bench_path(), write_GBps=round(w, 3), read_GBps=round(r, 3),
                                baseline="dd", baseline_write_GBps=round(dw, 3), baseline_read_GBps=round(dr, 3),
                                ratio_to_baseline={"write": round(w / dw, 3), "read": round(r / dr, 3)},
                                peak_host_bytes=peak_host_bytes())
