"""The fault matrix: a rank that fails, dies, stalls or takes another path never hangs a run.

Each case is a real 2-rank job under real ``python -m torch.distributed.run`` (gloo on CPU;
NCCL on 2 GPUs in ``test_fault_matrix_on_gpus``): ToyNet under ZeRO stage 3, 2 micro-steps
per step, the optimizer's states on the nvme tier, a checkpoint after every step
(tests/reliability/fault_script.py); rank 1 meets the fault in step 3, in its second
micro-step, with ``faults.timeout = 10`` s. Each case checks:

* torchrun exits non-zero, every rank exits non-zero, within BOUND seconds of the fault;
* the lines the case expects: which rank failed, in which step and micro-step and, for a
  collective, which unit and which collective;
* no swap file or swap directory left, no half-written checkpoint directory, and the newest
  checkpoint (what ``latest`` names) verifies;
* (slow) resuming from it continues exactly: every later step's loss equals an
  uninterrupted run's, bit for bit.

docs/reliability.md, section 11, has the table of what each case printed and how long it took.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zeroplug.checkpoint.loading import newest_verified

SCRIPT = Path(__file__).with_name("fault_script.py")
LIMIT = 10          # faults.timeout of the jobs
BOUND = 60          # seconds from the fault to the end of the job: the bound
RUN_TIMEOUT = 240   # a job that runs longer has hung: the test fails instead of stalling the suite

STEP3 = r"step 3 \(micro-step 2 of 2\)"
# a surviving rank's line: its collective failed (the peer's sockets closed), or torchrun's agent
# ended it first (SIGTERM; on a loaded machine the agent can be the quicker)
STOPPED = r"( stopped in|: ended by SIGTERM \(torchrun's agent ends every rank once one has failed\) in)"
# case -> what the output must show (regular expressions), and whether it is in the default run
CASES = {
    "raise_forward": ([rf"error: rank 1 stopped in {STEP3}, forward; last collective: all_gather of unit \d+ "
                       r"\(\w+\): RuntimeError: injected fault",
                       r"rank 1 failed: RuntimeError: injected fault"], False),
    "raise_backward": ([rf"error: rank 1 stopped in {STEP3}, backward.*RuntimeError: injected fault: an exception "
                        r"in rank 1's backward hook"], False),
    "oom": ([rf"error: rank 1 stopped in {STEP3}, forward.*can't allocate memory"], False),
    # (the killed rank's record is the one it published last, up to a quarter second before)
    "kill_backward": ([rf"error: rank 0{STOPPED} {STEP3}, backward; last collective: (gradient reduction|"
                       r"all_gather) of unit \d+ \(\w+\).*; rank 1: .*\(as of [\d.]+ s before\)",
                       r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9"], False),
    "kill_optimizer": ([rf"error: rank 0{STOPPED} .*; rank 1: .*\(as of [\d.]+ s before\)",
                        r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9"], True),
    "data_ends": ([r"error: rank 1: at exit: the ranks are on different paths and would block each other: rank 0 "
                   r"would run all_gather of unit \d+ \(\w+\) in step 4 \(micro-step 1 of 2\), forward; rank 1 "
                   r"would run nothing more \(its script ended\)",
                   rf"error: rank 0{STOPPED} step 4 \(micro-step 1 of 2\), forward"], True),
    "accumulation": ([r"RanksDisagree: the ranks run different settings: batch.gradient_accumulation_steps = 2 on "
                      r"rank 0, 1 on rank 1"], False),
    "loader_stall": ([rf"error: rank 0: no progress for \d+ s \(faults.timeout = {LIMIT} s\), in {STEP3}, "
                      r"forward; last collective: all_gather of unit \d+ \(\w+\); rank 1: the training loop's own "
                      r"code after step 2, outside the engine for \d+ s",
                      r"error: rank 1: ended by SIGTERM"], True),
    "checkpoint_dirs": ([r"the ranks passed different arguments to engine.save_checkpoint \(rank 0: '[^']+', tag "
                         r"None; rank 1: '[^']+', tag None\).*tempfile.mkdtemp\(\)"], False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(root: Path, case: str, *extra: str, device: str = "cpu") -> tuple[int, str, float]:
    """The job; returns (torchrun's exit status, its output, seconds from the fault to its end)."""
    (root / "swap").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "--monitor-interval", "0.2", str(SCRIPT), "--case", case, "--root", str(root),
           "--timeout", str(LIMIT), "--device", device, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_DUMP_TEMP_FILE=str(root / "flight_recorder_rank_"))
    start = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env,
                         timeout=RUN_TIMEOUT)
    end = time.time()
    fault = root / "fault.json"
    at = json.loads(fault.read_text())["time"] if fault.exists() else start
    return out.returncode, out.stdout, end - at


