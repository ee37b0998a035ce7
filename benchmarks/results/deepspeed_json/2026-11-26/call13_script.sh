#!/bin/bash
# 2 GPUs: Comm.barrier as an all-reduce (NCCL): GPU tests, each offloaded row alone, once more the table
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
env -u OUT timeout 150 python3 -m pytest -q -x tests/test_cuda_warmup.py tests/test_gpu.py -k "nccl and 2 or warm" -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? ($(el) s): $(tail -1 $OUT/gpu_tests.txt)"
run() { local n=$1 t=$2; shift 2
  [ $(el) -gt $((400 - t)) ] && { echo "skip $n"; return; }
  env -u OUT timeout $t torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_json_bench.py --steps 6 --info "$@" > $OUT/$n.txt 2>&1
  echo "$n rc=$? ($(el) s) barrier warnings: $(grep -c 'barrier()' $OUT/$n.txt)"
  grep -h "^| stage\|CUDA warm-up" $OUT/$n.txt | cut -c1-220 | sort -u | head -8
}
run s2_offload_alone 100 --rows s2_offload
run s3_offload_alone 100 --rows s3_offload
run table 150
echo "total $(el) s"
