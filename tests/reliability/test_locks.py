"""Directories are owned by locks, not by pids.

A checkpoint directory and an NVMe swap directory are held by ``fcntl.flock`` on a lock
file for the life of their run. A second run that would write a held checkpoint
directory is refused at start, naming the holder's host and pid; a swap directory whose
lock can be taken belongs to a dead run, whatever pid namespace it came from, and one
whose lock is held is never removed. Real processes, real files, real locks.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug.checkpoint import directory as checkpoint_dir
from zeroplug.checkpoint import CheckpointError
from zeroplug.locks import describe_holder, read_holder, try_lock

from tests.support.paths import child_env
from tests.support.toy import ToyNet

CLI = [sys.executable, "-m", "zeroplug.cli", "train", "--max-bytes", "40000", "--seq", "16",
       "--batch.micro_batch_size=2", "--batch.steps_per_print=1000", "--monitor.plugin=none"]
HOST = socket.gethostname()


def _wait_for(cond, timeout=60.0, proc=None):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def _latest(ck: Path) -> str:
    try:
        return (ck / "latest").read_text()
    except FileNotFoundError:
        return ""


# --- the lock itself -------------------------------------------------------------------------

HOLD = textwrap.dedent("""
    import sys
    from zeroplug.locks import try_lock
    lock = try_lock(sys.argv[1])
    print("held" if lock else "busy", flush=True)
    sys.stdin.read()
""")


def test_lock_held_by_another_process_names_it(tmp_path):
    path = tmp_path / "x.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert try_lock(path) is None                     # held elsewhere: not ours, not waited for
        rec = read_holder(path)
        assert rec["pid"] == p.pid and rec["host"] == HOST
        assert describe_holder(rec).startswith(f"pid {p.pid} on host {HOST}, started ")
    finally:
        p.communicate("")
    lock = try_lock(path)                                 # its holder exited: free
    assert lock is not None and read_holder(path)["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_a_removed_lock_file_is_not_taken_for_the_lock(tmp_path):
    """Opened just before its holder removed it: locking that file must not count."""
    path = tmp_path / "x.lock"
    first = try_lock(path)
    fd = os.open(path, os.O_RDWR)                          # a contender opens the file ...
    first.release()                                        # ... the holder removes it and lets go
    second = try_lock(path)                                # a new file, a new lock
    assert second is not None and path.exists()
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)         # the old file's lock is free, and worthless
    os.close(fd)
    assert try_lock(path) is None                          # the path's lock is still held
    second.release()


# --- checkpoint directories ------------------------------------------------------------------

@pytest.mark.slow
def test_second_run_on_a_checkpoint_dir_is_refused(tmp_path):
    ck = tmp_path / "ck"
    args = [f"--checkpoint.dir={ck}", "--checkpoint.every_n_steps=1", "--checkpoint.keep_last=2"]
    first = subprocess.Popen([*CLI, "--steps", "100000", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _latest(ck).startswith("global_step"), proc=first)
        t0 = time.time()
        second = subprocess.run([*CLI, "--steps", "3", *args], capture_output=True, text=True)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert lines[0].startswith(f"error: checkpoint directory '{ck}' is in use by pid {first.pid} on host "
                                   f"{HOST}, started "), lines[0]
        assert "-m zeroplug.cli train --max-bytes" in lines[0] and "--steps 100000" in lines[0]
        assert "training" not in second.stdout and time.time() - t0 < 60
        seen = _latest(ck)                                 # the first run goes on, undisturbed
        _wait_for(lambda: _latest(ck) != seen, proc=first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # SIGKILL: the kernel dropped the lock with the process; the next run takes the directory
    assert (ck / ".zeroplug.lock").exists()
    owner = object()
    assert checkpoint_dir.hold(ck, owner) and read_holder(ck / ".zeroplug.lock")["pid"] == os.getpid()
    checkpoint_dir.release(owner)
    assert not (ck / ".zeroplug.lock").exists()


GATED = textwrap.dedent("""
    import os, sys, time
    from zeroplug.cli import main
    print("at the gate", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.002)
    sys.exit(main(sys.argv[2:]))
""")


def test_two_runs_started_together_one_is_refused(tmp_path):
    """Both saving every step from the first: one owns the directory, the other is refused
    before it trains; the owner's checkpoints all verify."""
    ck = tmp_path / "ck"
    go = tmp_path / "go"
    # Note: both processes import everything, then wait at a gate the test opens once both
    # are there. Without it a loaded machine can start the second only after the first has
    # finished its four steps and released the directory, and then both rightly succeed.
    args = [sys.executable, "-c", GATED, str(go), *CLI[3:], "--steps", "4",
            f"--checkpoint.dir={ck}", "--checkpoint.every_n_steps=1"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "at the gate", p.stderr.read()
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    winner = [p for p in procs if p.returncode == 0][0]
    err = [o[1] for p, o in zip(procs, outs) if p.returncode == 2][0]
    assert f"is in use by pid {winner.pid} on host {HOST}" in err and "Traceback" not in err
    from zeroplug.checkpoint.loading import read_manifest, verify
    for s in range(1, 5):
        d = ck / f"global_step{s}"
        verify(d, read_manifest(d))
    assert sorted(p.name for p in ck.iterdir()) == [f"global_step{s}" for s in range(1, 5)] + ["latest"]


SAVE = textwrap.dedent("""
    import sys, torch, zeroplug
    from tests.support.toy import ToyNet
    e = zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})
    try:
        print(e.save_checkpoint(sys.argv[1]))
    except zeroplug.ZeroplugError as exc:
        print("error:", exc)
""")


def test_engine_holds_its_checkpoint_dir_until_close(tmp_path):
    e = zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})
    e.save_checkpoint(tmp_path)
    e2 = zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})
    e2.save_checkpoint(tmp_path, tag="other")             # the same process: shares the lock

    out = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path)], env=child_env(),
                         capture_output=True, text=True).stdout.strip()
    assert out.startswith(f"error: checkpoint 'global_step0' was not saved: checkpoint directory "
                          f"'{tmp_path}' is in use by pid {os.getpid()} on host {HOST}"), out
    assert out.endswith("latest still names the previous one")
    e.close()
    assert checkpoint_dir.holds(tmp_path)                   # e2 still needs it
    e2.close()
    assert not checkpoint_dir.holds(tmp_path) and not (tmp_path / ".zeroplug.lock").exists()
    lock = try_lock(tmp_path / ".zeroplug.lock")            # free for anyone now
    assert lock is not None
    lock.release()


