"""A probe in a fresh process: run it with a time limit, sample its resident memory, and
read the ``PROBE {json}`` line it prints (the benchmarks that search for the largest size
that trains: largest_model.py, long_seq.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
ROOT = str(Path(__file__).resolve().parents[2])


def rss_gib(pid: int | str = "self") -> float:
    """Resident memory of process ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return 0.0


def probe_env() -> dict:
    """The environment of a probe started as a file: this repository importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class Watched:
    """What a probe left: its exit code, its output, the largest memory sampled, whether the
    time limit ended it, its wall time and its ``PROBE`` record (empty if it printed none)."""
    rc: int
    out: str
    err: str
    peak_gib: float
    timed_out: bool
    wall_s: float
    record: dict = field(default_factory=dict)


def run_watched(cmd: list[str], env: dict, timeout: float, memory=rss_gib) -> Watched:
    """Run ``cmd`` in a session of its own, sampling ``memory(pid)`` every 0.2 s; past
    ``timeout`` seconds the whole session is killed."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    # Note: the pipes are drained by threads, so that a child writing a lot never blocks on them
    chunks = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda s=s, k=k: chunks[k].extend(s), daemon=True)
               for s, k in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for r in readers:
        r.start()
    peak, timed_out = 0.0, False
    while proc.poll() is None:
        peak = max(peak, memory(proc.pid))
        if time.time() - t0 > timeout:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    for r in readers:
        r.join(timeout=5)
    out = "".join(chunks["out"])
    record: dict = {}
    for line in out.splitlines():
        if line.startswith("PROBE "):
            record.update(json.loads(line[6:]))
    return Watched(proc.returncode, out, "".join(chunks["err"]), peak, timed_out, round(time.time() - t0, 1), record)
