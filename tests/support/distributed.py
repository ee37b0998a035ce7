"""Run a function on N real ranks (spawned processes, gloo on CPU) and collect results."""
from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result = None
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    # Note: the result is safe on disk. Every rank first waits for the others (a rank
    # that left early would reset connections its peers still read from), then leaves
    # without tearing gloo down, whose background threads have (rarely) aborted the
    # process at exit ("terminate called without an active exception").
    if dist.is_initialized() and result and result[0] == "ok":
        try:
            dist.barrier()
        except RuntimeError:
            pass
    os._exit(0)


def leave_without_teardown() -> None:
    """End a rank's process after its ranks met at a barrier: flushed, gloo not torn down
    (its background threads have rarely aborted the process at exit, see _worker)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float | None = None):
    """``fn(rank, world, *args)`` on each rank; returns the list of results by rank.

    World size 1 runs in this process (no process group), like a plain script. With a
    ``timeout`` (seconds), ranks still running then are killed and the call fails: a hang
    fails the test instead of stalling the suite.
    """
    if world == 1:
        return [fn(0, 1, *args)]
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), fn, args, outdir), nprocs=world,
                                 start_method="spawn", join=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ctx.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"no result from {world} ranks within {timeout:g} s (a hang?)")
        results, errors = [], []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} died without a result (killed or crashed)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {r} failed:\n{value}")
            results.append(value)
        if errors:
            # a rank's own error first: the others often only saw their peer go away
            errors.sort(key=lambda e: "Connection reset" in e or "Connection closed" in e)
            raise AssertionError("\n".join(errors))
        return results
