"""DeepSpeed's checkpoint files, found and read without DeepSpeed and without running code.

A DeepSpeed checkpoint directory (``engine.save_checkpoint(dir)``)::

    <dir>/latest                                   the newest tag
    <dir>/<tag>/mp_rank_00_model_states.pt         stages 1-2: the module (16-bit), param_shapes,
                                                   counters, lr_scheduler, ds_config, client state
    <dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt      stage 3: one per rank (same keys)
    <dir>/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                   per rank: optimizer_state_dict (fp32 partitions,
                                                   the torch optimizer's state over them, ...)

The files are pickles. :func:`load_deepspeed_file` reads them with
``torch.load(weights_only=True)``; the few DeepSpeed classes that DeepSpeed pickles in them
(:data:`STAND_INS`: the ZeRO stage enum, a loss scaler, a fragment address; any other class
of the loss-scaler and fragment modules, :data:`DATA_MODULES`) are read into stand-in classes
of our own that only hold attributes. A file that names any other class
or function is refused before it is unpickled (``torch.serialization``'s list of the
globals a file needs), naming it.
"""
from __future__ import annotations

import argparse
import enum
import re
from pathlib import Path

import torch

from .files import CheckpointError, plain_name

OPTIM_SUFFIX = "_optim_states.pt"
MODEL_SUFFIX = "_model_states.pt"
#: the client-state key under which a torch LR scheduler's state travels to zeroplug.deepspeed's engine
SCHEDULER_KEY = "zeroplug.deepspeed.lr_scheduler"
_OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class _Attributes:
    """Attributes only: what a pickled DeepSpeed object holds, without its methods."""

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self):
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(_Attributes):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``, ...)."""


class DynamicLossScaler(_Attributes):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class FragmentAddress(_Attributes):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


#: the DeepSpeed globals a checkpoint may name, and what reads them
STAND_INS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "argparse.Namespace": argparse.Namespace,      # Megatron-style scripts save their args
}


#: modules whose classes DeepSpeed pickles as plain attribute holders (its loss scalers, the
#: fragment address): a class of theirs not in :data:`STAND_INS` (another DeepSpeed release's)
#: is read into an attribute-only stand-in made for it
DATA_MODULES = ("deepspeed.runtime.fp16.loss_scaler.", "deepspeed.utils.tensor_fragment.")
_MADE: dict[str, type] = {}


def _stand_in(name: str) -> type | None:
    if name in STAND_INS:
        return STAND_INS[name]
    if not name.startswith(DATA_MODULES) or not name.rsplit(".", 1)[-1].isidentifier():
        return None
    if name not in _MADE:
        _MADE[name] = type(name.rsplit(".", 1)[-1], (_Attributes,), {"__doc__": f"Stand-in for ``{name}``."})
    return _MADE[name]


def load_deepspeed_file(path, mmap: bool = True):
    """``torch.load`` of a DeepSpeed checkpoint file with ``weights_only=True`` and the
    stand-ins of :data:`STAND_INS` (and :data:`DATA_MODULES`); anything else it names is
    refused unread."""
    path = Path(path)
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc})") from None
    refused = [g for g in needed if _stand_in(g) is None]
    if refused:
        raise CheckpointError(
            f"{path} pickles {refused[0]}{f' (and {len(refused) - 1} more)' if len(refused) > 1 else ''}, "
            f"which is not one of the DeepSpeed data classes zeroplug reads ({', '.join(sorted(STAND_INS))}); "
            "refused, since unpickling it could run code. Load it with DeepSpeed and save the state you need "
            "as tensors")
    allow = [(_stand_in(g), g) for g in needed]
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _is_tag_dir(d: Path) -> bool:
    return d.is_dir() and any(f.name.endswith(OPTIM_SUFFIX) for f in d.iterdir())


def find_deepspeed_checkpoint(load_dir, tag=None) -> Path | None:
    """The tag directory of a DeepSpeed checkpoint in ``load_dir`` (``tag`` None: the one
    ``latest`` names, or ``load_dir`` itself when it holds the files), or None when
    ``load_dir`` holds none (a zeroplug checkpoint, or nothing)."""
    root = Path(load_dir)
    if not root.is_dir() or (root / "manifest.json").is_file():
        return None
    if tag is None:
        if _is_tag_dir(root):
            return root
        latest = root / "latest"
        if not latest.is_file():
            return None
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    tag = str(tag)
    if not plain_name(tag):
        return None
    d = root / tag
    if (d / "manifest.json").is_file() or not _is_tag_dir(d):
        return None
    if d.is_symlink() or d.resolve().parent != root.resolve():
        raise CheckpointError(f"checkpoint {tag!r} in {str(root)!r} is a link outside the checkpoint directory; "
                              "refused")
    return d


def optim_files(path: Path) -> list[Path]:
    """The ``*_optim_states.pt`` files of one tag, in rank order (each data-parallel rank once)."""
    found = {}
    for f in sorted(path.iterdir(), key=lambda f: _natural(f.name)):
        m = _OPTIM_RE.match(f.name)
        if m is None:
            continue
        rank, mp = int(m.group(1)), int(m.group(2))
        if mp != 0:
            raise CheckpointError(f"{path}: {f.name} belongs to model-parallel rank {mp}; zeroplug reads "
                                  "data-parallel ZeRO checkpoints (mp_rank_00 only)")
        if rank in found:
            raise CheckpointError(f"{path}: two optimizer files of rank {rank} ({found[rank].name}, {f.name})")
        found[rank] = f
    if not found:
        raise CheckpointError(f"{path}: no *{OPTIM_SUFFIX} files (not a DeepSpeed ZeRO checkpoint)")
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        raise CheckpointError(f"{path}: the optimizer file of rank {missing[0]} is missing (an incomplete save)")
    return [found[r] for r in ranks]


def model_file(path: Path, stage: int) -> Path:
    """The model-states file with the module, shapes and counters (rank 0's at stage 3)."""
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    f = path / name
    if not f.is_file():
        raise CheckpointError(f"{path}: {name} is missing (an incomplete DeepSpeed save)")
    return f


__all__ = ["STAND_INS", "load_deepspeed_file", "find_deepspeed_checkpoint", "optim_files", "model_file",
           "ZeroStageEnum", "LossScaler", "DynamicLossScaler", "FragmentAddress"]
