"""Where ``engine.save_16bit_model(save_dir, save_filename)`` writes, and the writing itself
(``torch.save`` or safetensors, atomically)."""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

from .files import CheckpointError, atomic_torch_save

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
DEFAULT_FILENAME = "pytorch_model.bin"


def weights_path(save_dir, save_filename: str = DEFAULT_FILENAME) -> Path:
    """``save_dir/save_filename`` (DeepSpeed's form). The one-argument file form is kept:
    ``save_dir`` naming an existing file, or a new path ending in .pt, .pth, .bin or
    .safetensors while ``save_filename`` is the default, is the file itself (a
    FutureWarning says to pass a directory)."""
    p = Path(save_dir)
    as_file = p.is_file() or (save_filename == DEFAULT_FILENAME and not p.is_dir()
                              and p.suffix in WEIGHT_SUFFIXES)
    if as_file:
        warnings.warn(f"save_16bit_model({str(save_dir)!r}) writes that file; pass a directory "
                      f"(save_16bit_model(save_dir, save_filename=...), as DeepSpeed's): a file path "
                      "here is deprecated", FutureWarning, stacklevel=4)
        return p
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"save_16bit_model: {p} exists and is not a directory; pass a directory")
    return p / save_filename


def write_weights(sd: dict, path: Path) -> None:
    """``sd`` to ``path`` atomically: safetensors when the name ends in .safetensors (tied
    weights get a copy each, as safetensors refuses shared tensors), else ``torch.save``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".safetensors":
        atomic_torch_save(sd, path)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"{path}: writing .safetensors needs the safetensors package "
                              "(pip install safetensors); or save to a .bin file") from None
    seen, flat = set(), {}
    for k, v in sd.items():
        ptr = v.untyped_storage().data_ptr()
        flat[k] = v.clone() if ptr in seen else v.contiguous()
        seen.add(ptr)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(flat, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
