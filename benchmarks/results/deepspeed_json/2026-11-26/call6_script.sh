#!/bin/bash
# 2 GPUs: the stage 3 + offload row with the deterministic prefetch (A), and with the GPU lane off (B)
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
run() { local n=$1 t=$2; shift 2
  (sleep $((t - 5)); pkill -ABRT -f "u tests/benchmarks/deepspeed_json_bench") & local killer=$!
  PYTHONFAULTHANDLER=1 env -u OUT timeout $t torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --rows s3_offload --steps 6 --info "$@" > $OUT/$n.txt 2>&1
  echo "$n rc=$? ($(el) s)"; kill $killer 2>/dev/null
  grep -h "^step\|GPU steps\|^| stage" $OUT/$n.txt | head -12
  grep -c "Thread 0x" $OUT/$n.txt
}
run A_prefetch_fix 150 --trace-stalls 45
run B_lane_off 140 --set offload.optimizer.gpu_step_ratio=0
echo "total $(el) s"
