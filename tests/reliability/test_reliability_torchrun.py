"""A rank killed under torchrun (real ``python -m torch.distributed.run``, 2 ranks, gloo).

* ``--max-restarts 0``: SIGKILL one rank; the job ends well within the collective timeout,
  torchrun names the killed rank, and the swap directories of both ranks are gone.
* ``--max-restarts 1 ... --resume``: SIGKILL one rank; torchrun restarts both, they
  continue from the last checkpoint, and every step's loss and the final weights equal an
  uninterrupted run's, bit for bit.

The job: ``zeroplug train`` (the built-in GPT) with ZeRO stage 3, the optimizer on the
nvme tier, a checkpoint every 2 steps, the loss of every step in a CSV file.
"""
from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zeroplug import checkpoint

STEPS = 10
TIMEOUT = 30            # --collective-timeout


def _cmd(root: Path, restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(_free_port()), "--nproc-per-node", "2",
            "--max-restarts", str(restarts), "--monitor-interval", "0.2",
            "-m", "zeroplug.cli", "train", "--device", "cpu", "--steps", str(STEPS), "--max-bytes", "40000",
            "--seq", "16", "--batch.micro_batch_size=2", "--batch.steps_per_print=1", "--monitor.plugin=csv",
            f"--monitor.path={root / 'loss.csv'}", "--zero.plugin=stage3",
            "--offload.optimizer.plugin=nvme", f"--offload.optimizer.nvme_path={root / 'swap'}",
            f"--checkpoint.dir={root / 'ck'}", "--checkpoint.every_n_steps=2", "--resume",
            "--collective-timeout", str(TIMEOUT)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of worker ``rank`` of the torchrun process ``parent``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def _run(root: Path, restarts: int, kill_at: str | None):
    """Run the job; SIGKILL rank 1 once the output shows ``kill_at``. Returns (exit
    status, output, seconds from the kill to the end)."""
    (root / "swap").mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(_cmd(root, restarts), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=root, start_new_session=True)
    lines, killed = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if kill_at and killed is None and kill_at in line:
                pid = _rank_pid(p.pid, 1)
                assert pid is not None, "rank 1 not found"
                os.kill(pid, signal.SIGKILL)
                killed = time.time()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, "".join(lines), (time.time() - killed) if killed else None


def _tree(path: Path) -> list[str]:
    """Every file under ``path`` (what a failed cleanup left)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _losses(root: Path) -> dict[int, str]:
    """Step -> loss (its exact text) of the CSV's training rows (held-out evaluations have rows
    of their own, without a training loss); a step run again after a resume: the last row."""
    with open(root / "loss.csv") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f) if r.get("loss")}


@pytest.mark.slow
def test_killed_rank_ends_the_job_then_restart_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    code, out, _ = _run(ref, 0, None)
    assert code == 0, out[-3000:]
    want = _losses(ref)
    assert sorted(want) == list(range(1, STEPS + 1))

    # no restarts: the job ends soon after the kill, naming the rank
    run = tmp_path / "run"
    code, out, after = _run(run, 0, "ck/global_step4")
    assert code != 0 and after < TIMEOUT, (after, out[-3000:])
    assert "rank      : 1 (local_rank: 1)" in out and "Signal 9 (SIGKILL)" in out, out[-3000:]
    assert os.listdir(run / "swap") == [], _tree(run / "swap")  # rank 1's too: rank 0 removed it at exit
    assert (run / "ck" / "latest").read_text() in ("global_step4", "global_step6")

    # --max-restarts 1: killed again, restarted by torchrun, resumed from the last checkpoint
    code, out, _ = _run(run, 1, "checkpoint ")            # killed after its first save
    assert code == 0, out[-3000:]
    resumed = [ln for ln in out.splitlines() if ln.startswith("resumed from")]
    assert len(resumed) == 2, resumed                      # once by hand, once after torchrun's restart
    first, second = (int(ln.rsplit(" ", 1)[1]) for ln in resumed)
    assert first in (4, 6) and second > first, resumed
    assert _losses(run) == want                            # every step, bit for bit (repr of the float)
    a, b = checkpoint.consolidate(ref / "ck"), checkpoint.consolidate(run / "ck")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.listdir(run / "swap") == [], _tree(run / "swap")
