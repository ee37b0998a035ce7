"""Start a script as DeepSpeed's launcher (``deepspeed --num_gpus N script.py args``) does on
one host: one process per rank with torchrun's variables and ``--local_rank=<i>`` appended."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, world: int, args: list[str], timeout: float = 300) -> list[str]:
    """Each rank's stdout, by rank (the stderr of a failed rank in the error)."""
    port = str(_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, "-u", str(script), *args, f"--local_rank={rank}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs, errors = [], []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
        if p.returncode != 0:
            errors.append(f"rank {rank} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}")
    if errors:
        raise AssertionError("\n".join(errors))
    return outs
