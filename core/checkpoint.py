"""Checkpoint files: written atomically (temporary file, fsync, rename)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path) -> None:
    """``torch.save`` to ``path`` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path, map_location="cpu"):
    """Load a file written by zeroplug; never executes code (``weights_only=True``)."""
    return torch.load(path, map_location=map_location, weights_only=True)
