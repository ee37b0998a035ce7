"""DeepSpeed configs as users bring them: every config of the corpus (tests/integrations/data/deepspeed, real
files from public repositories, see SOURCES there) trains 2 steps of a tiny Hugging Face GPT-2
on CPU through ``zeroplug.initialize``, and the warnings each produces match the snapshot in
tests/integrations/data/deepspeed_warnings.json (``ZEROPLUG_UPDATE_SNAPSHOTS=1`` rewrites it after a
deliberate change). The rest: "auto" resolution, the refused keys and combinations, the
converted TOML training bit for bit like its JSON, and the generated compatibility table.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug.convert import convert_text, from_deepspeed
from zeroplug.errors import ConfigError

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "deepspeed"
CORPUS = sorted(DATA.glob("*.json"))
SNAPSHOT = DATA.parent / "deepspeed_warnings.json"


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture
def zeroplug_log():
    """Every WARNING+ message of the "zeroplug" logger, in order."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("zeroplug")
    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def train(engine, steps: int = 2, seed: int = 1) -> list[float]:
    """``steps`` optimizer steps on random tokens; the loss of each step's last micro batch."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps):
            x = torch.randint(0, 128, (2, 16), generator=g)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def snapshot():
    old = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.is_file() else {}
    new: dict[str, list[str]] = {}
    yield old, new
    if os.environ.get("ZEROPLUG_UPDATE_SNAPSHOTS") == "1" and new:
        SNAPSHOT.write_text(json.dumps({**old, **new}, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_corpus_config_trains_as_is(path, zeroplug_log, snapshot):
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zeroplug.initialize(model, str(path))
    losses = train(engine)
    gathers = getattr(engine.config.slot("zero").options, "stage3_gather_16bit_weights_on_model_save", True)
    # Note: stage 3 parameters are shards between steps; a config may forbid gathering them
    after = engine.consolidated_state_dict() if gathers or engine.config.slot("zero").name != "stage3" else None
    engine.close()
    assert engine.global_step == 2 and engine.skipped_steps < 2
    assert all(torch.isfinite(torch.tensor(losses)))
    if after is not None:
        assert any(not torch.equal(before[k].float(), after[k].float()) for k in before if k in after), \
            "nothing trained"
    old, new = snapshot
    new[path.name] = list(zeroplug_log)
    if os.environ.get("ZEROPLUG_UPDATE_SNAPSHOTS") != "1":
        assert zeroplug_log == old.get(path.name), (
            f"the warnings of {path.name} changed; if on purpose, rerun with ZEROPLUG_UPDATE_SNAPSHOTS=1")


def test_corpus_is_real_and_sourced():
    """At least 30 configs; each one (and each refused one) named in SOURCES with repository, path, commit."""
    rows = [r.split(" | ") for r in (DATA / "SOURCES").read_text().splitlines() if r and not r.startswith("#")]
    named = {r[0] for r in rows}
    files = {p.name for p in CORPUS} | {f"refused/{p.name}" for p in (DATA / "refused").glob("*.json")}
    assert len(CORPUS) >= 30 and files == named
    assert all(len(r) == 4 and "/" in r[1] and len(r[3]) == 40 for r in rows)


REFUSED = {
    "llamafactory_ds_z2_autotp.json": ["tensor_parallel.autotp_size = 2", "no tensor parallelism", "remove it"],
    "dse_megatron_zero3.json": ["zero_optimization.stage3_param_persitence_threshold",
                                "Did you mean 'stage3_param_persistence_threshold'?"],
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_corpus_configs_say_why(name):
    with pytest.raises(ConfigError) as exc:
        zeroplug.load_config(str(DATA / "refused" / name))
    assert all(s in str(exc.value) for s in REFUSED[name]), str(exc.value)
    assert name in str(exc.value)           # the file is named


def test_auto_values_resolved_once_and_printed(zeroplug_log):
    """HF-style "auto": sizes from the model's hidden size (32), the rest from the launcher's
    defaults; one line per value, once, with the value the run uses."""
    engine = zeroplug.initialize(tiny_gpt2(), str(DATA / "accelerate_zero_stage3.json"))
    z = engine.config.slot("zero").options
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == \
        (32 * 32, int(0.9 * 32 * 32), 320)
    b, o, s = engine.config.batch, engine.config.slot("optimizer").options, engine.config.slot("scheduler").options
    assert (b.micro_batch_size, b.gradient_accumulation_steps, b.train_batch_size, b.gradient_clipping) == (8, 1, 8, 1.0)
    assert (o.lr, o.weight_decay, s.warmup_min_lr, s.warmup_num_steps, s.total_num_steps) == (5e-5, 0.0, 0.0, 1, 10000)
    autos = [line for line in zeroplug_log if '= "auto" ->' in line]
    assert len(autos) == 13 and len(set(autos)) == 13
    assert any("zero_optimization.reduce_bucket_size = \"auto\" -> zero.reduce_bucket_size = 1024" in a
               for a in autos)
    assert any("scheduler.warmup_max_lr = 5e-05" in a for a in autos)      # shown as resolved, not "auto"
    engine.close()


def test_auto_precision_is_the_launchers_and_overrides_win(zeroplug_log):
    ds = json.loads((DATA / "transformers_tests_zero2.json").read_text())
    cfg = zeroplug.load_config(ds, overrides=["--precision.plugin=bf16", "--optimizer.lr=1e-4"])
    assert cfg.slot("precision").name == "bf16" and cfg.slot("optimizer").options.lr == 1e-4
    assert any('fp16.enabled = "auto" -> precision.plugin = bf16' in line for line in zeroplug_log)


def test_keys_deepspeed_accepts_are_accepted():
    """The keys a new user met as "unknown" or "no zeroplug equivalent"."""
    ds = {"train_micro_batch_size_per_gpu": 2, "prescale_gradients": True, "compile": {"deepcompile": False},
          "zero_force_ds_cpu_optimizer": False, "data_types": {"grad_accum_dtype": "fp32"},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "max_grad_norm": 1.0,
                                                   "bias_correction": True}},
          "zero_optimization": {"stage": 3, "max_live_parameters": 123, "prefetch_bucket_size": 7,
                                "stage3_gather_fp16_weights_on_model_save": False}}
    notes: list[str] = []
    cfg = zeroplug.load_config(from_deepspeed(ds, notes))
    z = cfg.slot("zero").options
    assert (z.stage3_max_live_parameters, z.stage3_prefetch_bucket_size,
            z.stage3_gather_16bit_weights_on_model_save) == (123, 7, False)
    assert cfg.slot("optimizer").name == "adamw"       # DeepSpeed's Adam is AdamW unless adam_w_mode = false
    assert cfg.batch.gradient_clipping == 0.0          # max_grad_norm does not clip (nor in DeepSpeed) ...
    assert sorted(n.split(" ")[0] for n in notes) == ["data_types.grad_accum_dtype", "optimizer.params.max_grad_norm"]


@pytest.mark.parametrize("params, offload, plugin, adamw_mode", [
    ({"adam_w_mode": False}, False, "adam", None),
    ({}, True, "auto", True),
    ({"adam_w_mode": False}, True, "cpu_adam", False),
    ({"bias_correction": False}, False, "cpu_adam", True),
])
def test_adam_translation(params, offload, plugin, adamw_mode):
    ds = {"optimizer": {"type": "Adam", "params": params},
          "zero_optimization": {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}}
    choice = zeroplug.load_config(ds).slot("optimizer")
    assert choice.name == plugin
    assert getattr(choice.options, "adamw_mode", None) == adamw_mode


@pytest.mark.parametrize("ds, key, parts", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled",
     ["fp16.enabled", "bf16.enabled", "both true", "keep one"]),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path",
     ["offload_optimizer.device = \"nvme\"", "offload_optimizer.nvme_path", "directory"]),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size", ["train_batch_size = 32", "train_micro_batch_size_per_gpu (4)",
                          "gradient_accumulation_steps (2)", "world size (1)", "= 8", "\"auto\""]),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "train_batch_size",
     ["train_batch_size = 30", "train_micro_batch_size_per_gpu (4)", "multiple of 4"]),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.cpu_offload", ["cpu_offload", "offload_optimizer", "both set"]),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled", ["fp16.enabled", "true, false or \"auto\""]),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com",
     ["Did you mean 'overlap_comm'?"]),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type", ["OneCycle", "WarmupLR"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "optimizer.params.momentum",
     ["optimizer.momentum", "DeepSpeed key optimizer.params.momentum"]),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", ["\"sum\"", "mean"]),
])
def test_conflicts_refused_with_deepspeed_key_names(ds, key, parts):
    with pytest.raises(ConfigError) as exc:
        zeroplug.load_config(ds)
    assert exc.value.key == key
    assert all(p in str(exc.value) for p in parts), str(exc.value)


@pytest.mark.parametrize("zero", [{"offload_param": {"device": "cpu", "pin_memory": True}},
                                  {"cpu_offload_param": True}])
def test_offload_param_below_stage_3_is_ignored_with_one_warning(zero, zeroplug_log):
    """DeepSpeed ignores offload_param below stage 3 (configs shared across stages carry it)."""
    cfg = zeroplug.load_config({"zero_optimization": {"stage": 2, **zero}})
    assert cfg.slot("zero").name == "stage2" and cfg.slot("offload.param").name == "none"
    assert cfg.slot("offload.optimizer").name == "none"
    assert sum("offload_param" in line and "ignored at stage 2" in line for line in zeroplug_log) == 1


def test_true_false_strings_are_read_as_booleans(zeroplug_log):
    cfg = zeroplug.load_config({"bf16": {"enabled": "true"},
                                "zero_optimization": {"stage": 1, "overlap_comm": "false"}})
    assert cfg.slot("precision").name == "bf16" and cfg.slot("zero").options.overlap_comm is False
    assert sum("(a string) read as" in line for line in zeroplug_log) == 2


def test_unknown_top_level_key_warns_with_a_suggestion():
    notes: list[str] = []
    from_deepspeed({"gradient_cliping": 1.0, "_comment": "ignored silently", "optimizer": {"type": "AdamW"}}, notes)
    assert notes == ["gradient_cliping is not a DeepSpeed key; DeepSpeed ignores it and so does zeroplug. "
                     "Did you mean 'gradient_clipping'?"]


def test_cli_convert_refuses_with_one_error_line(tmp_path, capsys):
    from zeroplug.cli import main
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert main(["convert", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: DeepSpeed keys fp16.enabled and bf16.enabled") and err.count("\n") == 1


@pytest.mark.parametrize("name", ["accelerate_zero_stage3_offload.json", "dse_cifar.json",
                                  "axolotl_zero3_bf16_cpuoffload_params.json"])
def test_convert_output_trains_bit_identically(name, tmp_path):
    """A DeepSpeed JSON and the TOML `zeroplug convert` writes for it: the same losses, bit for bit."""
    text = convert_text(json.loads((DATA / name).read_text()))
    assert "# auto:" in text or "# note:" in text
    toml = tmp_path / "zero.toml"
    toml.write_text(text)
    runs = []
    for source in (DATA / name, toml):
        engine = zeroplug.initialize(tiny_gpt2(), str(source))
        runs.append((train(engine, steps=3), engine.consolidated_state_dict()))
        engine.close()
    (loss_json, params_json), (loss_toml, params_toml) = runs
    assert loss_json == loss_toml
    assert params_json.keys() == params_toml.keys()
    assert all(torch.equal(params_json[k], params_toml[k]) for k in params_json)


def test_compat_doc_is_generated_from_the_table():
    from zeroplug.convert.keys import compat_markdown
    doc = Path(__file__).resolve().parents[2] / "docs" / "deepspeed-compat.md"
    assert doc.read_text() == compat_markdown() + "\n", "regenerate: zeroplug docs --deepspeed > docs/deepspeed-compat.md"


def _ranks_report(rank, world, path):
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("zeroplug").addHandler(Keep(level=logging.WARNING))
    cfg = zeroplug.load_config(path, world_size=world)
    return cfg.batch.train_batch_size, sum("DeepSpeed config:" in line for line in lines)


@pytest.mark.slow
def test_report_on_rank_zero_only_and_batch_from_world_size():
    from tests.support.distributed import run_ranks
    results = run_ranks(_ranks_report, 2, str(DATA / "fastchat_s3.json"))
    assert results[0][0] == results[1][0] == 16      # 8 per rank x 1 x 2 ranks
    assert results[0][1] > 0 and results[1][1] == 0
