"""``deepspeed.utils.zero_to_fp32`` over zeroplug's checkpoints (and DeepSpeed's, without DeepSpeed).

The same names and arguments as DeepSpeed's module::

    from zeroplug.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt")          # the 'latest' tag
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out_dir", safe_serialization=True)

``checkpoint_dir`` is a zeroplug checkpoint directory (``engine.save_checkpoint``) or a
DeepSpeed ZeRO one (``global_stepN/*_optim_states.pt``). The conversion writes one tensor at
a time (:mod:`zeroplug.checkpoint.fp32_export`), so host memory stays near the largest
tensor; ``get_fp32_state_dict_from_zero_checkpoint`` returns the whole state dict and needs
its size. As a script: ``python -m zeroplug.deepspeed.utils.zero_to_fp32 CKPT OUT_DIR``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from zeroplug.checkpoint.fp32_export import fp32_state_dict, open_source, write_state_dict
from zeroplug.errors import ZeroplugError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _exclude_frozen(flag: bool) -> None:
    if flag:
        raise ZeroplugError("exclude_frozen_parameters=True: a zeroplug checkpoint keeps the trainable parameters "
                            "and the other state-dict entries as the model has them; filter the keys afterwards")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict:
    """The consolidated fp32 state dict (on the CPU) of the checkpoint ``tag`` (None: the
    one ``latest`` names) in ``checkpoint_dir``. ``lazy_mode`` is accepted; the tensors are
    always real."""
    _exclude_frozen(exclude_frozen_parameters)
    return fp32_state_dict(checkpoint_dir, tag)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the consolidated weights into ``output_dir`` as ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization``), in shards of ``max_shard_size`` with
    an index when bigger; one tensor in memory at a time. ``output_dir`` ending in
    ``.bin`` / ``.pt`` / ``.safetensors`` is one file instead (DeepSpeed's older
    ``output_file``). Returns the files written."""
    _exclude_frozen(exclude_frozen_parameters)
    if isinstance(dtype, str):
        key = dtype.replace("torch.", "").lower()
        if key not in _DTYPES:
            raise ZeroplugError(f"dtype {dtype!r}: use one of {', '.join(sorted(_DTYPES))}")
        dtype = _DTYPES[key]
    fmt = "safetensors" if safe_serialization else "bin"
    out = str(output_dir)
    if out.endswith((".bin", ".pt", ".pth", ".safetensors")):
        fmt = None
    return write_state_dict(open_source(checkpoint_dir, tag, dtype=dtype), output_dir, fmt, max_shard_size)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (not strict,
    as DeepSpeed's); returns the model."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="zero_to_fp32", description="Write a ZeRO checkpoint's fp32 weights.")
    p.add_argument("checkpoint_dir", help="the checkpoint folder (the one holding the tag folders)")
    p.add_argument("output_dir", help="folder for the state-dict files (or one .bin/.safetensors file)")
    p.add_argument("--max_shard_size", default="5GB")
    p.add_argument("--safe_serialization", action="store_true")
    p.add_argument("-t", "--tag", default=None)
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    a = p.parse_args(argv)
    try:
        for f in convert_zero_checkpoint_to_fp32_state_dict(a.checkpoint_dir, a.output_dir, a.max_shard_size,
                                                            a.safe_serialization, a.tag,
                                                            a.exclude_frozen_parameters):
            print(f"wrote {f}")
    except ZeroplugError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
