"""``engine.offload_states`` / ``reload_states``: the built-in plugin that moves the engine's
states into an offload tier and back (what and why: :mod:`zeroplug.offload_states`)."""
from __future__ import annotations

import tempfile
import weakref
from typing import TYPE_CHECKING

import torch

from zeroplug import hookimpl
from zeroplug.errors import StateError
from zeroplug.offload_states import ALL_STATES, engine_state_tensors

if TYPE_CHECKING:
    from zeroplug.engine import Engine


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

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is offloaded by this mover."""
        return t.untyped_storage()._cdata in self.moved

    def offload_engine(self, engine: Engine, names: frozenset[str], device: str, pin_memory: bool,
                       non_blocking: bool, nvme_path: str | None) -> set[str]:
        """``engine.offload_states``: the named states into the tier ``device`` names.
        Returns the names moved."""
        tier = self.tiers.get(device) or make_tier(engine, device, pin_memory, nvme_path)
        self.tiers[device] = tier
        engine.partitioner.release_all()      # drains in-flight prefetches first (stage 3)
        if engine.run.device.type == "cuda":
            torch.cuda.synchronize()
        tensors = engine_state_tensors(engine)
        moved = set()
        for name in ALL_STATES:
            if name in names:
                self.offload(tensors[name], tier, non_blocking)
                moved.add(name)
        return moved

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


#: one mover per engine, gone with it
_movers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@hookimpl(tryfirst=True)
def zeroplug_offload_states(engine: Engine, include: frozenset[str], device: str, pin_memory: bool,
                            non_blocking: bool, nvme_path: str | None) -> set[str]:
    mover = _movers.get(engine)
    if mover is None:
        mover = _movers[engine] = StateMover()
    return mover.offload_engine(engine, include, device, pin_memory, non_blocking, nvme_path)


@hookimpl(tryfirst=True)
def zeroplug_reload_states(engine: Engine, non_blocking: bool) -> None:
    mover = _movers.get(engine)
    if mover is not None:
        mover.reload(non_blocking)


@hookimpl
def zeroplug_state_devices(engine: Engine, state: str) -> set[torch.device]:
    mover = _movers.get(engine)
    tensors = engine_state_tensors(engine)[state]
    if mover is None:
        return {t.device for t in tensors if t.untyped_storage().size() > 0}
    return {mover.location(t) for t in tensors if t.untyped_storage().size() > 0 or mover.holds(t)}


@hookimpl
def zeroplug_engine_closed(engine: Engine) -> None:
    mover = _movers.pop(engine, None)
    if mover is not None:
        mover.close()
