"""Host memory as a budget: ``initialize`` refuses, before anything is allocated, a run
whose offload tiers need more host memory than the host has (all local ranks together,
cgroup limits included), with the numbers and the fix."""
from __future__ import annotations

import pytest
import torch

import zeroplug
from zeroplug.errors import HostMemoryError
from zeroplug.host_budget import LIMIT_ENV
from zeroplug.observe.memory import cgroup_memory

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet

ELEMENTS = sum(p.numel() for p in ToyNet().parameters())        # 6,772


def _cfg(stage=2, opt="adamw", **offload) -> dict:
    return {"zero": {"plugin": f"stage{stage}"}, "precision": {"plugin": "bf16"},
            "optimizer": {"plugin": opt}, "monitor": {"plugin": "none"},
            "offload": offload or {"optimizer": {"plugin": "cpu"}}}


# --- what the host has: cgroup limits, read from real files laid out as the kernel does ----------

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_of_an_ancestor_binds(tmp_path):
    _write(tmp_path / "proc", "0::/job/step\n")
    root = tmp_path / "cg"
    _write(root / "job" / "memory.max", str(1 << 30))
    _write(root / "job" / "memory.current", str(300 << 20))
    _write(root / "job" / "memory.stat", "anon 1\ninactive_file 104857600\nactive_file 5\n")
    _write(root / "job" / "step" / "memory.max", "max")
    _write(root / "job" / "step" / "memory.current", str(200 << 20))
    cg = cgroup_memory(str(tmp_path / "proc"), str(root))
    assert cg.version == 2 and cg.path == str(root / "job")
    assert cg.limit == 1 << 30 and cg.room == (1 << 30) - (200 << 20)     # page cache it can drop is room


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    _write(tmp_path / "proc", "5:cpu,cpuacct:/x\n4:memory:/slurm/job_7\n0::/\n")
    root = tmp_path / "cg"
    d = root / "memory" / "slurm" / "job_7"
    _write(d / "memory.limit_in_bytes", str(8 << 30))
    _write(d / "memory.usage_in_bytes", str(3 << 30))
    _write(d / "memory.stat", "total_inactive_file 0\n")
    _write(root / "memory" / "slurm" / "memory.limit_in_bytes", "9223372036854771712")   # v1's "unlimited"
    cg = cgroup_memory(str(tmp_path / "proc"), str(root))
    assert (cg.version, cg.limit, cg.room) == (1, 8 << 30, 5 << 30)
    _write(d / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_memory(str(tmp_path / "proc"), str(root)) is None


def test_cgroup_mounted_at_the_container_root(tmp_path):
    """A container sees its own cgroup at the mount's root while /proc names the host's path."""
    _write(tmp_path / "proc", "0::/kubepods/pod1/abc\n")
    root = tmp_path / "cg"
    _write(root / "memory.max", str(2 << 30))
    _write(root / "memory.current", str(1 << 30))
    cg = cgroup_memory(str(tmp_path / "proc"), str(root))
    assert cg.room == 1 << 30


# --- initialize refuses what cannot fit ----------------------------------------------------------------

def test_a_run_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch):
    need = ELEMENTS * 16                      # fp32 master 4 + fp32 gradient 4 + Adam's moments 8
    monkeypatch.setenv(LIMIT_ENV, str(need - 1))
    model = ToyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(HostMemoryError) as info:
        zeroplug.initialize(model, _cfg())
    msg = str(info.value)
    assert "\n" not in msg
    assert f"{ELEMENTS:,} master elements x 16 bytes: master 4 + gradient 4 + optimizer states 8" in msg
    assert f"need 105.81 KiB = {need:,} bytes per rank (offload.optimizer: 105.81 KiB pageable" in msg
    assert f"this host has 105.81 KiB = {need - 1:,} bytes ({LIMIT_ENV})" in msg
    assert "Fix: offload to NVMe" in msg and "smaller optimizer states" in msg
    # nothing was set up: the stage would have cast the parameters to bf16 and moved them
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    monkeypatch.setenv(LIMIT_ENV, str(need))
    zeroplug.initialize(ToyNet(), _cfg()).close()


def test_the_optimizers_state_bytes_are_counted(monkeypatch):
    """SGD without momentum keeps no state: half of what AdamW needs beside each master."""
    monkeypatch.setenv(LIMIT_ENV, str(ELEMENTS * 12))
    with pytest.raises(HostMemoryError, match="x 16 bytes"):
        zeroplug.initialize(ToyNet(), _cfg())
    zeroplug.initialize(ToyNet(), _cfg(opt="sgd")).close()
    momentum = _cfg(opt="sgd")
    momentum["optimizer"]["momentum"] = 0.9
    monkeypatch.setenv(LIMIT_ENV, str(ELEMENTS * 12 - 1))
    with pytest.raises(HostMemoryError, match=r"x 12 bytes: master 4 \+ gradient 4 \+ optimizer states 4"):
        zeroplug.initialize(ToyNet(), momentum)


def test_stage3_param_tier_counts_too(monkeypatch):
    need = ELEMENTS * 16 + ELEMENTS * 2       # + the bf16 parameter shards in host memory
    monkeypatch.setenv(LIMIT_ENV, str(need - 1))
    c = _cfg(3, optimizer={"plugin": "cpu"}, param={"plugin": "cpu"})
    with pytest.raises(HostMemoryError, match=rf"offload.param: .* {ELEMENTS:,} parameter elements x 2 bytes"):
        zeroplug.initialize(ToyNet(), c)
    monkeypatch.setenv(LIMIT_ENV, str(need))
    zeroplug.initialize(ToyNet(), c).close()


def test_no_offload_needs_no_host_budget(monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "1")
    zeroplug.initialize(ToyNet(), {"zero": {"plugin": "stage2"}, "monitor": {"plugin": "none"}}).close()


def _two(rank, world, limit):
    import os
    os.environ[LIMIT_ENV] = str(limit)
    try:
        zeroplug.initialize(ToyNet(), _cfg()).close()
    except HostMemoryError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_local_ranks_are_counted_together():
    """Each rank's shard fits alone; the two ranks on this host together do not."""
    per_rank = -(-ELEMENTS // 2) * 16
    got = run_ranks(_two, 2, per_rank + 1000, timeout=300)
    assert all(g is not None and "x 2 ranks on this host" in g and "fewer ranks on this host" in g for g in got), got
    assert f"{per_rank:,} bytes per rank" in got[0] and f"= {2 * per_rank:,} bytes" in got[0]
    assert run_ranks(_two, 2, 2 * per_rank, timeout=300) == [None, None]


def test_zeroplug_train_refuses_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    cfg = tmp_path / "z.toml"
    cfg.write_text('[offload.optimizer]\nplugin = "cpu"\n[zero]\nplugin = "stage2"\n')
    out = subprocess.run([sys.executable, "-m", "zeroplug.cli", "train", "--config", str(cfg), "--steps", "1"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, **{LIMIT_ENV: "1MiB"}))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "error: host memory: the offload tiers need" in line[0] and "Fix:" in line[0]
