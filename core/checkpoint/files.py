"""Checkpoint files: the on-disk layout, atomic writes, manifests and verification.

A checkpoint directory::

    <dir>/latest                 the newest complete tag (written last: temp file, fsync, rename)
    <dir>/<tag>/manifest.json    format, counters, the model's parameter names / shapes / dtype,
                                 each file's size and sha256 (and its own checksum)
    <dir>/<tag>/rank_00000.pt    one file per rank (``torch.save``; read with ``weights_only=True``)
    <dir>/<tag>/rank_00000.sg00003.pt
                                 part files of a rank (format version 2): states written one
                                 sub-group at a time (the nvme tier streams them from its swap
                                 files); listed in the manifest with "part" (and size, sha256)

Part files (version 2): a piece may carry ``"part": "rank_00000.sg00003.pt"`` instead of
its "master" / "optim" tensors; that file (``format``, ``version``, ``rank``, ``part``,
``pieces``) holds, under the same name and [start, end), a piece with exactly those
tensors. The partitioner writes part files through the :class:`PartWriter` that
``checkpoint_state(optimizer, parts=...)`` receives; :meth:`ShardSet.piece_states`
resolves a piece either way. Checkpoints without part files are written as version 1.

The save / load protocol that uses these is :mod:`zeroplug.checkpoint`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

import torch

from zeroplug.errors import ZeroplugError


FORMAT = "zeroplug-checkpoint"
VERSION = 2             # the newest format this reads; a save without part files writes version 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


class CheckpointError(ZeroplugError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this model."""


# --- files -----------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, write, mode: str) -> None:
    """``write(f)`` into ``path`` so that a crash leaves either the old file or the new one
    (temporary file, fsync, rename, fsync the directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)          # mkstemp's 0600 would hide it from other users
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj, path) -> None:
    """``torch.save`` to ``path`` atomically."""
    _atomic_write(path, lambda f: torch.save(obj, f), "wb")


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    _atomic_write(path, lambda f: f.write(text), "w")


def load(path, map_location="cpu", mmap: bool = False):
    """Load a file written by zeroplug; never executes code (``weights_only=True``)."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b) -> int:
        self.sha.update(b)
        try:
            n = self.f.write(b)
        except OSError as exc:
            self.error = exc        # torch.save reports it as "unexpected pos": keep the cause
            raise
        self.size += len(memoryview(b).cast("B"))
        return n

    def flush(self) -> None:
        self.f.flush()


def write_torch_file(obj, path) -> tuple[int, str]:
    """``torch.save`` ``obj`` into a new file, fsynced; returns (size, sha256) of its bytes.
    A failed write raises the ``OSError`` (ENOSPC, EIO, ...) with the file's path."""
    w = None
    try:
        with open(path, "xb") as f:
            w = _HashingWriter(f)
            try:
                torch.save(obj, w)
            except RuntimeError:
                if w.error is None:
                    raise
                raise w.error from None
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    return w.size, w.sha.hexdigest()


def file_sha256(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def part_file_name(rank: int, label: str) -> str:
    return f"rank_{rank:05d}.{label}.pt"


_LABEL = re.compile(r"^[a-z][a-z0-9]{0,31}$")


class PartWriter:
    """Writes a rank's part files into the checkpoint being saved (each fsynced and hashed as
    it is written), so that a partitioner can stream states that are not all in memory."""

    def __init__(self, directory: Path, rank: int):
        self.directory, self.rank = Path(directory), rank
        self.written: list[dict] = []       # {"file", "part", "size", "sha256"}

    def write(self, label: str, pieces: dict) -> str:
        """Write ``pieces`` ({param name: [piece, ...]}) as part ``label`` (e.g. "sg00003");
        returns the file name, which the rank file's pieces name under "part"."""
        if not _LABEL.match(label) or any(w["part"] == label for w in self.written):
            raise CheckpointError(f"part label {label!r}: use a new lower-case alphanumeric name")
        name = part_file_name(self.rank, label)
        obj = {"format": FORMAT, "version": VERSION, "rank": self.rank, "part": label, "pieces": pieces}
        size, digest = write_torch_file(obj, self.directory / name)
        self.written.append({"file": name, "part": label, "size": size, "sha256": digest})
        return name

def piece_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory whose storage is exactly ``t`` (no copy), so that
    ``torch.save`` writes only these elements rather than the whole underlying buffer."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()
    return torch.from_dlpack(t)


# --- manifest ------------------------------------------------------------------------

def manifest_checksum(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    manifest = dict(manifest, checksum=manifest_checksum(manifest))
    with open(directory / MANIFEST, "x") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# --- directories ---------------------------------------------------------------------

def install(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to its tag (an existing tag is replaced)."""
    old = None
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{secrets.token_hex(4)}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- reading -------------------------------------------------------------------------

def plain_name(name) -> bool:
    """A name that stays inside its directory: no separators, not hidden, not '..'."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name
            and "\0" not in name and not name.startswith(".") and name.isprintable())
