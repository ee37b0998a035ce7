"""Gradient sinks: where a unit's gradients go, from autograd's hook to the optimizer's step.

The partitioner picks one sink at setup (and again once the optimizer is built, which may
allow keeping the gradients in the model dtype) from :data:`GRAD_SINKS`:

======================  =====================================================================
sink                    chosen where (first that applies)
======================  =====================================================================
``LowPrecisionSink``    one rank, stage 2-3, masters on the device, model dtype below fp32, no
                        accumulation, an optimizer that applies the step's multiplier itself:
                        autograd's gradients kept as they are until the step (lp_grads.py)
``DirectGrads``         one rank, stage 2-3, masters on the device: each gradient added
                        straight into the fp32 master gradient (nothing to reduce)
``ShardGradsToTier``    stage 2-3, offloaded states: a bucket per unit, reduce-scattered each
                        micro-step, its shard handed to the tier (its pinned buffers)
``ShardGrads``          stage 2-3: a bucket per unit, reduce-scattered into the fp32 master
                        gradient shard
``FlatGradsToTier``     stage 0-1, offloaded states: persistent flat gradients, all-reduced at
                        the boundary, this rank's part handed to the tier
``FlatGradsCopied``     stage 0-1, masters of their own (model dtype below fp32): persistent
                        flat gradients, all-reduced, copied into the fp32 master gradients
``FlatGrads``           stage 0-1, fp32 masters aliasing the parameters: the master gradients
                        are slices of the all-reduced flat gradients
======================  =====================================================================

A sink is asked, in order: ``take`` (one parameter's gradient, from the hook),
``reduces_now`` (a unit's gradients are complete: reduce it now or at the boundary),
``reduce`` (launch its reduction and land the result), ``reduce_at_end`` (a unit no
reduction reached by the end of backward), ``finish``, ``norm_sq``, ``step`` and ``zero``.
"""
from __future__ import annotations

import torch

from zeroplug.slots import takes_grad_scale
from zeroplug.tiers import step_all

from .groups import reduce_gradients
from .lp_grads import LowPrecisionGrads
from zeroplug.modes import Modes

GRAD_SINKS = Modes("gradient sink")


def choose_grad_sink(part, optimizer=None) -> "GradSink":
    """The sink for ``part`` (its masters laid out); ``optimizer``: None before it is built."""
    return GRAD_SINKS.pick(part, optimizer)(part)


# -- how a unit's buffer is summed over the ranks (decided once per sink) ------------------

def _alone(part):
    """One rank: the collective is a no-op on the buffer itself (no pre-division)."""
    comm = part.comm

    def launch(u, buf):
        return comm.all_reduce(buf, async_op=True), buf
    return launch


def _all_reduced(part):
    comm, scale = part.comm, 1.0 / part.comm.world_size

    def launch(u, buf):
        buf.mul_(scale)     # pre-divide: an fp16 sum of N ranks cannot overflow
        return comm.all_reduce(buf, async_op=True), buf
    return launch


def _reduce_scattered(part):
    mesh, scale = part.mesh, 1.0 / part.comm.world_size

    def launch(u, buf):
        buf.mul_(scale)
        out = torch.empty(u.hi - u.lo, dtype=buf.dtype, device=buf.device)
        return reduce_gradients(mesh, out, buf), out
    return launch


def _shard_sum(part):
    """The squared norm of this rank's shard summed over its shard group (the replicas hold
    the same shards)."""
    if part.layout_world == 1:
        return lambda sq: sq
    comm, device = part.shard_comm, part.device

    def total(sq):
        sq = sq.to(device)
        comm.all_reduce(sq)
        return sq
    return total


def _own_part(u, out):
    """This rank's elements of a reduced buffer (the whole buffer, or its shard already)."""
    return out if out.numel() == u.hi - u.lo else out[u.lo:u.hi]


