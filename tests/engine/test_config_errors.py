"""Bad configurations: every ConfigError names the full key path and says how to fix it.

Dicts, TOML files and command-line overrides all go through ``zeroplug.config.load``;
the last tests run the real CLI in a subprocess (``error: ...``, exit code 2, no traceback).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zeroplug.config import load
from zeroplug.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    # A stray allow/block list would change which plugins exist.
    monkeypatch.delenv("ZEROPLUG_PLUGINS_ALLOW", raising=False)
    monkeypatch.delenv("ZEROPLUG_PLUGINS_BLOCK", raising=False)


def write(tmp_path, text, name="zero.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# (id, raw dict, overrides, world_size, expected ConfigError.key, substrings the message must hold)
BAD_DICTS = [
    ("unknown-top-level-table", {"zeroo": {"plugin": "stage2"}}, None, 1, "zeroo",
     ["[zeroo]", "Did you mean 'zero'?", "Known tables:", "optimizer"]),
    ("unknown-key-in-slot-table", {"zero": {"overlap_com": True}}, None, 1, "zero.overlap_com",
     ["zero.overlap_com", "Did you mean 'overlap_comm'?", "Known keys of [zero]", "reduce_bucket_size"]),
    ("unknown-key-of-the-chosen-plugin", {"optimizer": {"plugin": "adamw", "momentum": 0.9}}, None, 1,
     "optimizer.momentum", ["optimizer.momentum", "Known keys of [optimizer]", "betas", "weight_decay"]),
    ("deepspeed-stage-key", {"zero": {"stage": 2}}, None, 1, "zero.stage",
     ["zero.stage", '[zero] plugin = "stage2"', "DeepSpeed's \"stage\""]),
    ("deepspeed-offload-device-key", {"offload": {"optimizer": {"device": "cpu"}}}, None, 1,
     "offload.optimizer.device", ['[offload.optimizer] plugin = "cpu"']),
    ("unknown-zero-plugin", {"zero": {"plugin": "stage4"}}, None, 1, "zero.plugin",
     ["zero.plugin", "'stage4'", "Did you mean 'stage3'?", "stage0, stage1, stage2, stage3"]),
    ("unknown-precision-plugin", {"precision": {"plugin": "fp61"}}, None, 1, "precision.plugin",
     ["precision.plugin", "Did you mean 'fp16'?", "bf16", "fp32"]),
    ("plugin-name-not-a-string", {"optimizer": {"plugin": 3}}, None, 1, "optimizer.plugin",
     ["optimizer.plugin", "plugin name (a string)"]),
    ("string-for-int", {"zero": {"reduce_bucket_size": "big"}}, None, 1, "zero.reduce_bucket_size",
     ["zero.reduce_bucket_size", "'big'", "wrong type", "an integer", "'auto'"]),
    ("bool-for-int", {"batch": {"micro_batch_size": True}}, None, 1, "batch.micro_batch_size",
     ["batch.micro_batch_size", "True", "an integer"]),
    ("bool-for-int-hysteresis", {"precision": {"plugin": "fp16", "hysteresis": True}}, None, 1,
     "precision.hysteresis", ["precision.hysteresis", "an integer"]),
    ("betas-wrong-length", {"optimizer": {"betas": [0.9]}}, None, 1, "optimizer.betas",
     ["optimizer.betas", "[0.9]", "a list of 2 numbers"]),
    ("non-integral-float-for-int", {"zero": {"allgather_bucket_size": 5.5}}, None, 1,
     "zero.allgather_bucket_size", ["zero.allgather_bucket_size", "5.5", "an integer"]),
    ("negative-lr", {"optimizer": {"lr": -1e-3}}, None, 1, "optimizer.lr",
     ["optimizer.lr", "-0.001", "out of range", ">= 0"]),
    ("nan-lr", {"optimizer": {"lr": float("nan")}}, None, 1, "optimizer.lr",
     ["optimizer.lr", "nan", "finite"]),
    ("hysteresis-zero", {"precision": {"plugin": "fp16", "hysteresis": 0}}, None, 1, "precision.hysteresis",
     ["precision.hysteresis", "= 0", "out of range", ">= 1"]),
    ("loss-scale-window-zero", {"precision": {"plugin": "fp16", "loss_scale_window": 0}}, None, 1,
     "precision.loss_scale_window", ["precision.loss_scale_window", ">= 1"]),
    ("betas-above-one", {"optimizer": {"betas": [0.9, 1.5]}}, None, 1, "optimizer.betas",
     ["optimizer.betas", "1.5", "out of range", "< 1"]),
    ("literal-not-allowed", {"scheduler": {"plugin": "warmup", "warmup_type": "cosine"}}, None, 1,
     "scheduler.warmup_type", ["scheduler.warmup_type", "'cosine'", "'log' or 'linear'"]),
    ("batch-size-mismatch", {"batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 2,
                                       "train_batch_size": 30}}, None, 2, "batch.train_batch_size",
     ["train_batch_size = 30", "micro_batch_size (4)", "gradient_accumulation_steps (2)", "world size (2)",
      "= 16", '"auto"']),
    ("batch-size-mismatch-world-4", {"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3,
                                               "train_batch_size": 12}}, None, 4, "batch.train_batch_size",
     ["train_batch_size = 12", "micro_batch_size (2)", "gradient_accumulation_steps (3)", "world size (4)",
      "= 24"]),
    ("auto-micro-not-divisible", {"batch": {"micro_batch_size": "auto", "gradient_accumulation_steps": 2,
                                            "train_batch_size": 30}}, None, 4, "batch.train_batch_size",
     ["batch.train_batch_size = 30", "not divisible", "(2)", "world size (4)", "multiple of 8"]),
    ("auto-accumulation-not-divisible", {"batch": {"micro_batch_size": 4, "train_batch_size": 10}}, None, 2,
     "batch.train_batch_size", ["batch.train_batch_size = 10", "not divisible", "micro_batch_size (4)",
                                "world size (2)", "multiple of 8"]),
    ("cpu-adam-amsgrad", {"optimizer": {"plugin": "cpu_adam", "amsgrad": True}}, None, 1, "optimizer.amsgrad",
     ["optimizer.amsgrad", "cpu_adam", 'optimizer.plugin = "adamw"', "amsgrad = false"]),
    ("nesterov-without-momentum", {"optimizer": {"plugin": "sgd", "nesterov": True}}, None, 1,
     "optimizer.nesterov", ["optimizer.nesterov", "momentum > 0", "momentum = 0.0"]),
    ("warmup-decay-total-below-warmup", {"scheduler": {"plugin": "warmup_decay", "warmup_num_steps": 100,
                                                       "total_num_steps": 50}}, None, 1,
     "scheduler.total_num_steps", ["scheduler.total_num_steps = 50", "warmup_num_steps = 100"]),
    ("warmup-cosine-total-below-warmup", {"scheduler": {"plugin": "warmup_cosine", "warmup_num_steps": 10,
                                                        "total_num_steps": 5}}, None, 1,
     "scheduler.total_num_steps", ["scheduler.total_num_steps = 5", "warmup_num_steps = 10"]),
    ("offload-param-with-stage2", {"zero": {"plugin": "stage2"}, "offload": {"param": {"plugin": "cpu"}}},
     None, 1, "offload.param.plugin", ["offload.param.plugin", "stage3", "[offload.optimizer]"]),
    ("unknown-offload-table", {"offload": {"foo": {"plugin": "cpu"}}}, None, 1, "offload.foo",
     ["[offload.foo]", "[offload.optimizer]", "[offload.param]"]),
    ("offload-table-typo", {"offload": {"optimzer": {"plugin": "cpu"}}}, None, 1, "offload.optimzer",
     ["[offload.optimzer]", "Did you mean 'optimizer'?"]),
    ("alias-given-twice", {"batch": {"micro_batch_size": 4, "train_micro_batch_size_per_gpu": 4}}, None, 1,
     "batch.train_micro_batch_size_per_gpu",
     ["batch.train_micro_batch_size_per_gpu", "twice", "micro_batch_size", "keep one"]),
    ("auto-not-allowed-float", {"optimizer": {"lr": "auto"}}, None, 1, "optimizer.lr",
     ["optimizer.lr", "'auto'", "a number"]),
    ("auto-not-allowed-int", {"batch": {"steps_per_print": "auto"}}, None, 1, "batch.steps_per_print",
     ["batch.steps_per_print", "'auto'", "an integer"]),
    ("table-not-a-table", {"batch": 3}, None, 1, "batch", ["[batch]", "must be a table"]),
    ("monitor-wrong-type", {"monitor": {"plugin": "csv", "path": 3}}, None, 1, "monitor.path",
     ["monitor.path", "a string"]),
    # command-line overrides, on top of a dict
    ("override-wrong-type", {}, ["--optimizer.lr=abc"], 1, "optimizer.lr",
     ["optimizer.lr", "'abc'", "a number"]),
    ("override-unknown-plugin", {"zero": {"plugin": "stage1"}}, ["--zero.plugin=stage9"], 1, "zero.plugin",
     ["zero.plugin", "'stage9'", "Did you mean", "stage0, stage1, stage2, stage3"]),
    ("override-unknown-key", {}, ["--zero.overlap_com=false"], 1, "zero.overlap_com",
     ["zero.overlap_com", "Did you mean 'overlap_comm'?"]),
    ("override-out-of-range", {}, ["--precision.plugin=fp16", "--precision.hysteresis=0"], 1,
     "precision.hysteresis", ["precision.hysteresis", ">= 1"]),
]


@pytest.mark.parametrize("raw,overrides,world,key,parts", [c[1:] for c in BAD_DICTS],
                         ids=[c[0] for c in BAD_DICTS])
def test_bad_config(raw, overrides, world, key, parts):
    with pytest.raises(ConfigError) as info:
        load(raw, overrides=overrides, world_size=world)
    msg = str(info.value)
    assert info.value.key == key, msg
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"


def test_at_least_twenty_distinct_bad_configs():
    assert len({c[0] for c in BAD_DICTS}) == len(BAD_DICTS) >= 20


@pytest.mark.parametrize("item", ["--optimizer.lr", "optimizer.lr", "--lr=3"])
def test_malformed_override(item):
    with pytest.raises(ConfigError) as info:
        load({}, overrides=[item])
    msg = str(info.value)
    assert repr(item) in msg
    assert "--section.key=value" in msg and "--optimizer.lr=1e-4" in msg


def test_override_into_a_non_table(tmp_path):
    with pytest.raises(ConfigError) as info:
        load({"batch": 3}, overrides=["--batch.micro_batch_size=2"])
    assert "batch" in str(info.value) and "not a table" in str(info.value)


def test_override_switching_a_plugin_leaves_out_the_replaced_plugins_keys(caplog):
    """--scheduler.plugin=none over a TOML [scheduler] of warmup_cosine: the TOML's keys that
    "none" has no option for are left out (with a note) instead of failing the run; keys the
    new plugin shares stay, and an unknown key written on the command line is still an error."""
    raw = {"scheduler": {"plugin": "warmup_cosine", "warmup_num_steps": 30, "total_num_steps": 300},
           "optimizer": {"plugin": "adamw", "lr": 2e-3, "betas": [0.9, 0.95]}}
    with caplog.at_level("INFO", logger="zeroplug"):
        cfg = load(raw, overrides=["--scheduler.plugin=none", "--optimizer.plugin=cpu_adam"])
    assert cfg.slots["scheduler"].name == "none"
    assert cfg.slots["optimizer"].options.lr == 2e-3 and tuple(cfg.slots["optimizer"].options.betas) == (0.9, 0.95)
    assert "warmup_num_steps, total_num_steps are left out" in caplog.text
    with pytest.raises(ConfigError) as info:
        load(raw, overrides=["--scheduler.plugin=none", "--scheduler.warmup_num_steps=5"])
    assert "unknown key scheduler.warmup_num_steps" in str(info.value)
    # the same plugin named again changes nothing
    assert load(raw, overrides=["--scheduler.plugin=warmup_cosine"]).slots["scheduler"].options.total_num_steps == 300


def test_toml_file_unknown_key_names_path(tmp_path):
    p = write(tmp_path, """
        [zero]
        plugin = "stage2"
        reduce_bucket_sise = 5e8
    """)
    with pytest.raises(ConfigError) as info:
        load(p)
    assert info.value.key == "zero.reduce_bucket_sise"
    assert "Did you mean 'reduce_bucket_size'?" in str(info.value)


def test_toml_file_wrong_type(tmp_path):
    p = write(tmp_path, """
        [precision]
        plugin = "fp16"
        initial_scale_power = "16"
    """)
    with pytest.raises(ConfigError) as info:
        load(p)
    assert info.value.key == "precision.initial_scale_power"
    assert "an integer" in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    p = write(tmp_path, """
        [zero
        plugin = "stage2"
    """, name="broken.toml")
    with pytest.raises(ConfigError) as info:
        load(p)
    msg = str(info.value)
    assert str(p) in msg and "not valid TOML" in msg


def test_missing_config_file(tmp_path):
    p = tmp_path / "nope" / "zero.toml"
    with pytest.raises(ConfigError) as info:
        load(p)
    msg = str(info.value)
    assert str(p) in msg and "does not exist" in msg


def test_config_of_wrong_kind():
    with pytest.raises(ConfigError) as info:
        load(42)
    assert "a path, a dict" in str(info.value)


# --- what is accepted ------------------------------------------------------------------

def test_alias_accepted_equals_micro_batch_size(tmp_path):
    a = load({"batch": {"train_micro_batch_size_per_gpu": 4}}, world_size=2)
    b = load({"batch": {"micro_batch_size": 4}}, world_size=2)
    assert a.batch.micro_batch_size == b.batch.micro_batch_size == 4
    assert a.batch.train_batch_size == 8
    p = write(tmp_path, """
        [batch]
        train_micro_batch_size_per_gpu = 3
        gradient_accumulation_steps = 2
    """)
    c = load(p)
    assert c.batch.micro_batch_size == 3 and c.batch.train_batch_size == 6


def test_int_option_accepts_integral_float(tmp_path):
    p = write(tmp_path, """
        [zero]
        reduce_bucket_size = 5e8
        allgather_bucket_size = 2e8
    """)
    opts = load(p).slot("zero").options
    assert opts.reduce_bucket_size == 500_000_000 and type(opts.reduce_bucket_size) is int
    assert opts.allgather_bucket_size == 200_000_000 and type(opts.allgather_bucket_size) is int
    opts = load(p, overrides=["--zero.reduce_bucket_size=1e3"]).slot("zero").options
    assert opts.reduce_bucket_size == 1000 and type(opts.reduce_bucket_size) is int


def test_auto_batch_sizes_filled_from_world_size():
    cfg = load({"batch": {"train_batch_size": 32, "gradient_accumulation_steps": 2}}, world_size=4)
    assert (cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps, cfg.batch.train_batch_size) == (4, 2, 32)
    cfg = load({"batch": {"micro_batch_size": 2, "train_batch_size": 16}}, world_size=2)
    assert cfg.batch.gradient_accumulation_steps == 4


def test_precedence_cli_over_file_over_defaults(tmp_path):
    p = write(tmp_path, """
        [optimizer]
        plugin = "adamw"
        lr = 0.01
        weight_decay = 0.1

        [zero]
        plugin = "stage1"
    """)
    defaults = load(None).slot("optimizer").options
    from_file = load(p)
    opts = from_file.slot("optimizer").options
    assert opts.lr == 0.01 and opts.weight_decay == 0.1          # file over defaults
    assert opts.eps == defaults.eps == 1e-8                      # defaults where the file is silent
    assert from_file.slot("zero").name == "stage1"
    cfg = load(p, overrides=["--optimizer.lr=0.02", "--zero.plugin=stage2", "--batch.micro_batch_size=3"])
    opts = cfg.slot("optimizer").options
    assert opts.lr == 0.02                                       # command line over file
    assert opts.weight_decay == 0.1                              # file value kept
    assert cfg.slot("zero").name == "stage2"
    assert cfg.batch.micro_batch_size == 3                       # command line over defaults
    # the same holds for a dict source, and the source is not modified
    raw = {"optimizer": {"lr": 0.5}}
    assert load(raw, overrides=["optimizer.lr=0.25"]).slot("optimizer").options.lr == 0.25
    assert raw == {"optimizer": {"lr": 0.5}}


def test_override_string_value_without_quotes():
    cfg = load({}, overrides=["--scheduler.plugin=warmup", "--scheduler.warmup_type=linear"])
    assert cfg.slot("scheduler").name == "warmup"
    assert cfg.slot("scheduler").options.warmup_type == "linear"


# --- the CLI ------------------------------------------------------------------------------

def _cli_available() -> bool:
    try:
        importlib.import_module("zeroplug.cli")
    except ImportError:
        return False
    return True


needs_cli = pytest.mark.skipif(not _cli_available(), reason="zeroplug.cli cannot be imported yet")


@needs_cli
def test_cli_subprocess_prints_error_without_traceback(tmp_path):
    """``python -m zeroplug.cli train --config bad.toml``: exit 2, ``error: ...``, no traceback."""
    bad = write(tmp_path, """
        [zero]
        plugin = "stage2"
        overlap_com = true
    """, name="bad.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROPLUG_PLUGINS_")}
    r = subprocess.run([sys.executable, "-m", "zeroplug.cli", "train", "--config", str(bad)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    assert r.stderr.startswith("error:") or "\nerror:" in r.stderr, out
    assert "zero.overlap_com" in r.stderr and "Did you mean 'overlap_comm'?" in r.stderr, out


@needs_cli
@pytest.mark.parametrize("case", ["bad-override", "malformed-override", "missing-file", "bad-toml"])
def test_cli_main_error_exit_code(tmp_path, capsys, monkeypatch, case):
    """The same contract through ``zeroplug.cli.main(argv)`` in this process (cheaper than a subprocess)."""
    from zeroplug.cli import main
    monkeypatch.chdir(tmp_path)
    good = write(tmp_path, """
        [zero]
        plugin = "stage1"
    """, name="good.toml")
    broken = write(tmp_path, "[zero\n", name="broken.toml")
    missing = tmp_path / "missing.toml"
    args, expect = {
        "bad-override": (["train", "--config", str(good), "--optimizer.lr=abc"], ["optimizer.lr", "a number"]),
        "malformed-override": (["train", "--config", str(good), "--optimizer.lr"],
                               ["--optimizer.lr", "--section.key=value"]),
        "missing-file": (["train", "--config", str(missing)], [str(missing), "does not exist"]),
        "bad-toml": (["train", "--config", str(broken)], [str(broken), "not valid TOML"]),
    }[case]
    try:
        rc = main(args)
    except SystemExit as exc:     # argparse refused the arguments
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert "error:" in err, err
    for part in expect:
        assert part in err, err


def test_zeroplug_device_env(monkeypatch):
    """ZEROPLUG_DEVICE picks the device when none is given; a bad value names the variable."""
    import zeroplug
    from tests.support.toy import ToyNet
    cfg = {"zero": {"plugin": "stage1"}, "monitor": {"plugin": "none"}}
    monkeypatch.setenv("ZEROPLUG_DEVICE", "cpu")
    assert zeroplug.initialize(ToyNet(), cfg).run.device == torch.device("cpu")
    monkeypatch.setenv("ZEROPLUG_DEVICE", "gpu7")
    with pytest.raises(ValueError, match="ZEROPLUG_DEVICE='gpu7' is not a device"):
        zeroplug.initialize(ToyNet(), cfg)
    # an explicit device wins over the variable
    assert zeroplug.initialize(ToyNet(), cfg, device="cpu").run.device == torch.device("cpu")
