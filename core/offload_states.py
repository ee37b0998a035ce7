"""``engine.offload_states`` / ``reload_states`` / ``get_state_devices``.

One mechanism for every stage and tier: each distinct storage behind a state's
tensors is copied out (to CPU memory, pinned or not, or to a file for "nvme") and
then resized to 0 bytes; reloading resizes it back and copies the bytes in.

Note: because storages are resized in place rather than tensors replaced, every
view (parameters of a flat buffer, sub-group tensors, ``.grad`` views, tensors the
optimizer keys its state by) stays the same Python object: nothing has to be
re-wired after a reload, and a reload restores bit-identical bytes.
"""
from __future__ import annotations

import ctypes
import enum
import os
import shutil
import tempfile

import torch

from .errors import ZeroplugError


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, enum.Enum):
    cpu = "cpu"
    nvme = "nvme"


ALL_STATES = tuple(s.value for s in OffloadStateTypeEnum)


def state_name(s) -> str:
    v = s.value if isinstance(s, enum.Enum) else str(s)
    if v not in ALL_STATES:
        raise ZeroplugError(f"unknown state {v!r}; choose from {', '.join(ALL_STATES)}")
    return v


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor as a buffer for file I/O.

    Note: through ctypes rather than ``.numpy()``, which would need numpy and would fix
    the storage's size for good (it could no longer be resized to 0)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


class StateMover:
    """Remembers where each moved storage's bytes are."""

    def __init__(self):
        self.moved: dict[int, tuple[torch.UntypedStorage, object, int]] = {}   # cdata -> (storage, where, nbytes)
        self.by_state: dict[str, set[int]] = {}
        self.dir: str | None = None

    def location(self, t: torch.Tensor) -> torch.device:
        entry = self.moved.get(t.untyped_storage()._cdata)
        if entry is None:
            return t.device
        where = entry[1]
        return torch.device("cpu") if torch.is_tensor(where) else torch.device("cpu")  # files count as host

    def offload(self, state: str, tensors, device: str, pin_memory: bool, non_blocking: bool,
                nvme_path: str | None = None) -> None:
        keys = self.by_state.setdefault(state, set())
        for t in tensors:
            s = t.untyped_storage()
            key = s._cdata
            if key in self.moved or s.size() == 0:
                keys.add(key) if key in self.moved else None
                continue
            if device == "cpu" and s.device.type == "cpu":
                continue                       # already in host memory
            nbytes = s.size()
            src = _bytes_view(s)
            if device == "nvme":
                if self.dir is None:
                    base = nvme_path or tempfile.gettempdir()
                    self.dir = tempfile.mkdtemp(prefix="zeroplug-states-", dir=base)   # mode 0700
                path = os.path.join(self.dir, f"{key:x}.bin")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(_host_buffer(src if src.device.type == "cpu" else src.cpu()))
                where = path
            else:
                pin = pin_memory and torch.cuda.is_available()
                where = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                where.copy_(src, non_blocking=non_blocking and pin)
            # Note: freeing right after an async copy on the same stream is safe: the
            # caching allocator hands the block out again only to later work on that stream.
            s.resize_(0)
            self.moved[key] = (s, where, nbytes)
            keys.add(key)

    def reload(self, non_blocking: bool) -> None:
        for key, (s, where, nbytes) in list(self.moved.items()):
            s.resize_(nbytes)
            dst = _bytes_view(s)
            if isinstance(where, str):
                host = dst if dst.device.type == "cpu" else torch.empty(nbytes, dtype=torch.uint8)
                with open(where, "rb") as f:
                    if f.readinto(_host_buffer(host)) != nbytes:
                        raise ZeroplugError(f"reload_states: {where} is shorter than the {nbytes} bytes "
                                            f"written; the state file was changed or truncated")
                if host is not dst:
                    dst.copy_(host)
                os.unlink(where)
            else:
                dst.copy_(where, non_blocking=non_blocking and where.is_pinned())
        if torch.cuda.is_available() and not non_blocking:
            torch.cuda.synchronize()
        self.moved.clear()
        self.by_state.clear()
        self.close()

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def engine_state_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each state name, from the partitioner and the optimizer."""
    part = engine.partitioner.state_tensors()
    optim = [v for st in engine.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return {"optim_states": optim, "hp_params": part.get("hp_params", []),
            "lp_params": part.get("lp_params", []), "lp_grads": part.get("lp_grads", []),
            "contiguous_grad_buffer": part.get("hp_grads", [])}


def get_state_devices(engine, state) -> set[torch.device]:
    """The devices where ``state``'s data lives now (offloaded data counts as ``cpu``)."""
    name = state_name(state)
    tensors = engine_state_tensors(engine)[name]
    mover = engine._mover
    return {mover.location(t) for t in tensors
            if t.untyped_storage().size() > 0 or t.untyped_storage()._cdata in mover.moved}
