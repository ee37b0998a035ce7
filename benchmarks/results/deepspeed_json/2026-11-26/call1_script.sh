#!/bin/bash
# device call: DeepSpeed JSON as-is against the best configuration, interleaved fresh processes
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
fs() { # name, args...
  local n=$1; shift
  env -u OUT timeout 70 python3 tests/benchmarks/first_step.py --steps 8 --sample 99 "$@" >> $OUT/$n.txt 2>&1
  echo "$n ($(el) s): $(grep '^RESULT' $OUT/$n.txt | tail -1 | grep -o '"tokens_per_s": [0-9.]*\|"init_s": [0-9.]*\|"first_over_steady": [0-9.]*' | tr '\n' ' ')"
}
hb() {
  local n=$1; shift
  env -u OUT timeout 70 python3 tests/benchmarks/h100_bench.py workload --model 1.3B --steps 8 "$@" >> $OUT/$n.txt 2>&1
  echo "$n ($(el) s): $(grep '^RESULT' $OUT/$n.txt | tail -1)"
}
for i in 1 2; do
  fs s2_json --system s2_offload
  fs s2_json_bucket1e8 --system s2_offload --ds zero_optimization.reduce_bucket_size=1e8
  hb s2_best --zero stage2 --offload-optimizer cpu
done
S3B="--ds zero_optimization.sub_group_size=1e8 --ds zero_optimization.reduce_bucket_size=1e8 --ds zero_optimization.stage3_max_reuse_distance=1e8"
for i in 1 2; do
  [ $(el) -gt 440 ] && break
  fs s3_json --system s3_offload
  fs s3_json_best_keys --system s3_offload $S3B
  hb s3_best --zero stage3 --offload-optimizer cpu --offload-param cpu
done
echo "total $(el) s"
