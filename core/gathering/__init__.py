"""Whole parameters for a block, on every rank: ``zeroplug.gathered_parameters(params,
modifier_rank)``, the engine-independent form of ``engine.gathered_parameters`` (what
``deepspeed.zero.GatheredParameters`` stands for).

Each parameter is handled by whoever holds it:

* an engine's parameter (after ``zeroplug.initialize``): that engine's ZeRO stage, which on
  exit partitions the values of ``modifier_rank`` again, into its fp32 masters too;
* a parameter of a model built under ``zeroplug.init`` and not yet given to an engine: the
  plugin that sharded it (hook ``zeroplug_gathered_params``);
* any other parameter is whole already; with ``modifier_rank`` its value is broadcast from
  that rank on exit, so every rank holds what that rank wrote.

Without ``modifier_rank`` a parameter written inside the block is refused on exit
(:class:`zeroplug.errors.StateError`): its write would otherwise be lost at the next step
or partition.
"""
from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist

from zeroplug.errors import StateError


# the engines of this process, oldest first (weak: an engine dropped by its script is gone)
_engines: list = []


def register_engine(engine) -> None:
    """Called by the engine at the end of ``initialize``."""
    _engines.append(weakref.ref(engine))


def forget_engine(engine) -> None:
    """Called by ``engine.close()``: its parameters are no longer its own to gather."""
    _engines[:] = [r for r in _engines if r() is not None and r() is not engine]


def live_engines() -> list:
    """The engines not closed yet, the newest first (a model wrapped again belongs to its newest)."""
    return [e for r in reversed(_engines) if (e := r()) is not None]


def written_error(names: str) -> StateError:
    return StateError(f"parameters written inside gathered parameters without a modifier rank ({names}): "
                      "those writes would be lost when the parameters are partitioned again; pass "
                      "modifier_rank=<the rank whose values to keep> (e.g. 0: every rank then gets rank 0's "
                      "values), or write the parameters before zeroplug.init / zeroplug.initialize")


@contextmanager
def plain_gathered(params, modifier_rank=None):
    """Parameters that are whole on every rank: broadcast from ``modifier_rank`` on exit."""
    params = [p for p in params if p.is_floating_point()]
    yield
    if modifier_rank is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        nccl = dist.get_backend() == "nccl"
        for p in params:
            if p.device.type == "meta":
                continue
            if nccl and p.device.type != "cuda":        # (a model still on the host: NCCL sends device memory)
                wire = p.data.to(torch.device("cuda", torch.cuda.current_device()))
                dist.broadcast(wire, src=modifier_rank)
                p.data.copy_(wire)
            else:
                dist.broadcast(p.data, src=modifier_rank)


@contextmanager
def gathered_parameters(params, modifier_rank=None, plugin_manager=None):
    """Whole values of ``params`` inside the block (every rank enters with the same list)."""
    from zeroplug.registry import get_plugin_manager
    params = list(params)
    with ExitStack() as stack:
        rest = params
        for engine in live_engines():
            mine = [p for p in rest if engine.owns(p)]
            if mine:
                stack.enter_context(engine.gathered_parameters(mine, modifier_rank=modifier_rank))
                ids = {id(p) for p in mine}
                rest = [p for p in rest if id(p) not in ids]
        if rest:
            pm = plugin_manager or get_plugin_manager()
            held = pm.hook.zeroplug_gathered_params(params=rest, modifier_rank=modifier_rank)
            if held is not None:
                ctx, taken = held
                stack.enter_context(ctx)
                ids = {id(p) for p in taken}
                rest = [p for p in rest if id(p) not in ids]
        if rest:
            stack.enter_context(plain_gathered(rest, modifier_rank))
        yield


def changed(tensors, before) -> bool:
    """Whether any of ``tensors`` differs from its ``fingerprint`` taken as ``before``."""
    return any(fingerprint(t) != b for t, b in zip(tensors, before))




def fingerprint(t: torch.Tensor) -> int:
    """A checksum of ``t``'s bits, position-weighted (a changed or moved element changes it
    almost surely): how a block that must not write parameters sees that it did."""
    if t.numel() == 0 or t.untyped_storage().size() == 0:
        return 0
    flat = t.detach().reshape(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.view(bits)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = 1 << 22
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo:lo + chunk].to(torch.int64)
        weight = torch.arange(lo, lo + part.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
        total += (part * weight).sum()      # (int64 wraps around: a checksum, not a sum)
    return int(total.item())
