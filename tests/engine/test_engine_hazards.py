"""Hazards a DeepSpeed script meets in ``zeroplug.initialize`` itself (issue 32): the process
group under a launcher, save_16bit_model's directory form, torch's parameter-group flags,
offload_param below stage 3 (tests/integrations/test_deepspeed_compat.py). Writes to gathered parameters:
tests/stages/test_gathered_writes.py."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import zeroplug
from zeroplug.errors import ConfigError, ZeroplugError
from tests.support.toy import ToyNet, batches
from tests.support.paths import child_env

CFG = {"batch": {"micro_batch_size": 4, "gradient_clipping": 0.05}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
       "scheduler": {"plugin": "none"}, "monitor": {"plugin": "none"}}


def grouped(model):
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def test_groups_that_went_through_torch_adamw_train_like_torch():
    """``torch.optim.AdamW(groups).param_groups`` carry fused=None, foreach, capturable...: the
    first clipped step used to fail (``Expected grad_scale and found_inf to be None``)."""
    torch.manual_seed(0)
    ref_model = ToyNet()
    ref = torch.optim.AdamW(grouped(ref_model), lr=1e-2)
    want = []
    for x, y in batches(3, 4):
        loss = ref_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        ref.step()
        ref.zero_grad()
        want.append(loss.item())
    torch.manual_seed(0)
    model = ToyNet()
    groups = torch.optim.AdamW(grouped(model), lr=1e-2).param_groups
    assert groups[0]["fused"] is None and "capturable" in groups[0]
    engine = zeroplug.initialize(model, CFG, model_parameters=groups)
    got = []
    for x, y in batches(3, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torch_flags_that_change_the_maths_are_refused():
    model = ToyNet()
    groups = torch.optim.AdamW(model.parameters(), maximize=True).param_groups
    with pytest.raises(ConfigError, match=r"model_parameters\[0\]: maximize = True is not supported: .*negate"):
        zeroplug.initialize(model, CFG, model_parameters=groups)


def test_save_16bit_model_writes_into_a_directory(tmp_path):
    torch.manual_seed(0)
    model = ToyNet()
    engine = zeroplug.initialize(model, CFG)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "out"
    assert engine.save_16bit_model(str(out))                               # DeepSpeed's form: a directory
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
    got = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    engine.save_16bit_model(out, "model.safetensors")                       # an existing directory is fine
    from safetensors.torch import load_file
    st = load_file(out / "model.safetensors")
    assert all(torch.equal(st[k], want[k]) for k in want)
    engine.save_16bit_model(out, "small.bin", exclude_frozen_parameters=True)


def test_save_16bit_model_file_form_is_kept_with_a_deprecation_note(tmp_path):
    engine = zeroplug.initialize(ToyNet(), CFG)
    with pytest.warns(FutureWarning, match="pass a directory"):
        engine.save_16bit_model(str(tmp_path / "model.pt"))                 # a new weights file path
    assert (tmp_path / "model.pt").is_file()
    with pytest.warns(FutureWarning):
        engine.save_16bit_model(str(tmp_path / "model.pt"))                 # the existing file: rewritten
    (tmp_path / "plainfile").write_text("x")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        engine.save_16bit_model(str(tmp_path / "plainfile"))                 # an existing file of any name
    assert torch.load(tmp_path / "plainfile", weights_only=True).keys() == ToyNet().state_dict().keys()


# --- the process group under a launcher -------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_without_a_rendezvous_address_is_refused_in_one_line(monkeypatch):
    import torch.distributed as dist
    if dist.is_initialized():       # a group an earlier test left behind: initialize would use it
        dist.destroy_process_group()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ZeroplugError, match="WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT not set") as e:
        zeroplug.initialize(ToyNet(), CFG)
    assert "\n" not in str(e.value)


SCRIPT = textwrap.dedent("""
    import logging, sys, torch, torch.distributed as dist
    import zeroplug
    from tests.support.toy import ToyNet, batches
    lines = []
    class Keep(logging.Handler):
        def emit(self, record): lines.append(record.getMessage())
    logging.getLogger("zeroplug").addHandler(Keep(level=logging.WARNING))
    torch.manual_seed(0)
    cfg = {"batch": {"micro_batch_size": 2}, "zero": {"plugin": "stage2"}, "monitor": {"plugin": "none"},
           "scheduler": {"plugin": "none"}}
    engine = zeroplug.initialize(ToyNet(), cfg)          # no init_process_group in this script
    zeroplug.initialize(ToyNet(), cfg)                    # a second engine: the group is there
    rank = dist.get_rank()
    x, y = list(batches(1, 4))[0]
    loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    engine.backward(loss)
    engine.step()
    said = sum("started the gloo process group of 2 ranks" in l for l in lines)
    print(f"RESULT rank={rank} world={engine.run.world_size} backend={dist.get_backend()} said={said}", flush=True)
""")


@pytest.mark.slow
def test_initialize_under_torchrun_starts_the_process_group(tmp_path):
    """torchrun's variables and no init_process_group: every rank used to train alone."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = child_env(OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_port()), str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # (the ranks share torchrun's stdout: one rank's line may run into the other's)
    lines = sorted(re.findall(r"RESULT rank=\d world=\d backend=\w+ said=\d", out.stdout))
    assert lines == ["RESULT rank=0 world=2 backend=gloo said=1", "RESULT rank=1 world=2 backend=gloo said=0"]


AT_EXIT = textwrap.dedent("""
    import atexit, sys, torch.distributed as dist
    # registered first, so it runs after zeroplug's exit handler (atexit runs them last-in first-out)
    atexit.register(lambda: print(f"AT EXIT initialized={dist.is_initialized()}", flush=True))
    if sys.argv[1] == "zeroplug":
        from zeroplug.launch import start_process_group
        start_process_group("cpu", single=True, announce=False)
    else:
        dist.init_process_group("gloo")                  # the script's own group
        if sys.argv[1] == "engine":
            import zeroplug
            from tests.support.toy import ToyNet
            zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})
    print(f"STARTED {dist.get_backend()}", flush=True)
""")


@pytest.mark.parametrize("who, alive", [("zeroplug", False), ("engine", False), ("script", True)])
def test_the_gloo_group_zeroplug_runs_on_is_destroyed_at_exit(who, alive):
    """torch aborts about one two-rank gloo run in five at exit ("terminate called without an
    active exception") when the group is alive: the group zeroplug started (as DeepSpeed's
    initialize does, for scripts that never destroy it) or an engine ran on is destroyed
    before the interpreter ends; a script that never used zeroplug keeps its group (the
    control: the probe sees a live group)."""
    env = child_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    out = subprocess.run([sys.executable, "-c", AT_EXIT, who], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STARTED gloo" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"AT EXIT initialized={alive}" in out.stdout, out.stdout
