#!/bin/bash
# device call: two GPUs, plain torchrun, DeepSpeed's JSON as-is: zeroplug's three rows, then DeepSpeed's stage 3 + offload
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
env -u OUT timeout 300 torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --steps 6 --log > $OUT/zeroplug_2gpu.txt 2>&1
echo "zeroplug ($(el) s)"; grep -v "^\[\|INFO\|WARNING\|^step" $OUT/zeroplug_2gpu.txt | tail -25
grep -h "cpu_adam: [0-9]* threads" $OUT/zeroplug_2gpu.txt | head -2
left=$(( 560 - $(el) ))
if [ $left -gt 150 ]; then
  python3 -m pip install -q --no-deps .dsdeps/*.whl 2>&1 | grep -v WARNING | tail -1
  DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation .dsdeps/deepspeed-0.19.8.tar.gz 2>&1 | grep -v WARNING | tail -1
  env -u OUT timeout $(( 560 - $(el) )) torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --engine deepspeed --rows s3_offload --steps 6 > $OUT/deepspeed_2gpu.txt 2>&1
  echo "deepspeed rc=$? ($(el) s)"; grep -v "^\[\|INFO\|WARNING" $OUT/deepspeed_2gpu.txt | tail -12
fi
echo "total $(el) s"