class GradSink:
    """The base: gradients land in the fp32 master gradients on the training device, through
    at most two reductions in flight."""
    lp_grads = None     # the model-dtype gradients kept until the step (LowPrecisionSink)

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        raise NotImplementedError

    def __init__(self, part):
        self.part = part
        self.units = part.units
        self.pending: list = []         # (unit, handle, out) reductions in flight
        # Note: at most two reductions in flight (as DeepSpeed's double-buffered buckets):
        # draining the older ones frees their buckets during backward instead of holding a
        # gradient-sized buffer per unit until the step. For NCCL the wait only orders the
        # stream; the host does not block. Without overlap_comm, none stays in flight.
        self.in_flight_max = 2 if part.options.overlap_comm else 0
        self.shard_sum = _shard_sum(part)

    # -- backward ----------------------------------------------------------------------
    def take(self, u, i: int, p: torch.nn.Parameter) -> None:
        """Parameter ``i`` of unit ``u`` has its gradient in ``p.grad``."""
        raise NotImplementedError

    def reduces_now(self) -> bool:
        """Whether a unit whose gradients are complete is reduced in this micro-step."""
        return True

    def reduce(self, u) -> None:
        """Launch ``u``'s reduction (its turn has come) and land the result."""

    def land(self, u, handle, out: torch.Tensor) -> None:
        self.pending.append((u, handle, out))
        if len(self.pending) > self.in_flight_max:
            self.drain(len(self.pending) - self.in_flight_max)

    def drain(self, count: int | None = None) -> None:
        done = self.pending if count is None else self.pending[:count]
        for u, handle, out in done:
            handle.wait()
            self.landed(u, out)
        del self.pending[:len(done)]

    def landed(self, u, out: torch.Tensor) -> None:
        """``u``'s reduction ``out`` is complete."""

    def in_flight(self) -> list[torch.Tensor]:
        return [out for _, _, out in self.pending]

    def reduce_at_end(self, u) -> bool:
        """At the end of backward, ``u`` was not reduced: whether to reduce it now."""
        return False

    def finish(self) -> None:
        """Every reduction of this backward is launched."""
        self.drain()
        for u in self.units:      # no gradient in this window: a zero one, as if allocated
            if u.master.grad is None:
                u.master.grad = torch.zeros_like(u.master)

    # -- the step ------------------------------------------------------------------------
    def norm_sq(self) -> torch.Tensor:
        grads = [t.grad for t in self.part.master_params()]
        if not grads:
            return torch.zeros((), device=self.part.device)
        norms = torch._foreach_norm(grads)
        return self.shard_sum(torch.stack([n.float() for n in norms]).pow(2).sum())

    def step(self, optimizer, grad_multiplier: float) -> None:
        step_all(optimizer, grad_multiplier)

    def zero(self) -> None:
        """After the step: master gradients freed, allocated again as the next window's
        reductions land."""
        for u in self.units:
            u.master.grad = None


# -- stages 0-1: persistent flat gradients, the parameters' .grad are views -------------

@GRAD_SINKS.register
class FlatGrads(GradSink):
    """fp32 masters aliasing the parameters: the master gradients are the flat gradients."""

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return not part.shard_grads

    def __init__(self, part):
        super().__init__(part)
        self.rdtype = part.rdtype
        self.launch = _all_reduced(part) if part.comm.world_size > 1 else _alone(part)

    def take(self, u, i, p) -> None:
        if p.grad is not u.grad_views[i]:
            # Note: the user's model.zero_grad() (set_to_none) replaced the view of the
            # flat gradient buffer; fold the new gradient in and restore the view.
            u.grad_views[i].add_(p.grad)
            p.grad = u.grad_views[i]

    def reduces_now(self) -> bool:
        return self.part.at_boundary       # the flat gradients accumulate the window

    def reduce(self, u) -> None:
        handle, out = self.launch(u, u.grad_flat.to(self.rdtype))
        self.land(u, handle, out)

    def landed(self, u, out) -> None:
        if out is not u.grad_flat:
            u.grad_flat.copy_(out)

    def reduce_at_end(self, u) -> bool:
        return True

    def finish(self) -> None:
        self.drain()

    def zero(self) -> None:
        for u in self.units:
            u.grad_flat.zero_()


@GRAD_SINKS.register(before=FlatGrads)
class FlatGradsCopied(FlatGrads):
    """Masters of their own: each reduced flat gradient is copied into the fp32 master gradient."""

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return not part.shard_grads and not part.alias

    def landed(self, u, out) -> None:
        super().landed(u, out)
        if u.master.grad is None:
            u.master.grad = torch.empty_like(u.master)
        u.master.grad.copy_(u.grad_flat[u.lo:u.hi])

    def finish(self) -> None:
        GradSink.finish(self)

    def zero(self) -> None:
        super().zero()
        GradSink.zero(self)


class ToTier:
    """Mixin: the reduced gradient is handed to the offload tier (its pinned buffers), which
    also steps the masters."""

    def __init__(self, part):
        super().__init__(part)
        self.offload = part.offload
        if not self.offload.gpu_norm:   # (accumulation: the norm is taken from the tier's gradients)
            self.norm_sq = super().norm_sq

    def first_micro(self, u) -> bool:
        return True

    def land(self, u, handle, out) -> None:
        # Note: for NCCL, wait() only orders the current stream after the collective;
        # the host does not block, and the D2H copy then follows on a side stream.
        handle.wait()
        self.offload.grad_ready(u, _own_part(u, out), first_micro=self.first_micro(u))
        u.window_fresh = False

    def finish(self) -> None:
        self.offload.wait_grads()

    def norm_sq(self) -> torch.Tensor:
        """Summed on the device as each shard was handed over (offload.py)."""
        return self.shard_sum(self.offload.take_norm_sq())

    def step(self, optimizer, grad_multiplier: float) -> None:
        self.offload.step(optimizer, grad_multiplier)

    def zero(self) -> None:
        # Note: offloaded master grads are overwritten by the next boundary's copies (and
        # zeroed for units that got none), which saves a pass over host memory per step.
        self.offload.discard()      # a speculation no step validated (overflow)


@GRAD_SINKS.register(before=FlatGradsCopied)
class FlatGradsToTier(ToTier, FlatGrads):

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return not part.shard_grads and part.offloaded

    def zero(self) -> None:
        FlatGrads.zero(self)
        ToTier.zero(self)


