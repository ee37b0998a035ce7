"""Checkpoints that never lose work.

Sharded, atomic and verified files; exact resume after SIGKILL for every stage and
tier; any world size on load (N ranks -> M ranks); a consolidated export that plain
PyTorch reads; keep_last; load_module_only / load_optimizer_states.

Run as a script (``python test_checkpoint.py train|resume ROOT STEPS``) it is the child
process of the SIGKILL tests: it trains every config of ``kill_configs`` one step at a
time, checkpointing each after every step, and prints each loss as it goes.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zeroplug
from zeroplug import checkpoint
from zeroplug.checkpoint import CheckpointError

from tests.support.distributed import run_ranks
from tests.support.paths import child_env
from tests.support.toy import ToyNet

HERE = Path(__file__).resolve()


class DropNet(ToyNet):
    """ToyNet with dropout: exact resume then also needs the RNG state back."""

    def forward(self, x, y=None):
        h = F.dropout(self.emb(x), 0.1, self.training)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def cfg(stage=0, world=1, global_batch=8, gas=1, **tables):
    c = {"zero": {"plugin": f"stage{stage}", "reduce_bucket_size": 600, "sub_group_size": 900},
         "batch": {"micro_batch_size": global_batch // world // gas, "gradient_accumulation_steps": gas,
                   "gradient_clipping": 1.0},
         "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
         "scheduler": {"plugin": "warmup_cosine", "warmup_num_steps": 3, "total_num_steps": 30},
         "monitor": {"plugin": "none"}}
    for k, v in tables.items():
        if k == "offload":
            c["offload"] = v
        else:
            c.setdefault(k, {}).update(v)
    return c


CPU = {"optimizer": {"plugin": "cpu"}}
FP16 = {"plugin": "fp16", "initial_scale_power": 20, "loss_scale_window": 3, "hysteresis": 1}
# every stage, the cpu tier, 16-bit precisions (non-aliased masters, the loss scaler), accumulation
CONFIGS = {
    "stage0": cfg(0),
    "stage1": cfg(1, gas=2),
    "stage2": cfg(2),
    "stage3": cfg(3),
    "stage2_cpu": cfg(2, offload=CPU),
    "stage3_cpu": cfg(3, offload=CPU),
    "stage3_bf16": cfg(3, precision={"plugin": "bf16"}),
    "stage1_fp16": cfg(1, precision=FP16),
}


def nvme(swap_dir) -> dict:
    """The optimizer on "NVMe": swap files under ``swap_dir`` (which must exist)."""
    return {"optimizer": {"plugin": "nvme", "nvme_path": str(swap_dir), "buffer_count": 2}}


def kill_configs(swap_dir) -> dict:
    """The configs of the SIGKILL tests: CONFIGS and the nvme tier (stages 2 and 3)."""
    return dict(CONFIGS, stage2_nvme=cfg(2, offload=nvme(swap_dir)),
                stage3_nvme=cfg(3, precision={"plugin": "bf16"}, offload=nvme(swap_dir)))


def batch(step, micro, world=1, rank=0, global_batch=8):
    """Micro-batch ``micro`` of step ``step`` (this rank's slice): a pure function of its position."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, 37, (global_batch, 8), generator=g)
    y = torch.randint(0, 37, (global_batch, 8), generator=g)
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def make(config, model_cls=ToyNet, seed=0):
    torch.manual_seed(seed)
    return zeroplug.initialize(model_cls(), config)


def train_step(engine, step, world=1, rank=0) -> float:
    """One optimizer step (all micro-steps); returns the global mean loss."""
    gas = engine.gradient_accumulation_steps
    total = 0.0
    for m in range(gas):
        x, y = batch(step, m, world, rank, global_batch=8 // gas)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        engine.run.comm.all_reduce(t)
        total += t.item() / world / gas
    return total


def train(engine, steps, world=1, rank=0) -> list[float]:
    return [train_step(engine, s, world, rank) for s in steps]


def _names(d) -> list[str]:
    """What a checkpoint directory holds, less the lock file of the run that writes it."""
    return sorted(p.name for p in Path(d).iterdir() if p.name != ".zeroplug.lock")


def close_rel(a, b, tol):
    return all(abs(x - y) <= tol * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b)) and len(a) == len(b)


# --- exact resume, in process ------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_exact(tmp_path, name):
    c = CONFIGS[name]
    ref = train(make(c, DropNet), range(8))
    e = make(c, DropNet)
    first = train(e, range(5))
    path = e.save_checkpoint(tmp_path, client_state={"data_pos": 5})
    assert Path(path) == tmp_path / "global_step5" and (tmp_path / "latest").read_text() == "global_step5"
    counters = (e.global_step, e.micro_step, e.skipped_steps, e.lr_step, e.precision.state_dict())
    e.close()
    torch.manual_seed(123)                     # the checkpoint's RNG state must win
    e2 = make(c, DropNet, seed=7)              # other initial weights: all must be overwritten
    got_path, client = e2.load_checkpoint(tmp_path)
    assert got_path == path and client == {"data_pos": 5}
    assert (e2.global_step, e2.micro_step, e2.skipped_steps, e2.lr_step, e2.precision.state_dict()) == counters
    rest = train(e2, range(client["data_pos"], 8))
    assert first + rest == ref                 # bit-identical
    if name == "stage1_fp16":
        assert e2.skipped_steps > 0            # the scaler's state mattered
    e2.close()


def test_cross_stage_and_tier(tmp_path):
    """The format knows no stage: stage 0 -> stage 3, stage 2 -> cpu tier, bf16 -> fp32."""
    for src, dst in (("stage0", "stage3"), ("stage2", "stage2_cpu"), ("stage3_cpu", "stage0")):
        ref = train(make(CONFIGS[src]), range(6))
        e = make(CONFIGS[src])
        first = train(e, range(3))
        e.save_checkpoint(tmp_path / src)
        e2 = make(CONFIGS[dst], seed=5)
        e2.load_checkpoint(tmp_path / src)
        assert close_rel(first + train(e2, range(3, 6)), ref, 1e-6), (src, dst)
    e = make(CONFIGS["stage3_bf16"])
    train(e, range(3))
    e.save_checkpoint(tmp_path / "bf16")
    e2 = make(cfg(2), seed=5)
    e2.load_checkpoint(tmp_path / "bf16")      # an fp32 model gets the bf16 run's fp32 masters
    w16, w32 = e.consolidated_state_dict(), e2.consolidated_state_dict()
    assert all(torch.equal(w32[k].to(torch.bfloat16), v) for k, v in w16.items())
    assert any(not torch.equal(w32[k], v.float()) for k, v in w16.items())


# --- SIGKILL at a random step, resume in a fresh process -----------------------------------

def _child(mode: str, root: Path, steps: int, die_in_save: int | None = None, async_save: bool = False,
           die_at: str = "manifest") -> None:
    torch.set_num_threads(1)
    # Note: the configs take turns in one process; each keeps its own torch RNG state (the
    # dropout masks), swapped in around its steps, as if each ran in a process of its own.
    engines, start, rng = {}, {}, {}
    swap = root / "swap"
    swap.mkdir(exist_ok=True)
    for name, c in kill_configs(swap).items():
        engines[name] = make(c, DropNet)
        start[name] = 0
        if mode == "resume":
            _, client = engines[name].load_checkpoint(root / name)
            start[name] = client["data_pos"]
        rng[name] = torch.get_rng_state()
    # the swap directories now: a killed run's are removed when the next one starts
    print(json.dumps({"pid": os.getpid(), "swap": sorted(os.listdir(swap))}), flush=True)
    if die_in_save is not None and die_at == "manifest":    # SIGKILL while the save of step
        orig = checkpoint.write_manifest                     # `die_in_save` is half done

        def dying(directory, manifest):
            orig(directory, manifest)
            if manifest["global_step"] == die_in_save:
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.write_manifest = dying
    elif die_in_save is not None:     # ... or in the middle of writing a rank file
        def dying_write(obj, path):
            if Path(path).parent.name.startswith(f".tmp-global_step{die_in_save}-"):
                with open(path, "wb") as f:
                    f.write(b"PK\x03\x04 half a rank file")
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(obj, path)
        real_write = checkpoint.write_torch_file
        checkpoint.write_torch_file = dying_write
    for step in range(min(start.values()), steps):
        for name, e in engines.items():
            if step < start[name]:
                continue
            torch.set_rng_state(rng[name])
            loss = train_step(e, step)
            e.save_checkpoint(root / name, client_state={"data_pos": step + 1}, async_save=async_save)
            rng[name] = torch.get_rng_state()
            print(json.dumps({"cfg": name, "step": step, "loss": loss.hex()}), flush=True)
        print(f"STEP {step}", flush=True)


def _spawn(*args):
    return subprocess.Popen([sys.executable, str(HERE), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE.parent, env=child_env())


def _losses(lines) -> dict:
    out: dict = {}
    for line in lines:
        if line.startswith('{"cfg"'):
            d = json.loads(line)
            out.setdefault(d["cfg"], {})[d["step"]] = float.fromhex(d["loss"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_at_random_step_then_resume_exact(tmp_path, async_save):
    steps = 6
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # (an asynchronous first save may still be in flight at STEP 0: no checkpoint to resume then)
    kill_after = rng.randint(1 if async_save else 0, steps - 3)
    delay = rng.uniform(0.0, 0.05)          # often lands in the middle of the next step's saves
    child = _spawn("train", tmp_path, steps, *(["--async"] if async_save else []))
    seen = []
    for line in child.stdout:
        seen.append(line.strip())
        if line.strip() == f"STEP {kill_after}":
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()
    swap = tmp_path / "swap"
    stale = sorted(os.listdir(swap))        # SIGKILL: no clean-up ran
    assert len(stale) == 2 and all(f"-{child.pid}-" in d for d in stale), stale
    # the reference: the same training, uninterrupted, in this process
    (tmp_path / "refswap").mkdir()
    configs = kill_configs(tmp_path / "refswap")
    ref = {}
    for n, c in configs.items():
        e = make(c, DropNet)
        ref[n] = train(e, range(steps))
        e.close()
    for name in configs:
        assert (tmp_path / name / "latest").is_file()
    resumed = subprocess.run([sys.executable, str(HERE), "resume", str(tmp_path), str(steps),
                              *(["--async"] if async_save else [])],
                             capture_output=True, text=True, cwd=HERE.parent, env=child_env())
    assert resumed.returncode == 0, resumed.stderr
    at_start = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith('{"pid"')][0]
    assert len(at_start["swap"]) == 2 and all(f"-{at_start['pid']}-" in d for d in at_start["swap"]), \
        (at_start, stale)                   # the killed run's directories were removed at start
    assert os.listdir(swap) == []           # and the resumed run's own at its exit
    before, after = _losses(seen), _losses(resumed.stdout.splitlines())
    for name in configs:
        got = after[name]
        first = min(got)
        # Note: an asynchronous save of step k may still be in flight when STEP k is
        # printed; the one before it has finished (the save of step k waited for it)
        assert first >= kill_after + (not async_save), (name, first, seed)
        assert [got[s] for s in range(first, steps)] == ref[name][first:], (name, seed, delay)
        assert all(before[name][s] == ref[name][s] for s in before.get(name, {})), name


@pytest.mark.parametrize("async_save,die_at", [(False, "manifest"), (False, "rankfile"),
                                                (True, "manifest"), (True, "rankfile")])
def test_sigkill_during_save_keeps_previous(tmp_path, async_save, die_at):
    """SIGKILL in the middle of a save (for ``async_save``: in its background writer, while
    the training thread goes on) leaves the previous checkpoint loadable."""
    child = _spawn("train", tmp_path, 3, "--die-in-save", 2, "--die-at", die_at,
                   *(["--async"] if async_save else []))
    out, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err
    d = tmp_path / "stage0"               # the first config died in its second save
    assert (d / "latest").read_text() == "global_step1"
    assert not (d / "global_step2").exists()
    assert [p.name for p in d.iterdir() if p.name.startswith(".tmp-global_step2-")]   # the half save
    e = make(CONFIGS["stage0"], DropNet)
    path, client = e.load_checkpoint(d)
    assert Path(path).name == "global_step1" and client == {"data_pos": 1}
    e.save_checkpoint(d)                  # the next save removes the stale temporary directory
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == [".zeroplug.lock"]   # (e holds it)


# --- atomicity and verification, in process ---------------------------------------------------

def test_failed_write_leaves_previous(tmp_path, monkeypatch):
    e = make(CONFIGS["stage2"])
    train(e, range(2))
    e.save_checkpoint(tmp_path, client_state={"n": 2})
    saved = {k: v.clone() for k, v in e.consolidated_state_dict().items()}
    train(e, range(2, 3))
    real = checkpoint.write_torch_file

    def broken(obj, path):
        with open(path, "wb") as f:
            f.write(b"PK half a file")
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(checkpoint, "write_torch_file", broken)
    with pytest.raises(CheckpointError, match="No space left"):
        e.save_checkpoint(tmp_path, client_state={"n": 3})
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert _names(tmp_path) == ["global_step2", "latest"]   # no half directory
    # a failure after all files are written (e.g. the manifest) is no different
    monkeypatch.setattr(checkpoint, "write_torch_file", real)
    monkeypatch.setattr(checkpoint, "write_manifest", lambda *a: (_ for _ in ()).throw(OSError("injected")))
    with pytest.raises(CheckpointError, match="injected"):
        e.save_checkpoint(tmp_path)
    assert _names(tmp_path) == ["global_step2", "latest"]
    e2 = make(CONFIGS["stage2"], seed=3)
    assert e2.load_checkpoint(tmp_path)[1] == {"n": 2}
    got = e2.consolidated_state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.items())


def test_client_state_must_be_plain(tmp_path):
    e = make(CONFIGS["stage1"])
    with pytest.raises(CheckpointError, match=r"client_state\['it'\] is a .*object"):
        e.save_checkpoint(tmp_path, client_state={"it": object()})
    assert not (tmp_path / "latest").exists() and _names(tmp_path) == []


def _saved(tmp_path, config="stage1"):
    e = make(CONFIGS[config])
    train(e, range(2))
    return e, Path(e.save_checkpoint(tmp_path))


def test_corruption_and_missing_files_are_named(tmp_path):
    e, path = _saved(tmp_path)
    f = path / "rank_00000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"file rank_00000\.pt is corrupt \(sha256"):
        make(CONFIGS["stage1"]).load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt is corrupt"):
        checkpoint.consolidate(tmp_path)
    f.write_bytes(bytes(data) + b"x")
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt is corrupt \(size"):
        make(CONFIGS["stage1"]).load_checkpoint(tmp_path)
    f.unlink()
    with pytest.raises(CheckpointError, match=r"file rank_00000\.pt is missing"):
        make(CONFIGS["stage1"]).load_checkpoint(tmp_path)
    m = path / "manifest.json"
    m.write_text(m.read_text().replace('"global_step": 2', '"global_step": 3'))
    with pytest.raises(CheckpointError, match=r"manifest\.json is corrupt"):
        make(CONFIGS["stage1"]).load_checkpoint(tmp_path)
    m.unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        make(CONFIGS["stage1"]).load_checkpoint(tmp_path)


def test_missing_dir_tag_and_wrong_model(tmp_path):
    e = make(CONFIGS["stage0"])
    with pytest.raises(CheckpointError, match="does not exist"):
        e.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        e.load_checkpoint(tmp_path)
    e.save_checkpoint(tmp_path, tag="mine")
    with pytest.raises(CheckpointError, match="'other' not found"):
        e.load_checkpoint(tmp_path, tag="other")
    assert Path(e.load_checkpoint(tmp_path, tag="mine")[0]).name == "mine"
    assert Path(e.load_checkpoint(tmp_path / "mine")[0]).name == "mine"       # a tag directory itself
    with pytest.raises(CheckpointError, match="plain name"):
        e.save_checkpoint(tmp_path, tag="../escape")
    torch.manual_seed(0)
    other = zeroplug.initialize(ToyNet(d=16), CONFIGS["stage0"])
    with pytest.raises(CheckpointError, match="does not fit this model.*shape mismatch: blocks"):
        other.load_checkpoint(tmp_path)


def test_saving_to_an_existing_tag_replaces_it(tmp_path):
    e = make(CONFIGS["stage2"])
    train(e, range(1))
    e.save_checkpoint(tmp_path, tag="t")
    train(e, range(1, 2))
    e.save_checkpoint(tmp_path, tag="t")
    assert _names(tmp_path) == ["latest", "t"]
    e2 = make(CONFIGS["stage2"])
    e2.load_checkpoint(tmp_path)
    assert e2.global_step == 2


def test_keep_last(tmp_path):
    c = cfg(1, checkpoint={"keep_last": 2})
    e = make(c)
    for s in range(4):
        train(e, [s])
        e.save_checkpoint(tmp_path)
    e.save_checkpoint(tmp_path, tag="named")            # newest (same step as global_step4)
    names = _names(tmp_path)
    assert names == ["global_step4", "latest", "named"]
    assert (tmp_path / "latest").read_text() == "named"


def test_load_module_only_and_without_optimizer_states(tmp_path):
    c = CONFIGS["stage2_cpu"]
    e = make(c)
    train(e, range(3))
    e.save_checkpoint(tmp_path, client_state={"k": 1})
    weights = e.consolidated_state_dict()
    # module only: weights (and masters from them); no optimizer state, counters or schedule
    e2 = make(c, seed=9)
    _, client = e2.load_checkpoint(tmp_path, load_module_only=True)
    assert client == {"k": 1}
    assert all(torch.equal(v, weights[k]) for k, v in e2.consolidated_state_dict().items())
    assert e2.global_step == 0 and e2.lr_step == 0 and not e2.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(e2.partitioner.master_params(), e.partitioner.master_params()))
    # no optimizer states: counters and masters come back, the Adam moments start fresh
    e3 = make(c, seed=9)
    e3.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert e3.global_step == 3 and e3.lr_step == 3 and not e3.optimizer.state
    fresh = make(c)
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    fresh.lr_step = 3
    assert train(e3, range(3, 5)) == train(fresh, range(3, 5))
    # without the scheduler state the schedule keeps its own position
    e4 = make(c, seed=9)
    e4.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert e4.global_step == 3 and e4.lr_step == 0 and len(e4.optimizer.state) > 0


def test_rank_file_holds_only_views_of_its_pieces(tmp_path):
    """Saving writes each piece from live memory: the file holds each state once (no
    whole-buffer storages behind views), and the save makes no copy of the states."""
    e = make(cfg(0))
    train(e, range(1))
    n = sum(p.numel() for p in e.module.parameters())
    path = Path(e.save_checkpoint(tmp_path))
    size = (path / "rank_00000.pt").stat().st_size
    assert 3 * 4 * n <= size < 3 * 4 * n + 60_000        # param (= master) + exp_avg + exp_avg_sq
    state = checkpoint.load(path / "rank_00000.pt")
    pc = state["model"]["pieces"]["emb.weight"][0]
    assert pc["param"].untyped_storage().nbytes() == pc["param"].numel() * 4


# --- export -------------------------------------------------------------------------------

class TiedNet(ToyNet):
    def __init__(self):
        super().__init__(vocab=37, d=24)
        self.head.weight = self.emb.weight
        self.register_buffer("counter", torch.arange(5.0))


def test_export_plain_torch(tmp_path):
    for name in ("stage3_bf16", "stage0"):
        e = make(CONFIGS[name], TiedNet)
        train(e, range(2))
        e.module.counter += 1
        e.save_checkpoint(tmp_path / name)
        want = e.consolidated_state_dict()
        out = checkpoint.export(tmp_path / name, tmp_path / f"{name}.pt")
        sd = torch.load(out, weights_only=True)       # plain torch, no code executed
        assert list(sd) == list(want)
        for k, v in want.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
        assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()    # tied, as in state_dict
        ToyNet_ = TiedNet()
        ToyNet_.to(want["emb.weight"].dtype).load_state_dict(sd)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="needs the safetensors package"):
            checkpoint.export(tmp_path / "stage0", tmp_path / "m.safetensors")
    else:
        from safetensors.torch import load_file
        checkpoint.export(tmp_path / "stage0", tmp_path / "m.safetensors")
        assert set(load_file(tmp_path / "m.safetensors")) == set(want)


def test_cli_export_and_train_resume(tmp_path, capsys):
    from zeroplug.cli import main
    # the schedule's length is set, not taken from --steps: the 3-step run and its resumption
    # train on the 5-step run's schedule
    common = ["train", "--max-bytes", "120000", "--seq", "16", "--batch.micro_batch_size=2",
              "--batch.steps_per_print=100", "--monitor.plugin=none", "--scheduler.total_num_steps=5",
              "--scheduler.warmup_num_steps=2"]
    assert main([*common, "--steps", "5"]) == 0
    full = capsys.readouterr().out
    ck = f"--checkpoint.dir={tmp_path / 'ck'}"
    assert main([*common, "--steps", "3", ck, "--checkpoint.every_n_steps=2", "--checkpoint.keep_last=1"]) == 0
    assert _names(tmp_path / "ck") == ["global_step3", "latest"]
    capsys.readouterr()
    assert main([*common, "--steps", "5", ck, "--checkpoint.every_n_steps=2", "--resume"]) == 0
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and "at step 3" in resumed
    last = [line for line in full.splitlines() if line.startswith("train loss")][0].split("->")[1]
    assert last in resumed                       # the same last-step loss as the uninterrupted run
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "m.pt")]) == 0
    sd = torch.load(tmp_path / "m.pt", weights_only=True)
    assert "tok_emb.weight" in sd
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- any world size: N ranks -> M ranks ---------------------------------------------------------

