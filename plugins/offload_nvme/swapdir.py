"""The swapper's private directory: creation, stale directories, cleanup at exit / SIGTERM.

Files live in a private directory ``zeroplug-swap-<pid>-<random>`` (0700, files 0600)
under ``nvme_path``, which holds a lock file (``.lock``, :mod:`zeroplug.locks`) that the
run keeps locked while it lives. The directory is removed by :meth:`AsyncSwapper.close`,
at interpreter exit (atexit), on SIGTERM (the handler cleans up, then chains to the
previous handler or re-raises the default action) and by ``with AsyncSwapper(...)`` on an
exception; a SIGTERM that arrives while atexit cleans up lets it finish. A directory left
by a run that was killed (SIGKILL, a crash) has a free lock: it is removed when a swapper
starts or closes under the same ``nvme_path``. A removal renames the directory to a hidden
``.<name>.del`` first, so one cut short leaves garbage by its name. Only the
lock decides, never the pid in the name, so a run in another pid namespace (a container)
or on another host sharing the filesystem is never taken for a dead one. A forked child
(a DataLoader worker) never removes its parent's directory.
"""
from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import secrets
import shutil
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from zeroplug.errors import ConfigError
from zeroplug.locks import UNSUPPORTED, holder_record, read_holder, try_lock
from zeroplug.observe.memory import GB

from .errors import SwapPathError, explain

if TYPE_CHECKING:
    from .swapper import AsyncSwapper

log = logging.getLogger("zeroplug")

DIR_PREFIX = "zeroplug-swap-"
_DIR_RE = re.compile(r"^zeroplug-swap-(\d+)-[0-9a-f]+$")
_NEW_RE = re.compile(r"^\.zeroplug-swap-(\d+)-[0-9a-f]+\.new$")     # being created
_DEL_RE = re.compile(r"^\.zeroplug-swap-(\d+)-[0-9a-f]+\.del$")     # being removed
LOCK = ".lock"
_WARNED_UNLOCKED: set[str] = set()


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _fmt_bytes(n: float) -> str:
    return f"{n / GB:.2f} GiB" if n >= GB / 10 else f"{n / 2**20:.1f} MiB"


def check_path(nvme_path: str, key: str = "nvme_path") -> str:
    """``nvme_path`` must exist, be a directory and be writable; returns its absolute path."""
    if not nvme_path:
        raise ConfigError(f"{key} is empty: set it to a directory on a local NVMe disk", key=key)
    path = os.path.abspath(os.path.expanduser(nvme_path))
    if not os.path.exists(path):
        raise explain(FileNotFoundError(errno.ENOENT, "missing"), path, f"{key} = {nvme_path!r}")
    if not os.path.isdir(path):
        raise explain(NotADirectoryError(errno.ENOTDIR, "not a directory"), path, f"{key} = {nvme_path!r}")
    if not os.access(path, os.W_OK | os.X_OK):
        try:    # tell a read-only filesystem from a permission problem
            ro = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        except OSError:
            ro = False
        e = errno.EROFS if ro else errno.EACCES
        raise explain(OSError(e, os.strerror(e)), path, f"{key} = {nvme_path!r}: not writable")
    return path


def _discard(d: str) -> str | None:
    """Remove the directory ``d``; what is left of it (None: nothing).

    Note: ``d`` is first renamed to a hidden ``.<name>.del``, then emptied. A removal cut
    short (SIGTERM's default action arriving mid-way, a kill) then leaves garbage by its
    name, which :func:`clean_stale` removes, never a directory under its live name whose
    lock file is already gone (no later run could tell it from a live one's). And on
    SIGTERM the owner removes its directory while transfers are still in flight (the
    handler cannot wait for them): after the rename, a transfer that opens a new file
    under ``d`` fails instead of recreating entries there."""
    base, name = os.path.split(d)
    doomed = d if _DEL_RE.match(name) else os.path.join(base, f".{name}.del")
    if doomed != d:
        try:
            os.rename(d, doomed)
        except OSError:
            doomed = d
    for _ in range(3):
        shutil.rmtree(doomed, ignore_errors=True)
        if not os.path.lexists(doomed):
            return None
        time.sleep(0.05)    # a transfer that opened its file before the rename
    return doomed


def remove_run_dir(d: str, lock) -> None:
    """Remove this run's directory ``d`` (:func:`_discard`), then let its lock go."""
    _discard(d)
    if lock is not None:
        lock.release(remove=False)


def _remove_stale(d: str, lock, rec: dict | None, why: str) -> tuple[str, int] | None:
    size = _tree_bytes(d)
    left = _discard(d)
    if lock is not None:
        lock.release(remove=False)          # the file went with the directory
    who = f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')}" if rec else "an unknown process"
    if left:
        log.warning("NVMe swap: found the stale swap directory %s (%s) of %s, but could not remove it; remove "
                    "%s by hand", d, _fmt_bytes(size), who, left)
        return None
    log.warning("NVMe swap: removed the stale swap directory %s (%s) left by a run that ended without cleaning "
                "up (%s; %s)", d, _fmt_bytes(size), who, why)
    return d, size


