#!/usr/bin/env bash
# The benchmark suites at the gpu size, in one device call; results in $OUT (default ./bench_out).
# Usage: bash tests/benchmarks/gpu_suite.sh [model preset, default 1.3B] [extra pytest args]
#   --benchmark-compare against an earlier $OUT/suites.json works as usual.
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export ZEROPLUG_BENCH_SIZE=gpu ZEROPLUG_BENCH_MODEL=${1:-1.3B} PYTHONUNBUFFERED=1
shift || true
python3 -m pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
python3 -m pytest -q tests/gpu/test_gpu.py 2>&1 | tail -3
python3 -m pytest -q tests/benchmarks --benchmark-enable --benchmark-json "$OUT/suites.json" "$@" 2>&1 | tail -30
python3 -m tests.benchmarks.h100_bench offload-states --model "$ZEROPLUG_BENCH_MODEL" --zero stage2 \
  --json "$OUT/offload_states.json" 2>&1 | tail -8
