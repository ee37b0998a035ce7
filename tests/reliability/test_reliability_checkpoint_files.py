"""A checkpoint directory others can write: what is loaded is what was verified, and a bad
file never half-loads.

Manifests and rank files are mutated and *re-sealed* (sizes, sha256 and the manifest's own
checksum recomputed: anyone who can write the directory can do that), so verification
passes and only the checks of the contents stand between them and the engine. Each is
refused with one line naming the file and the field; the engine's parameters, masters,
optimizer state, counters and RNG stay byte for byte as they were, and it trains on
exactly as an engine that never saw the checkpoint. Links are never followed: ``latest``,
``manifest.json`` and rank files as links are refused, and a file swapped after it was
verified is not what gets loaded. Two ranks refuse together when one rank's checks fail.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug import checkpoint
from zeroplug.checkpoint import CheckpointError
from zeroplug.errors import StepFailedError

from tests.support.distributed import run_ranks
from tests.support.toy import ToyNet

CFG = {"zero": {"plugin": "stage2", "reduce_bucket_size": 600, "sub_group_size": 900},
       "batch": {"micro_batch_size": 4, "gradient_clipping": 1.0},
       "precision": {"plugin": "fp16", "initial_scale_power": 8},
       "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
       "scheduler": {"plugin": "warmup_cosine", "warmup_num_steps": 3, "total_num_steps": 30},
       "monitor": {"plugin": "none"}}


def batch(step, world=1, rank=0):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 37, (4 * world, 8), generator=g)
    y = torch.randint(0, 37, (4 * world, 8), generator=g)
    return x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]


def make(seed=0, config=CFG):
    torch.manual_seed(seed)
    return zeroplug.initialize(ToyNet(), config)


def step(e, s, world=1, rank=0) -> float:
    x, y = batch(s, world, rank)
    loss = e(x, y)
    e.backward(loss)
    e.step()
    return loss.item()


# --- re-sealing: what anyone who can write the directory can do -------------------------------

def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def reseal_manifest(tag: Path, change=None) -> None:
    m = json.loads((tag / "manifest.json").read_text())
    if change is not None:
        change(m)
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (tag / "manifest.json").write_text(json.dumps(m))


def reseal_file(tag: Path, name: str, mutate) -> None:
    """Rewrite file ``name`` as ``mutate(obj)`` leaves it (changed in place) and seal the
    manifest again."""
    f = tag / name
    obj = torch.load(f, weights_only=True)
    mutate(obj)
    torch.save(obj, f)

    def fix(m):
        m["files"][name]["size"] = f.stat().st_size
        m["files"][name]["sha256"] = _sha(f)
    reseal_manifest(tag, fix)


def _first(obj):
    """The first piece of the first parameter in a rank file."""
    name = next(iter(obj["model"]["pieces"]))
    return name, obj["model"]["pieces"][name][0]


def _set(path, value):
    def mutate(obj):
        d = obj
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return mutate


def _piece(change):
    def mutate(obj):
        name, pc = _first(obj)
        change(pc, obj, name)
    return mutate


def _wider(pc, key, sub=None):
    t = pc[key] if sub is None else pc[key][sub]
    wide = torch.cat([t, t[:3]])
    if sub is None:
        pc[key] = wide
    else:
        pc[key][sub] = wide


class Payload:
    """Unpickling it would run code (here only os.getpid)."""

    def __reduce__(self):
        return (os.getpid, ())


# name: (mutation of rank_00000.pt, what the one-line refusal says)
RANK_MUTATIONS = {
    "pickle-payload": (_set(("client_state",), {"x": Payload()}),
                       "rank_00000.pt cannot be read: it holds objects other than tensors and plain data"),
    "no-counters": (lambda o: o.pop("counters"), "field counters is missing"),
    "nan-counter": (_set(("counters", "global_step"), math.nan), "field counters.global_step = nan: not an integer"),
    "string-counter": (_set(("counters", "lr_step"), "abc"), "counters.lr_step = 'abc': not an integer"),
    "negative-counter": (_set(("counters", "micro_step"), -1), "counters.micro_step = -1: out of range"),
    "huge-counter": (_set(("counters", "global_step"), 2**70), "counters.global_step = 1180591620717411303424"),
    "extra-tensor": (_set(("evil",), torch.zeros(3)), "field 'evil' is not one this file can hold"),
    "version-string": (_set(("version",), "2"), "field version = '2': not an integer"),
    "rank-wrong": (_set(("rank",), 3), "field rank = 3: the manifest lists this file as rank 0's"),
    "no-pieces": (lambda o: o["model"].pop("pieces"), "field model.pieces is missing"),
    "piece-wider": (_piece(lambda pc, o, n: _wider(pc, "param")), "param is a float16 tensor of shape"),
    "piece-2d": (_piece(lambda pc, o, n: pc.update(param=pc["param"].view(1, -1))), "the piece's range holds"),
    "piece-dtype": (_piece(lambda pc, o, n: pc.update(param=pc["param"].double())),
                    "the checkpoint declares float16"),
    "piece-not-tensor": (_piece(lambda pc, o, n: pc.update(param="abc")), ".param = 'abc': not a tensor"),
    "master-dtype": (_piece(lambda pc, o, n: pc.update(master=pc["master"].half())), "declares float32"),
    "optim-wider": (_piece(lambda pc, o, n: _wider(pc, "optim", "exp_avg")), "optim['exp_avg'] is a float32"),
    "optim-int": (_piece(lambda pc, o, n: pc["optim"].update(exp_avg=pc["optim"]["exp_avg"].long())),
                  "optimizer states are floating point"),
    "optim-extra-state": (_piece(lambda pc, o, n: pc["optim"].update(evil=pc["optim"]["exp_avg"].clone())),
                          "optimizer state 'evil' (float32) is not one its optim_keys declare"),
    "range-negative": (_piece(lambda pc, o, n: pc.update(start=-1)), ".start = -1: out of range"),
    "range-beyond": (_piece(lambda pc, o, n: pc.update(end=10**9)), ".end = 1000000000: out of range"),
    "range-empty": (_piece(lambda pc, o, n: pc.update(end=pc["start"])), "an empty range"),
    "piece-twice": (lambda o: o["model"]["pieces"][_first(o)[0]].append(copy.copy(_first(o)[1])), "twice"),
    "piece-missing": (lambda o: o["model"]["pieces"][_first(o)[0]].pop(0), "this rank needs"),
    "unknown-param": (lambda o: o["model"]["pieces"].update(evil=[]), "field model.pieces['evil'] is not a parameter"),
    "scalar-inf": (_set(("model", "optim_scalars", "step"), torch.tensor(math.inf)), "not a finite number"),
    "optim-key-dtype": (_set(("model", "optim_keys", "exp_avg"), "int16"), "optim_keys['exp_avg'] = 'int16'"),
    "optim-key-list": (_set(("model", "optim_keys", "exp_avg"), ["x"]), "optim_keys['exp_avg'] = ['x']"),
    "group-betas": (lambda o: o["model"]["optim_groups"][0].update(betas="abc"), "betas = 'abc': not a list of 2"),
    "scale-nan": (_set(("precision", "scale"), math.nan), "field precision.scale = nan: not a finite number"),
    "scale-missing": (lambda o: o["precision"].pop("cur_hysteresis"), "precision.cur_hysteresis is missing"),
    "rng-python": (_set(("rng", "python"), (3, (1, 2), None)), "field rng.python is not a random.getstate()"),
    "rng-torch": (_set(("rng", "torch"), torch.zeros(7, dtype=torch.uint8)), "field rng.torch is not a generator"),
    "client-not-dict": (_set(("client_state",), 5), "field client_state = 5: not a table"),
    "extra-state-dict-entry": (_set(("model", "extras", "evil"), torch.zeros(3)),
                               "file rank_00000.pt field model.extras['evil'] is not an entry"),
}

MANIFEST_MUTATIONS = {
    "shape-4tib": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(shape=[1 << 41]),
                   "field model.params declare 4.0 TiB of values; the checkpoint's files hold "),
    "shape-2-62": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(shape=[2**62]),
                   "out of range [0, 281474976710656]"),
    "shape-negative": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(shape=[-5]),
                       ".shape = -5: out of range"),
    "shape-abc": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(shape=["abc"]),
                  ".shape = 'abc': not an integer"),
    "world-size-abc": (lambda m: m.update(world_size="abc"), "field world_size = 'abc': not an integer"),
    "version-string": (lambda m: m.update(version="2"), "field version = '2': not an integer"),
    "model-null": (lambda m: m.update(model=None), "field model = None: not a table"),
    "dtype-unknown": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(dtype="os.system"),
                      "dtype = 'os.system': not one of"),
    "size-string": (lambda m: next(iter(m["files"].values())).update(size="big"), ".size = 'big': not an integer"),
    "files-null": (lambda m: m.update(files=None), "field files = None: lists no files"),
    "state-dict-garbage": (lambda m: m["model"].update(state_dict=[["x", "nope"]]), "model.state_dict[0]"),
    "state-dict-unhashable": (lambda m: m["model"].update(state_dict=[["x", ["a"]]]), "model.state_dict[0]"),
    "dtype-list": (lambda m: m["model"]["params"][next(iter(m["model"]["params"]))].update(dtype=["float32"]),
                   "dtype = ['float32']: not one of"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps (fp16: masters, the scaler, Adam's states), and the
    losses of 2 more steps of an engine that never saw any other checkpoint."""
    d = tmp_path_factory.mktemp("ck")
    e = make()
    for s in range(2):
        step(e, s)
    path = Path(e.save_checkpoint(d / "ck"))
    e.close()
    return path