RESHAPE = ("stage0", "stage1", "stage2", "stage3", "stage2_cpu", "stage2_nvme")
K, C = 3, 3           # steps before the checkpoint, steps after it


def _reshape_cfg(name, world, root):
    if name.endswith("_cpu"):
        return cfg(int(name[5]), world=world, offload=CPU)
    if name.endswith("_nvme"):
        swap = Path(root) / "swap"
        swap.mkdir(exist_ok=True)
        return cfg(int(name[5]), world=world, offload=nvme(swap))
    return cfg(int(name[5]), world=world)


def _reshape_worker(rank, world, root, loads):
    """Train K steps, save, train C more (the reference); then for each (name, source
    world) in ``loads``: a fresh engine loads that checkpoint and trains the C steps."""
    torch.set_num_threads(1)
    root = Path(root)
    out = {"ref": {}, "loaded": {}, "sd": {}}
    for name in RESHAPE:
        c = _reshape_cfg(name, world, root)
        e = make(c)
        train(e, range(K), world, rank)
        e.save_checkpoint(root / name / f"w{world}", client_state={"rank": rank})
        sd = e.consolidated_state_dict()
        if rank == 0:
            out["sd"][name] = sd
        out["ref"][name] = train(e, range(K, K + C), world, rank)
        e.close()
        for src in loads:
            e = make(c, seed=11)
            _, client = e.load_checkpoint(root / name / f"w{src}")
            assert client == {"rank": rank if rank < src else 0}
            out["loaded"][(name, src)] = train(e, range(K, K + C), world, rank)
            e.close()
    return out


