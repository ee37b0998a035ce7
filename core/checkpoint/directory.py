"""A checkpoint directory as a run owns it: checked, locked, with room for the next save.

* :func:`prepare` checks a directory before anything is written there: creatable, a
  directory (not a file), writable, and changeable by no other user (one owned by another
  user, or that every user can write, sticky bit or not, is refused: a resume would load
  what they put there). A group that can write it is trusted (its owner granted it).
  ``zeroplug train`` calls it at start, so a bad ``checkpoint.dir`` fails before the
  training it would lose. A directory it creates is 0755 (less under a stricter umask).
* The lock file is opened without following a link or blocking, and only a regular file is
  a lock (:mod:`zeroplug.locks`): a FIFO or link there is refused with one error.
* :func:`hold` takes the directory's lock (``<dir>/.zeroplug.lock``, see
  :mod:`zeroplug.locks`) for an owner (an engine) and keeps it until :func:`release`.
  A second process that would write there is refused, naming the holder. Every engine of
  one process shares the process's lock.
* :func:`check_space` compares the bytes a save will write with the free space;
  :func:`os_error_message` names ENOSPC / EDQUOT / EIO / EROFS / EACCES with the path,
  the numbers and the fix.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

from zeroplug.trust import data_dir_problem, make_dirs
from zeroplug.locks import UNSUPPORTED, NotALockFile, describe_holder, read_holder, try_lock

from .files import CheckpointError

log = logging.getLogger("zeroplug")

LOCK = ".zeroplug.lock"

_FIXES = {
    errno.ENOSPC: "free space there, keep fewer checkpoints (checkpoint.keep_last), or set checkpoint.dir "
                  "to a disk with more room",
    errno.EDQUOT: "this user's disk quota is exhausted: raise it, free space, or set checkpoint.dir to "
                  "another disk",
    errno.EROFS: "the filesystem is mounted read-only: remount it read-write or set checkpoint.dir to a "
                 "writable disk",
    errno.EACCES: "this user may not write there: fix the permissions or set checkpoint.dir to a directory "
                  "you own",
    errno.EPERM: "the operation is not permitted there: set checkpoint.dir to a directory you own",
    errno.EIO: "the disk reported an I/O error: check `dmesg` and the drive's health, or set "
               "checkpoint.dir to another disk",
    errno.ENOTDIR: "a component of the path is a file: set checkpoint.dir to a directory path",
    errno.EEXIST: "a file is in the way: remove it or set checkpoint.dir to another path",
}


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def free_bytes(path) -> int | None:
    """Bytes an unprivileged user may still write at ``path`` (None if unknown)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def os_error_message(exc: OSError, path, action: str, need: int | None = None) -> str:
    """``writing /ck/.tmp-x/rank_00000.pt failed: ENOSPC (No space left on device); ...``."""
    where = exc.filename or path
    e = exc.errno
    if e is None:
        return f"{action} {where} failed: {type(exc).__name__}: {exc}"
    msg = f"{action} {where} failed: {errno.errorcode.get(e, f'errno {e}')} ({os.strerror(e)})"
    if e in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(Path(path).parent if not Path(path).exists() else path)
        if need:
            msg += f"; the checkpoint needs about {fmt_bytes(need)}"
        if free is not None:
            msg += f"{',' if need else ';'} {fmt_bytes(free)} free there now"
    fix = _FIXES.get(e)
    return msg + (f". Fix: {fix}" if fix else "")


def prepare(save_dir) -> Path:
    """Create ``save_dir`` if needed and check that it is a directory this user can write."""
    d = Path(save_dir)
    if not str(save_dir).strip():
        raise CheckpointError("checkpoint directory is empty: set checkpoint.dir (e.g. --checkpoint.dir=ckpt)")
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"checkpoint.dir {str(d)!r} is a file, not a directory: remove it or set "
                              "checkpoint.dir to another path")
    try:
        make_dirs(d, 0o755)
    except OSError as exc:
        raise CheckpointError(f"checkpoint.dir {str(d)!r}: " + os_error_message(exc, d, "creating")) from None
    if not os.access(d, os.W_OK | os.X_OK):
        try:
            ro = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
        except OSError:
            ro = False
        e = errno.EROFS if ro else errno.EACCES
        raise CheckpointError(f"checkpoint.dir {str(d)!r}: "
                              + os_error_message(OSError(e, os.strerror(e)), d, "writing into"))
    problem = data_dir_problem(d)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint.dir {str(d)!r} is not used: {problem}, so another user could replace its checkpoints or "
            f"add one that a resume would load. Fix: chmod o-w {str(d)!r} if it is yours, or set checkpoint.dir "
            f"to a directory you own (e.g. mkdir -m 755 {os.path.join(str(d), '$USER')!r} if you may)")
    return d


