"""Asynchronous checkpoints (``save_checkpoint(..., async_save=True)``).

The checkpoint holds the states of the moment the save was called, although training goes
on while it is copied and written; at most one save is in flight; a failed background save
is raised at the next step, never lost; a host without the memory for the copy saves
synchronously. Crash safety (SIGKILL in the background writer) is in test_checkpoint.py.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from zeroplug import checkpoint
from zeroplug.checkpoint import CheckpointError
from zeroplug.checkpoint.staging import Staging

from tests.checkpoint.test_checkpoint import CONFIGS, DropNet, cfg, make, train, train_step
from tests.support.distributed import run_ranks


def _slow(monkeypatch, seconds=0.3):
    """The copy into host memory and the file writes take their time: training runs meanwhile."""
    copy, write = Staging.copy, checkpoint.write_torch_file

    def slow_copy(self, places, after=None):
        time.sleep(seconds)
        return copy(self, places, after)

    def slow_write(obj, path):
        time.sleep(seconds)
        return write(obj, path)
    monkeypatch.setattr(Staging, "copy", slow_copy)
    monkeypatch.setattr(checkpoint, "write_torch_file", slow_write)


@pytest.mark.parametrize("name", ["stage0", "stage2_cpu", "stage3", "stage3_bf16", "stage1_fp16"])
def test_async_save_holds_the_states_of_its_call(tmp_path, monkeypatch, name):
    c = CONFIGS[name]
    ref = train(make(c, DropNet), range(7))
    _slow(monkeypatch)
    e = make(c, DropNet)
    first = train(e, range(4))
    client = {"data_pos": 4, "seen": [1, 2]}
    path = e.save_checkpoint(tmp_path, client_state=client, async_save=True)
    assert path == str(tmp_path / "global_step4")
    assert e.background_saves.in_flight()
    client["data_pos"], client["seen"][0] = 99, 99      # the caller's dict changes after the call
    assert train(e, range(4, 7)) == ref[4:]             # training goes on, exactly as without a save
    e.close()                                           # waits for the write
    assert (tmp_path / "latest").read_text() == "global_step4"
    e2 = make(c, DropNet, seed=5)
    _, got = e2.load_checkpoint(tmp_path)
    assert got == {"data_pos": 4, "seen": [1, 2]}
    assert first + train(e2, range(4, 7)) == ref        # bit-identical: the states of step 4
    e2.close()


def test_nvme_tier_async_save(tmp_path):
    """A tier that keeps states out of memory writes its part files during the call; the
    rest in the background."""
    (tmp_path / "swap").mkdir()
    c = cfg(2, offload={"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path / "swap"), "buffer_count": 2}})
    ref = train(make(c), range(5))
    e = make(c)
    train(e, range(3))
    e.save_checkpoint(tmp_path / "ck", async_save=True)
    train(e, range(3, 5))
    e.close()
    e2 = make(c, seed=3)
    e2.load_checkpoint(tmp_path / "ck")
    assert train(e2, range(3, 5)) == ref[3:]
    e2.close()


def test_one_save_in_flight_and_close_waits(tmp_path, monkeypatch):
    _slow(monkeypatch, 0.4)
    e = make(CONFIGS["stage2"])
    train(e, range(1))
    e.save_checkpoint(tmp_path, async_save=True)
    assert not (tmp_path / "global_step1").exists()     # still being written
    train(e, range(1, 2))
    e.save_checkpoint(tmp_path, async_save=True)        # waits for the first
    assert (tmp_path / "global_step1" / "manifest.json").is_file()
    assert not (tmp_path / "global_step2").exists()
    e.close()
    assert (tmp_path / "latest").read_text() == "global_step2"
    checkpoint.verify(tmp_path / "global_step2", checkpoint.read_manifest(tmp_path / "global_step2"))


def test_load_waits_for_the_save(tmp_path, monkeypatch):
    _slow(monkeypatch, 0.3)
    e = make(CONFIGS["stage1"])
    train(e, range(2))
    e.save_checkpoint(tmp_path, async_save=True)
    path, _ = e.load_checkpoint(tmp_path)               # the checkpoint just saved, complete
    assert Path(path).name == "global_step2"
    e.close()


def test_background_failure_is_raised_at_the_next_step(tmp_path, monkeypatch, caplog):
    e = make(CONFIGS["stage2"])
    train(e, range(2))
    e.save_checkpoint(tmp_path)
    written = threading.Event()

    def broken(obj, path):
        written.set()
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    monkeypatch.setattr(checkpoint, "write_torch_file", broken)
    train(e, range(2, 3))
    e.save_checkpoint(tmp_path, async_save=True)        # returns: the failure comes later
    e.background_saves.wait(raise_error=False)
    assert written.is_set()
    step = e.global_step
    with pytest.raises(CheckpointError) as info:
        train_step(e, 3)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg and "global_step3" in msg and "ENOSPC" in msg
    assert e.global_step == step                        # the step was not taken
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".zeroplug.lock") == ["global_step2", "latest"]
    train_step(e, 3)                                    # raised once; training goes on
    monkeypatch.undo()
    e.save_checkpoint(tmp_path, async_save=True)
    e.close()
    assert (tmp_path / "latest").read_text() == "global_step4"


def test_failure_is_raised_by_close(tmp_path, monkeypatch):
    e = make(CONFIGS["stage1"])
    train(e, range(1))
    monkeypatch.setattr(checkpoint, "write_manifest", lambda *a: (_ for _ in ()).throw(OSError("injected")))
    e.save_checkpoint(tmp_path, async_save=True)
    with pytest.raises(CheckpointError, match="asynchronous save of checkpoint 'global_step1'.*injected"):
        e.close()
    assert not (tmp_path / "latest").exists()


def test_saved_synchronously_when_the_host_lacks_memory(tmp_path, monkeypatch, caplog):
    from zeroplug.observe import memory
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 20)
    e = make(CONFIGS["stage2"])
    train(e, range(1))
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        e.save_checkpoint(tmp_path, async_save=True)
    assert "saved synchronously" in caplog.text and "host memory" in caplog.text
    assert not e.background_saves.in_flight()
    assert (tmp_path / "latest").read_text() == "global_step1"
    e.close()


def test_config_key_makes_saves_asynchronous(tmp_path, monkeypatch):
    _slow(monkeypatch, 0.3)
    e = make(cfg(1, checkpoint={"async_save": True}))
    train(e, range(1))
    e.save_checkpoint(tmp_path)
    assert e.background_saves.in_flight()
    e.close()
    assert (tmp_path / "latest").read_text() == "global_step1"


# --- two ranks ------------------------------------------------------------------------------

def _two_ranks(rank, world, root, stage, fail_rank):
    import zeroplug.checkpoint as ck
    torch.manual_seed(0)
    c = cfg(stage, world=world)
    e = make(c, DropNet)
    losses = train(e, range(3), world, rank)
    if fail_rank == rank:
        real = ck.write_torch_file

        def broken(obj, path):
            raise OSError(errno.EIO, "Input/output error (injected)")
        ck.write_torch_file = broken
    e.save_checkpoint(root, client_state={"pos": 3}, async_save=True)
    error = step = None
    try:
        losses += train(e, range(3, 5), world, rank)
    except CheckpointError as exc:      # at the step by which every rank's writer has ended
        error, step = str(exc), e.global_step
    if fail_rank == rank:
        ck.write_torch_file = real
    try:
        e.close()
    except CheckpointError as exc:      # or, if none has, when the engine closes
        error = error or str(exc)
    return {"losses": losses, "error": error, "step": step}


def _resume_ranks(rank, world, root, stage):
    e = make(cfg(stage, world=world), DropNet, seed=4)
    _, client = e.load_checkpoint(root)
    out = train(e, range(client["pos"], 5), world, rank)
    e.close()
    return out


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_ranks_async_save(tmp_path, stage):
    ok = run_ranks(_two_ranks, 2, str(tmp_path / "ok"), stage, None, timeout=300)
    assert ok[0]["error"] is None and ok[1]["error"] is None
    ref = ok[0]["losses"]
    assert len(ref) == 5
    resumed = run_ranks(_resume_ranks, 2, str(tmp_path / "ok"), stage, timeout=300)
    assert resumed[0] == ref[3:]
    # one rank's write fails: every rank raises it at its next step, the directory is as before
    bad = run_ranks(_two_ranks, 2, str(tmp_path / "bad"), stage, 1, timeout=300)
    assert all(r["error"] and "EIO" in r["error"] and "rank 1" in r["error"] for r in bad), bad
    assert bad[0]["step"] == bad[1]["step"]         # raised at the same step on both ranks
    assert not (tmp_path / "bad" / "latest").exists()
    assert [p.name for p in (tmp_path / "bad").iterdir() if p.name != ".zeroplug.lock"] == []


# --- on a GPU: the copies into pinned host memory on a stream of their own ------------------------

def _gpu_train(engine, steps):
    from tests.checkpoint.test_checkpoint import batch
    out = []
    for s in steps:
        x, y = batch(s, 0)
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["stage3_bf16", "stage2_cpu", "stage1_fp16"])
def test_gpu_async_save_holds_the_states_of_its_call(tmp_path, monkeypatch, name):
    import zeroplug

    def make_gpu(seed):
        torch.manual_seed(seed)
        return zeroplug.initialize(DropNet(), CONFIGS[name], device="cuda")
    ref = _gpu_train(make_gpu(0), range(7))
    _slow(monkeypatch)
    e = make_gpu(0)
    first = _gpu_train(e, range(4))
    e.save_checkpoint(tmp_path, client_state={"data_pos": 4}, async_save=True)
    assert _gpu_train(e, range(4, 7)) == ref[4:]
    assert e.background_saves.staging.pinned is not None and e.background_saves.staging.pinned.is_pinned()
    e.close()
    e2 = make_gpu(5)
    e2.load_checkpoint(tmp_path)
    assert first + _gpu_train(e2, range(4, 7)) == ref
    e2.close()


@pytest.mark.slow
def test_zeroplug_train_async_save(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "zeroplug.cli", "train", "--steps", "2", "--async-save",
                          f"--checkpoint.dir={tmp_path}", "--checkpoint.every_n_steps=1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"checkpoint {tmp_path / 'global_step1'} (being written in the background)" in out.stderr
    assert (tmp_path / "latest").read_text() == "global_step2"       # close() waited for the last one
    checkpoint.verify(tmp_path / "global_step2", checkpoint.read_manifest(tmp_path / "global_step2"))
