#!/bin/bash
# one H100: which CUDA first-use warm-up takes the first step's extra time out of it
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
mkdir -p ~/.cache && tar xzf .dsdeps/kernel_cache.tgz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
fs() { local sys=$1 w=$2
  [ $(el) -gt 540 ] && return
  env -u OUT timeout 75 python3 tests/benchmarks/first_step.py --system $sys --steps 5 --sample 99 --log --warm $w >> $OUT/${sys}_$w.txt 2>&1
  echo "$sys $w ($(el) s): $(grep -h '^warm-up' $OUT/${sys}_$w.txt | tail -1) | $(grep -h '^step 1\|^step 3' $OUT/${sys}_$w.txt | tail -2 | tr '\n' ' ') | $(grep -h 'kernel variant' $OUT/${sys}_$w.txt | tail -1 | grep -o 'cache: .*built')"
}
fs s2_offload none
fs s2_offload blas
fs s2_offload blas+lin8192
fs s2_offload blas+lin256
fs s2_offload blas+leaf8192+sdpa
fs s2_offload blas+leaf8192+sdpa+alloc
fs s2_offload alloc
fs s3_offload blas+leaf8192+sdpa+alloc
fs s3_offload none
fs s2_offload none
fs s2_offload blas+leaf8192+sdpa+alloc
echo "total $(el) s"
