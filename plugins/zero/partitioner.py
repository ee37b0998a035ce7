"""One partitioner for every stage; the stages differ only in what is sharded.

=======  =================  ====================  ==========================
stage    optimizer states   gradients             parameters
=======  =================  ====================  ==========================
0        whole              all-reduced, whole    whole
1        sharded            all-reduced, whole    whole, all-gathered
2        sharded            reduce-scattered      whole, all-gathered
3        sharded            reduce-scattered      sharded, gathered per use
=======  =================  ====================  ==========================

Note: when the model is fp32 and the optimizer lives on the model's device, the
master weights *are* this rank's slice of the model's flat buffer, and (stages 0-1)
the master gradients are slices of the flat gradient buffer: no copies at all.
"""
from __future__ import annotations

import torch

from zeroplug.errors import StateError
from .flat_layout import FlatLayout
from .groups import reduce_gradients, shard_mesh
from .lp_grads import LowPrecisionGrads
from zeroplug.param_groups import ParamGroups
from zeroplug.slots import Partitioner, takes_grad_scale
from zeroplug.tiers import all_exported, step_all

from .masters import make_masters
from .names import unit_name
from .partitioned_init import init_group
from .options import ZeroOptions, bucket_elements, hidden_size
from .unit import Unit


class FlatPartitioner(Partitioner):
    Options = ZeroOptions
    stage = 0
    shard_optimizer = False
    shard_grads = False
    shard_params = False
    params_offloaded = False
    param_tier_units: frozenset = frozenset()   # units whose shard the param tier holds (stage 3)
    params_from_masters = False     # stage 3 gathers trainable units from host masters (stage3.py)

    # -- setup ----------------------------------------------------------------------
    def tier_elements(self, module):
        """This rank's share (padding aside) of the trainable elements (stages 1-3) and, at
        stage 3, of every parameter's elements (frozen ones are sharded too), among the ranks
        of its shard group (zero.shard_group_size)."""
        world = self.run.world_size
        size = self.options.shard_group_size
        if 0 < size < world:
            world = size
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        every = sum(p.numel() for p in module.parameters() if p.is_floating_point())
        return {"optimizer": -(-trainable // world) if self.shard_optimizer else trainable,
                "param": -(-every // world) if self.shard_params else 0}

    def setup(self, module, precision, offload_optimizer, offload_param, groups: ParamGroups | None = None):
        run = self.run
        self.module, self.precision, self.comm = module, precision, run.comm
        self.groups = groups or ParamGroups({})
        # which parameters train: fixed for the engine's life (checked before each backward)
        self._trainability = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self.device = run.device
        self.pdtype, self.rdtype = precision.param_dtype, precision.reduce_dtype
        # the ranks that shard the states between them, and those that hold the same shard (groups.py)
        self.mesh = shard_mesh(run.comm, self.options.shard_group_size) if self.shard_optimizer else None
        self.shard_comm = self.mesh.shard if self.mesh is not None else run.comm
        self.layout_world = self.shard_comm.world_size if self.shard_optimizer else 1
        self.layout_rank = self.shard_comm.rank if self.shard_optimizer else 0
        self.offload_optimizer, self.offload_param = offload_optimizer, offload_param
        h = hidden_size(module)
        o = self.options
        self.bucket_size = bucket_elements(o, h, None if self.shard_params else
                                           offload_optimizer.capabilities.granularity)
        self._pending: list = []       # (unit, handle, out) reductions in flight
        self._gather_late = False      # the shards change when the tier's step in flight ends
        self._prepare_module(module)
        self.all_units = [self._make_unit(i, g) for i, g in enumerate(self._group_params(module))]
        for u in self.all_units:
            u.group = self.groups.index(u.params[0])
        # Note: frozen (requires_grad=False) parameters are never in a trainable unit: no
        # master, no optimizer state, no reduction, no weight decay. Below stage 3 they are
        # in no unit at all; stage 3 shards them in units of their own (all_units).
        self.units = [u for u in self.all_units if u.trainable]
        self.unit_of = {p: u for u in self.all_units for p in u.params}
        # Note: with several ranks, reductions are launched in one fixed order (the reverse
        # of the layout, which is the order backward usually produces gradients), so that
        # ranks whose graphs differ (mixture-of-experts routing, unused branches) still
        # pair every collective with the same unit's on the other ranks.
        self._reduce_order = self.units[::-1]
        self._next_reduce = 0
        self._flush_queued = False      # _end_micro_step is queued for this backward
        # Note: one rank, sharded gradients, masters on this device: nothing to reduce, so
        # each gradient is added straight into the fp32 master gradient as it is produced;
        # no bucket (4 bytes per element of the unit) ever exists.
        self._direct_grads = (self.shard_grads and run.world_size == 1
                              and not offload_optimizer.capabilities.offloaded)
        self.lp_grads = None            # direct gradients kept in the model dtype (lp_grads.py)
        m = make_masters(self)          # (masters.py)
        self.offloaded, self.alias, self.lazy_grads = m.offloaded, m.alias, m.lazy_grads
        self.master_flat, self.sub_group_ranges = m.flat, m.sub_group_ranges
        self.offload = m.offload        # the offloaded states (offload.py), when the tier offloads
        self._master_list, self._master_group = m.tensors, m.groups
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for u in self.units for p in u.trainable]

    def close(self) -> None:
        # Note: a parameter's post-accumulate-grad hook is held by autograd's C++ side, which
        # the garbage collector cannot see through: until it is removed, the bound method
        # keeps this partitioner, and every buffer it owns, alive after the engine is gone.
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _prepare_module(self, module):
        for name, p in module.named_parameters():
            check_materialized(name, p)
            # Note: integer parameters keep their dtype and bits; frozen floating-point ones
            # take the model dtype like every other weight the forward reads.
            p.data = p.data.to(self.device, self.pdtype) if p.is_floating_point() else p.data.to(self.device)
        for b in module.buffers():
            b.data = b.data.to(self.device)

    def _group_params(self, module) -> list[list[torch.nn.Parameter]]:
        """Consecutive trainable parameters in buckets of at most ``bucket_size`` elements,
        a new bucket where the parameter group changes."""
        groups, cur, n, key = [], [], 0, None
        for p in module.parameters():     # deduplicated: tied weights appear once
            if not p.requires_grad:
                continue
            k = self.groups.index(p)
            if cur and (n + p.numel() > self.bucket_size or k != key):
                groups.append(cur)
                cur, n = [], 0
            cur.append(p)
            key = k
            n += p.numel()
        if cur:
            groups.append(cur)
        return groups

    def _make_unit(self, index, params) -> Unit:
        layout = FlatLayout.build(params, self.layout_world)
        full = torch.empty(layout.padded, dtype=self.pdtype, device=self.device)
        layout.copy_in(full, params)
        unit = Unit(index, params, layout, full, self.layout_rank, sharded_params=False)
        unit.bind_params()
        if not self.shard_grads:      # persistent flat gradients; .grad are views
            unit.grad_flat = torch.zeros_like(full)
            unit.grad_views = layout.views(unit.grad_flat)
            for p, g in zip(params, unit.grad_views):
                p.grad = g
        return unit

    def gathers_per_unit(self) -> bool:
        """Whether units are gathered on use (after waiting for their sub-group's step)."""
        return False

    def master_params(self):
        return self._master_list

    def optimizer_params(self):
        """What the optimizer is built over: one param group per sub-group when offloaded,
        so the offload path can step (and publish) sub-group by sub-group."""
        settings = self.groups.settings
        if self.offloaded:
            return [{"params": [t], **settings[g]} for t, g in zip(self._master_list, self._master_group)]
        if self.groups.plain:
            return self._master_list
        by_group: dict[int, list] = {}
        for t, g in zip(self._master_list, self._master_group):
            by_group.setdefault(g, []).append(t)
        return [{"params": ts, **settings[g]} for g, ts in sorted(by_group.items())]

    def before_forward(self) -> None:
        if self.offload is not None:
            self.offload.discard()    # a forward before the step: no speculated values in it

    # -- backward ---------------------------------------------------------------------
    def before_backward(self) -> None:
        self._check_trainability()
        if self.run.first_micro_step:
            for u in self.units:
                u.window_fresh = True     # its first reduction in this window overwrites
        for u in self.units:
            u.pending = len(u.trainable)
            u.reduced = False
            u.ready = False
        self._next_reduce = 0

    def _check_trainability(self) -> None:
        for name, p, trains in self._trainability:
            if p.requires_grad != trains:
                now = "trains now" if p.requires_grad else "is frozen now"
                raise StateError(f"parameter {name!r} {now} but did not when zeroplug.initialize built the "
                                 "engine; set requires_grad before zeroplug.initialize (the optimizer holds "
                                 "states for the parameters that trained then), or build a new engine after "
                                 "changing which parameters train")

    def _on_grad(self, p) -> None:
        if not self._flush_queued and self.shard_grads and not self.run.at_boundary and self.comm.world_size > 1:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_step)
        u = self.unit_of[p]
        i = u.position[p]
        if self.lp_grads is not None:
            self.lp_grads.keep(u, i, p.grad)
            p.grad = None
        elif self._direct_grads:
            o, n = u.layout.offsets[i], u.layout.numels[i]
            if u.master.grad is None:
                u.master.grad = torch.zeros_like(u.master)
            u.master.grad[o - u.lo:o - u.lo + n].view(u.layout.shapes[i]).add_(p.grad)
            p.grad = None
        elif self.shard_grads:
            o, n = u.layout.offsets[i], u.layout.numels[i]
            if u.bucket is None:
                u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
                u.bucket[o:o + n].view(u.layout.shapes[i]).copy_(p.grad)
            else:       # grads of an earlier micro-step that were not reduced yet
                u.bucket[o:o + n].view(u.layout.shapes[i]).add_(p.grad)
            p.grad = None
        elif p.grad is not u.grad_views[i]:
            # Note: the user's model.zero_grad() (set_to_none) replaced the view of the
            # flat gradient buffer; fold the new gradient in and restore the view.
            u.grad_views[i].add_(p.grad)
            p.grad = u.grad_views[i]
        u.pending -= 1
        if u.pending == 0 and (self.shard_grads or self.run.at_boundary):
            self._ready(u)

    def _ready(self, u: Unit) -> None:
        """``u``'s gradients are complete: reduce it now, or (several ranks) once every unit
        before it in the fixed order is reduced."""
        if self.comm.world_size == 1:
            self._reduce(u)
            return
        u.ready = True
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].ready:
            v = order[self._next_reduce]
            self._next_reduce += 1
            if not v.reduced:
                self._reduce(v)

    def _end_micro_step(self) -> None:
        """The end of a backward that does not close the accumulation window (several ranks,
        sharded gradients): every unit not reduced yet is reduced now, in the fixed order (zeros
        where no gradient came).

        Note: a unit's reduction waits for every unit before it in the order; a unit this
        rank's backward did not reach (an expert no token was routed to, a skipped branch)
        stops the chain on this rank while another rank's goes on, and the next micro-step's
        reductions would pair different units (zeroplug.faults' comparisons stop the run there).
        Every unit reduced once per micro-step keeps the ranks' sequences equal."""
        self._flush_queued = False
        for u in self._reduce_order:
            if u.reduced:
                continue
            if u.bucket is None:
                u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        world = self.comm.world_size
        u.reduced = True
        if self._direct_grads:      # already in the master gradient
            self._after_reduce(u)
            return
        if world > 1:   # faults: named in messages (zeroplug.faults; no comparison: see _end_micro_step)
            self.run.faults.issued("reduce", u.index, self.unit_name)
        if self.shard_grads:
            buf, u.bucket = u.bucket, None
        else:
            buf = u.grad_flat if self.rdtype == self.pdtype else u.grad_flat.to(self.rdtype)
        if world > 1:
            buf.mul_(1.0 / world)    # pre-divide: an fp16 sum of N ranks cannot overflow
        if not self.shard_grads or world == 1:
            handle = self.comm.all_reduce(buf, async_op=True)
            out = buf
        elif self.options.reduce_scatter:
            out = torch.empty(u.hi - u.lo, dtype=buf.dtype, device=buf.device)
            handle = reduce_gradients(self.mesh, out, buf)
        else:
            handle = self.comm.all_reduce(buf, async_op=True)
            out = buf
        if self.offload is not None:
            # Note: for NCCL, wait() only orders the current stream after the collective;
            # the host does not block, and the D2H copy then follows on a side stream.
            handle.wait()
            part = out if out.numel() == u.hi - u.lo else out[u.lo:u.hi]
            self.offload.grad_ready(u, part, first_micro=not self.shard_grads or u.window_fresh)
            u.window_fresh = False
        else:
            self._pending.append((u, handle, out))
            # Note: at most two reductions in flight (as DeepSpeed's double-buffered
            # buckets): draining the older ones frees their buckets during backward
            # instead of holding a gradient-sized buffer per unit until the step. For NCCL
            # the wait only orders the stream; the host does not block.
            if not self.options.overlap_comm:
                self._drain()
            elif len(self._pending) > 2:
                self._drain(len(self._pending) - 2)
        self._after_reduce(u)

    def unit_name(self, index: int) -> str:
        """What unit ``index`` holds, for messages (names.py)."""
        return unit_name(self, index)

    def _after_reduce(self, u: Unit) -> None:
        """Hook for stage 3: release the unit's gathered parameters."""

    def _drain(self, count: int | None = None) -> None:
        done = self._pending if count is None else self._pending[:count]
        for u, handle, out in done:
            handle.wait()
            if not self.shard_grads:
                if out is not u.grad_flat:
                    u.grad_flat.copy_(out)
                if not self.alias:
                    if u.master.grad is None:
                        u.master.grad = torch.empty_like(u.master)
                    u.master.grad.copy_(u.grad_flat[u.lo:u.hi])
            else:
                part = out if out.numel() == u.hi - u.lo else out[u.lo:u.hi]
                if u.master.grad is None:
                    # the reduce-scatter's output becomes the master gradient when it is one
                    # already (fp32, this rank's elements only); else a copy of this rank's part
                    own = part is out and part.dtype == u.master.dtype and part.device == u.master.device
                    u.master.grad = part if own else part.to(u.master.device, u.master.dtype, copy=True)
                else:
                    u.master.grad.add_(part.to(u.master.grad.device, non_blocking=True))
        del self._pending[:len(done)]

    def finish_gradients(self) -> None:
        self.wait_optimizer(keep_speculation=True)
        several = self.comm.world_size > 1
        for u in (self._reduce_order if several else self.units):
            if u.reduced:
                continue
            if self.shard_grads and u.bucket is None:
                if several:     # every rank reduces every unit, in the same order
                    u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
                else:
                    if self.offload is not None and u.window_fresh:
                        self.offload.no_grad(u)   # offloaded grads are overwritten, not zeroed each step
                    continue            # no gradient reached this unit in this window
            self._reduce(u)
        self._drain()
        if self.offload is not None:
            self.offload.wait_grads()
        elif self.lazy_grads and self.lp_grads is None:
            for u in self.units:      # no gradient in this window: a zero one, as if allocated
                if u.master.grad is None:
                    u.master.grad = torch.zeros_like(u.master)

    def grad_norm_sq(self) -> torch.Tensor:
        if self.offload is not None:
            sq = self.offload.take_norm_sq()
            if sq is not None:
                if self.layout_world > 1:       # (the replicas hold the same shards)
                    self.shard_comm.all_reduce(sq)
                return sq
        if self.lp_grads is not None:
            return self.lp_grads.norm_sq(self.device)
        grads = [t.grad for t in self._master_list]
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch._foreach_norm(grads)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        if self.layout_world > 1:
            sq = sq.to(self.device)
            self.shard_comm.all_reduce(sq)
        return sq

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_flat is not None:
                u.grad_flat.zero_()
            for p in u.trainable:
                if self.shard_grads:
                    p.grad = None
        if self.lazy_grads:
            for u in self.units:      # freed: allocated again as the next window's reductions land
                u.master.grad = None
        if self.lp_grads is not None:
            self.lp_grads.clear()
        # Note: offloaded master grads are overwritten by the next boundary's copies (and
        # zeroed for units that got none), which saves a pass over host memory per step.
        if self.offload is not None:
            self.offload.discard()      # a speculation no step validated (overflow)
        self.before_backward()

    # -- the optimizer step --------------------------------------------------------------
    def optimizer_built(self, optimizer) -> None:
        if self.offload is not None:
            self.offload.prepare(optimizer)
        # Note: one rank, no accumulation, gradients straight into the masters: the fp32
        # master gradient would be an exact widening of autograd's model-dtype gradient, so
        # those are kept instead (2 bytes per parameter less at the end of backward, the
        # stage's peak) and widened slice by slice in the step. Only with an optimizer that
        # applies the step's multiplier itself: an in-place multiply would round them.
        if (self._direct_grads and self.pdtype != torch.float32 and takes_grad_scale(optimizer)
                and self.run.config.batch.gradient_accumulation_steps == 1):
            self.lp_grads = LowPrecisionGrads(self.units)

    def step_optimizer(self, optimizer, grad_multiplier: float = 1.0) -> None:
        """Step the masters and publish them as model parameters."""
        self.release_all()
        if self.offload is not None:
            self.offload.step(optimizer, grad_multiplier)
        else:
            if self.lp_grads is not None:
                self.lp_grads.step(optimizer, grad_multiplier)
            else:
                step_all(optimizer, grad_multiplier)
            if not self.alias:
                for u in self.units:
                    if u.lp_source is None:     # (else gathered from the master on use)
                        u.shard.copy_(u.master, non_blocking=True)
        self.gather_after_step()

    def gather_after_step(self) -> None:
        """All-gather the shards the step wrote into every rank's whole parameters (stages 1-2;
        later, in ``wait_optimizer``, while a tier's step is still writing them)."""
        if self.layout_world == 1:
            return
        if self.offload is not None and self.offload.pending:
            # Note: a tier whose step is still running when step() returns (the cpu tier's
            # delayed_update) writes this rank's shards when it is waited for; gathering now
            # would copy the old values, so the gather waits for wait_optimizer().
            self._gather_late = True
            return
        self._gather_late = False
        inflight, n = [], 0      # at most allgather_bucket_size elements in flight at once
        for u in self.units:
            if inflight and n + u.numel > self.options.allgather_bucket_size:
                for h in inflight:
                    h.wait()
                inflight, n = [], 0
            inflight.append(self.shard_comm.all_gather(u.full, u.shard, async_op=True))
            n += u.numel
        for h in inflight:
            h.wait()

    def wait_optimizer(self, keep_speculation: bool = False) -> None:
        """``keep_speculation``: the step that validates it follows (else states read as before it)."""
        if self.offload is not None:
            if not keep_speculation:
                self.offload.discard()
            self.offload.wait_all()
            if self._gather_late:
                self.gather_after_step()

    # -- views -------------------------------------------------------------------------
    def gathered_params(self, params=None, modifier_rank=None, check_writes: bool = False):
        """Every parameter (or ``params``) whole for a block (below stage 3: as always); writes: writes.py."""
        from .writes import units_of, writes_kept
        self.wait_optimizer()
        return writes_kept(self, units_of(self, params), params, modifier_rank, check_writes)

    def consolidated_state_dict(self, module) -> dict | None:
        with self.gathered_params():
            if self.run.rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def writes_states(self) -> bool:
        """Stage 0's replicated states by rank 0; sharded ones by the ranks whose rank in their
        shard group (zero.shard_group_size) is their own."""
        return self.layout_rank == self.run.rank

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors behind each memory category (zeroplug.observe.memory.memory_report)."""
        from .accounting import memory_tensors
        return memory_tensors(self, self._master_list, [out for _, _, out in self._pending])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        from .accounting import state_tensors
        self.wait_optimizer()
        return state_tensors(self, self._master_list)

    def checkpoint_state(self, optimizer=None, parts=None) -> dict:
        """This rank's world-size-independent checkpoint part (see checkpointing.py).

        A tier that keeps states out of memory between steps, with a ``parts`` writer (what
        save_checkpoint passes): each sub-group's master and optimizer states are brought in,
        written to a part file and freed, one sub-group at a time. Without one, every
        sub-group is brought in and the export is copied (the pieces would otherwise point
        into storages freed right after)."""
        from zeroplug.checkpoint import active_part_writer

        from .checkpointing import copy_tensors, export_state
        self.wait_optimizer()
        if self.offload is None or self.offload_optimizer.capabilities.in_memory:
            return export_state(self, optimizer, parts=parts)   # parts: parameter shards out of memory
        if parts is None:
            parts = active_part_writer()      # called through an override that does not pass it on
        if parts is not None:
            return export_state(self, optimizer, parts=parts)
        with all_exported(self.offload_optimizer, optimizer):
            return copy_tensors(export_state(self, optimizer))

    def load_checkpoint_state(self, states, optimizer=None, **flags) -> None:
        """Load from a :class:`zeroplug.checkpoint.ShardSet` (a tier that keeps states out of
        memory: one sub-group at a time)."""
        from .checkpointing import import_state
        self.wait_optimizer()
        return import_state(self, states, optimizer, **flags)

    @classmethod
    def check_config(cls, config, choice) -> None:
        from .options import check_stage_config
        check_stage_config(cls, config, choice)


def check_materialized(name: str, p: torch.Tensor) -> None:
    """Refuse a parameter without values (on the meta device, not built by zeroplug.init)."""
    if p.is_meta and init_group(p) is None:
        raise StateError(f"parameter {name!r} is on the meta device (it has no values): materialize the "
                         "model before zeroplug.initialize (model.to_empty(device=...) and initialize or "
                         "load the weights), or build it inside zeroplug.init")


class Stage0(FlatPartitioner):
    """Data parallel: everything whole on every rank; bucketed all-reduce overlapping backward."""
    stage = 0


class Stage1(FlatPartitioner):
    """ZeRO-1: fp32 masters and optimizer states sharded; gradients all-reduced."""
    stage = 1
    shard_optimizer = True


class Stage2(FlatPartitioner):
    """ZeRO-2: as stage 1, plus gradients reduce-scattered into shards during backward."""
    stage = 2
    shard_optimizer = True
    shard_grads = True