def snapshot(e) -> dict:
    def raw(t):
        return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    opt = e.optimizer.state_dict()
    return {
        "masters": [raw(t) for t in e.partitioner.master_params()],
        "module": {k: raw(v) for k, v in e.module.state_dict().items()},
        "opt": {(i, k): (raw(v) if torch.is_tensor(v) else v) for i, st in opt["state"].items() for k, v in st.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
        "counters": (e.global_step, e.micro_step, e.skipped_steps, e.lr_step),
        "precision": e.precision.state_dict(),
        "rng": raw(torch.get_rng_state()),
    }


def same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        return x == y
    return eq(a, b)


def refused(fn) -> str:
    with pytest.raises(CheckpointError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_rank_file_mutations_are_refused_and_change_nothing(saved, tmp_path):
    e = make(seed=3)
    step(e, 0)                                  # an engine with states of its own
    ref = make(seed=3)
    step(ref, 0)
    before = snapshot(e)
    for i, (name, (mutate, says)) in enumerate(RANK_MUTATIONS.items()):
        tag = tmp_path / f"m{i}"
        shutil.copytree(saved, tag)
        reseal_file(tag, "rank_00000.pt", mutate)
        msg = refused(lambda: e.load_checkpoint(tag))
        assert str(tag) in msg and says in msg and "weights_only=False" not in msg, (name, msg)
        assert same(snapshot(e), before), name
        assert e.run.failed is None, name
    # the refused loads left it as it was: it trains on exactly as one that never saw them
    assert [step(e, s) for s in (1, 2)] == [step(ref, s) for s in (1, 2)]
    assert same(snapshot(e), snapshot(ref))
    # and a good checkpoint still loads
    e.load_checkpoint(saved)
    assert e.global_step == 2


@pytest.mark.parametrize("name", list(MANIFEST_MUTATIONS))
def test_resealed_manifest_mutations_are_one_line(saved, tmp_path, name):
    change, says = MANIFEST_MUTATIONS[name]
    tag = tmp_path / "t"
    shutil.copytree(saved, tag)
    reseal_manifest(tag, change)
    msg = refused(lambda: checkpoint.consolidate(tag))
    assert f"{tag}': manifest.json" in msg and says in msg, msg
    e = make()
    before = snapshot(e)
    assert says in refused(lambda: e.load_checkpoint(tag))
    assert same(snapshot(e), before)


def test_cli_refuses_a_resealed_checkpoint_in_one_line(saved, tmp_path):
    tag = tmp_path / "t"
    shutil.copytree(saved, tag)
    reseal_file(tag, "rank_00000.pt", RANK_MUTATIONS["piece-wider"][0])
    r = subprocess.run([sys.executable, "-m", "zeroplug.cli", "export", str(tag), str(tmp_path / "o.pt")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert "rank_00000.pt field model.pieces[" in r.stderr and not (tmp_path / "o.pt").exists()


def test_a_failure_after_the_checks_marks_the_engine_failed(saved, monkeypatch):
    """Should a load fail midway (after every check passed), the engine says so at its next step."""
    from zeroplug.plugins.zero import loader

    def boom(*a, **k):
        raise RuntimeError("disk vanished")
    e = make()
    monkeypatch.setattr(loader, "install_optimizer_state", boom)
    msg = refused(lambda: e.load_checkpoint(saved))
    assert "failed after it was checked" in msg and "disk vanished" in msg, msg
    with pytest.raises(StepFailedError) as ei:
        step(e, 5)
    assert "\n" not in str(ei.value) and "disk vanished" in str(ei.value)
    monkeypatch.undo()
    e.load_checkpoint(saved)                    # a whole load repairs it
    assert e.run.failed is None and e.global_step == 2
    step(e, 2)


# --- links ---------------------------------------------------------------------------------------

def test_latest_and_manifest_links_are_refused_and_never_echoed(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved.parent, ck)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-LINE\n")
    (ck / "latest").unlink()
    os.symlink(secret, ck / "latest")
    e = make()
    msg = refused(lambda: e.load_checkpoint(ck))
    assert "latest' is a symbolic link; refused" in msg and "SECRET" not in msg, msg
    # a FIFO as latest never blocks
    (ck / "latest").unlink()
    os.mkfifo(ck / "latest")
    assert "is not a regular file" in refused(lambda: e.load_checkpoint(ck))
    # a symbolic link as manifest.json (to an exact copy of it) is refused
    tag = ck / saved.name
    (tag / "manifest.json").rename(tmp_path / "manifest.json")
    os.symlink(tmp_path / "manifest.json", tag / "manifest.json")
    assert "manifest.json is a symbolic link; refused" in refused(lambda: e.load_checkpoint(ck, tag=saved.name))
    assert "manifest.json is a symbolic link" in refused(lambda: checkpoint.consolidate(tag))


def _other_checkpoint(tmp_path) -> Path:
    """A checkpoint of the same model with other values (seed 5), in the same layout."""
    e = make(seed=5)
    step(e, 7)
    step(e, 8)
    path = Path(e.save_checkpoint(tmp_path / "other"))
    e.close()
    return path


@pytest.mark.parametrize("private", [True, False])
def test_a_file_swapped_after_verification_is_not_loaded(saved, tmp_path, monkeypatch, private):
    """Between the checks and the copies the rank file is replaced by a link to another
    checkpoint's file (private: this user's 0644 file, read through the descriptor it was
    verified through) or rewritten in place (not private: a group-writable file, whose
    verified bytes were copied into memory): the engine gets the verified values."""
    tag = tmp_path / "t"
    shutil.copytree(saved, tag)
    other = _other_checkpoint(tmp_path)
    f = tag / "rank_00000.pt"
    if not private:
        os.chmod(f, 0o666)
    want = checkpoint.consolidate(saved)
    real_commit = checkpoint.ShardSet.commit

    def swap(self, error=None):
        if private:
            f.unlink()
            os.symlink(other / "rank_00000.pt", f)
        else:
            f.write_bytes((other / "rank_00000.pt").read_bytes())     # same size: rewritten in place
        return real_commit(self, error)
    assert (other / "rank_00000.pt").stat().st_size == f.stat().st_size
    monkeypatch.setattr(checkpoint.ShardSet, "commit", swap)
    e = make()
    e.load_checkpoint(tag)
    got = e.consolidated_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


# --- two ranks ---------------------------------------------------------------------------------

def _two_rank_worker(rank, world, root, name):
    e = make(config=dict(CFG))
    step(e, 0, world, rank)
    good = Path(e.save_checkpoint(Path(root) / "ck", tag="good"))
    if rank == 0:
        bad = Path(root) / "ck" / "bad"
        shutil.copytree(good, bad)
        if name == "hole-in-rank0":
            # only rank 0 needs the elements of rank 0's file: rank 1's checks pass on their own
            reseal_file(bad, "rank_00000.pt", lambda o: o["model"]["pieces"][_first(o)[0]].pop(0))
        else:
            reseal_file(bad, "rank_00001.pt", RANK_MUTATIONS["optim-wider"][0])
    e.run.comm.barrier()
    step(e, 1, world, rank)
    before = snapshot(e)
    with pytest.raises(CheckpointError) as ei:
        e.load_checkpoint(Path(root) / "ck", tag="bad")
    msg = str(ei.value)
    after = snapshot(e)
    loss = step(e, 2, world, rank)              # trains on, in step with the other rank
    e.load_checkpoint(Path(root) / "ck", tag="good")
    return {"msg": msg, "unchanged": same(before, after), "loss": loss, "step": e.global_step}


@pytest.mark.parametrize("name", ["hole-in-rank0", "bad-rank1-file"])
def test_two_ranks_refuse_together(tmp_path, name):
    res = run_ranks(_two_rank_worker, 2, str(tmp_path), name)
    for r in res:
        assert r["unchanged"] and r["step"] == 1 and "\n" not in r["msg"], r
    if name == "hole-in-rank0":
        assert "this rank needs" in res[0]["msg"] and res[1]["msg"].startswith("rank 0: "), res
    else:
        assert all("rank_00001.pt field model.pieces[" in r["msg"] for r in res), res


def test_a_part_file_mutation_is_refused(tmp_path):
    """The optimizer on "NVMe": masters and states in part files, streamed in one sub-group
    at a time on load. A re-sealed part file with a wider master is refused before any
    sub-group is brought in, and the engine trains on as one that never saw it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    c = dict(CFG, offload={"optimizer": {"plugin": "nvme", "nvme_path": str(swap), "buffer_count": 2}})
    e = make(config=c)
    step(e, 0)
    tag = Path(e.save_checkpoint(tmp_path / "ck"))
    parts = sorted(p.name for p in tag.iterdir() if ".sg" in p.name)
    assert parts, list(tag.iterdir())

    def wider(obj):
        name = next(iter(obj["pieces"]))
        _wider(obj["pieces"][name][0], "master")
    reseal_file(tag, parts[0], wider)
    ref = make(config=c)
    step(ref, 0)
    msg = refused(lambda: e.load_checkpoint(tag))
    assert f"file {parts[0]} field pieces[" in msg and ".master is a float32 tensor" in msg, msg
    assert e.run.failed is None
    assert [step(e, s) for s in (1, 2)] == [step(ref, s) for s in (1, 2)]
    e.close()
    ref.close()
