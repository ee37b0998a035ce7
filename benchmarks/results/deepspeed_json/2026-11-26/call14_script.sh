#!/bin/bash
# one H100: where plain stage 3's (AdamW on the GPU) first step goes
cd "$(dirname "$0")/.."
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -1
fs() { local n=$1; shift
  env -u OUT timeout 100 python3 tests/benchmarks/first_step.py --steps 5 --sample 1,2 --log "$@" >> $OUT/$n.txt 2>&1
  echo "$n ($(el) s): $(grep -h '^step [0-9]:' $OUT/$n.txt | head -3 | tr '\n' ' ')"
}
fs s3_warmfirst --system s2_offload --steps 2 --sample 99
fs s3_json --system s3
fs s3_json_again --system s3
echo "total $(el) s"
