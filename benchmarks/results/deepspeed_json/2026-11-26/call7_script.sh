#!/bin/bash
# 2 GPUs: lane auto against lane off, interleaved
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
run() { local n=$1; shift
  env -u OUT timeout 70 torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --rows s3_offload --steps 6 "$@" >> $OUT/$n.txt 2>&1
  echo "$n rc=$? ($(el) s) $(grep -h '^| stage' $OUT/$n.txt | tail -1)"
}
for i in 1 2; do
  [ $(el) -gt 150 ] && break
  run lane_off --set offload.optimizer.gpu_step_ratio=0
  run lane_auto
done
echo "total $(el) s"
