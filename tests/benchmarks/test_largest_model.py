"""largest_model.py on the CPU: the search, its estimate and its table, at a tiny preset
(DeepSpeed: "not installed" where it is not)."""
from __future__ import annotations

import json

import pytest

from tests.benchmarks import largest_model as lm
from tests.benchmarks.memory_floor import deepspeed_installed


def test_host_bytes_per_parameter_arithmetic():
    """fp32 master 4 + bf16 gradient 2 + moments; + 2 with bf16 shards in the param tier."""
    assert lm.host_bytes_per_param("zeroplug-fp32-param-tier") == 16
    assert lm.host_bytes_per_param("zeroplug-fp32") == 14
    assert lm.host_bytes_per_param("zeroplug-bf16") == 10
    assert lm.host_bytes_per_param("zeroplug-int8") == 8 + 8 / 256
    assert lm.host_bytes_per_param("deepspeed") == 18 and lm.host_bytes_per_param("deepspeed-bf16") == 10
    # 13B with int8 states fits a 128 GiB host with room; with fp32 states it does not
    assert lm.predicted_host_gib("zeroplug-int8", "13B") < 105 < 128 < lm.predicted_host_gib("zeroplug-fp32", "13B")


def test_search_on_the_cpu(tmp_path, monkeypatch, capsys):
    """125M is predicted not to fit the given host, so the search starts at char-tiny, which
    trains in a process of its own; it then tries 125M, which zeroplug's host budget refuses
    (ZEROPLUG_HOST_MEMORY_LIMIT); the table and the JSON say so."""
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")       # no kernel build in the children
    monkeypatch.setenv("ZEROPLUG_HOST_MEMORY_LIMIT", "200MiB")  # char-tiny fits, 125M does not
    monkeypatch.setenv("OUT", str(tmp_path))
    engines = "zeroplug-int8" + ("" if deepspeed_installed() else ",deepspeed-bf16")
    assert lm.main(["--models", "125M,char-tiny", "--engines", engines, "--seq", "32", "--micro", "2",
                    "--steps", "2", "--host-gib", "3.5", "--budget-s", "300"]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "largest_model.json").read_text())
    z = res["engines"]["zeroplug-int8"]
    assert z["largest"] == "char-tiny"
    note, tiny, up = z["tried"]
    assert "predicted not to fit" in note["note"] and "125M" in note["note"]
    assert tiny["model"] == "char-tiny" and tiny["outcome"] == "trains"
    assert tiny["tokens_per_s"] > 0 and tiny["sampled_peak_rss_gib"] > 0
    assert up["model"] == "125M" and up["outcome"].startswith("host memory (refused by initialize)")
    assert "| zeroplug-int8 | 8.03 | char-tiny |" in out
    if not deepspeed_installed():
        assert "| deepspeed-bf16 | 10.00 | not installed |" in out


def test_probing_up_skips_a_size_that_failed_on_the_way_down(tmp_path, monkeypatch):
    """125M is predicted to fit but refused; char-tiny then trains, and the search ends there
    instead of trying 125M a second time."""
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")
    monkeypatch.setenv("ZEROPLUG_HOST_MEMORY_LIMIT", "200MiB")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert lm.main(["--models", "125M,char-tiny", "--engines", "zeroplug-int8", "--seq", "32", "--micro", "2",
                    "--steps", "2", "--host-gib", "64", "--budget-s", "300"]) == 0
    tried = json.loads((tmp_path / "largest_model.json").read_text())["engines"]["zeroplug-int8"]["tried"]
    assert [(t["model"], t["outcome"].split(" (")[0]) for t in tried] == [("125M", "host memory"),
                                                                          ("char-tiny", "trains")]


def test_several_ranks_and_nvme_arithmetic():
    """With several ranks the gradient shard is fp32 (4 bytes); with NVMe only the gradients
    stay in host memory and the rest goes to disk."""
    assert lm.host_bytes_per_param("zeroplug-int8", ranks=4) == 10 + 8 / 256
    assert lm.host_bytes_per_param("zeroplug-fp32", ranks=4, offload="nvme") == 4
    assert lm.disk_bytes_per_param("zeroplug-int8", "nvme") == 8 + 8 / 256
    assert lm.disk_bytes_per_param("deepspeed", "nvme") == 14 and lm.disk_bytes_per_param("zeroplug-int8") == 0
    # four ranks' fixed memory is counted once per rank
    one, four = lm.predicted_host_gib("zeroplug-int8", "13B"), lm.predicted_host_gib("zeroplug-int8", "13B", ranks=4)
    assert four - one > 3 * lm.FIXED_HOST_GIB


@pytest.mark.slow
def test_two_ranks_on_nvme(tmp_path, monkeypatch, capsys):
    """--gpus 2 --offload nvme on the CPU: each candidate is a torchrun of two gloo ranks with
    both tiers swapping to files under --nvme-path; the table says which preset trained."""
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert lm.main(["--gpus", "2", "--offload", "nvme", "--nvme-path", str(tmp_path / "nvme"),
                    "--models", "char-tiny", "--engines", "zeroplug-int8", "--seq", "32", "--micro", "2",
                    "--steps", "2", "--budget-s", "300"]) == 0
    res = json.loads((tmp_path / "out" / "largest_model.json").read_text())
    (tiny,) = res["engines"]["zeroplug-int8"]["tried"]
    assert tiny["outcome"] == "trains" and tiny["ranks"] == 2 and tiny["offload"] == "nvme"
    assert "| zeroplug-int8 | 4.00 | char-tiny |" in capsys.readouterr().out
    assert not any((tmp_path / "nvme").rglob("*.swp")), "swap files left behind"


def test_unknown_engine_is_refused(capsys):
    assert lm.main(["--engines", "zeroplug-int4"]) == 2
    assert capsys.readouterr().err.startswith("error: --engines zeroplug-int4: unknown")
