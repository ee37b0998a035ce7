"""``engine.memory_report()``: bytes held per category, on the training device and on the host."""
from __future__ import annotations

import torch

from zeroplug.observe.memory import GB


MEMORY_CATEGORIES = ("lp_params", "master", "gradients", "optimizer", "buckets", "prefetch")


def memory_report(engine) -> dict:
    """Bytes held now, per category, on the training device and on the host: the distinct
    storages behind the partitioner's tensors (``partitioner.memory_tensors()``) and the
    optimizer's state, as allocated; a storage is counted once, in the first category that
    holds it. On CUDA, ``rest`` is what the allocator holds beyond them (activations,
    workspaces, caches of the model's own)."""
    part = engine.partitioner
    cats = dict(part.memory_tensors())
    cats["optimizer"] = [v for st in engine.optimizer.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.dim() > 0]
    dev = engine.run.device
    device, host, seen = {}, {}, set()
    for name in MEMORY_CATEGORIES:
        for t in cats.get(name, []):
            if t is None:
                continue
            s = t.untyped_storage()
            key = (s.data_ptr(), str(s.device))
            if s.size() == 0 or key in seen:
                continue
            seen.add(key)
            on_device = s.device.type == dev.type and (dev.index is None or s.device.index == dev.index)
            where = device if on_device else host
            where[name] = where.get(name, 0) + s.size()
    out = {"device": {k: device.get(k, 0) for k in MEMORY_CATEGORIES}, "host": host}
    if engine.run.device.type == "cuda":
        total = torch.cuda.memory_allocated(engine.run.device)
        out["device"]["rest"] = max(0, total - sum(device.values()))
    return out


def format_memory_report(report: dict, params: int) -> str:
    """One line: GiB per category on the device (and bytes per trainable parameter), then the host."""
    dev = report["device"]
    total = sum(dev.values())
    unit, div = ("GiB", GB) if total >= GB else ("MiB", 2**20)
    parts = [f"{k} {v / div:.2f}" for k, v in dev.items() if v]
    line = (f"[zeroplug] memory after the first step ({unit}, device): {' | '.join(parts) or '0'} | "
            f"total {total / div:.2f} ({total / max(1, params):.1f} bytes per trainable parameter)")
    if report["host"]:
        line += "; host: " + " | ".join(f"{k} {v / div:.2f}" for k, v in report["host"].items())
    return line
