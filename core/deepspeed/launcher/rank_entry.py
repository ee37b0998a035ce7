"""What torchrun starts on every rank for ``zeroplug-deepspeed``: the user's script (or
module, or program) with DeepSpeed's ``--local_rank=N`` first among its arguments, on this
rank's share of the cores when the launch asked for ``--bind_cores_to_rank``.

``python -m zeroplug.deepspeed.launcher.rank_entry [--module | --no-python] [--no-local-rank]
SCRIPT ARGS...`` (torchrun keeps no ``--`` separator, so the options are only these three).
"""
from __future__ import annotations

import os
import runpy
import sys


def _cores(spec: str) -> list[int]:
    if spec == "all":
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def bind_cores(spec: str, local_rank: int, local_world: int) -> list[int]:
    """This local rank's equal share of the cores ``spec`` names ("all": the allowed ones)."""
    cores = _cores(spec)
    per = max(1, len(cores) // max(1, local_world))
    mine = cores[local_rank * per:(local_rank + 1) * per] or cores
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))
    return mine


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode, local_rank_arg = "script", True
    flags = {"--module", "--no-python", "--no-local-rank"}
    while argv and argv[0] in flags:        # ours, before the script; everything after is the script's
        flag = argv.pop(0)
        if flag == "--module":
            mode = "module"
        elif flag == "--no-python":
            mode = "program"
        else:
            local_rank_arg = False
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("error: rank_entry: no script to run", file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank_arg:
        args = [f"--local_rank={local_rank}", *args]
    spec = os.environ.get("ZEROPLUG_BIND_CORES")
    if spec:
        bind_cores(spec, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if mode == "program":
        os.execvp(target, [target, *args])
    sys.argv = [target, *args]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
