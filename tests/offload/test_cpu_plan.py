"""The CPU plan: cores split among local ranks (synthetic topologies), binding honouring an
outside affinity, the measured thread count cached for a second process, bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

from zeroplug.plugins.optim.cpu_adam import plan as cpu_plan, plan_cache as cpu_plan_cache
from zeroplug.plugins.optim.cpu_adam.topology import Topology, format_cpulist, parse_cpulist, split

from tests.support.paths import child_env


def _topo(cpus, n, rank, nodes=None, smt=None, gpu_nodes=(), **kw):
    core_of = {}
    if smt:         # logical i and i + smt are siblings
        core_of = {c: c % smt for c in cpus}
    return Topology(cpus=tuple(cpus), local_rank=rank, local_ranks=n, nodes=nodes or {}, core_of=core_of,
                    gpu_nodes=tuple(gpu_nodes), **kw)


def _all(n, **kw):
    return [split(_topo(rank=r, n=n, **kw)) for r in range(n)]


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpulist("") == ()


def test_64_cores_one_node_four_ranks_disjoint():
    sets = _all(4, cpus=range(64), nodes={0: frozenset(range(64))})
    assert [s.cpus for s in sets] == [tuple(range(16 * r, 16 * r + 16)) for r in range(4)]
    assert all(s.cores == 16 and s.warning is None and s.node == 0 for s in sets)


def test_two_numa_nodes_ranks_on_their_gpus_node():
    nodes = {0: frozenset(range(32)), 1: frozenset(range(32, 64))}
    # GPUs of ranks 0 and 1 hang off node 1, those of ranks 2 and 3 off node 0
    sets = _all(4, cpus=range(64), nodes=nodes, gpu_nodes=(1, 1, 0, 0))
    assert [s.node for s in sets] == [1, 1, 0, 0]
    assert sets[0].cpus == tuple(range(32, 48)) and sets[2].cpus == tuple(range(0, 16))
    flat = [c for s in sets for c in s.cpus]
    assert sorted(flat) == list(range(64))          # disjoint and complete
    # every GPU on node 0: two ranks there, two spill to node 1 (never two ranks per core)
    sets = _all(4, cpus=range(64), nodes=nodes, gpu_nodes=(0, 0, 0, 0))
    assert [s.node for s in sets] == [0, 0, 1, 1]
    assert len({c for s in sets for c in s.cpus}) == 64


def test_smt_siblings_stay_together_and_odd_counts():
    # 8 physical cores, logical i and i + 8 siblings; 3 ranks: 3 + 3 + 2 cores
    sets = _all(3, cpus=range(16), smt=8)
    assert [s.cores for s in sets] == [3, 3, 2]
    for s in sets:
        assert {c % 8 for c in s.cpus} == {c for c in s.cpus if c < 8}      # both siblings of each core
    assert sorted(c for s in sets for c in s.cpus) == list(range(16))


def test_set_smaller_than_the_ranks_is_not_split():
    s = split(_topo(cpus=(0, 1), n=4, rank=3))
    assert s.cpus == () and s.cores == 1
    assert "smaller than its 4 local ranks" in s.warning and "not binding" in s.warning


def test_outside_binding_and_quota():
    s = split(_topo(cpus=(8, 9, 10, 11), n=4, rank=2, bound_outside=True))
    assert s.cpus == (8, 9, 10, 11) and s.cores == 4
    s = split(_topo(cpus=range(64), n=4, rank=1, quota=8))
    assert len(s.cpus) == 16 and s.cores == 2       # a quota of 8 CPUs: 2 each


def test_candidates_budget_and_tie():
    assert cpu_plan.candidates(15) == [15, 11, 8, 6, 4]
    assert cpu_plan.candidates(1) == [1] * 5
    assert cpu_plan.budget(16, {"copy": 2}, loop=1) == 13
    assert cpu_plan.budget(2, {"copy": 2}, loop=1) == 1
    assert cpu_plan.pick({16: 10.0, 12: 9.8, 8: 9.75, 4: 6.0}) == 8    # within 3% of the best: fewer
    assert cpu_plan.pick({16: 10.0, 8: 9.0}) == 16
    # slots (the ranks' agreed rates) with their thread counts: the fewest threads near the best
    assert cpu_plan.pick({0: 10.0, 1: 9.9, 2: 7.0}, order=[15, 11, 8]) == 1


def test_plan_line():
    p = cpu_plan.Plan(0, tuple(range(16)), 12, {"copy": 2}, "measured", 9.8e9)
    assert p.describe() == "cpu plan: rank 0 cores 0-15, 12 optimizer threads, 2 copy threads, measured 9.8 G params/s"
    p = cpu_plan.Plan(3, (), 1, {}, "off")
    assert p.describe().startswith("cpu plan: rank 3 not bound, 1 optimizer thread, cpu_plan = off")


def _key(**change):
    t = _topo(cpus=range(4), n=1, rank=0)
    k = cpu_plan_cache.key(t, t.cpus, 3, "torch.bfloat16", "torch.bfloat16")
    k.update(change)
    return k


def test_cache_round_trip_and_bad_files(tmp_path):
    where = str(tmp_path / "plans")
    k = _key()
    assert cpu_plan_cache.load(k, where) == (None, None)
    assert cpu_plan_cache.store(k, {"threads": 2, "rate": 1.5e9}, where) is None
    assert cpu_plan_cache.load(k, where) == ({"threads": 2, "rate": 1.5e9}, None)
    assert oct(os.stat(cpu_plan_cache.path_for(k, where)).st_mode & 0o777) == "0o600"
    assert not [f for f in os.listdir(where) if f.endswith(".tmp")]
    path = cpu_plan_cache.path_for(k, where)
    with open(path, "w") as f:
        f.write("{not json")
    found, why = cpu_plan_cache.load(k, where)
    assert found is None and "corrupt" in why and "measuring again" in why
    with open(path, "w") as f:          # another key's entry under this name
        json.dump({"key": _key(cpu_model="other"), "threads": 2, "rate": 1.0}, f)
    found, why = cpu_plan_cache.load(k, where)
    assert found is None and "another machine's plan" in why
    with open(path, "w") as f:          # threads beyond the budget
        json.dump({"key": k, "threads": 99, "rate": 1.0}, f)
    assert "corrupt" in cpu_plan_cache.load(k, where)[1]
    if os.getuid() == 0:                # a file of another user
        cpu_plan_cache.store(k, {"threads": 2, "rate": 1.0}, where)
        os.chown(path, 12345, 12345)
        assert "not a file of this user" in cpu_plan_cache.load(k, where)[1]
    blocker = tmp_path / "file"
    blocker.write_text("")
    why = cpu_plan_cache.store(k, {"threads": 2, "rate": 1.0}, str(blocker / "plans"))
    assert why.startswith("cpu plan: cannot write the plan cache") and "measures again" in why


SCRIPT = r"""
import json, os, sys
from tests.support.toy import ToyNet
import torch
import zeroplug
cfg = {"zero": {"plugin": "stage3"}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-3, "cpu_plan": sys.argv[1]},
       "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}}
