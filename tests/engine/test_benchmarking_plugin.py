"""The user-facing pytest plugin: ``pytest -p zeroplug.benchmarking`` and its ``zeroplug_step``
fixture, run as a user would (a separate pytest process on a test file of their own)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

USER_TEST = textwrap.dedent('''
    import pytest, torch
    from zeroplug.plugins.workload.models import GPT, GPTConfig

    CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2)

    def build_model():
        torch.manual_seed(0)
        return GPT(CFG)

    def make_batch(device):
        x = torch.randint(0, 64, (2, 17), device=device)
        return x[:, :-1], x[:, 1:]

    @pytest.mark.parametrize("stage", ["stage1", "stage3"])
    def test_mine(zeroplug_step, stage):
        result = zeroplug_step(build_model, make_batch, steps=3, warmup=1, baseline="torch",
                               config={"zero": {"plugin": stage}, "monitor": {"plugin": "none"},
                                       "batch": {"micro_batch_size": 2, "steps_per_print": 1}})
        assert result.tokens_per_step == 32
        assert result.losses[0] > 3.5           # ~ ln(64) at init
''')


def _pytest(tmp_path, *args, autoload=True):
    (tmp_path / "test_user.py").write_text(USER_TEST)
    env = {**os.environ, "ZEROPLUG_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    if not autoload:        # only what -p names is loaded: the plugin works without its entry point
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
           "-c", os.devnull, *args, str(tmp_path / "test_user.py")]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_fixture_records_tokens_memory_and_baseline_ratio(tmp_path):
    out = tmp_path / "bench.json"
    p = _pytest(tmp_path, "-p", "pytest_benchmark.plugin", "-p", "zeroplug.benchmarking",
                "--benchmark-enable", f"--benchmark-json={out}", autoload=False)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(rows) == {"test_mine[stage1]", "test_mine[stage3]"}
    for row in rows.values():
        info = row["extra_info"]
        assert row["stats"]["rounds"] == 3
        assert info["tokens_per_step"] == 32
        assert abs(info["tokens_per_s"] - 32 / row["stats"]["median"]) < 0.01 * info["tokens_per_s"]
        assert info["peak_host_bytes"] > 50 * 2**20 and info["peak_gpu_bytes"] == 0
        assert info["baseline"] == "torch" and info["baseline_tokens_per_s"] > 0
        ratio = info["tokens_per_s"] / info["baseline_tokens_per_s"]      # (both rounded to 0.1)
        assert abs(info["ratio_to_baseline"] - ratio) < 0.01 * ratio
        assert {"forward", "backward", "optimizer"} <= set(info["phases"])
    # the baseline is measured once per session and shared
    assert len({r["extra_info"]["baseline_tokens_per_s"] for r in rows.values()}) == 1


def test_fixture_under_benchmark_disable_runs_one_step(tmp_path):
    """The default test run: the configurations are checked to train, nothing is timed."""
    p = _pytest(tmp_path, "--benchmark-disable")       # the entry point loads the plugin
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 passed" in p.stdout
