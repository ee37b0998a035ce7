"""Reading a checkpoint's files as they were verified: each opened once, never through a link.

Whoever can write a checkpoint directory can also re-seal its manifest (the checksums are
not a secret), and can rename or replace a file between a check and a read by name. So
every file is opened once, relative to a descriptor of its checkpoint directory, with
``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is refused, a FIFO never blocks), checked to
be a regular file of the size the manifest gives, hashed from the bytes read, and loaded
(``torch.load(weights_only=True)``) from those same bytes:

* a file of this user that no one else may write is loaded from the descriptor it was
  hashed through (memory-mapped through ``/proc/self/fd``): nobody else can change it;
* any other file is copied while it is hashed into anonymous memory (``memfd``), which is
  what is loaded: the bytes another user may change afterwards are not the ones read.
  Note: such a checkpoint costs its size in host memory while it loads.

:class:`VerifiedFile` is one such file; :func:`read_small` reads ``latest`` and
``manifest.json`` (bounded sizes) the same way.
"""
from __future__ import annotations

import hashlib
import io
import os
import stat

import torch

from zeroplug.errors import ZeroplugError

_NOFOLLOW = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 22


class ReadError(ZeroplugError):
    """A file that cannot be used as it is (the message says why, without its path)."""


def open_dir(path, dir_fd=None, follow: bool = True) -> int:
    """A descriptor of directory ``path`` (relative to ``dir_fd``); ``follow`` False refuses a link."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise ReadError(_why(exc, "directory")) from None


def _why(exc: OSError, what: str = "file") -> str:
    import errno
    if exc.errno == errno.ELOOP:
        return "is a symbolic link; refused"
    if exc.errno == errno.ENOENT:
        return "is missing"
    if exc.errno == errno.ENOTDIR:
        return f"is not a {what}"
    return f"cannot be opened ({os.strerror(exc.errno) if exc.errno else exc})"


def open_regular(dir_fd, name: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise ReadError(_why(exc)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ReadError("is not a regular file (a FIFO, device or directory); refused")
    return fd, st


def read_small(dir_fd, name: str, limit: int) -> bytes:
    """The whole of regular file ``name`` (at most ``limit`` bytes), opened without following links."""
    fd, st = open_regular(dir_fd, name)
    try:
        if st.st_size > limit:
            raise ReadError(f"is {st.st_size} bytes, more than the {limit} it can be")
        chunks, n = [], 0
        while True:
            b = os.read(fd, min(_CHUNK, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:
                raise ReadError(f"is more than the {limit} bytes it can be")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _private(st: os.stat_result) -> bool:
    """Only this user (or root) can change the file's bytes."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _proc_fd(fd: int) -> str | None:
    p = f"/proc/self/fd/{fd}"
    return p if os.path.exists(p) else None


class VerifiedFile:
    """One file of a checkpoint, opened (no links), size- and sha256-checked once; :meth:`load`
    reads the verified bytes, as often as asked, never the name again."""

    def __init__(self, dir_fd, name: str, size, sha256):
        self.name = name
        self._fd = self._mem = None
        self._bytes: bytes | None = None
        fd, st = open_regular(dir_fd, name)
        keep, sink = False, None
        try:
            if st.st_size != size:
                raise ReadError(f"is corrupt (size {st.st_size}, manifest says {size})")
            keep = _private(st) and _proc_fd(fd) is not None
            if not keep:
                try:
                    sink = os.memfd_create(f"zeroplug-{name}", getattr(os, "MFD_CLOEXEC", 0))
                except (AttributeError, OSError):
                    sink = None
            h, n, buf = hashlib.sha256(), 0, [] if not keep and sink is None else None
            while True:
                b = os.read(fd, _CHUNK)
                if not b:
                    break
                h.update(b)
                n += len(b)
                if n > size:
                    break
                if sink is not None:
                    view = memoryview(b)
                    while view:
                        view = view[os.write(sink, view):]
                elif buf is not None:
                    buf.append(b)
            if n != size:
                raise ReadError(f"is corrupt (it changed while read: {n} bytes, manifest says {size})")
            if h.hexdigest() != sha256:
                raise ReadError("is corrupt (sha256 differs from the manifest)")
            if keep:
                self._fd, fd = fd, None
            elif sink is not None:
                self._mem, sink = sink, None
            else:
                self._bytes = b"".join(buf)
        finally:
            if fd is not None:
                os.close(fd)
            if not keep and sink is not None:
                os.close(sink)

    def load(self):
        """The file's object (``torch.load(weights_only=True)``) from the verified bytes."""
        if self._bytes is not None:
            return torch.load(io.BytesIO(self._bytes), map_location="cpu", weights_only=True)
        fd = self._fd if self._fd is not None else self._mem
        if fd is None:
            raise ReadError("was closed")
        return torch.load(f"/proc/self/fd/{fd}", map_location="cpu", weights_only=True, mmap=True)

    def close(self) -> None:
        for fd in (self._fd, self._mem):
            if fd is not None:
                os.close(fd)
        self._fd = self._mem = self._bytes = None

    def __del__(self):
        try:
            self.close()
        except Exception:       # noqa: BLE001 - interpreter shutdown
            pass
