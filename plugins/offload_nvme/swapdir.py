"""The swapper's private directory: creation, stale directories, cleanup at exit / SIGTERM.

Files live in a private directory ``zeroplug-swap-<pid>-<random>`` (0700, files 0600)
under ``nvme_path``. It is removed by :meth:`AsyncSwapper.close`, at interpreter exit
(atexit), on SIGTERM (the handler cleans up, then chains to the previous handler or
re-raises the default action) and by ``with AsyncSwapper(...)`` on an exception. A
directory left by a run that was killed (SIGKILL, a crash) is found and removed at the
next start under the same ``nvme_path``. A forked child (a DataLoader worker) never
removes its parent's directory.
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
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from zeroplug.errors import ConfigError
from zeroplug.memory import GB

from .errors import SwapPathError, explain

if TYPE_CHECKING:
    from .swapper import AsyncSwapper

log = logging.getLogger("zeroplug")

DIR_PREFIX = "zeroplug-swap-"
_DIR_RE = re.compile(r"^zeroplug-swap-(\d+)-[0-9a-f]+$")
_OWNER = ".owner"


def _proc_start(pid: int) -> str | None:
    """The start time of a process (clock ticks since boot), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def clean_stale(nvme_path: str) -> list[tuple[str, int]]:
    """Remove swap directories under ``nvme_path`` whose process is gone; returns (dir, bytes)."""
    removed = []
    host = socket.gethostname()
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in names:
        m = _DIR_RE.match(name)
        if not m:
            continue
        d = os.path.join(nvme_path, name)
        pid = int(m.group(1))
        try:
            with open(os.path.join(d, _OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            owner = None
        if owner is not None:
            if owner.get("host") != host:
                continue            # another machine's run on a shared filesystem
            start = owner.get("start")
            stale = not _alive(pid) or (start is not None and _proc_start(pid) not in (None, start))
        else:
            try:                    # no marker: being created right now, or killed right then
                young = time.time() - os.lstat(d).st_mtime < 60
            except OSError:
                continue
            stale = not young and not _alive(pid)
        if not stale:
            continue
        size = _tree_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(d):
            log.warning("NVMe swap: found the stale swap directory %s (%s) of a run that ended without "
                        "cleaning up (pid %d), but could not remove it; remove it by hand", d,
                        _fmt_bytes(size), pid)
            continue
        log.warning("NVMe swap: removed the stale swap directory %s (%s) left by a run that ended without "
                    "cleaning up (pid %d is gone)", d, _fmt_bytes(size), pid)
        removed.append((d, size))
    return removed


def _make_run_dir(base: str) -> str:
    for _ in range(100):
        d = os.path.join(base, f"{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise explain(exc, base, "creating the swap directory") from None
        try:
            os.chmod(d, 0o700)      # whatever the umask
            fd = os.open(os.path.join(d, _OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                           "start": _proc_start(os.getpid())}, f)
        except OSError as exc:
            shutil.rmtree(d, ignore_errors=True)
            raise explain(exc, d, "writing into the swap directory") from None
        return d
    raise SwapPathError(f"NVMe swap: could not create a unique directory under {base}", base)


_LIVE: dict[int, "AsyncSwapper"] = {}
_LIVE_LOCK = threading.Lock()
_HANDLER_STATE: dict[str, Any] = {"installed": False, "previous": None}


def _cleanup_all(fast: bool) -> None:
    with _LIVE_LOCK:
        swappers = list(_LIVE.values())
    for s in swappers:
        try:
            s._remove_dir() if fast else s.close(wait=False)
        except Exception:   # noqa: BLE001 - cleanup at exit must not raise
            pass


def _atexit() -> None:
    _cleanup_all(fast=False)


def _on_sigterm(signum, frame):
    prev = _HANDLER_STATE["previous"]
    if callable(prev):
        # Note: a previous handler decides. If it returns, the process goes on (e.g. to save a
        # checkpoint, which may need the swap files) and they stay; if it raises (SystemExit,
        # torchelastic's SignalException) the exception unwinds and atexit removes them.
        prev(signum, frame)
        return
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

