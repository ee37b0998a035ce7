"""The fault matrix's table for docs/reliability.md: each case of
tests/reliability/test_fault_matrix.py run once, with how long the job took to stop after the
fault, every rank's exit status and the lines zeroplug wrote (the first two). Run from the repo root:

    python3 tests/benchmarks/fault_matrix_table.py                 # CPU: 2 ranks, gloo
    python3 tests/benchmarks/fault_matrix_table.py --device cuda   # 2 GPUs: NCCL
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.reliability.test_fault_matrix import BOUND, CASES, rank_exit_codes, run_job  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    print(f"2 ranks, {args.device}; faults.timeout = 10 s; bound {BOUND} s from the fault to the end of the job")
    print("| case | stops after (s) | exit status by rank | lines zeroplug wrote |")
    print("| --- | --- | --- | --- |")
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory() as d:
            rc, out, took = run_job(Path(d), case, device=args.device)
        codes = rank_exit_codes(out)
        status = ", ".join(f"{r}: {codes.get(r, 0)}" for r in range(2)) + f"; torchrun {rc}"
        lines = [re.sub(r"/tmp/[\w/.-]+", "/tmp/...", line) for line in re.findall(r"error: rank \d.*", out)]
        text = "<br>".join(line if len(line) <= 400 else line[:400] + " ..." for line in lines[:2]) or "(none)"
        print(f"| {case} | {took:.1f} | {status} | {text.replace('|', '/')} |")


if __name__ == "__main__":
    main()