# -- stages 2-3: reduce-scattered into fp32 shards -----------------------------------------

@GRAD_SINKS.register(before=FlatGradsToTier)
class ShardGrads(GradSink):
    """A transient bucket per unit, filled by the hooks and reduce-scattered as soon as the
    unit's gradients are complete, in every micro-step."""

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return part.shard_grads

    def __init__(self, part):
        super().__init__(part)
        self.rdtype, self.device = part.rdtype, part.device
        several = part.comm.world_size > 1
        if not several:
            self.launch = _alone(part)
        elif part.options.reduce_scatter:
            self.launch = _reduce_scattered(part)
        else:
            self.launch = _all_reduced(part)
        # a unit that no gradient reached in this window: every rank reduces every unit, in
        # the same order (several ranks); one rank skips it
        self.unreached = self.reduce_zeros if several else self.skip

    def take(self, u, i, p) -> None:
        o, n = u.layout.offsets[i], u.layout.numels[i]
        if u.bucket is None:
            u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
            u.bucket[o:o + n].view(u.layout.shapes[i]).copy_(p.grad)
        else:       # grads of an earlier micro-step that were not reduced yet
            u.bucket[o:o + n].view(u.layout.shapes[i]).add_(p.grad)
        p.grad = None

    def reduce(self, u) -> None:
        buf, u.bucket = u.bucket, None
        handle, out = self.launch(u, buf)
        self.land(u, handle, out)

    def landed(self, u, out) -> None:
        part = _own_part(u, out)
        if u.master.grad is None:
            # the reduce-scatter's output becomes the master gradient when it is one
            # already (fp32, this rank's elements only); else a copy of this rank's part
            own = part is out and part.dtype == u.master.dtype and part.device == u.master.device
            u.master.grad = part if own else part.to(u.master.device, u.master.dtype, copy=True)
        else:
            u.master.grad.add_(part.to(u.master.grad.device, non_blocking=True))

    def reduce_at_end(self, u) -> bool:
        return True if u.bucket is not None else self.unreached(u)

    def reduce_zeros(self, u) -> bool:
        u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
        return True

    def skip(self, u) -> bool:
        return False

    def zero(self) -> None:
        for u in self.units:
            for p in u.trainable:
                p.grad = None
        super().zero()


@GRAD_SINKS.register(before=ShardGrads)
class ShardGradsToTier(ToTier, ShardGrads):

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return part.shard_grads and part.offloaded

    def first_micro(self, u) -> bool:
        return u.window_fresh

    def skip(self, u) -> bool:
        if u.window_fresh:
            self.offload.no_grad(u)   # offloaded grads are overwritten, not zeroed each step
        return False

    def zero(self) -> None:
        for u in self.units:
            for p in u.trainable:
                p.grad = None
        ToTier.zero(self)


# -- one rank, stages 2-3, masters on the device: nothing to reduce ------------------------

@GRAD_SINKS.register(before=ShardGradsToTier)
class DirectGrads(ShardGrads):
    """Note: one rank, sharded gradients, masters on this device: nothing to reduce, so
    each gradient is added straight into the fp32 master gradient as it is produced; no
    bucket (4 bytes per element of the unit) ever exists."""

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return part.shard_grads and part.run.world_size == 1 and not part.offloaded

    def take(self, u, i, p) -> None:
        o, n = u.layout.offsets[i], u.layout.numels[i]
        if u.master.grad is None:
            u.master.grad = torch.zeros_like(u.master)
        u.master.grad[o - u.lo:o - u.lo + n].view(u.layout.shapes[i]).add_(p.grad)
        p.grad = None

    def reduce(self, u) -> None:
        """Already in the master gradient."""

    def reduce_at_end(self, u) -> bool:
        return False


@GRAD_SINKS.register(before=DirectGrads)
class LowPrecisionSink(DirectGrads):
    """Note: one rank, no accumulation, gradients straight into the masters: the fp32
    master gradient would be an exact widening of autograd's model-dtype gradient, so
    those are kept instead (2 bytes per parameter less at the end of backward, the
    stage's peak) and widened slice by slice in the step. Only with an optimizer that
    applies the step's multiplier itself: an in-place multiply would round them."""

    @classmethod
    def applies(cls, part, optimizer) -> bool:
        return (DirectGrads.applies(part, optimizer) and part.pdtype != torch.float32
                and optimizer is not None and takes_grad_scale(optimizer)
                and part.run.config.batch.gradient_accumulation_steps == 1)

    def __init__(self, part):
        super().__init__(part)
        self.lp_grads = LowPrecisionGrads(part.units)

    def take(self, u, i, p) -> None:
        self.lp_grads.keep(u, i, p.grad)
        p.grad = None

    def finish(self) -> None:
        self.drain()

    def norm_sq(self) -> torch.Tensor:
        return self.lp_grads.norm_sq(self.device)

    def step(self, optimizer, grad_multiplier: float) -> None:
        self.lp_grads.step(optimizer, grad_multiplier)

    def zero(self) -> None:
        super().zero()
        self.lp_grads.clear()
