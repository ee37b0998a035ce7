"""Checkpoint export: the full model state dict from a checkpoint's files alone.

:func:`consolidate` gathers every rank's pieces into whole parameters (model dtype, the
model's own names) without an engine, a model class or a process group; :func:`export`
writes that state dict as ``.safetensors`` or a ``torch.save`` file (``zeroplug export``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from zeroplug.errors import StateError

from .files import CheckpointError, atomic_torch_save
from .loading import open_checkpoint


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint metadata")
    return dt


def consolidate(load_dir, tag=None) -> dict:
    """The full model state dict (model dtype, the model's own names), read from the
    checkpoint files alone: no engine, no model class, no process group."""
    with open_checkpoint(load_dir, tag) as shards:
        return _consolidate(shards)


def _consolidate(shards) -> dict:
    path, meta = shards.path, shards.meta
    full = {n: torch.empty(int(torch.Size(p["shape"]).numel()), dtype=_dtype(p["dtype"]))
            for n, p in meta["params"].items()}
    spans: dict[str, list] = {n: [] for n in full}
    extras = {}
    for model in shards:
        for name, pieces in model["pieces"].items():
            if name not in full:
                raise CheckpointError(f"checkpoint {str(path)!r}: pieces of {name!r}, which the manifest "
                                      "does not list")
            for pc in pieces:
                val = pc["param"] if "param" in pc else shards.piece_states(name, pc).get("param")
                if val is None:
                    raise CheckpointError(f"checkpoint {str(path)!r}: a piece of {name!r} has no values")
                full[name][pc["start"]:pc["end"]].copy_(val)
                spans[name].append((pc["start"], pc["end"]))
        for k, v in model.get("extras", {}).items():
            extras[k] = v.clone()
    for name, t in full.items():
        at = 0
        for a, b in sorted(spans[name]):
            if a != at:
                raise CheckpointError(f"checkpoint {str(path)!r} holds element {min(a, at)} of {name!r} "
                                      f"{'twice' if a < at else 'not at all'}")
            at = b
        if at != t.numel():
            raise CheckpointError(f"checkpoint {str(path)!r} holds {at} of the {t.numel()} elements of {name!r}")
    out = {}
    for key, name in meta["state_dict"]:
        if name is None:
            if key not in extras:
                raise CheckpointError(f"checkpoint {str(path)!r}: state-dict entry {key!r} is missing")
            out[key] = extras[key]
        else:
            out[key] = full[name].view(meta["params"][name]["shape"])
    return out


def export(load_dir, out_path, tag=None) -> str:
    """Write the consolidated model state dict to ``out_path``: ``.safetensors`` (needs the
    safetensors package) or anything else as a ``torch.save`` file (``.pt``)."""
    out_path = Path(out_path)
    if out_path.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(f"{out_path}: writing .safetensors needs the safetensors package "
                                  "(pip install safetensors); or export to a .pt file") from None
        sd = consolidate(load_dir, tag)
        seen, flat = set(), {}
        for k, v in sd.items():      # safetensors refuses shared tensors: tied weights get a copy
            ptr = v.untyped_storage().data_ptr()
            flat[k] = v.clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
        os.close(fd)
        try:
            save_file(flat, tmp)
            os.replace(tmp, out_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    else:
        atomic_torch_save(consolidate(load_dir, tag), out_path)
    return str(out_path)


def save_pretrained(engine, save_directory, **kwargs) -> bool:
    """``engine.save_pretrained``: the whole weights through the Hugging Face model's own
    ``save_pretrained`` on rank 0 (every rank calls it); True on the rank that wrote."""
    if not hasattr(engine.module, "save_pretrained"):
        raise StateError(f"engine.save_pretrained: {type(engine.module).__name__} has no save_pretrained "
                         "(not a Hugging Face model); use engine.save_16bit_model(path)")
    sd = engine.consolidated_state_dict()
    if sd is not None:
        engine.module.save_pretrained(save_directory, state_dict=sd, **kwargs)
    engine.run.comm.barrier()
    return sd is not None


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_16bit_model``: the consolidated model-dtype state dict, written atomically
    by rank 0 to ``save_dir/save_filename`` (see :func:`.weights.weights_path`; every rank
    calls it); True on the rank that wrote."""
    from .weights import weights_path, write_weights
    path = problem = None
    if engine.run.rank == 0:
        try:
            path = weights_path(save_dir, save_filename)
        except CheckpointError as exc:
            problem = str(exc)
    problem = engine.run.comm.broadcast_object(problem)      # every rank stops, or none
    if problem is not None:
        raise CheckpointError(problem)
    sd = engine.consolidated_state_dict()
    if sd is not None:
        if exclude_frozen_parameters:
            frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        write_weights(sd, path)
    engine.run.comm.barrier()
    return sd is not None
