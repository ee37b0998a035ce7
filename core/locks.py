"""Who holds a directory: advisory locks (``fcntl.flock``) on lock files.

A run holds the lock of each directory it writes (its checkpoint directory, its NVMe swap
directory) for as long as it runs. The kernel drops a flock when the last descriptor of
the open file closes, at exit, SIGKILL and crashes included, so "the lock can be taken"
means "no live process holds it": true across pid namespaces (containers) and, where the
filesystem supports locks (local disks, NFSv4, Lustre, GPFS), across hosts. Pids and
hosts are recorded only to tell people who holds it.

The lock file holds the holder's host, pid, start time and command line (JSON).

Note: a lock path may sit in a directory that other users can write. A lock file is opened
without following links and without blocking (``O_NOFOLLOW | O_NONBLOCK``) and used only
if it is a regular file (a FIFO there would block a reader forever); a holder's record is
read with a size bound and printed with its control characters escaped.

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
import logging
import os
import socket
import stat
import sys
import time
import weakref

from zeroplug.trust import printable

#: errnos of a filesystem that keeps no locks (some FUSE and old NFS mounts)
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class NotALockFile(OSError):
    """What is at a lock path is not a regular file (a FIFO, a device, a link, a directory):
    no zeroplug process made it, so it is no one's lock; it is never opened for reading,
    never waited on."""


class FileLock:
    """A lock this process holds; :meth:`release` (or process exit) lets it go.

    ``path`` names the file for messages; where the lock was taken inside a held directory
    (``dir_fd``), the file is found again by ``name`` relative to that directory."""

    def __init__(self, path: str, fd: int, name: str | None = None, dir_fd: int | None = None):
        self.path, self._fd = path, fd
        self._name = name
        self._dir_fd = None if dir_fd is None else os.dup(dir_fd)
        _HELD.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove: bool = True) -> None:
        """Let go; ``remove`` deletes the lock file first (if it is still ours)."""
        fd, self._fd = self._fd, None
        dir_fd, self._dir_fd = self._dir_fd, None
        _HELD.discard(self)
        if fd is None:
            return
        try:
            if remove:
                if dir_fd is not None:
                    if _same_file(self._name, fd, dir_fd):
                        os.unlink(self._name, dir_fd=dir_fd)
                elif _same_file(self.path, fd):
                    os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)
            if dir_fd is not None:
                os.close(dir_fd)

    def close_in_child(self) -> None:
        """In a forked child: close this process's copies of the descriptors, keeping the lock
        (it belongs to the parent) and its file."""
        fds, self._fd, self._dir_fd = (self._fd, self._dir_fd), None, None
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __repr__(self) -> str:
        return f"FileLock({self.path!r}, {'held' if self.held else 'released'})"


_HELD: "weakref.WeakSet[FileLock]" = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        lock.close_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _same_file(path: str, fd: int, dir_fd: int | None = None) -> bool:
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str, flags: int, mode: int, dir_fd: int | None, where: str) -> int:
    """``os.open`` that never follows a link, never blocks (a FIFO), and keeps only a
    regular file; raises :class:`NotALockFile` for anything else."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotALockFile(errno.ELOOP, "a symbolic link, not a lock file", where) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):     # a FIFO without a reader; a directory
            raise NotALockFile(exc.errno, "not a regular file", where) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotALockFile(errno.EINVAL, f"{_kind(st.st_mode)}, not a lock file", where)
    return fd


def holder_record() -> dict:
    """What a lock file says about this process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "command": " ".join([os.path.basename(argv[0]), *argv[1:]] if (argv := sys.orig_argv) else [])[:300]}


def try_lock(path, create: bool = True, record: bool = True, mode: int = 0o644,
             dir_fd: int | None = None, where: str | None = None) -> FileLock | None:
    """Take the lock at ``path`` without waiting; None when another process holds it (or,
    with ``create=False``, when there is no lock file). ``record`` writes this process's
    :func:`holder_record` into the file. ``dir_fd``: ``path`` is a name inside that held
    directory; ``where`` names the file in messages. The file is opened without following
    a link or blocking; anything but a regular file raises :class:`NotALockFile`. Raises
    ``OSError`` for anything else, with an errno in :data:`UNSUPPORTED` where the
    filesystem keeps no locks. ``mode``: of a new file."""
    path = os.fspath(path)
    where = where or path
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    for _ in range(100):
        try:
            fd = _open_regular(path, flags, mode, dir_fd, where)
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
        if not _same_file(path, fd, dir_fd):  # removed by its holder meanwhile: not the lock any more
            os.close(fd)
            if not create:
                return None
            continue
        if record:
            data = json.dumps(holder_record()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        return FileLock(where, fd, name=path if dir_fd is not None else None, dir_fd=dir_fd)
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced", where)


def wait_lock(path, what: str = "", timeout_s: float | None = None, mode: int = 0o600,
              poll_s: float = 0.1) -> tuple[FileLock | None, float]:
    """Take the lock at ``path``, waiting while another process holds it: ``(lock, seconds
    waited)``. The lock is None where the filesystem keeps no locks, or after ``timeout_s``
    (None: no limit). ``what`` (e.g. "building the kernel"): one INFO line the first time it
    waits, naming the file."""
    t0 = time.monotonic()
    said = False
    while True:
        try:
            lock = try_lock(path, mode=mode)
        except OSError:
            return None, time.monotonic() - t0
        if lock is not None or (timeout_s is not None and time.monotonic() - t0 > timeout_s):
            return lock, time.monotonic() - t0
        if what and not said:
            logging.getLogger("zeroplug").info("[zeroplug] another process on this machine is %s (%s); "
                                               "waiting for it", what, os.fspath(path))
            said = True
        time.sleep(poll_s)


#: the longest record read from a lock file (a holder's record is well below it)
RECORD_LIMIT = 4096


def read_holder(path, dir_fd: int | None = None) -> dict | None:
    """The record in the lock file at ``path`` (None if it cannot be read, is no regular
    file, or is longer than :data:`RECORD_LIMIT`). Never follows a link, never blocks. A
    holder writes it just after locking, so an empty file is read again for a moment."""
    for _ in range(20):
        try:
            fd = _open_regular(os.fspath(path), os.O_RDONLY, 0, dir_fd, os.fspath(path))
        except OSError:
            return None
        try:
            data = os.read(fd, RECORD_LIMIT + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) > RECORD_LIMIT:
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
    # Note: the record is whatever the file holds, written by whoever could write it:
    # control characters are escaped, so that it cannot drive the terminal it is printed on.
    out = f"pid {printable(rec.get('pid', '?'), 40)} on host {printable(rec.get('host', '?'), 100)}"
    started = rec.get("started")
    if isinstance(started, (int, float)) and not isinstance(started, bool):
        try:
            out += ", started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        except (OverflowError, OSError, ValueError):
            pass
    if rec.get("command"):
        out += f" ({printable(rec['command'], 300)})"
    return out


__all__ = ["FileLock", "NotALockFile", "RECORD_LIMIT", "try_lock", "wait_lock", "read_holder", "describe_holder", "holder_record",
           "UNSUPPORTED"]