def clean_stale(nvme_path: str) -> list[tuple[str, int]]:
    """Remove the swap directories under ``nvme_path`` that no live process holds (their
    lock can be taken); returns (dir, bytes) of each. A lock says whether its holder
    lives in any pid namespace and, where the filesystem has locks, on any host."""
    removed = []
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in names:
        if _DEL_RE.match(name):     # garbage by its name, unless its owner is removing it now
            d, lock = os.path.join(nvme_path, name), None
            if os.path.lexists(os.path.join(d, LOCK)):
                try:
                    lock = try_lock(os.path.join(d, LOCK), create=False, record=False)
                except OSError:     # no locks on this filesystem: garbage by its name
                    pass
                else:
                    if lock is None:
                        continue    # held: a rank beside this one is emptying it
            found = _remove_stale(d, lock, None, "left while it was being removed")
            removed += [found] if found else []
            continue
        staging = _NEW_RE.match(name)
        if not (staging or _DIR_RE.match(name)):
            continue
        d = os.path.join(nvme_path, name)
        lock_path = os.path.join(d, LOCK)
        if not os.path.lexists(lock_path):
            try:                    # a directory being created, or whose creation was killed
                old = time.time() - os.lstat(d).st_mtime > 60
            except OSError:
                continue
            if staging and old:
                found = _remove_stale(d, None, None, "killed while it was being created")
                removed += [found] if found else []
            elif not staging and name not in _WARNED_UNLOCKED:
                _WARNED_UNLOCKED.add(name)
                log.warning("NVMe swap: %s has no lock file (an older zeroplug made it), so whether its run "
                            "still lives is unknown; it is left alone: remove it by hand once no run uses it", d)
            continue
        try:
            lock = try_lock(lock_path, create=False, record=False)
        except OSError as exc:      # no locks on this filesystem, or not ours to open: cannot tell
            log.debug("NVMe swap: cannot test the lock of %s (%s); left alone", d, exc)
            continue
        if lock is None:
            continue                # held: its run is alive
        found = _remove_stale(d, lock, read_holder(lock_path), "its lock was free")
        removed += [found] if found else []
    return removed


def _make_run_dir(base: str):
    """Create this run's private directory, locked: ``(path, lock)``. It is made under a
    hidden name, locked, then renamed, so a directory under the final name always has a
    lock file (held while the run lives)."""
    for _ in range(100):
        name = f"{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        staging, final = os.path.join(base, f".{name}.new"), os.path.join(base, name)
        try:
            os.mkdir(staging, 0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise explain(exc, base, "creating the swap directory") from None
        lock = None
        try:
            os.chmod(staging, 0o700)      # whatever the umask
            try:
                lock = try_lock(os.path.join(staging, LOCK), mode=0o600)
            except OSError as exc:
                if exc.errno not in UNSUPPORTED:
                    raise
                log.warning("NVMe swap: the filesystem of %s keeps no file locks (%s): a directory this run "
                            "leaves behind (SIGKILL) is never removed automatically", base,
                            errno.errorcode.get(exc.errno, exc.errno))
                fd = os.open(os.path.join(staging, LOCK), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(holder_record(), f)
            else:
                if lock is None:          # taken by a cleaner in the instant before: start again
                    shutil.rmtree(staging, ignore_errors=True)
                    continue
            os.rename(staging, final)
            if lock is not None:
                lock.path = os.path.join(final, LOCK)
        except OSError as exc:
            if lock is not None:
                lock.release(remove=False)
            shutil.rmtree(staging, ignore_errors=True)
            raise explain(exc, staging, "writing into the swap directory") from None
        return final, lock
    raise SwapPathError(f"NVMe swap: could not create a unique directory under {base}", base)


_LIVE: dict[int, "AsyncSwapper"] = {}
_LIVE_LOCK = threading.Lock()
_HANDLER_STATE: dict[str, Any] = {"installed": False, "previous": None, "exiting": False}


def _cleanup_all(fast: bool) -> None:
    with _LIVE_LOCK:
        swappers = list(_LIVE.values())
    for s in swappers:
        try:
            s._remove_dir() if fast else s.close(wait=False)
        except Exception:   # noqa: BLE001 - cleanup at exit must not raise
            pass


def _atexit() -> None:
    _HANDLER_STATE["exiting"] = True
    _cleanup_all(fast=False)


def _on_sigterm(signum, frame):
    prev = _HANDLER_STATE["previous"]
    if callable(prev):
        # Note: a previous handler decides. If it returns, the process goes on (e.g. to save a
        # checkpoint, which may need the swap files) and they stay; if it raises (SystemExit,
        # torchelastic's SignalException) the exception unwinds and atexit removes them.
        prev(signum, frame)
        return
    if _HANDLER_STATE["exiting"]:
        return                     # atexit is cleaning up, and the process ends after it
    _cleanup_all(fast=True)        # the default action follows: files first
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    if _HANDLER_STATE["installed"]:
        return
    if threading.current_thread() is not threading.main_thread():
        log.debug("NVMe swap: not on the main thread, so no SIGTERM handler (atexit still cleans up)")
        return
    prev = signal.getsignal(signal.SIGTERM)
    if prev is signal.SIG_IGN:
        _HANDLER_STATE["installed"] = True        # the process ignores SIGTERM: so do we
        return
    _HANDLER_STATE["previous"] = prev if callable(prev) else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    _HANDLER_STATE["installed"] = True


def _after_fork_in_child() -> None:
    # a forked child (a DataLoader worker) must never remove its parent's files
    with _LIVE_LOCK:
        _LIVE.clear()


atexit.register(_atexit)
os.register_at_fork(after_in_child=_after_fork_in_child)

