#!/usr/bin/env bash
# The offloaded rows of the training-step suite for several models (the gpu size), with plain
# PyTorch's row where it fits; results in $OUT (default ./bench_out).
# Usage: bash tests/benchmarks/offload_suite.sh "1.3B 2.7B" [extra pytest args]
# (docs/benchmarks.md's per-phase offload figures come from h100_bench.py workload, which
#  adds a synchronised phase breakdown and the NVMe I/O floor.)
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
MODELS=${1:-"1.3B 2.7B"}; shift || true
export PYTHONUNBUFFERED=1 ZEROPLUG_BENCH_SIZE=gpu
for m in $MODELS; do
  ZEROPLUG_BENCH_MODEL=$m python3 -m pytest -q tests/benchmarks/test_bench_train_step.py --benchmark-enable \
    -k "offload" --benchmark-json "$OUT/offload_$m.json" "$@" 2>&1 | tail -8
done
