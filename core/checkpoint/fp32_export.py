"""The fp32 master weights of a checkpoint, merged from every rank's shards, one tensor at a time.

``zeroplug export CKPT OUT --dtype fp32`` and :func:`export_fp32` write them (DeepSpeed's
``zero_to_fp32``, for zeroplug's checkpoints and for DeepSpeed's). For each tensor in the
model's state-dict order the pieces that each rank file holds are copied into one buffer,
written and dropped, so host memory stays near the largest tensor, not the model.

Rank files are memory-mapped; the pages a copy touches stay resident while a file is mapped,
so the files are mapped again after every ``budget`` bytes read (default: the largest
tensor's bytes). Peak memory is therefore about the tensor being assembled plus ``budget``.

A source is anything with ``entries()`` (:class:`zeroplug.checkpoint.writers.Entry` per
state-dict key, in order) and ``produce(entry)`` (that tensor); :class:`ZeroplugSource`
reads a zeroplug checkpoint, :class:`zeroplug.checkpoint.deepspeed_format.DeepSpeedSource` a
DeepSpeed one.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .files import CheckpointError
from .loading import ShardSet, read_manifest, resolve, verify
from .writers import Entry, out_dtype, parse_size, shard_entries, write_safetensors, write_torch

log = logging.getLogger("zeroplug")

FORMATS = ("safetensors", "bin")
_SUFFIX = {".safetensors": "safetensors", ".bin": "bin", ".pt": "bin", ".pth": "bin"}
WEIGHTS_NAME = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint metadata")
    return dt


class ZeroplugSource:
    """A zeroplug checkpoint (verified first) as fp32 tensors: each parameter from the fp32
    master pieces of every rank file (the parameter's own values where the master is the
    parameter), the other state-dict entries (buffers) as saved, floating ones cast."""

    def __init__(self, load_dir, tag=None, dtype: torch.dtype | None = torch.float32, budget: int | None = None):
        self.path = resolve(load_dir, tag)
        manifest = read_manifest(self.path)
        verify(self.path, manifest)
        self.shards = ShardSet(self.path, manifest)
        meta = manifest.get("model") or {}
        self.params, self.keys = meta.get("params", {}), meta.get("state_dict", [])
        self.ranks = sorted(e["rank"] for e in manifest["files"].values() if "part" not in e)
        self.dtype = dtype
        self._maps: dict | None = None
        self._touched = 0
        self._warned = False
        self._extras: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
        for r in self.ranks:                       # where each extra is, its shape and dtype
            model = self.shards.load_rank(r)["model"]
            for k, v in model.get("extras", {}).items():
                self._extras.setdefault(k, (r, tuple(v.shape), v.dtype))
            del model
        largest = max([int(torch.Size(p["shape"]).numel()) * 4 for p in self.params.values()] + [1])
        self.budget = budget if budget is not None else largest

    def entries(self) -> list[Entry]:
        out = []
        for key, name in self.keys:
            if name is None:
                if key not in self._extras:
                    raise CheckpointError(f"checkpoint {str(self.path)!r}: state-dict entry {key!r} is missing")
                _, shape, dt = self._extras[key]
                out.append(Entry(key, ("extra", key), shape, out_dtype(dt, self.dtype)))
            else:
                p = self.params[name]
                out.append(Entry(key, ("param", name), p["shape"], out_dtype(_dtype(p["dtype"]), self.dtype)))
        return out

    def _models(self) -> dict:
        if self._maps is None:
            self._maps = {r: self.shards.load_rank(r)["model"] for r in self.ranks}
        return self._maps

    def _read(self, nbytes: int) -> None:
        """Count bytes read from the mapped files; past the budget, unmap them all."""
        self._touched += nbytes
        if self._touched >= self.budget:
            self.release()

    def release(self) -> None:
        self._maps = None
        self._touched = 0
        self.shards.release()

    def produce(self, e: Entry) -> torch.Tensor:
        kind, name = e.source
        if kind == "extra":
            r = self._extras[name][0]
            v = self._models()[r]["extras"][name]
            t = v.to(e.dtype, copy=True)
            self._read(v.numel() * v.element_size())
            return t
        numel = int(torch.Size(self.params[name]["shape"]).numel())
        out = torch.empty(numel, dtype=e.dtype)
        filled = 0
        for r in self.ranks:
            for pc in self._models()[r]["pieces"].get(name, ()):
                full = self.shards.piece_states(name, pc)
                val = full.get("master")
                if val is None:     # the master is the parameter itself (or no master was saved)
                    val = pc["param"] if "param" in pc else full.get("param")
                    if val is None:
                        raise CheckpointError(f"checkpoint {str(self.path)!r}: a piece of {name!r} has no values")
                    if val.dtype != torch.float32 and not self._warned:
                        self._warned = True
                        log.warning("[zeroplug] checkpoint %s keeps no fp32 masters of %r (its parameters are "
                                    "%s): exporting those values", self.path, name, val.dtype)
                out[pc["start"]:pc["end"]].copy_(val)
                filled += pc["end"] - pc["start"]
                self._read(val.numel() * val.element_size())
        if filled != numel:
            raise CheckpointError(f"checkpoint {str(self.path)!r} holds {filled} of the {numel} elements of {name!r}")
        return out.view(e.shape)


def open_source(load_dir, tag=None, dtype: torch.dtype | None = torch.float32, budget: int | None = None):
    """A zeroplug checkpoint's source, or a DeepSpeed checkpoint's (``global_stepN/`` with
    ``*_optim_states.pt``), whichever ``load_dir`` holds."""
    from .deepspeed_format import DeepSpeedSource, find_deepspeed_checkpoint
    ds = find_deepspeed_checkpoint(load_dir, tag)
    if ds is not None:
        return DeepSpeedSource(ds, dtype=dtype, budget=budget)
    return ZeroplugSource(load_dir, tag, dtype=dtype, budget=budget)


def _layout(out: Path, fmt: str | None) -> tuple[str, Path | None]:
    """(format, file) for ``out``: a file by its suffix, or a directory (file None)."""
    if fmt is not None and fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    suffix = _SUFFIX.get(out.suffix)
    if suffix is not None and not out.is_dir():
        if fmt is not None and fmt != suffix:
            raise CheckpointError(f"{out}: the suffix says {suffix}, --format says {fmt}; give a matching name "
                                  f"or a directory")
        return suffix, out
    return fmt or "safetensors", None


def write_state_dict(source, out, fmt: str | None = None, max_shard_size=None) -> list[str]:
    """Write ``source``'s tensors to ``out``: a file (``.safetensors``, ``.bin``/``.pt``) or a
    directory, which gets ``model.safetensors`` / ``pytorch_model.bin`` (Hugging Face's names)
    or, past ``max_shard_size``, numbered shards and their ``*.index.json``. Returns the
    files written."""
    out = Path(out)
    fmt, file = _layout(out, fmt)
    entries = source.entries()
    write = write_safetensors if fmt == "safetensors" else write_torch
    shards = shard_entries(entries, parse_size(max_shard_size) if max_shard_size and file is None else None)
    written = []
    try:
        if file is not None or len(shards) == 1:
            target = file if file is not None else out / WEIGHTS_NAME[fmt]
            write(target, entries, source.produce)
            return [str(target)]
        stem, ext = WEIGHTS_NAME[fmt].rsplit(".", 1)
        weight_map, total = {}, 0
        for i, chunk in enumerate(shards, 1):
            name = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
            write(out / name, chunk, source.produce)
            written.append(str(out / name))
            for e in chunk:
                weight_map[e.key] = name
                total += e.nbytes
        index = out / f"{WEIGHTS_NAME[fmt]}.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                    indent=2, sort_keys=True) + "\n")
        return written + [str(index)]
    finally:
        release = getattr(source, "release", None)
        if release is not None:
            release()


def export_fp32(load_dir, out, tag=None, fmt: str | None = None, max_shard_size=None,
                budget: int | None = None) -> list[str]:
    """Write the fp32 master weights of the checkpoint in ``load_dir`` (zeroplug's or
    DeepSpeed's; ``tag`` None: the one ``latest`` names) to ``out`` (see
    :func:`write_state_dict`), one tensor at a time. Returns the files written."""
    return write_state_dict(open_source(load_dir, tag, torch.float32, budget), out, fmt, max_shard_size)


def fp32_state_dict(load_dir, tag=None) -> dict:
    """The whole fp32 state dict in memory (tied keys share one tensor)."""
    src = open_source(load_dir, tag, torch.float32)
    out, made = {}, {}
    try:
        for e in src.entries():
            if e.source not in made:
                made[e.source] = src.produce(e)
            out[e.key] = made[e.source]
    finally:
        src.release()
    return out


__all__ = ["ZeroplugSource", "open_source", "write_state_dict", "export_fp32", "fp32_state_dict", "FORMATS"]
