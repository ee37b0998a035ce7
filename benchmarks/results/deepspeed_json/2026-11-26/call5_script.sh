#!/bin/bash
# 2 GPUs, fresh machine: where does the stage 3 + offload row stop?
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
ls ~/.cache/zeroplug 2>/dev/null
(sleep 270; pkill -ABRT -f "u tests/benchmarks/deepspeed_json_bench") &
PYTHONFAULTHANDLER=1 env -u OUT timeout 300 torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --rows s3_offload --steps 6 --info --trace-stalls 40 > $OUT/s3_offload_2gpu.txt 2>&1
echo "rc=$? ($(el) s)"
grep -v "^W11" $OUT/s3_offload_2gpu.txt | grep -i "cpu_adam\|RESULT\|step\|error\|Thread\|File" | head -60
find ~/.cache/zeroplug -name "*.log" -exec tail -20 {} \; ; find ~/.cache/zeroplug -maxdepth 3 | head
