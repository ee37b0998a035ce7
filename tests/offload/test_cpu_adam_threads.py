"""cpu_adam's threads per rank with cpu_plan = off (a CPU-only run's default): cores (affinity,
cgroup quota) divided among local ranks, whatever OMP_NUM_THREADS says; an explicit count
wins and is clamped with a warning. tests/offload/test_cpu_plan.py has the measured plan."""
import json
import os
import subprocess
import sys

import pytest

from zeroplug.plugins.optim.cpu_adam import cores as cpu_cores
from zeroplug.launch import local_ranks
from zeroplug.plugins.optim.cpu_adam.cores import available_cores, cgroup_cpu_limit, choose_threads

from tests.support.paths import child_env


def _tree(root, files: dict) -> str:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def test_share_per_local_rank():
    c = choose_threads(0, cores=32, ranks=2)
    assert (c.threads, c.cores, c.local_ranks, c.warning) == (16, 32, 2, None)
    assert c.describe() == "cpu_adam: 16 threads per rank, 32 cores, 2 local ranks"
    assert choose_threads(0, cores=16, ranks=1).threads == 16
    assert choose_threads(0, cores=3, ranks=8).threads == 1         # never 0
    assert choose_threads(0, cores=17, ranks=2).threads == 8


def test_explicit_wins_and_too_many_is_clamped():
    c = choose_threads(4, cores=32, ranks=2)
    assert (c.threads, c.warning) == (4, None)
    assert c.describe() == "cpu_adam: 4 threads per rank (optimizer.threads), 32 cores, 2 local ranks"
    c = choose_threads(64, cores=32, ranks=2)
    assert c.threads == 16
    assert "optimizer.threads = 64 is more than the 16 cores available to each rank" in c.warning


def test_local_ranks_from_the_launchers_env():
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "2(x3)"}) == 2
    assert local_ranks({"LOCAL_WORLD_SIZE": "junk"}) == 1
    assert local_ranks({}) == 1


def test_cgroup_v2_quota_smallest_along_the_path(tmp_path):
    root = _tree(tmp_path / "cg", {"cpu.max": "max 100000\n", "kubepods/cpu.max": "800000 100000\n",
                                   "kubepods/pod1/cpu.max": "250000 100000\n"})
    proc = _tree(tmp_path, {"proc_cgroup": "0::/kubepods/pod1\n"})
    assert cgroup_cpu_limit(root, os.path.join(proc, "proc_cgroup")) == pytest.approx(2.5)
    # a 2.5-CPU quota runs 2 threads (unless affinity allows fewer)
    assert available_cores(root, os.path.join(proc, "proc_cgroup")) == min(2, cpu_cores.affinity_cores())


def test_cgroup_v2_unlimited_and_garbage(tmp_path):
    root = _tree(tmp_path / "cg", {"cpu.max": "max 100000\n", "a/cpu.max": "nonsense\n"})
    proc = _tree(tmp_path, {"proc_cgroup": "0::/a\n"})
    assert cgroup_cpu_limit(root, os.path.join(proc, "proc_cgroup")) is None
    assert available_cores(root, os.path.join(proc, "proc_cgroup")) == cpu_cores.affinity_cores()


def test_cgroup_v1_quota_and_container_root(tmp_path):
    # the path in /proc/self/cgroup is the host's; the container sees its own group at the root
    root = _tree(tmp_path / "cg", {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                                   "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    proc = _tree(tmp_path, {"proc_cgroup": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"})
    assert cgroup_cpu_limit(root, os.path.join(proc, "proc_cgroup")) == pytest.approx(3.0)
    root = _tree(tmp_path / "cg1", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    proc = _tree(tmp_path, {"proc_cgroup2": "4:cpu:/\n"})
    assert cgroup_cpu_limit(root, os.path.join(proc, "proc_cgroup2")) is None


SCRIPT = r"""
import json, logging, os, sys, io
from concurrent.futures import ThreadPoolExecutor
import torch
stream = io.StringIO()
logging.getLogger("zeroplug").addHandler(logging.StreamHandler(stream))
logging.getLogger("zeroplug").setLevel(logging.INFO)
from tests.support.toy import ToyNet
import zeroplug
before = torch.get_num_threads()
cfg = {"zero": {"plugin": "stage2"}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-3},
       "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}}
if len(sys.argv) > 1:
    cfg["optimizer"]["threads"] = int(sys.argv[1])
eng = zeroplug.initialize(ToyNet(), cfg, device="cpu")
worker = ThreadPoolExecutor(1).submit(torch.get_num_threads).result()
print(json.dumps({"before": before, "after": torch.get_num_threads(), "worker": worker,
                  "optimizer": eng.optimizer.threads, "log": stream.getvalue()}))
"""


def _run(env_extra, *args):
    env = child_env({k: v for k, v in os.environ.items() if k not in ("ZEROPLUG_CPU_ADAM_THREADS", "LOCAL_WORLD_SIZE")})
    env.update(env_extra, ZEROPLUG_CPU_ADAM_IMPL="eager")     # no kernel build: threads only
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchrun_omp_num_threads_1_is_not_obeyed():
    """torchrun's OMP_NUM_THREADS=1: the optimizer still gets the rank's cores, on the
    worker thread that runs the overlapped step too; the choice is printed once."""
    cores = available_cores()
    r = _run({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"})
    assert r["before"] == 1
    assert r["after"] == r["worker"] == r["optimizer"] == cores
    plural = "s" if cores != 1 else ""
    assert r["log"].count(f"cpu plan: rank 0 not bound, {cores} optimizer thread{plural}, cpu_plan = off") == 1


def test_local_world_size_divides_and_explicit_too_high_is_clamped():
    cores = available_cores()
    r = _run({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(cores)})
    assert r["optimizer"] == 1 and "cpu plan: rank 0 not bound, 1 optimizer thread, cpu_plan = off" in r["log"]
    r = _run({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}, cores + 5)
    assert r["optimizer"] == r["after"] == cores
    assert f"optimizer.threads = {cores + 5} is more than the {cores} cores" in r["log"]
