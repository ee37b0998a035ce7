#!/bin/bash
# 2 GPUs, plain torchrun, defaults: the whole table, then each offloaded row in a fresh job (its first step is the process's)
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
run() { local n=$1 t=$2; shift 2
  [ $(el) -gt $((590 - t)) ] && { echo "skip $n"; return; }
  env -u OUT timeout $t torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --steps 6 --info "$@" > $OUT/$n.txt 2>&1
  echo "$n rc=$? ($(el) s)"
  grep -h "^| \|CUDA warm-up\|threads per rank\|kernel variant" $OUT/$n.txt | sort -u | head -14
}
run table 330
run s2_offload_alone 130 --rows s2_offload
run s3_offload_alone 130 --rows s3_offload
echo "total $(el) s"