def rank_exit_codes(output: str) -> dict[int, int]:
    """Each failed rank's exit status, from torchrun's summary (a rank that exited 0 is not in it)."""
    return {int(r): int(c) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)",
                                                   output)}


def check_left_behind(root: Path) -> None:
    """No swap file or directory, no half-written checkpoint; the newest checkpoint verifies."""
    swap = root / "swap"
    assert not list(swap.iterdir()), f"left in the swap directory: {sorted(p.name for p in swap.iterdir())}"
    ck = root / "ck"
    if not ck.exists():
        return
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".tmp")], sorted(p.name for p in ck.iterdir())
    newest, problems = newest_verified(ck)
    assert newest is not None and not problems, problems
    assert (ck / "latest").read_text().strip() == newest


def check_case(tmp_path: Path, case: str, device: str = "cpu") -> None:
    expect, _ = CASES[case]
    rc, out, took = run_job(tmp_path, case, device=device)
    tail = out[-6000:]
    assert rc != 0, f"{case}: torchrun exited 0\n{tail}"
    codes = rank_exit_codes(out)
    assert set(codes) == {0, 1} and all(codes.values()), f"{case}: every rank must exit non-zero: {codes}\n{tail}"
    assert took <= BOUND, f"{case}: the job ended {took:.0f} s after the fault (bound {BOUND} s)\n{tail}"
    for pattern in expect:
        assert re.search(pattern, out), f"{case}: no match for {pattern!r} in\n{tail}"
    check_left_behind(tmp_path)
    (tmp_path / "took.txt").write_text(f"{took:.1f}")


@pytest.mark.parametrize("case", [c for c, (_, default) in CASES.items() if default])
def test_fault_case(tmp_path, case):
    check_case(tmp_path, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, (_, default) in CASES.items() if not default])
def test_fault_case_slow(tmp_path, case):
    check_case(tmp_path, case)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    rc, out, _ = run_job(root, "none")
    assert rc == 0, out[-6000:]
    return json.loads((root / "losses.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["kill_optimizer", "kill_backward", "raise_forward", "loader_stall"])
def test_resume_after_the_fault_continues_exactly(tmp_path, case, uninterrupted):
    check_case(tmp_path, case)
    rc, out, _ = run_job(tmp_path, "none", "--resume")
    assert rc == 0, out[-6000:]
    assert json.loads((tmp_path / "losses.json").read_text()) == uninterrupted
    check_left_behind(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["nvme", "none"])
@pytest.mark.parametrize("stage", [2, 3])
def test_experts_on_the_model_train(tmp_path, stage, offload):
    """An ``experts`` ModuleList held by the model itself, each rank routed to its own two
    experts: trains at stages 2 and 3, with and without the optimizer offloaded (stage 3
    gathers the list with the model's own forward)."""
    rc, out, _ = run_job(tmp_path, "experts", "--stage", str(stage), "--offload", offload)
    assert rc == 0, out[-6000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses) == 4 and all(v == v for v in losses.values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL ranks cannot share one)")
@pytest.mark.parametrize("case", list(CASES))
def test_fault_matrix_on_gpus(tmp_path, case):
    """The same cases on 2 GPUs through NCCL (the comparisons stay on their gloo group); oom is
    a real CUDA out-of-memory error there."""
    if case == "oom":
        CASES_GPU = [rf"error: rank 1 stopped in {STEP3}, forward.*OutOfMemoryError"]
        rc, out, took = run_job(tmp_path, case, device="cuda")
        assert rc != 0 and took <= BOUND and all(re.search(p, out) for p in CASES_GPU), out[-6000:]
        check_left_behind(tmp_path)
        return
    check_case(tmp_path, case, device="cuda")
