"""``zeroplug-deepspeed`` / ``zeroplug launch``: DeepSpeed's launcher command line through torchrun."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from zeroplug.deepspeed.launcher.runner import format_line, main, plan

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "argv": sys.argv[1:],
           "local_rank_env": os.environ["LOCAL_RANK"], "sum": t.item(), "name": __name__,
           "cores": len(os.sched_getaffinity(0)), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def test_two_ranks_run_with_local_rank(tmp_path, script):
    """The launch line of DeepSpeed with one word changed: both ranks run, meet, get --local_rank."""
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "zeroplug.cli", "launch", "--num_gpus", "2", "--master_port",
                        str(_port()), "--bind_cores_to_rank", str(script), "--deepspeed", "ds.json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, out in enumerate(ranks):
        assert out["rank"] == i and out["world"] == 2 and out["sum"] == 3.0
        assert out["argv"] == [f"--local_rank={out['local_rank_env']}", "--deepspeed", "ds.json"]
        assert out["name"] == "__main__" and out["cuda_visible"] == "0,1"
        assert out["cores"] == max(1, len(os.sched_getaffinity(0)) // 2)


def _hostfile(tmp_path, text):
    p = tmp_path / "hostfile"
    p.write_text(text)
    return str(p)


def test_hostfile_include_exclude(tmp_path, script):
    hf = _hostfile(tmp_path, "# cluster\nlocalhost slots=4\n")
    (host, argv, env), = plan(["-H", hf, "--include", "localhost:1,3", str(script), "--x"])
    assert host == "localhost" and env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "--nproc-per-node=2" in argv and argv[-2:] == [str(script), "--x"]
    (_, argv, env), = plan(["-H", hf, "--exclude", "localhost:0", "--master_port", "1234", str(script)])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,3" and "--master-port=1234" in argv
    (_, argv, env), = plan(["-H", hf, "--num_gpus", "2", "--no_local_rank", "--module", "pkg.train"])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "--no-local-rank" in argv and "--module" in argv


def test_several_nodes(tmp_path, script, capsys):
    hf = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\nworker-2 slots=2\n")
    nodes = plan(["-H", hf, "--num_nodes", "2", str(script)])
    assert [n[0] for n in nodes] == ["worker-0", "worker-1"]
    for i, (_, argv, env) in enumerate(nodes):
        assert f"--node-rank={i}" in argv and "--nnodes=2" in argv and "--master-addr=worker-0" in argv
    (host, argv, _), = plan(["-H", hf, "--node_rank", "2", "--master_addr", "10.0.0.1", str(script)])
    assert host == "worker-2" and "--node-rank=2" in argv and "--master-addr=10.0.0.1" in argv
    assert main(["-H", hf, str(script)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1] == format_line(*plan(["-H", hf, str(script)])[0])
    # one host that is not this one: its line is printed, nothing runs here
    assert main(["-H", hf, "--include", "worker-1", str(script)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("worker-1: ") and "--nnodes=1" in lines[1]


@pytest.mark.parametrize("args,msg", [
    (["--include", "nohost:0"], "host 'nohost' is not among"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], "cannot be used together"),
    (["--num_gpus", "9"], "has 4 slot(s)"),
    (["--include", "localhost:7"], "not 7"),
    (["--autotuning", "tune"], "zeroplug tune"),
    (["--num_nodes", "3"], "only 1 host"),
])
def test_bad_input_one_line(tmp_path, script, capsys, args, msg):
    hf = _hostfile(tmp_path, "localhost slots=4\n")
    assert main(["-H", hf, *args, str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err


def test_bad_hostfile_and_script(tmp_path, script, capsys):
    assert main(["-H", _hostfile(tmp_path, "worker-0 4\n"), str(script)]) == 2
    assert main(["-H", str(tmp_path / "missing"), str(script)]) == 2
    assert main([str(tmp_path / "nope.py")]) == 2
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("error: ") for e in err)
    assert "line 1" in err[0] and "no such file" in err[1] and "no such script" in err[2]
