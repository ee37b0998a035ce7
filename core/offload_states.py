"""The names of the states ``engine.offload_states`` moves, the tensors behind each, and
``zeroplug.get_state_devices``. The moving itself is the built-in ``offload_states``
plugin (plugins/offload_states), on the ``zeroplug_offload_states`` /
``zeroplug_reload_states`` hooks.

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

import torch

from zeroplug.errors import ZeroplugError


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
    found = engine.hook.zeroplug_state_devices(engine=engine, state=name)
    if found is not None:
        return found
    return {t.device for t in engine_state_tensors(engine)[name] if t.untyped_storage().size() > 0}
