"""Disks that fill up, fail or are read-only: the cause is named, nothing valid is lost.

On real small tmpfs mounts (a private mount namespace: ``unshare -m``) where that is
permitted, else (with a warning) with the same errors injected at the same calls:

* a checkpoint that does not fit is refused before anything is written (the free-space
  check), naming both sizes;
* a disk that fills between that check and the write: ENOSPC is named with the file and
  the numbers (torch reports it as "unexpected pos"), and ``latest`` still names the
  previous checkpoint, which verifies;
* a read-only ``checkpoint.dir`` fails at the start of ``zeroplug train``, naming EROFS;
* an NVMe swap disk that fills between start-up and the first step: the step fails with
  ENOSPC, the engine refuses to save the half-applied state, and once space is back a load
  of the last checkpoint continues exactly as a run that never failed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from zeroplug import checkpoint
from zeroplug.checkpoint import CheckpointError

from tests.support.paths import child_env

CHILD = textwrap.dedent(r"""
    import contextlib, errno, io, json, os, pathlib, sys
    import torch
    from zeroplug.checkpoint import directory as checkpoint_dir
    from zeroplug.checkpoint import files as checkpoint_files
    from zeroplug.checkpoint import CheckpointError
    from zeroplug.errors import StepFailedError, ZeroplugError
    from tests.checkpoint.test_checkpoint import cfg, make, train, train_step
    ck_fs, swap_fs, ro_fs, plain, mode = sys.argv[1:6]
    real = mode == "real"
    out = {"mode": mode}

    def fill(path, leave):
        # a filler file that leaves about `leave` bytes free (tmpfs allocates whole pages)
        free = checkpoint_dir.free_bytes(path)
        with open(os.path.join(path, "filler"), "wb") as f:
            try:
                f.write(b"\0" * max(0, free - leave))
                f.flush()
            except OSError:
                pass

    def listing(d):
        return sorted(n for n in os.listdir(d) if n not in ("filler", ".zeroplug.lock"))

    # 1. a checkpoint that does not fit: refused by the free-space check
    e = make(cfg(2, checkpoint={"keep_last": 1}))
    train(e, range(1))
    first = e.save_checkpoint(ck_fs)
    size = sum(p.stat().st_size for p in pathlib.Path(first).iterdir())
    train(e, range(1, 2))
    real_free, real_check, real_write = (checkpoint_dir.free_bytes, checkpoint_dir.check_space,
                                         checkpoint_files._HashingWriter.write)
    if real:
        fill(ck_fs, size // 2)
    else:
        checkpoint_dir.free_bytes = lambda p: size // 2
    try:
        e.save_checkpoint(ck_fs)
    except CheckpointError as exc:
        out["precheck"] = str(exc)
    out["precheck_listing"] = listing(ck_fs)
    checkpoint_dir.free_bytes = real_free

    # 2. the disk fills between the check and the write: ENOSPC from the write itself
    checkpoint_dir.check_space = lambda *a: None
    if not real:
        def write(self, b):
            if self.size > size // 3:
                self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                raise self.error
            return real_write(self, b)
        checkpoint_files._HashingWriter.write = write
    try:
        e.save_checkpoint(ck_fs)
    except CheckpointError as exc:
        out["write"] = str(exc)
    out["write_listing"] = listing(ck_fs)
    checkpoint_dir.check_space, checkpoint_files._HashingWriter.write = real_check, real_write
    out["size"] = size
    e.close()

    # 3. a read-only checkpoint.dir: named at start
    real_mkdir = pathlib.Path.mkdir
    if not real:
        def ro_mkdir(self, *a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        pathlib.Path.mkdir = ro_mkdir
    from zeroplug.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        out["ro_code"] = main(["train", "--steps", "2", "--max-bytes", "40000", "--seq", "16",
                               "--monitor.plugin=none", f"--checkpoint.dir={ro_fs}/ck"])
    out["ro_err"] = err.getvalue()
    pathlib.Path.mkdir = real_mkdir

    # 4. the swap disk fills after start-up: the first step's new optimizer-state files fail
    def nvme(path):
        return cfg(2, offload={"optimizer": {"plugin": "nvme", "nvme_path": path, "buffer_count": 2}})
    ref = make(nvme(plain))
    ref_losses = train(ref, range(3))
    ref.close()
    e = make(nvme(swap_fs))
    e.save_checkpoint(os.path.join(plain, "ck"))                # the state at start
    if real:
        fill(swap_fs, 0)
    else:
        real_fallocate = os.posix_fallocate
        def full(*a):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = full
    try:
        train_step(e, 0)
    except ZeroplugError as exc:
        out["swap"] = f"{type(exc).__name__}: {exc}"
    out["failed"] = e.run.failed
    try:
        e.save_checkpoint(os.path.join(plain, "ck"))
    except StepFailedError as exc:
        out["swap_save"] = str(exc)
    out["swap_latest"] = open(os.path.join(plain, "ck", "latest")).read()
    if real:
        os.unlink(os.path.join(swap_fs, "filler"))
    else:
        os.posix_fallocate = real_fallocate
    e.load_checkpoint(os.path.join(plain, "ck"))
    out["swap_resumed"] = train(e, range(3)) == ref_losses
    e.close()
    out["swap_left"] = os.listdir(swap_fs)
    print("RESULT " + json.dumps(out), flush=True)
""")


def _mount_namespace_ok() -> str | None:
    """None if ``unshare -m`` may mount a tmpfs here, else why not."""
    if not shutil.which("unshare"):
        return "no unshare command"
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _run_child(tmp_path, mode):
    dirs = {n: tmp_path / n for n in ("ck", "swap", "ro", "plain")}
    for d in dirs.values():
        d.mkdir()
    args = [sys.executable, "-c", CHILD, *map(str, dirs.values()), mode]
    if mode == "real":
        # (a checkpoint directory every user can write is refused: a tmpfs is 1777 unless told)
        mounts = (f"mount -t tmpfs -o size=4m,mode=0755 tmpfs {dirs['ck']} "
                  f"&& mount -t tmpfs -o size=4m tmpfs {dirs['swap']} "
                  f"&& mount -t tmpfs -o ro,size=64k tmpfs {dirs['ro']}")
        args = ["unshare", "-m", "sh", "-c", mounts + ' && exec "$@"', "sh", *args]
    r = subprocess.run(args, env=child_env(), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr
    return json.loads(lines[0][7:]), dirs


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """Real tmpfs mounts where they can be made, else the injected errors (a warning says why)."""
    why = _mount_namespace_ok()
    if why:
        import warnings
        warnings.warn(f"cannot mount a tmpfs in a private mount namespace here ({why}): errors are injected "
                      f"at the same calls instead")
    mode = "injected" if why else "real"
    return _run_child(tmp_path_factory.mktemp(mode), mode)


def test_a_checkpoint_that_does_not_fit_is_refused_first(result):
    out, dirs = result
    msg = out["precheck"]
    assert msg.startswith("checkpoint 'global_step2' was not saved: it needs about "), msg
    assert f"but {dirs['ck']} has " in msg and "free (it would fail with ENOSPC)" in msg
    assert "Fix: free space there, keep fewer checkpoints (checkpoint.keep_last)" in msg
    assert msg.endswith(f"{dirs['ck'] / 'latest'} still names the previous one")
    assert out["precheck_listing"] == ["global_step1", "latest"]          # nothing half written


def test_enospc_during_the_write_is_named(result):
    out, dirs = result
    msg = out["write"]
    assert "unexpected pos" not in msg and "inline_container" not in msg, msg
    assert "rank 0: writing " in msg and "rank_00000.pt failed: ENOSPC (No space left on device)" in msg, msg
    assert "the checkpoint needs about " in msg and " free there now" in msg
    assert out["write_listing"] == ["global_step1", "latest"]
    if out["mode"] == "real":
        return              # the files live in the child's mount namespace only
    path = checkpoint.resolve(dirs["ck"])
    checkpoint.verify(path, checkpoint.read_manifest(path))                # the previous one is whole


def test_read_only_checkpoint_dir_fails_at_start(result):
    out, dirs = result
    assert out["ro_code"] == 2
    lines = out["ro_err"].strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: checkpoint.dir '{dirs['ro']}/ck': creating ")
    assert "EROFS (Read-only file system). Fix: the filesystem is mounted read-only" in lines[0]


def test_swap_disk_full_after_start_fails_the_step_safely(result):
    out, _ = result
    assert out["swap"].startswith("SwapSpaceError: NVMe swap: writing (") and "ENOSPC" in out["swap"], out["swap"]
    assert out["failed"] and "ENOSPC" in out["failed"]
    assert "may be half updated" in out["swap_save"] and "resume from the last checkpoint" in out["swap_save"]
    assert out["swap_latest"] == "global_step0"
    assert out["swap_resumed"] is True
    assert out["swap_left"] == []


def test_checkpoint_dir_checked_at_start(tmp_path, capsys):
    """A file where the directory should be: named before any training (not at the first save)."""
    from zeroplug.cli import main
    (tmp_path / "ck").write_text("x")
    code = main(["train", "--steps", "50", "--max-bytes", "40000", "--seq", "16", "--monitor.plugin=none",
                 f"--checkpoint.dir={tmp_path / 'ck'}", "--checkpoint.every_n_steps=40"])
    out, err = capsys.readouterr()
    assert code == 2 and "train loss" not in out and "progress" not in err
    assert err.strip() == (f"error: checkpoint.dir '{tmp_path / 'ck'}' is a file, not a directory: remove it or set "
                           f"checkpoint.dir to another path")


def test_unverifiable_sizes_never_block(tmp_path):
    """The free-space check uses the previous checkpoint's size when it can read it, and an
    estimate otherwise; a directory without one saves normally."""
    assert checkpoint.CheckpointError is CheckpointError
    from zeroplug.checkpoint import _previous_bytes
    assert _previous_bytes(tmp_path) == 0
    (tmp_path / "latest").write_text("nope")
    assert _previous_bytes(tmp_path) == 0
