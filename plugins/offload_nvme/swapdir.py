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

``nvme_path`` may be a scratch disk every user can write. The run's directory is held by a
descriptor from the moment it is made (:class:`zeroplug.trust.HeldDir`: this user's,
0700, checked on the descriptor), and every file in it is opened, renamed and removed
relative to that descriptor without following links: another user who renames it and
puts a link in its place redirects nothing. Only this user's directories are cleaned (by
root too), and a lock path that is not a regular file (a FIFO that would block a reader)
marks a directory to leave alone.
"""
from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import secrets
import signal
import stat
import threading
import time
from typing import Any, Protocol

from zeroplug.errors import ConfigError
from zeroplug.faults import at_abort
from zeroplug.trust import HeldDir, UntrustedDirError, printable
from zeroplug.locks import UNSUPPORTED, NotALockFile, describe_holder, holder_record, read_holder, try_lock
from zeroplug.observe.memory import GB

from .errors import SwapPathError, explain


log = logging.getLogger("zeroplug")

DIR_PREFIX = "zeroplug-swap-"
_DIR_RE = re.compile(r"^zeroplug-swap-(\d+)-[0-9a-f]+$")
_NEW_RE = re.compile(r"^\.zeroplug-swap-(\d+)-[0-9a-f]+\.new$")     # being created
_DEL_RE = re.compile(r"^\.zeroplug-swap-(\d+)-[0-9a-f]+\.del$")     # being removed
LOCK = ".lock"
_WARNED_UNLOCKED: set[str] = set()
_WARNED_NOT_A_LOCK: set[str] = set()


def _tree_bytes(d: HeldDir) -> int:
    total = 0
    for name in d.listdir():
        try:
            st = d.lstat(name)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = d.open_owned(name)
            except OSError:
                continue
            try:
                total += _tree_bytes(sub)
            finally:
                sub.close()
        else:
            total += st.st_blocks * 512
    return total


def fmt_bytes(n: float) -> str:
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


class RunDir:
    """A swap directory held by descriptors: ``parent`` (``nvme_path``), its ``name`` there,
    ``held`` (the directory itself) and its ``lock`` (None where the filesystem keeps no
    locks). ``path`` names it in messages."""

    def __init__(self, parent: HeldDir, name: str, held: HeldDir, lock):
        self.parent, self.name, self.held, self.lock = parent, name, held, lock

    @property
    def path(self) -> str:
        return self.held.path

    def close(self) -> None:
        self.held.close()
        self.parent.close()


def _discard(parent: HeldDir, name: str, held: HeldDir) -> str | None:
    """Empty and remove the held directory ``held``, found as ``name`` in ``parent``; what is
    left of it (None: nothing).

    Note: it is first renamed to a hidden ``.<name>.del``, then emptied. A removal cut
    short (SIGTERM's default action arriving mid-way, a kill) then leaves garbage by its
    name, which :func:`clean_stale` removes, never a directory under its live name whose
    lock file is already gone (no later run could tell it from a live one's). Every step
    goes through the descriptors: a name is renamed or removed only while it still names
    the held directory, so whatever another user put in its place is never touched, and
    the files removed are the held directory's wherever it was moved. A transfer still in
    flight may create a file while it is emptied: emptied again, up to 3 times."""
    doomed = name if _DEL_RE.match(name) else f".{name}.del"
    if doomed != name:
        if parent.is_entry(name, held):
            try:
                parent.rename(name, doomed)
            except OSError:
                doomed = name
        else:
            doomed = None       # moved away by someone else: emptied where it is, left there
    for _ in range(3):
        held.empty()
        if doomed is None:
            return None
        if not parent.is_entry(doomed, held):
            return None         # gone (or replaced by something that is not ours)
        try:
            parent.rmdir(doomed)
            return None
        except OSError:
            time.sleep(0.05)    # a transfer that opened its file before the rename
    return parent.join(doomed)


def remove_run_dir(run: RunDir, close: bool = True) -> None:
    """Remove this run's directory (:func:`_discard`), then let its lock go. ``close=False``
    keeps the descriptors open (the SIGTERM path: a transfer still running must not find
    their numbers given to another file)."""
    _discard(run.parent, run.name, run.held)
    if run.lock is not None:
        run.lock.release(remove=False)
    if close:
        run.close()


def _remove_stale(parent: HeldDir, name: str, held: HeldDir, lock, rec: dict | None,
                  why: str) -> tuple[str, int] | None:
    d = parent.join(name)
    size = _tree_bytes(held)
    left = _discard(parent, name, held)
    if lock is not None:
        lock.release(remove=False)          # the file went with the directory
    who = describe_holder(rec) if rec else "an unknown process"
    if left:
        log.warning("NVMe swap: found the stale swap directory %s (%s) of %s, but could not remove it; remove "
                    "%s by hand", d, fmt_bytes(size), who, left)
        return None
    log.warning("NVMe swap: removed the stale swap directory %s (%s) left by a run that ended without cleaning "
                "up (%s; %s)", d, fmt_bytes(size), who, why)
    return d, size


def _not_a_lock(exc: OSError) -> None:
    key = exc.filename or ""
    if key not in _WARNED_NOT_A_LOCK:
        _WARNED_NOT_A_LOCK.add(key)
        log.warning("NVMe swap: %s is %s, which no zeroplug run made; its directory is left alone: remove it "
                    "once you know whose it is", printable(key), exc.strerror)


def clean_stale(nvme_path: str) -> list[tuple[str, int]]:
    """Remove the swap directories under ``nvme_path`` that no live process holds (their
    lock can be taken); returns (dir, bytes) of each. A lock says whether its holder
    lives in any pid namespace and, where the filesystem has locks, on any host.

    Only directories owned by this user are touched (by root too: another user's are
    theirs to remove), each through a descriptor opened without following links. A lock
    path that holds no regular file (a FIFO, a link) is no run's lock: its directory is
    left, with one warning, and nothing waits on it."""
    removed = []
    try:
        parent = HeldDir.open_dir(nvme_path, follow=True)
    except OSError:
        return removed
    try:
        for name in parent.listdir():
            found = _clean_one(parent, name)
            if found:
                removed.append(found)
    finally:
        parent.close()
    return removed


def _clean_one(parent: HeldDir, name: str) -> tuple[str, int] | None:
    deleting, staging = _DEL_RE.match(name), _NEW_RE.match(name)
    if not (deleting or staging or _DIR_RE.match(name)):
        return None
    try:
        held = parent.open_owned(name)      # this user's directory, not a link
    except OSError as exc:
        log.debug("NVMe swap: %s is not this user's directory (%s); left alone", parent.join(name), exc)
        return None
    lock = None
    try:
        d = held.path
        try:
            held.lstat(LOCK)
            has_lock = True
        except FileNotFoundError:
            has_lock = False
        except OSError:
            return None
        if has_lock:
            try:
                lock = try_lock(LOCK, create=False, record=False, dir_fd=held.fd, where=held.join(LOCK))
            except NotALockFile as exc:
                _not_a_lock(exc)
                return None
            except OSError as exc:      # no locks on this filesystem, or not ours to open: cannot tell
                if not deleting:
                    log.debug("NVMe swap: cannot test the lock of %s (%s); left alone", d, exc)
                    return None
                lock = None             # garbage by its name
            else:
                if lock is None:
                    return None         # held: its run is alive (or a rank beside this one empties it)
        if deleting:
            return _remove_stale(parent, name, held, lock, None, "left while it was being removed")
        if lock is None:                # a directory being created, or whose creation was killed
            try:
                old = time.time() - held.fstat().st_mtime > 60
            except OSError:
                return None
            if staging and old:
                return _remove_stale(parent, name, held, None, None, "killed while it was being created")
            if not staging and name not in _WARNED_UNLOCKED:
                _WARNED_UNLOCKED.add(name)
                log.warning("NVMe swap: %s has no lock file (an older zeroplug made it), so whether its run "
                            "still lives is unknown; it is left alone: remove it by hand once no run uses it", d)
            return None
        rec = read_holder(LOCK, dir_fd=held.fd)
        found, lock = _remove_stale(parent, name, held, lock, rec, "its lock was free"), None
        return found
    finally:
        if lock is not None:
            lock.release(remove=False)
        held.close()


def make_run_dir(base: str) -> RunDir:
    """Create this run's private directory, locked. It is made under a hidden name, held by
    a descriptor and checked (this user's, 0700), locked, then renamed, so a directory under
    the final name always has a lock file (held while the run lives)."""
    try:
        parent = HeldDir.open_dir(base, follow=True)
    except OSError as exc:
        raise explain(exc, base, "opening nvme_path") from None
    try:
        for _ in range(100):
            name = f"{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            staging = f".{name}.new"
            try:
                held = parent.make_private(staging)
            except FileExistsError:
                continue
            except UntrustedDirError as exc:
                raise SwapPathError(
                    f"NVMe swap: the swap directory {exc.filename} was replaced just after this run made it "
                    f"({exc.strerror}): another user can write {base}. Fix: set nvme_path to a directory only "
                    f"you can write (chmod go-w, or a subdirectory of your own)", base) from None
            except OSError as exc:
                raise explain(exc, base, "creating the swap directory") from None
            lock = None
            try:
                try:
                    lock = try_lock(LOCK, mode=0o600, dir_fd=held.fd, where=held.join(LOCK))
                except OSError as exc:
                    if exc.errno not in UNSUPPORTED or isinstance(exc, NotALockFile):
                        raise
                    log.warning("NVMe swap: the filesystem of %s keeps no file locks (%s): a directory this run "
                                "leaves behind (SIGKILL) is never removed automatically", base,
                                errno.errorcode.get(exc.errno, exc.errno))
                    fd = held.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "w") as f:
                        json.dump(holder_record(), f)
                else:
                    if lock is None:      # taken by a cleaner in the instant before: start again
                        _discard(parent, staging, held)
                        held.close()
                        continue
                parent.rename(staging, name)
                held.path = parent.join(name)
                if lock is not None:
                    lock.path = held.join(LOCK)
            except OSError as exc:
                if lock is not None:
                    lock.release(remove=False)
                where = held.path
                _discard(parent, staging, held)
                held.close()
                raise explain(exc, where, "writing into the swap directory") from None
            return RunDir(parent, name, held, lock)
    except BaseException:
        parent.close()
        raise
    parent.close()
    raise SwapPathError(f"NVMe swap: could not create a unique directory under {base}", base)


class LiveSwapper(Protocol):
    """What the exit and signal handlers need of a swapper whose directory lives (AsyncSwapper)."""

    def remove_dir(self, fast: bool = False) -> None: ...

    def close(self, wait: bool = True) -> None: ...


_LIVE: dict[int, LiveSwapper] = {}
_LIVE_LOCK = threading.Lock()
_HANDLER_STATE: dict[str, Any] = {"installed": False, "previous": None, "exiting": False}


def register_live(swapper) -> None:
    """``swapper`` has a run directory: removed at exit and on SIGTERM unless it is removed first."""
    with _LIVE_LOCK:
        _LIVE[id(swapper)] = swapper
    _install_handlers()


def forget_live(swapper) -> None:
    """``swapper`` removed its run directory (harmless when it was never registered)."""
    with _LIVE_LOCK:
        _LIVE.pop(id(swapper), None)


def cleanup_all(fast: bool) -> None:
    """Remove every live swapper's run directory (``fast``: the SIGTERM path)."""
    with _LIVE_LOCK:
        swappers = list(_LIVE.values())
    for s in swappers:
        try:
            s.remove_dir(fast=True) if fast else s.close(wait=False)
        except Exception as exc:   # noqa: BLE001 - cleanup at exit must not raise
            log.debug("NVMe swap: cleaning up %r at exit failed: %r", s, exc)


def at_exit() -> None:
    """The atexit handler: every live run directory removed."""
    _HANDLER_STATE["exiting"] = True
    cleanup_all(fast=False)


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
    cleanup_all(fast=True)        # the default action follows: files first
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


atexit.register(at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
# a rank that zeroplug's watchdog ends (os._exit, no atexit) removes its swap directories first
at_abort(lambda: cleanup_all(fast=True))

