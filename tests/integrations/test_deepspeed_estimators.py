"""DeepSpeed's memory estimators at their module paths print DeepSpeed's table with zeroplug's numbers."""
from __future__ import annotations

import re

import torch

from zeroplug.deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs_all_cold,
                                                    estimate_zero3_model_states_mem_needs_all_live)
from zeroplug.deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs_all_cold,
                                                           estimate_zero2_model_states_mem_needs_all_live)
from zeroplug.tools.probe import estimate_model_states

ROW = re.compile(r"^ +(\d+\.\d\d)GB \| +(\d+\.\d\d)GB \| (.+)$")


def _table(out: str):
    lines = out.splitlines()
    assert lines[0] == "Estimated memory needed for params, optim states and gradients for a:"
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    rows = [ROW.match(line) for line in lines[4:]]
    assert all(rows), lines[4:]
    return lines[1], lines[2], [(float(m[1]), float(m[2]), m[3]) for m in rows]


def test_zero2_table(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 500))
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    hw, sw, rows = _table(capsys.readouterr().out)
    assert hw == "HW: Setup with 1 node, 2 GPUs per node." and sw == "SW: Model with 1M total params."
    assert [r[2] for r in rows] == ["offload_optimizer=cpu ", "offload_optimizer=none"]
    n = 1000 * 1000 + 1000 + 1000 * 500 + 500
    want = estimate_model_states(n, 2, 2, 2, False, False)["device"] / 2**30
    assert rows[1][1] == round(want, 2)
    estimate_zero2_model_states_mem_needs_all_cold(6.7e9, num_gpus_per_node=8, num_nodes=2)
    hw, sw, big = _table(capsys.readouterr().out)
    assert hw == "HW: Setup with 2 nodes, 8 GPUs per node." and sw == "SW: Model with 6700M total params."
    assert big[0][1] < big[1][1]           # offloading the optimizer leaves less on the GPU


def test_zero3_table(capsys):
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 1000), torch.nn.Linear(1000, 1000))
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
    hw, sw, rows = _table(capsys.readouterr().out)
    assert sw == "SW: Model with 4M total params, 3M largest layer params."
    assert [r[2] for r in rows] == [
        "offload_param=cpu , offload_optimizer=cpu , zero_init=1",
        "offload_param=cpu , offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=cpu , zero_init=1",
        "offload_param=none, offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=none, zero_init=1",
        "offload_param=none, offload_optimizer=none, zero_init=0"]
    assert rows[0][1] <= rows[2][1] <= rows[4][1]       # the more is offloaded, the less per GPU
    assert rows[1][0] >= rows[0][0]                     # building whole on the host needs more than zero_init
    estimate_zero3_model_states_mem_needs_all_cold(2e10, 1e9, num_gpus_per_node=8)
    assert len(_table(capsys.readouterr().out)[2]) == 6
