"""The random-number generators' states in a checkpoint: torch's (CPU, and the CUDA
device's), Python's and numpy's (when installed), as tensors and plain values."""
from __future__ import annotations

import random

import torch


def rng_states() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        st = np.random.get_state(legacy=False)
        out["numpy"] = {"bit_generator": st["bit_generator"],
                        "key": torch.from_numpy(st["state"]["key"].astype("int64")),
                        "pos": int(st["state"]["pos"]), "has_gauss": int(st["has_gauss"]),
                        "gauss": float(st["gauss"])}
    return out


def set_rng_states(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    if "numpy" in st:
        try:
            import numpy as np
        except ImportError:
            return
        n = st["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": n["key"].numpy().astype("uint32"), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
