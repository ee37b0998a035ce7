"""Who holds a directory: advisory locks (``fcntl.flock``) on lock files.

A run holds the lock of each directory it writes (its checkpoint directory, its NVMe swap
directory) for as long as it runs. The kernel drops a flock when the last descriptor of
the open file closes, at exit, SIGKILL and crashes included, so "the lock can be taken"
means "no live process holds it": true across pid namespaces (containers) and, where the
filesystem supports locks (local disks, NFSv4, Lustre, GPFS), across hosts. Pids and
hosts are recorded only to tell people who holds it.

The lock file holds the holder's host, pid, start time and command line (JSON).

Note: a forked child (a DataLoader worker) inherits every descriptor, and with it a share of
each lock: were it to keep them, a holder killed before its children would look alive until
the last child ended. The child closes its copies at once (closing, never unlocking, so the
parent keeps its lock).

Note: a holder removes its lock file when it lets go. A process that opened the file just
before may then lock the removed file, so whoever takes a lock checks afterwards that the
path still names the file it locked, and starts again if not.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import weakref

#: errnos of a filesystem that keeps no locks (some FUSE and old NFS mounts)
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class FileLock:
    """A lock this process holds; :meth:`release` (or process exit) lets it go."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd
        _HELD.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove: bool = True) -> None:
        """Let go; ``remove`` deletes the lock file first (if it is still ours)."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is None:
            return
        try:
            if remove and _same_file(self.path, fd):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"FileLock({self.path!r}, {'held' if self.held else 'released'})"


_HELD: "weakref.WeakSet[FileLock]" = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        try:
            os.close(fd)
        except (OSError, TypeError):
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def holder_record() -> dict:
    """What a lock file says about this process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "command": " ".join([os.path.basename(argv[0]), *argv[1:]] if (argv := sys.orig_argv) else [])[:300]}


def try_lock(path, create: bool = True, record: bool = True, mode: int = 0o644) -> FileLock | None:
    """Take the lock at ``path`` without waiting; None when another process holds it (or,
    with ``create=False``, when there is no lock file). ``record`` writes this process's
    :func:`holder_record` into the file. Raises ``OSError`` for anything else, with an
    errno in :data:`UNSUPPORTED` where the filesystem keeps no locks. ``mode``: of a new file."""
    path = os.fspath(path)
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    for _ in range(100):
        try:
            fd = os.open(path, flags, mode)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(path, fd):      # removed by its holder meanwhile: not the lock any more
            os.close(fd)
            if not create:
                return None
            continue
        if record:
            data = json.dumps(holder_record()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        return FileLock(path, fd)
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced", path)


def read_holder(path) -> dict | None:
    """The record in the lock file at ``path`` (None if it cannot be read). A holder writes
    it just after locking, so an empty file is read again for a moment."""
    for _ in range(20):
        try:
            with open(path, "rb") as f:
                data = f.read(4096)
        except OSError:
            return None
        if data:
            try:
                rec = json.loads(data)
            except ValueError:
                return None
            return rec if isinstance(rec, dict) else None
        time.sleep(0.01)
    return None


def describe_holder(rec: dict | None) -> str:
    """``pid 123 on host gpu7, started 2025-01-02 10:11:12 (zeroplug train ...)``."""
    if not rec:
        return "another process (its lock file names no holder)"
    out = f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')}"
    started = rec.get("started")
    if isinstance(started, (int, float)):
        out += ", started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    if rec.get("command"):
        out += f" ({rec['command']})"
    return out


__all__ = ["FileLock", "try_lock", "read_holder", "describe_holder", "holder_record", "UNSUPPORTED"]