# --- the directory lock, one per directory and process ------------------------------------

_HELD: dict[str, tuple] = {}        # real path of the directory -> (FileLock | None, {owner ids})
_HELD_LOCK = threading.Lock()
_WARNED: set[str] = set()


def hold(save_dir, owner) -> bool:
    """This process holds ``save_dir``'s lock on behalf of ``owner`` (taken now if this
    process does not hold it yet). Returns False where the filesystem keeps no locks
    (warned once). Raises :class:`CheckpointError` naming the holder when another process
    holds it."""
    d = prepare(save_dir)
    key = os.path.realpath(d)
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1].add(id(owner))
            return _HELD[key][0] is not None
        path = os.path.join(key, LOCK)
        try:
            lock = try_lock(path)
        except NotALockFile as exc:
            raise CheckpointError(
                f"checkpoint.dir {str(d)!r}: its lock file {LOCK} is {exc.strerror} (no zeroplug run made it). "
                f"Fix: remove {path!r} once you know who put it there, or set checkpoint.dir to another "
                f"directory") from None
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                if key not in _WARNED:
                    _WARNED.add(key)
                    log.warning("[zeroplug] the filesystem of %s keeps no file locks (%s): nothing stops "
                                "another run from writing checkpoints there too", key,
                                errno.errorcode.get(exc.errno, exc.errno))
                _HELD[key] = (None, {id(owner)})
                return False
            raise CheckpointError(f"checkpoint.dir {str(d)!r}: " + os_error_message(exc, path, "locking")) from None
        if lock is None:
            raise CheckpointError(
                f"checkpoint directory {str(d)!r} is in use by {describe_holder(read_holder(path))}; two "
                f"runs writing one directory overwrite each other's checkpoints. Wait for that run to end, "
                f"or give this one its own directory (--checkpoint.dir=...)")
        _HELD[key] = (lock, {id(owner)})
        return True


def hold_on_rank0(comm, save_dir, owner) -> None:
    """:func:`hold` on rank 0 (which alone writes the directory's files), its refusal
    raised on every rank."""
    error = None
    if comm.rank == 0:
        try:
            hold(save_dir, owner)
        except CheckpointError as exc:
            error = str(exc)
    error = comm.broadcast_object(error, src=0)
    if error is not None:
        raise CheckpointError(error)


def holds(save_dir) -> bool:
    """Whether this process holds ``save_dir``'s lock."""
    with _HELD_LOCK:
        entry = _HELD.get(os.path.realpath(save_dir))
    return entry is not None and entry[0] is not None


def release(owner) -> None:
    """``owner`` no longer needs its directories; a lock no owner needs is let go."""
    with _HELD_LOCK:
        for key in list(_HELD):
            lock, owners = _HELD[key]
            owners.discard(id(owner))
            if not owners:
                del _HELD[key]
                if lock is not None:
                    lock.release()


def check_space(save_dir, need: int) -> None:
    """Refuse a save of ``need`` bytes that cannot fit, before anything is written."""
    free = free_bytes(save_dir)
    if free is None or need <= free:
        return
    raise CheckpointError(
        f"it needs about {fmt_bytes(need)} but {save_dir} has {fmt_bytes(free)} free (it would fail with ENOSPC). "
        f"Fix: {_FIXES[errno.ENOSPC]}")


__all__ = ["LOCK", "prepare", "hold", "hold_on_rank0", "holds", "release", "check_space", "os_error_message", "fmt_bytes",
           "free_bytes"]