@pytest.mark.slow
def test_reshape_any_world_size(tmp_path):
    r1 = run_ranks(_reshape_worker, 1, str(tmp_path), [])[0]
    r2 = run_ranks(_reshape_worker, 2, str(tmp_path), [2, 1])[0]           # 2 -> 2, 1 -> 2
    r4 = run_ranks(_reshape_worker, 4, str(tmp_path), [2])[0]              # 2 -> 4
    r2b = run_ranks(_reshape_worker, 2, str(tmp_path), [4])[0]             # 4 -> 2
    back = _reshape_worker(0, 1, str(tmp_path), [2])                       # 2 -> 1
    refs = {1: r1["ref"], 2: r2["ref"], 4: r4["ref"]}
    for name in RESHAPE:
        assert r2["loaded"][(name, 2)] == r2["ref"][name], name            # same world: bit-identical
        assert r2b["ref"][name] == r2["ref"][name], name                   # (determinism of the runs)
        for got, src in ((r2["loaded"][(name, 1)], 1), (r4["loaded"][(name, 2)], 2),
                         (r2b["loaded"][(name, 4)], 4), (back["loaded"][(name, 2)], 2)):
            assert close_rel(got, refs[src][name], 1e-6), (name, src, got, refs[src][name])
        # export from files alone equals the engine's consolidated state dict, at every world size
        for world, res in ((1, r1), (2, r2), (4, r4)):
            sd = checkpoint.consolidate(tmp_path / name / f"w{world}")
            assert list(sd) == list(res["sd"][name])
            assert all(torch.equal(sd[k], v) for k, v in res["sd"][name].items()), (name, world)
        files = sorted(p.name for p in (tmp_path / name / "w4" / f"global_step{K}").iterdir())
        ranks = ["manifest.json"] + [f"rank_{r:05d}.pt" for r in range(4)]
        if name.endswith("_nvme"):      # and each rank's sub-groups in part files of their own
            parts = [f for f in files if f not in ranks]
            assert set(ranks) <= set(files) and {f[:10] for f in parts} == {f"rank_{r:05d}" for r in range(4)}
            assert all(f[10:13] == ".sg" for f in parts), parts
        else:
            assert files == ranks
    assert os.listdir(tmp_path / "swap") == []


if __name__ == "__main__":
    args = sys.argv[1:]
    die = None
    if "--die-in-save" in args:
        i = args.index("--die-in-save")
        die = int(args[i + 1])
        del args[i:i + 2]
    asynchronous = "--async" in args
    if asynchronous:
        args.remove("--async")
    die_at = "manifest"
    if "--die-at" in args:
        i = args.index("--die-at")
        die_at = args[i + 1]
        del args[i:i + 2]
    _child(args[0], Path(args[1]), int(args[2]), die, asynchronous, die_at)
