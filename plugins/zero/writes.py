"""Writes to gathered parameters (``engine.gathered_parameters(params, modifier_rank)``).

With a modifier rank, the values that rank holds at the end of the block are broadcast and
partitioned again: every rank's shard and fp32 master take them (the optimizer's moments
stay as they are, the same on every rank). Without one, a parameter written inside raises
StateError on every rank at the end of the block: the next step (which publishes the
masters) or the release of a stage-3 unit would lose the write silently.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zeroplug.errors import StateError
from zeroplug.gathering import fingerprint, written_error


def units_of(part, params) -> list:
    """The units holding ``params`` (None: every unit), in layout order."""
    if params is None:
        return list(part.all_units)
    wanted = {id(p) for p in params}
    return [u for u in part.all_units if any(id(p) in wanted for p in u.params)]


def loose_params(part, params) -> list[torch.Tensor]:
    """Floating-point parameters of ``params`` (None: the module's) in no unit (frozen ones
    below stage 3): whole on every rank, outside the stage's buffers."""
    ps = part.module.parameters() if params is None else params
    return [p for p in ps if p.is_floating_point() and p not in part.unit_of]


@contextmanager
def writes_kept(part, units, params, modifier_rank, check_writes: bool):
    """Around a block in which ``units`` are gathered (see the module docstring)."""
    loose = loose_params(part, params)
    watched = [u.full for u in units] + [p.data for p in loose]
    before = [fingerprint(t) for t in watched] if modifier_rank is None and check_writes else None
    yield
    if modifier_rank is not None:
        for u in units:
            take_values(part, u, modifier_rank)
        for p in loose:
            part.comm.broadcast(p.data, src=modifier_rank)
    elif before is not None:
        written = sum(fingerprint(t) != b for t, b in zip(watched, before))
        if part.comm.all_reduce_scalar(float(written)) > 0:    # every rank raises
            raise written_error(f"{written} tensor(s) written on rank {part.run.rank}")


def take_values(part, u, src: int) -> None:
    """Unit ``u``'s gathered values, as rank ``src`` holds them, into every rank's shard and
    fp32 master."""
    if part.comm.world_size > 1:
        part.comm.broadcast(u.full, src=src)
    full_part = u.full[u.lo:u.hi]
    if u.secondary is not None:
        u.secondary.fresh = False       # (an hpZ secondary shard holds the values before the write)
    shard_live = u.shard.untyped_storage().size() > 0 and u.lp_source is None
    if shard_live and u.shard.data_ptr() != full_part.data_ptr():
        if part.params_offloaded and u.index in part.param_tier_units \
                and not part.offload_param.capabilities.in_memory:
            with part.offload_param.update(u.index) as shard:
                shard.copy_(full_part)
        else:
            u.shard.copy_(full_part)
    master = u.master
    if master is None or master.data_ptr() == full_part.data_ptr() or (
            shard_live and master.data_ptr() == u.shard.data_ptr()):
        return
    if part.offload is not None and not part.offload_optimizer.capabilities.in_memory:
        raise StateError("parameters written with a modifier rank while the optimizer states are out of "
                         "memory (offload tier): the fp32 masters cannot take them; write them before "
                         "zeroplug.initialize (under zeroplug.init, with a modifier rank), or load a checkpoint")
    master.copy_(full_part)
