"""A run that finished exits 0: 2 ranks (gloo) under real torchrun, a DeepSpeed script through
``zeroplug.deepspeed`` (``init_distributed``, ``initialize`` with the optimizer offloaded to the
CPU, ``load_checkpoint``, 5 steps) that never closes its engine nor destroys its process group.

At exit the ranks meet once more, the engine is closed (the CPU step's worker, the tiers'
threads), the watchdog stops and the default gloo group is destroyed, in that order
(plugins/faults/shutdown.py, zeroplug.launch). torch aborted about one gloo process in five
that exited with its group alive ("terminate called without an active exception", exit -6),
and torchrun then reported the finished job as failed. The slow test repeats the run 50 times.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import zeroplug.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ck = sys.argv[1]
    if sys.argv[2] == "save":
        engine.save_checkpoint(ck)
    else:
        engine.load_checkpoint(ck)
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(5):
        x, y = torch.randn(2, 16, generator=g), torch.randn(2, 4, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
    print(f"FINISHED rank {engine.global_rank}", flush=True)
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    if not script.exists():
        script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "--monitor-interval", "0.2", str(script), str(tmp_path / "ck"), mode]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)


def check(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0 and "terminate called" not in out.stdout, out.stdout[-4000:]
    assert out.stdout.count("FINISHED rank") == 2, out.stdout[-4000:]


def test_a_finished_run_exits_zero(tmp_path):
    check(run(tmp_path, "save"))
    check(run(tmp_path, "load"))


@pytest.mark.slow
def test_fifty_finished_runs_exit_zero(tmp_path):
    check(run(tmp_path, "save"))
    failed = []
    for i in range(50):
        out = run(tmp_path, "load")
        if out.returncode != 0 or "terminate called" in out.stdout:
            failed.append(f"run {i}: exit {out.returncode}\n{out.stdout[-1500:]}")
    assert not failed, f"{len(failed)} of 50 runs did not exit 0:\n" + "\n".join(failed[:3])