def test_a_save_removes_only_dead_runs_temporary_dirs(tmp_path):
    """A temporary directory in a directory this run holds can only be a dead run's; without
    the lock (a filesystem that keeps none), a save removes only its own."""
    from zeroplug.checkpoint.loading import prune
    e = zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})
    (tmp_path / ".tmp-global_step9-deadbeef").mkdir(parents=True)
    assert prune(tmp_path, 0, stale_tmp=False) == [] and (tmp_path / ".tmp-global_step9-deadbeef").exists()
    e.save_checkpoint(tmp_path)
    assert not (tmp_path / ".tmp-global_step9-deadbeef").exists()
    e.close()


# --- swap directories: the pid namespace case ----------------------------------------------------

SWAPPER = textwrap.dedent("""
    import os, sys, torch
    if len(sys.argv) > 2:                 # a pid that means nothing here, as seen from another namespace
        os.getpid = lambda: int(sys.argv[2])
    from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper
    sw = AsyncSwapper(sys.argv[1], buffer_count=2, buffer_size=1 << 14, block_size=1 << 16, thread_count=1)
    t = torch.arange(10000, dtype=torch.float32)
    sw.write("w", t).wait()
    print(sw.path, flush=True)
    sys.stdin.readline()                  # another run starts beside this one now
    out = torch.empty_like(t)
    sw.read("w", out).wait()
    print("intact" if torch.equal(out, t) else "CHANGED", flush=True)
    sw.close()
""")


def _other_run_starts_beside(tmp_path, prefix, *extra):
    """A live run (``prefix`` + python) writes swap files; a second swapper starts under the
    same nvme_path (and removes stale directories); the first must read its files back."""
    base = tmp_path / "swap"
    base.mkdir()
    p = subprocess.Popen([*prefix, sys.executable, "-c", SWAPPER, str(base), *extra], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        assert line, p.stderr.read()
        live = Path(line)
        from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper, clean_stale
        with AsyncSwapper(str(base), buffer_count=2, buffer_size=1 << 14, block_size=1 << 16, thread_count=1):
            assert live.is_dir()
        assert clean_stale(str(base)) == [] and live.is_dir()
        out, err = p.communicate("go\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert out.strip() == "intact", err
    assert os.listdir(base) == []
    return live


def test_swap_dir_of_a_run_whose_pid_means_nothing_here_is_kept(tmp_path):
    """The directory's name carries a pid that is no live process here (as a run in another
    pid namespace looks): its lock, held, keeps it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = _other_run_starts_beside(tmp_path, [], dead)
    assert live.name.startswith(f"zeroplug-swap-{dead}-")


def test_swap_dir_of_a_run_in_another_pid_namespace_is_kept(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here: "
                    + (probe.stderr.strip() if probe else "no unshare"))
    # in its own pid namespace (its own /proc) the run is a low pid, unrelated to ours
    live = _other_run_starts_beside(tmp_path, ["unshare", "--pid", "--fork", "--mount-proc"])
    pid = int(live.name.split("-")[2])
    assert pid < 10


def test_killed_run_swap_dir_is_removed_by_the_next(tmp_path):
    base = tmp_path / "swap"
    base.mkdir()
    p = subprocess.Popen([sys.executable, "-c", SWAPPER, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    live = Path(p.stdout.readline().strip())
    p.kill()
    p.wait()
    assert live.is_dir()
    from zeroplug.plugins.offload_nvme.swapper import clean_stale
    assert [d for d, _ in clean_stale(str(base))] == [str(live)]
    assert os.listdir(base) == []


FORKING_HOLDER = textwrap.dedent("""
    import os, sys, time
    from zeroplug.locks import try_lock
    lock = try_lock(sys.argv[1])
    brief = os.fork()                   # a child that ends at once: the lock stays ours
    if brief == 0:
        os._exit(0 if not lock.held else 1)
    assert os.waitpid(brief, 0)[1] == 0
    r, w = os.pipe()
    child = os.fork()                   # a child that outlives us (a DataLoader worker)
    if child == 0:
        os.write(w, b"x")               # runs after the fork handlers: its copies are closed
        time.sleep(60)
        os._exit(0)
    # Note: fork returns here before the child has run at all; on a loaded machine the
    # holder could be killed while the child still held its inherited copy of the lock.
    os.read(r, 1)
    print(child, flush=True)
    sys.stdin.read()
""")


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path):
    path = tmp_path / ".lock"
    p = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    try:
        assert try_lock(path) is None                  # the holder has it, its brief child gone
        p.kill()
        p.wait()
        os.kill(child, 0)                              # the child still runs ...
        lock = try_lock(path)
        assert lock is not None                        # ... and holds nothing
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)
