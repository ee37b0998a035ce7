"""``zeroplug export --dtype fp32``: the fp32 masters of every rank, merged, one tensor at a time.

The masters come from a DeepSpeed-layout checkpoint of a torch model (tests/support/deepspeed_ckpt.py)
loaded into a bf16 engine, so the expected fp32 values are that model's own parameters,
which bf16 cannot hold: an export of the 16-bit weights would not pass.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import zeroplug
from zeroplug.cli import main

from tests.support.deepspeed_ckpt import write_deepspeed_checkpoint
from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet, batches


def trained():
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(2, 4):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def config(stage, world):
    return {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": 600, "sub_group_size": 700},
            "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1},
            "optimizer": {"plugin": "adamw", "lr": 1e-2}, "precision": {"plugin": "bf16"},
            "monitor": {"plugin": "none"}}


def _save(rank, world, ds_dir, out_dir, stage):
    engine = zeroplug.initialize(ToyNet(), config(stage, world))
    engine.load_checkpoint(ds_dir)
    return engine.save_checkpoint(out_dir)


@pytest.fixture(scope="module")
def model_and_ckpt(tmp_path_factory):
    model, opt = trained()
    tmp = tmp_path_factory.mktemp("fp32")
    write_deepspeed_checkpoint(tmp / "ds", model, opt, 2, 2)
    _save(0, 1, str(tmp / "ds"), str(tmp / "zp"), 2)
    return model, tmp


def _load_any(path):
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("out_name,fmt", [("w.safetensors", None), ("w.bin", None), ("dir", "bin"), ("dir", None)])
def test_values_are_the_fp32_masters(model_and_ckpt, out_name, fmt, capsys):
    model, tmp = model_and_ckpt
    out = tmp / f"{out_name}-{fmt}"
    if out_name != "dir":
        out = tmp / f"{fmt}-{out_name}"
    args = ["export", str(tmp / "zp"), str(out), "--dtype", "fp32"] + (["--format", fmt] if fmt else [])
    assert main(args) == 0
    written = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert len(written) == 1
    if out_name == "dir":
        assert written[0].endswith("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    sd = _load_any(written[0])
    want = model.state_dict()
    assert list(sd) == list(want)
    for k, v in want.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
    # the 16-bit export differs: these are not bf16 values
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in want.values())


def test_python_api_and_zero_to_fp32_names(model_and_ckpt):
    from zeroplug.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                       get_fp32_state_dict_from_zero_checkpoint,
                                                       load_state_dict_from_zero_checkpoint)
    model, tmp = model_and_ckpt
    want = model.state_dict()
    for src in ("zp", "ds"):         # zeroplug's checkpoint, and DeepSpeed's read without DeepSpeed
        sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp / src))
        assert all(torch.equal(sd[k], v) for k, v in want.items())
    files = convert_zero_checkpoint_to_fp32_state_dict(str(tmp / "zp"), str(tmp / "hf"), max_shard_size="4KB",
                                                       safe_serialization=True)
    index = json.loads((tmp / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"]) == set(want)
    merged = {}
    for f in files[:-1]:
        merged.update(_load_any(f))
    assert all(torch.equal(merged[k], v) for k, v in want.items())
    fresh = load_state_dict_from_zero_checkpoint(ToyNet(), str(tmp / "zp"))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    from zeroplug.checkpoint.fp32_export import export_fp32
    export_fp32(str(tmp / "zp"), str(tmp / "api.bin"))
    assert all(torch.equal(torch.load(tmp / "api.bin", weights_only=True)[k], v) for k, v in want.items())


@pytest.mark.slow
def test_two_rank_stage3_checkpoint(tmp_path, model_and_ckpt):
    """Shards of two ranks at stage 3 merge into the same fp32 weights."""
    model, tmp = model_and_ckpt
    run_ranks(_save, 2, str(tmp / "ds"), str(tmp_path / "zp3"), 3)
    assert main(["export", str(tmp_path / "zp3"), str(tmp_path / "o.safetensors"), "--dtype", "fp32"]) == 0
    sd = _load_any(tmp_path / "o.safetensors")
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_deepspeed_checkpoint_in_its_model_dtype(model_and_ckpt, capsys):
    """``zeroplug export`` of a DeepSpeed checkpoint without --dtype: the 16-bit weights."""
    model, tmp = model_and_ckpt
    assert main(["export", str(tmp / "ds"), str(tmp / "ds16.safetensors")]) == 0
    sd = _load_any(tmp / "ds16.safetensors")
    assert all(sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16))
               for k, v in model.state_dict().items())


def test_bad_output_one_line(model_and_ckpt, capsys):
    _, tmp = model_and_ckpt
    assert main(["export", str(tmp / "zp"), str(tmp / "x.safetensors"), "--dtype", "fp32", "--format", "bin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--format" in err[0]


MEASURE = textwrap.dedent("""
    import sys, threading, time, os, resource
    import torch
    from zeroplug.checkpoint.fp32_export import export_fp32, fp32_state_dict

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    peak = [0]
    stop = threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)
    mode, ckpt, out = sys.argv[1:4]
    base = rss()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    if mode == "stream":
        export_fp32(ckpt, out)
    else:
        sd = fp32_state_dict(ckpt)
    stop.set(); t.join()
    peak[0] = max(peak[0], rss())
    print(peak[0] - base)
""")


class Wide(torch.nn.Module):
    def __init__(self, width=512, layers=48):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def test_memory_stays_near_the_largest_tensor(tmp_path):
    """48 tensors of 1 MiB (fp32): the export's resident memory grows by a few of them plus a
    fixed part (the verification's 4 MiB read buffer, the rank file's index), while building
    the whole state dict grows by all 48 (the measurement sees the difference)."""
    torch.manual_seed(0)
    engine = zeroplug.initialize(Wide(), {"zero": {"plugin": "stage1"}, "precision": {"plugin": "bf16"},
                                         "batch": {"micro_batch_size": 1}, "monitor": {"plugin": "none"}})
    engine.save_checkpoint(tmp_path / "ck")
    del engine
    largest = 512 * 512 * 4
    total = 48 * largest

    def measure(mode):
        r = subprocess.run([sys.executable, "-c", MEASURE, mode, str(tmp_path / "ck"), str(tmp_path / "o.safetensors")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.strip().splitlines()[-1])

    whole = measure("whole")
    assert whole > 0.8 * total                      # the measurement sees a whole state dict
    grown = measure("stream")
    assert grown < 4 * largest + 12 * 2**20, f"streaming export grew {grown / 2**20:.1f} MiB"