if len(sys.argv) > 2:
    cfg["optimizer"]["threads"] = int(sys.argv[2])
eng = zeroplug.initialize(ToyNet(), cfg, device="cpu")
print(json.dumps({"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                  "optimizer": eng.optimizer.threads}))
"""


def _run(cache, mode="measure", *extra, env_extra=None, cpus=None):
    env = child_env({k: v for k, v in os.environ.items() if k not in ("ZEROPLUG_CPU_ADAM_THREADS", "LOCAL_WORLD_SIZE",
                                                                      "LOCAL_RANK")})
    env.update(ZEROPLUG_CPU_ADAM_IMPL="eager", ZEROPLUG_CACHE_DIR=str(cache), **(env_extra or {}))
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, *map(str, extra)], env=env,
                         capture_output=True, text=True, timeout=300, preexec_fn=pre)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.slow
def test_outside_affinity_honoured_and_cache_reused_by_a_second_process(tmp_path):
    """A process started on CPU 0 only (taskset -c 0) plans within it: one line at the
    default log level, measured; a second process reads the cached plan."""
    first = min(os.sched_getaffinity(0))
    r, err = _run(tmp_path, cpus={first})
    assert r["affinity"] == [first] and r["threads"] == r["optimizer"] == 1
    lines = [ln for ln in err.splitlines() if "cpu plan:" in ln]
    assert lines == [f"[zeroplug] cpu plan: rank 0 cores {first}, 1 optimizer thread, measured "
                     f"{lines[0].split('measured ')[1]}"], err
    r, err = _run(tmp_path, cpus={first})
    assert [ln for ln in err.splitlines() if "cpu plan:" in ln][0].startswith(
        f"[zeroplug] cpu plan: rank 0 cores {first}, 1 optimizer thread, cached ")
    assert "measured" not in err
    plans = [f for d, _, fs in os.walk(tmp_path) if d.endswith(cpu_plan_cache.SUBDIR) for f in fs]
    assert len(plans) == 1 and plans[0].endswith(".json")


@pytest.mark.slow
def test_bad_input_warns_once_and_runs(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    # more local ranks than cores: not bound, one thread, one warning
    r, err = _run(tmp_path, env_extra={"LOCAL_WORLD_SIZE": str(len(cpus) + 2), "LOCAL_RANK": "0"})
    assert r["affinity"] == cpus and r["optimizer"] == 1
    assert err.count(f"smaller than its {len(cpus) + 2} local ranks: not binding") == 1
    # threads beyond the set: clamped, with a warning
    r, err = _run(tmp_path, "bind", len(cpus) + 5)
    assert r["optimizer"] == len(cpus)
    assert err.count(f"optimizer.threads = {len(cpus) + 5} is more than the {len(cpus)} CPUs") == 1
    assert "threads from optimizer.threads" in err
    # a cache that cannot be written: measured, warned, the run goes on
    blocker = tmp_path / "file"
    blocker.write_text("")
    r, err = _run(blocker / "cache")
    assert "cannot write the plan cache" in err and "measured" in err


def _ranks_plan(rank, world, cache):
    import io
    import logging

    import torch
    from tests.support.toy import ToyNet

    import zeroplug
    stream = io.StringIO()
    logging.getLogger("zeroplug").addHandler(logging.StreamHandler(stream))
    logging.getLogger("zeroplug").setLevel(logging.INFO)
    os.environ["ZEROPLUG_CACHE_DIR"] = cache
    os.environ.pop("ZEROPLUG_CPU_ADAM_THREADS", None)
    os.environ["ZEROPLUG_CPU_ADAM_IMPL"] = "eager"
    cfg = {"zero": {"plugin": "stage2"}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-3, "cpu_plan": "measure"},
           "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}}
    zeroplug.initialize(ToyNet(), cfg, device="cpu")
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), stream.getvalue()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.slow
def test_two_ranks_split_the_cores(tmp_path):
    from tests.support.distributed import run_ranks
    cpus = sorted(os.sched_getaffinity(0))
    res = run_ranks(_ranks_plan, 2, str(tmp_path))
    a, b = res[0][0], res[1][0]
    assert a and b and not set(a) & set(b) and set(a) | set(b) == set(cpus)
    assert res[0][1] == res[1][1]          # one thread count: a step waits for its slowest rank
    for rank, (aff, threads, log) in enumerate(res):
        plural = "s" if threads != 1 else ""
        assert f"cpu plan: rank {rank} cores {format_cpulist(aff)}, {threads} optimizer thread{plural}, measured" in log
    # one rank's cached plan gone: both measure again together (the same collectives on both)
    plans = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) if d.endswith(cpu_plan_cache.SUBDIR)
                   for f in fs)
    assert len(plans) == 2
    os.unlink(plans[0])
    res = run_ranks(_ranks_plan, 2, str(tmp_path))
    assert all(", measured " in log for _, _, log in res)
    res = run_ranks(_ranks_plan, 2, str(tmp_path))
    assert all(", cached " in log for _, _, log in res)


def test_tiers_declare_their_worker_threads(tmp_path):
    from zeroplug.engine import make_run
    _, run, _ = make_run({"zero": {"plugin": "stage3"}, "optimizer": {"plugin": "cpu_adam"},
                          "offload": {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path)},
                                      "param": {"plugin": "nvme", "nvme_path": str(tmp_path)}}}, device="cpu")
    assert cpu_plan.tier_workers(run) == {"copy": 4}       # each swapper's copy threads
    _, run, _ = make_run({"zero": {"plugin": "stage2"}, "offload": {"optimizer": {"plugin": "cpu"}}}, device="cpu")
    assert cpu_plan.tier_workers(run) == {}


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_calibration_steps_each_gradient_dtype(grad_dtype):
    """One rank keeps bf16 gradients on the host: the measurement steps them as the run will
    (a gradient of another dtype than its fp32 master is passed beside it, never as .grad)."""
    met = []
    rates, error = cpu_plan.calibrate([1, 2], lambda: met.append(1), grad_dtype=grad_dtype, elements=1 << 15)
    assert error is None and set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    assert len(met) == 2                                 # one barrier per count


def test_calibration_single_pass_proxy_and_kernel_choice(monkeypatch):
    """Where the compiled kernel will run, the one-pass fp32 fused step stands in for it;
    ZEROPLUG_CPU_ADAM_IMPL=eager measures the eager path the run will take."""
    met = []
    rates, error = cpu_plan.calibrate([1, 2, 1], lambda: met.append(1), grad_dtype=torch.bfloat16,
                                      elements=1 << 15, single_pass=True)
    assert error is None and set(rates) == {1, 2} and len(met) == 3
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")
    assert cpu_plan.compiled_kernel_expected() is False
