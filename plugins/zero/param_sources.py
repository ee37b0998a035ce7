"""Parameter sources: where a unit's gathered (model-dtype, whole) parameters come from.

Each unit holds a source, picked at setup from :data:`PARAM_SOURCES` for its kind
(trainable or frozen) and the partitioner's settled facts; the first that applies wins:

===================  =========================================================================
source               chosen where (first that applies)
===================  =========================================================================
``HostMaster``       trainable, ``zero.stage3_params_from_masters``, a device apart from the
                     host: the fp32 master in host memory uploaded in chunks and cast on the
                     device (the param tier holds no model-dtype shard)
``MasterCast``       trainable, stage 3 without model-dtype shards (masters on the training
                     device: ``stage3_low_precision_shards = false``; or params_from_masters on
                     a CPU run): the fp32 master cast into the gather buffer, as FSDP2 casts
``UploadedShard``    the param tier holds the shard and the device is apart from the host: it is
                     uploaded on the side stream, then gathered
``TierShard``        the param tier holds the shard in the training device's memory (CPU runs)
``Whole``            one rank, nothing offloaded: the unit is kept whole, never gathered
``DeviceShard``      the model-dtype shard on the training device, all-gathered
===================  =========================================================================

What a source says at setup: ``whole`` (kept whole on one rank), ``tiered`` (the param tier
holds the shard between uses) and ``from_master`` (no model-dtype shard is kept, and the
step writes none). What it does in the hot path: ``fill`` (start filling the unit's
``full`` buffer; returns a handle to wait on), ``gathered`` (after the wait), and the
param tier's ``fetch`` / ``prefetch`` / ``evict`` around a gather.
"""
from __future__ import annotations

import torch
from zeroplug.flat import free_storage

from . import unit as unit_module
from zeroplug.modes import Modes

PARAM_SOURCES = Modes("parameter source")


def choose_param_source(part, trainable: bool) -> "ParamSource":
    return PARAM_SOURCES.pick(part, trainable)(part)


class EventHandle:
    """An upload on a side stream: waiting orders the current stream after it."""

    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


@PARAM_SOURCES.register
class DeviceShard:
    """The base: a model-dtype shard on the training device, all-gathered into ``full``."""
    whole = False
    tiered = False
    from_master = False

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return True

    def __init__(self, part):
        #: the source a unit has while it is built, before its master exists: it fills the
        #: unit from its own shard (a persistent unit built by zeroplug.init is gathered then)
        self.seed = self

    def fill(self, u, comm, upload=None):
        return comm.all_gather(u.full, u.shard, async_op=True)

    def gathered(self, u) -> None:
        """``u``'s gather was waited for."""

    def bind_master(self, u) -> None:
        """``u``'s master exists (trainable units, after the masters are laid out): from now on
        ``u`` is filled from this source."""
        u.source = self

    # -- the param tier, around a gather -----------------------------------------------
    def fetch(self, u) -> None:
        """Before a gather of ``u`` starts."""

    def prefetch(self, u) -> bool:
        """``u`` is wanted soon: True if the shard is only read ahead (no gather started)."""
        return False

    def evict(self, u) -> None:
        """After ``u`` was released."""


@PARAM_SOURCES.register(before=DeviceShard)
class Whole(DeviceShard):
    """One rank keeps the unit whole (no gathers), unless it is gathered from its master."""
    whole = True

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return part.layout_world == 1 and not part.params_offloaded


@PARAM_SOURCES.register(before=Whole)
class TierShard(DeviceShard):
    """The param tier holds the shard (pinned host memory, or files) between uses."""
    tiered = True

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return part.params_offloaded

    def __init__(self, part):
        super().__init__(part)
        self.tier = part.offload_param

    def fetch(self, u) -> None:
        self.tier.fetch(u.index)

    def prefetch(self, u) -> bool:
        return self.tier.prefetch(u.index)      # (a shard out of memory is only read ahead)

    def evict(self, u) -> None:
        if u.state == unit_module.FREE:
            self.tier.evict(u.index, u.upload_event)


@PARAM_SOURCES.register(before=TierShard)
class UploadedShard(TierShard):
    """The param tier's shard in host memory, uploaded first (on the ``upload`` stream when
    there is one), then gathered; one rank uploads it into ``full`` itself."""

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return part.params_offloaded and part.offload_param.device.type != part.device.type

    def fill(self, u, comm, upload=None):
        src, full = u.shard, u.full
        if upload is None:
            return comm.all_gather(full, src.to(full.device), async_op=True)
        cur = torch.cuda.current_stream(full.device)
        upload.wait_stream(cur)
        with torch.cuda.stream(upload):
            if comm.world_size == 1:
                full.copy_(src, non_blocking=True)
                full.record_stream(upload)
                u.upload_event = upload.record_event()
                return EventHandle(u.upload_event, full.device)
            src = src.to(full.device, non_blocking=True)
            src.record_stream(upload)
            u.upload_event = upload.record_event()
        cur.wait_stream(upload)
        return comm.all_gather(full, src, async_op=True)


@PARAM_SOURCES.register(before=UploadedShard)
class MasterCast(DeviceShard):
    """No model-dtype shard: the fp32 master (``u.lp_source``) cast into the gather buffer
    (one rank: cast straight into ``full``)."""
    from_master = True

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return trainable and part.lp_from_master

    def __init__(self, part):
        super().__init__(part)
        self.seed = DeviceShard(part)     # (the shard seeds the unit, and its master)

    def bind_master(self, u) -> None:
        u.source = self
        u.lp_source = u.master
        free_storage(u.shard)       # (refilled from the master for checkpoints)

    def fill(self, u, comm, upload=None):
        src = u.lp_source if comm.world_size == 1 else u.lp_source.to(u.full.dtype)
        return comm.all_gather(u.full, src, async_op=True)


@PARAM_SOURCES.register(before=MasterCast)
class HostMaster(MasterCast):
    """The fp32 master in host memory, uploaded in chunks on ``upload`` and cast into the
    model-dtype shard on the device (one rank: ``full`` itself), then gathered."""

    @classmethod
    def applies(cls, part, trainable: bool) -> bool:
        return (trainable and part.params_from_masters
                and part.offload_optimizer.device.type != part.device.type)

    def fill(self, u, comm, upload=None):
        dev = u.full.device
        cur = torch.cuda.current_stream(dev)
        upload = upload if upload is not None else cur
        upload.wait_stream(cur)
        with torch.cuda.stream(upload):
            n = u.hi - u.lo
            dst = u.full[:n] if comm.world_size == 1 else torch.empty(n, dtype=u.full.dtype, device=dev)
            unit_module.cast_upload(dst, u.lp_source)
            u.upload_event = upload.record_event()
            if comm.world_size == 1:
                u.full.record_stream(upload)
                return EventHandle(u.upload_event, dev)
        cur.wait_stream(upload)
        dst.record_stream(cur)
        return comm.all_gather(u.full, dst, async_op=True)
