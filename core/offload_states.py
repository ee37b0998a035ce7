"""``engine.offload_states`` / ``reload_states`` / ``get_state_devices``.

One mechanism for every stage: each distinct storage behind a state's tensors is handed to
an offload tier (``device`` names one: "cpu" keeps the bytes in host memory, pinned or not;
"nvme" writes them through its swapper into a private directory; any registered tier
may serve) and then resized to 0 bytes; reloading resizes it back and the tier copies the
bytes in. The engine builds the tier for the call and closes it after the reload.

Note: because storages are resized in place rather than tensors replaced, every
view (parameters of a flat buffer, sub-group tensors, ``.grad`` views, tensors the
optimizer keys its state by) stays the same Python object: nothing has to be
re-wired after a reload, and a reload restores bit-identical bytes.
"""
from __future__ import annotations

import enum
import tempfile

import torch

from zeroplug.errors import StateError, ZeroplugError


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


def make_tier(engine, device: str, pin_memory: bool, nvme_path: str | None):
    """The offload tier named ``device``, for ``offload_states`` (kind "states"): its options
    are its defaults with ``pin_memory`` and ``nvme_path`` where it has them."""
    from zeroplug.options import build_options, fields_of
    from zeroplug.tiers import OffloadTier
    key = "offload_states(device)"
    reg = engine.plugin_manager.get("offload", device, key=key)
    given = {"pin_memory": pin_memory, "nvme_path": nvme_path or tempfile.gettempdir()}
    table = {k: v for k, v in given.items() if k in fields_of(reg.impl.Options)}
    tier = reg.impl(build_options(reg.impl.Options, table, key), engine.run, "states")
    if not isinstance(tier, OffloadTier) or not tier.capabilities.offloaded:
        raise StateError(f"offload_states(device={device!r}): that tier keeps states on the training device; "
                         "use \"cpu\" or \"nvme\"")
    return tier


class StateMover:
    """Remembers which storages went to which tier."""

    def __init__(self):
        self.moved: dict[int, tuple[torch.UntypedStorage, object, int]] = {}   # cdata -> (storage, tier, nbytes)
        self.tiers: dict[str, object] = {}

    def location(self, t: torch.Tensor) -> torch.device:
        entry = self.moved.get(t.untyped_storage()._cdata)
        return t.device if entry is None else entry[1].device     # files count as host memory

    def offload_engine(self, engine, include, device, pin_memory: bool, non_blocking: bool,
                       nvme_path: str | None) -> None:
        """``engine.offload_states``: the named states into the tier ``device`` names, each
        marked in ``engine.states_offloaded`` as soon as it has moved."""
        dev = device.value if hasattr(device, "value") else str(device)
        tier = self.tiers.get(dev) or make_tier(engine, dev, pin_memory, nvme_path)
        self.tiers[dev] = tier
        names = [state_name(s) for s in include] if include is not None else list(ALL_STATES)
        engine.partitioner.release_all()      # drains in-flight prefetches first (stage 3)
        if engine.run.device.type == "cuda":
            torch.cuda.synchronize()
        tensors = engine_state_tensors(engine)
        for name in names:
            self.offload(tensors[name], tier, non_blocking)
            engine.states_offloaded.add(name)
        engine.hook.zeroplug_offload_states(engine=engine, include=set(names), device=dev)

    def offload(self, tensors, tier, non_blocking: bool) -> None:
        for t in tensors:
            s = t.untyped_storage()
            key = s._cdata
            if key in self.moved or s.size() == 0:
                continue
            nbytes = s.size()
            if not tier.stash(key, _bytes_view(s), non_blocking):
                continue                        # already where the tier would keep it
            s.resize_(0)
            self.moved[key] = (s, tier, nbytes)

    def reload(self, non_blocking: bool) -> None:
        for key, (s, tier, nbytes) in list(self.moved.items()):
            s.resize_(nbytes)
            tier.unstash(key, _bytes_view(s), non_blocking)
        if torch.cuda.is_available() and not non_blocking:
            torch.cuda.synchronize()
        self.moved.clear()
        self.close()

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
        self.tiers.clear()


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
