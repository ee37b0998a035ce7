#!/usr/bin/env bash
# One device call for the NVMe figures (a GPU machine with a local NVMe disk): the swapper suite, then training with the
# optimizer states on NVMe through h100_bench.py (which adds the I/O floor), then a SIGTERM-ed run
# and the check that the swap directory is left empty. Logs in $OUT (default ./bench_out).
# Usage: [BIG=1.3B] [NO_DD=1 (skip swapper vs dd)] bash tests/benchmarks/nvme_suite.sh [nvme_path]
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
P=${1:-/root/zeroplug_nvme}; mkdir -p "$P"
export PYTHONUNBUFFERED=1
B="-m tests.benchmarks.h100_bench"      # from the repository root
left() { echo "left in $P: $(find "$P" -type f | wc -l) files, $(find "$P" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}') bytes"; }
if [ -z "${NO_DD:-}" ]; then
echo "== swapper vs dd, 4 GiB each way (the swapper suite at the gpu size)"
ZEROPLUG_BENCH_SIZE=gpu ZEROPLUG_BENCH_PATH="$P" timeout 150 python3 -m pytest -q tests/benchmarks/test_bench_swapper.py \
  --benchmark-enable --benchmark-json "$OUT/swapper_vs_dd.json" 2>&1 | tail -8 | tee "$OUT/swapper_vs_dd.txt"
left
fi
echo "== 350M, stage 3, parameters on CPU, optimizer states on NVMe (pipelined: the default)"
timeout 150 python3 $B workload --model 350M --zero stage3 --offload-optimizer nvme --offload-param cpu \
  --nvme-path "$P" --steps 5 --json "$OUT/nvme_350M.json" 2>&1 | grep -E "RESULT|IO per|PHASES|Error|error" | tee "$OUT/nvme_350M.txt"
left
echo "== the same with reuse_resident = false (every sub-group written and read every step)"
timeout 150 python3 $B workload --model 350M --zero stage3 --offload-optimizer nvme --offload-param cpu \
  --nvme-path "$P" --steps 5 --no-reuse --json "$OUT/nvme_350M_no_reuse.json" 2>&1 | grep -E "RESULT|IO per|PHASES|Error|error" | tee "$OUT/nvme_350M_no_reuse.txt"
left
if [ -n "${BIG:-}" ]; then
  echo "== $BIG, stage 3, parameters on CPU, optimizer states on NVMe"
  timeout 240 python3 $B workload --model "$BIG" --zero stage3 --offload-optimizer nvme --offload-param cpu \
    --nvme-path "$P" --steps 4 --json "$OUT/nvme_$BIG.json" 2>&1 | grep -E "RESULT|IO per|PHASES|Error|error" | tee "$OUT/nvme_$BIG.txt"
  left
fi
echo "== the same run killed with SIGTERM after 40 s"
timeout -s TERM 40 python3 $B workload --model 350M --zero stage3 --offload-optimizer nvme --offload-param cpu \
  --nvme-path "$P" --steps 50 2>&1 | tail -2; echo "exit $?"
sleep 1; left
