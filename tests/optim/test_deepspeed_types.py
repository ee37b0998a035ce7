"""Every optimizer type of a DeepSpeed JSON is translated to the plugin that steps its update
rule, or refused with its reason (one line)."""
from __future__ import annotations

import pytest

import zeroplug
from zeroplug.errors import ConfigError


def _load(opt):
    return zeroplug.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": opt}).slot("optimizer")


def test_muon_takes_deepspeeds_rule_and_defaults():
    choice = _load({"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 3e-4, "momentum": 0.9,
                                               "ns_method": "standard", "weight_decay": 0.1}})
    o = choice.options
    assert choice.name == "muon" and o.rule == "deepspeed" and o.ns_method == "standard"
    assert (o.lr, o.muon_lr, o.adam_lr, o.momentum, o.weight_decay) == (1e-3, 0.02, 3e-4, 0.9, 0.1)
    assert o.betas == (0.9, 0.95) and o.eps == 1e-10          # DeepSpeed's Adam half's defaults


@pytest.mark.parametrize("opt,plugin", [
    ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98]}}, "lion"),
    ({"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3, "bias_correction": False}}, "lamb"),
    ({"type": "Adagrad", "params": {"lr": 1e-2, "eps": 1e-10}}, "ds_adagrad"),
    ({"type": "RMSprop", "params": {"lr": 1e-2, "alpha": 0.9, "centered": True}}, "torch"),
    ({"type": "NAdam", "params": {"lr": 1e-3, "momentum_decay": 4e-3}}, "torch"),
])
def test_types_become_plugins(opt, plugin):
    choice = _load(opt)
    assert choice.name == plugin
    for k, v in opt["params"].items():
        got = getattr(choice.options, k)
        assert (list(got) if isinstance(got, tuple) else got) == v, k
    if plugin == "torch":
        assert choice.options.name == opt["type"]


@pytest.mark.parametrize("kind,why", [("OneBitAdam", "compresses"), ("ZeroOneAdam", "compresses"),
                                      ("OneBitLamb", "compresses"), ("MuAdamW", "width multipliers"),
                                      ("LBFGS", "closure"), ("SparseAdam", "sparse"), ("NotAnOptimizer", "builds")])
def test_refused_types_say_why(kind, why):
    with pytest.raises(ConfigError, match=why) as e:
        _load({"type": kind, "params": {"lr": 1e-3}})
    assert "\n" not in str(e.value)
