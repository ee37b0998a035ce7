#!/bin/bash
# one H100: GPU tests of the CUDA warm-up; first step against steady, warm-up on (default) and off, interleaved fresh processes
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; git log --oneline | head -1
env -u OUT timeout 200 python3 -m pytest -q -x tests/test_cuda_warmup.py tests/test_gpu.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? ($(el) s): $(tail -1 $OUT/gpu_tests.txt)"
fs() { local n=$1; shift
  [ $(el) -gt 555 ] && return
  env -u OUT timeout 70 python3 tests/benchmarks/first_step.py --steps 6 --sample 99 --log "$@" >> $OUT/$n.txt 2>&1
  echo "$n ($(el) s): $(grep -h 'CUDA warm-up' $OUT/$n.txt | tail -1 | grep -o 'in [0-9.]* s') | $(grep -h '^step 1' $OUT/$n.txt | tail -1) | $(grep '^RESULT' $OUT/$n.txt | tail -1 | grep -o '"tokens_per_s": [0-9.]*\|"first_over_steady": [0-9.]*\|"peak_gib": [0-9.]*' | tr '\n' ' ')"
}
for i in 1 2 3 4; do
  fs s2_on --system s2_offload
  fs s3_on --system s3_offload
  fs s2_off --system s2_offload --set batch.warm_up_rows=0
  fs s3_off --system s3_offload --set batch.warm_up_rows=0
done
echo "total $(el) s"
