"""State-dict files written one tensor at a time: ``.safetensors`` and torch's zip format.

Both formats put a table of every tensor's name, dtype and shape before the data, so a
writer that knows the shapes up front (from a checkpoint's metadata) writes the table
first and then each tensor's bytes as it is produced; the caller holds one tensor at a
time, never the whole state dict. The files are ordinary: ``safetensors.safe_open`` /
``safetensors.torch.load_file`` and ``torch.load(weights_only=True)`` read them.

Several state-dict keys that name one tensor (tied weights) are written once in a torch
file (both keys share a storage, as ``torch.save`` would store them) and once per key in a
safetensors file (the format has no sharing).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Entry:
    """One tensor of the output: ``key`` (the state-dict key), ``source`` (which tensor it is:
    keys with one source share it), ``shape`` and ``dtype``."""

    __slots__ = ("key", "source", "shape", "dtype")

    def __init__(self, key: str, source, shape, dtype: torch.dtype):
        self.key, self.source, self.shape, self.dtype = key, source, tuple(int(s) for s in shape), dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (any dtype, numpy has no bfloat16)."""
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class _Atomic:
    """A temporary file next to ``path`` that replaces it on success."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        os.fchmod(fd, 0o644)
        os.close(fd)
        self.tmp = Path(tmp)

    def commit(self) -> None:
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)


def write_safetensors(path, entries: list[Entry], produce, metadata: dict | None = None) -> None:
    """Write ``entries`` to ``path`` (atomically); ``produce(entry)`` returns each tensor in
    turn, called once per source in the entries' order."""
    header, offset = {}, 0
    for e in entries:
        if e.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{e.key}: dtype {e.dtype} cannot be written to safetensors")
        header[e.key] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out = _Atomic(path)
    try:
        with open(out.tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            last = (None, None)
            for e in entries:
                t = last[1] if last[0] is e.source and e.source is not None else produce(e)
                _check(e, t)
                f.write(_bytes_view(t))
                last = (e.source, t)
                del t
        out.commit()
    except BaseException:
        out.abort()
        raise


def _check(e: Entry, t: torch.Tensor) -> None:
    if tuple(t.shape) != e.shape or t.dtype != e.dtype:
        raise ValueError(f"{e.key}: produced {tuple(t.shape)} {t.dtype}, expected {e.shape} {e.dtype}")


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as torch's own tensor record: a storage (by key) viewed with a shape."""

    def __init__(self, storage: _StorageRef, shape):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self):
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, OrderedDict()))


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.TypedStorage(0, dtype=dtype, _internal=True)._pickle_storage_type())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def write_torch(path, entries: list[Entry], produce) -> None:
    """Write ``entries`` as a ``torch.save`` file (a dict, atomically) that
    ``torch.load(weights_only=True)`` reads; ``produce(entry)`` as for :func:`write_safetensors`."""
    storages: dict[object, _StorageRef] = {}
    order: list[tuple[_StorageRef, Entry]] = []
    obj = {}
    for e in entries:
        key = e.source if e.source is not None else ("key", e.key)
        ref = storages.get(key)
        if ref is None:
            numel = e.nbytes // max(1, torch.empty((), dtype=e.dtype).element_size())
            ref = storages[key] = _StorageRef(str(len(storages)), e.dtype, numel)
            order.append((ref, e))
        obj[e.key] = _TensorRef(ref, e.shape)
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    data = buf.getvalue()
    out = _Atomic(path)
    try:
        writer = torch._C.PyTorchFileWriter(str(out.tmp))
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for ref, e in order:
            t = produce(e)
            _check(e, t)
            t = t.detach().contiguous()
            if t.storage_offset() != 0 or t.untyped_storage().nbytes() != e.nbytes:
                t = t.clone()               # a view into a larger buffer: its own storage
            writer.write_record(f"data/{ref.key}", t.untyped_storage(), e.nbytes)
            del t
        writer.write_end_of_file()
        del writer
        out.commit()
    except BaseException:
        out.abort()
        raise


def parse_size(text) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1.5GiB"`` / an int -> bytes (decimal units as Hugging Face
    counts them, binary ones for ``*iB``)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(float(s))


def shard_entries(entries: list[Entry], max_bytes: int | None) -> list[list[Entry]]:
    """Consecutive entries cut into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    if not max_bytes:
        return [entries]
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_bytes and e.source is not cur[-1].source:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


__all__ = ["Entry", "write_safetensors", "write_torch", "parse_size", "shard_entries"]


def out_dtype(dt: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    """Floating tensors become ``want`` (None: kept); integer and bool ones stay as they are."""
    return want if want is not None and dt.is_floating_point else dt
