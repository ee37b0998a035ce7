#!/usr/bin/env bash
# Issue D's runs on the H100 machine: stage 3 with optimizer + parameters in CPU memory, and
# optimizer-only offload. Logs in $OUT (default ./bench_out).
# Usage: bash tests/benchmarks/offload_suite.sh "1.3B 2.7B" [extra h100_bench args]
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
MODELS=${1:-"1.3B 2.7B"}; shift || true
export PYTHONUNBUFFERED=1
B=tests/benchmarks/h100_bench.py
for m in $MODELS; do
  echo "== $m stage3, optimizer + parameters offloaded to CPU $*"
  timeout 300 python3 $B workload --model "$m" --zero stage3 --offload-optimizer cpu --offload-param cpu "$@" \
    --json "$OUT/offload_${m}_s3.json" 2>&1 | grep -E "RESULT|PHASES|Error|error"
done
