#!/usr/bin/env bash
# One device call for the H100 numbers. Results in $OUT (default ./bench_out).
# Usage: bash tests/benchmarks/gpu_suite.sh [model] [steps]
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
MODEL=${1:-1.3B}; STEPS=${2:-8}
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -e . -q >/dev/null 2>&1
python3 -m pytest -q tests/test_gpu.py 2>&1 | tail -3
B=tests/benchmarks/h100_bench.py
python3 $B workload --model "$MODEL" --baseline torch --steps "$STEPS" --json "$OUT/torch.json" 2>&1 | grep -E "RESULT|Error|error" 
for z in stage0 stage1 stage2 stage3; do
  python3 $B workload --model "$MODEL" --zero $z --steps "$STEPS" --json "$OUT/$z.json" 2>&1 | grep -E "RESULT|Error|error"
done
python3 $B offload-states --model "$MODEL" --zero stage2 --json "$OUT/offload_states.json" 2>&1 | tail -8
