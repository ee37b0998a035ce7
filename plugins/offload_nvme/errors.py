"""Errors of the NVMe swap: each names the path, the cause (errno) and the fix."""
from __future__ import annotations

import errno
import os

from zeroplug.errors import ZeroplugError


class SwapError(ZeroplugError):
    """An NVMe swap operation failed; the message names the path, the cause and the fix."""

    def __init__(self, message: str, path: str | None = None, errno_: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, errno_


class SwapSpaceError(SwapError):
    """Not enough free space at nvme_path (ENOSPC / EDQUOT, or plan()'s check)."""


class SwapPathError(SwapError):
    """nvme_path is missing, not a directory, read-only or not writable by this user."""


class SwapIOError(SwapError):
    """The disk reported an I/O error (EIO) or another unexpected OS error."""


class SwapMemoryError(SwapError, MemoryError):
    """The swap buffers do not fit in the available host memory."""


_FIXES = {
    errno.ENOSPC: (SwapSpaceError, "free space there, or point nvme_path at a disk with more room "
                                   "(plan() reports how much the swap files need)"),
    errno.EDQUOT: (SwapSpaceError, "this user's disk quota is exhausted: raise it, free space, or "
                                   "point nvme_path at another disk"),
    errno.EROFS: (SwapPathError, "the filesystem is mounted read-only: remount it read-write or set "
                                 "nvme_path to a writable local disk"),
    errno.EACCES: (SwapPathError, "this user may not write there: chmod/chown the directory or set "
                                  "nvme_path to a directory you own"),
    errno.EPERM: (SwapPathError, "the operation is not permitted there: set nvme_path to a directory "
                                 "you own on a local disk"),
    errno.ENOENT: (SwapPathError, "create it (mkdir -p) or fix nvme_path"),
    errno.ENOTDIR: (SwapPathError, "nvme_path must be a directory: fix nvme_path"),
    errno.EIO: (SwapIOError, "the disk or filesystem reported a hardware error: check `dmesg` and the "
                             "drive's health (nvme smart-log / smartctl), or use another nvme_path"),
}


def explain(exc: OSError, path: str, action: str, note: str = "") -> SwapError:
    """An ``OSError`` as a :class:`SwapError` naming the path, the errno meaning and the fix."""
    e = exc.errno if exc.errno is not None else errno.EIO
    cls, fix = _FIXES.get(e, (SwapIOError, "check the disk and nvme_path"))
    if e == errno.ENOENT and os.path.basename(os.path.dirname(path)).startswith("zeroplug-swap-"):
        cls, fix = SwapIOError, ("this run's swap file is gone: something outside this run removed its swap "
                                 "directory (a cleanup script, or a tool that ignores the directory's lock), "
                                 "and the states in it are lost; resume from the last checkpoint")
    meaning = f"{errno.errorcode.get(e, 'errno ' + str(e))} ({os.strerror(e)})"
    msg = f"NVMe swap: {action} failed at {path}: {meaning}. Fix: {fix}."
    if note:
        msg += " " + note
    err = cls(msg, path, e)
    err.__cause__ = exc
    return err
