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

What varies with the configuration is decided once, in ``setup``, into objects the hot
methods call without testing a flag (modes.py): the gradient sink (``grads``,
grad_sinks.py), each unit's parameter source (``u.source``, param_sources.py) and where
the optimizer's states are stepped (``states``, offload.py).
"""
from __future__ import annotations

import torch

from zeroplug.errors import StateError
from .flat_layout import FlatLayout
from .grad_sinks import choose_grad_sink
from .groups import shard_mesh
from zeroplug.param_groups import ParamGroups
from zeroplug.shard_map import bind_shard_map
from zeroplug.slots import Partitioner
from zeroplug.tiers import all_exported

from .masters import make_masters
from .offload import OnDevice
from .param_sources import choose_param_source
from .shard_map import build_shard_map
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
    at_boundary = True              # this backward ends the accumulation window (before_backward)
    params_offloaded = False
    param_tier_units: frozenset = frozenset()   # units whose shard the param tier holds (stage 3)
    params_from_masters = False     # stage 3 gathers trainable units from host masters (stage3.py)
    lp_from_master = False          # stage 3 gathers trainable units from their fp32 masters (stage3.py)

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
        self._prepare_module(module)
        # each unit's parameter source, by kind (trainable or frozen): param_sources.py
        self._sources = {kind: choose_param_source(self, kind) for kind in (True, False)}
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
        # one rank reduces a unit as soon as its gradients are complete; several ranks in
        # the fixed order, and every unit at the end of backward in that order too
        several = self.comm.world_size > 1
        self._ready = self._reduce_in_order if several else self._reduce
        self._end_order = self._reduce_order if several else self.units
        self._flush_pending = False     # _end_micro_step is to be queued in this backward
        self._flushes_micro_steps = self.shard_grads and several
        m = make_masters(self)          # (masters.py)
        self.offloaded, self.alias, self.lazy_grads = m.offloaded, m.alias, m.lazy_grads
        self.master_flat, self.sub_group_ranges = m.flat, m.sub_group_ranges
        self.offload = m.offload        # the offloaded states (offload.py), when the tier offloads
        self.states = m.offload if m.offload is not None else OnDevice()
        self._master_list, self._master_group = m.tensors, m.groups
        trained = self._sources[True]
        for u in self.units:
            trained.bind_master(u)
        # units whose model-dtype shard the device step writes (not those gathered from the master)
        self._published = [u for u in m.published if not u.source.from_master]
        # units all-gathered after the step (stages 1-2: the shards it wrote; one shard: none)
        self._gathered_after_step = self.units if self.layout_world > 1 else []
        self.grads = choose_grad_sink(self)     # (grad_sinks.py; chosen again with the optimizer)
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
        unit = Unit(index, params, layout, full, self.layout_rank, sharded_params=False,
                    source=self._sources[params[0].requires_grad].seed)
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

    @property
    def lp_grads(self):
        """The gradients kept in the model dtype until the step (lp_grads.py), or None."""
        return self.grads.lp_grads

    @lp_grads.setter
    def lp_grads(self, value) -> None:
        """Only None: the fp32 master-gradient sink instead (tests compare the two)."""
        if value is not None:
            raise ValueError("partitioner.lp_grads can only be set to None")
        self.grads = choose_grad_sink(self)

    def before_forward(self) -> None:
        self.states.discard()    # a forward before the step: no speculated values in it

    # -- backward ---------------------------------------------------------------------
    def before_backward(self, at_boundary: bool = True, first_micro_step: bool = True) -> None:
        self._check_trainability()
        self.at_boundary = at_boundary      # read by the gradient sink during this backward
        # several ranks, sharded gradients, a window still open: every unit is reduced at the
        # end of this backward (_end_micro_step), so that the ranks' reductions pair up
        self._flush_pending = self._flushes_micro_steps and not at_boundary
        if first_micro_step:
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
        if self._flush_pending:         # queued from inside the backward (the autograd engine runs)
            self._flush_pending = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_step)
        u = self.unit_of[p]
        self.grads.take(u, u.position[p], p)
        u.pending -= 1
        if u.pending == 0 and self.grads.reduces_now():
            self._ready(u)

    def _reduce_in_order(self, u: Unit) -> None:
        """``u``'s gradients are complete: reduce it once every unit before it in the fixed
        order is reduced (several ranks)."""
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
        for u in self._reduce_order:
            if not u.reduced and self.grads.reduce_at_end(u):
                self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        u.reduced = True
        self.run.faults.issued("reduce", u.index, self.unit_name)    # faults: named in messages
        self.grads.reduce(u)
        self._after_reduce(u)

    def unit_name(self, index: int) -> str:
        """What unit ``index`` holds, for messages (names.py)."""
        return unit_name(self, index)

    def _after_reduce(self, u: Unit) -> None:
        """Hook for stage 3: release the unit's gathered parameters."""

    def finish_gradients(self) -> None:
        self.wait_optimizer(keep_speculation=True)
        for u in self._end_order:
            if not u.reduced and self.grads.reduce_at_end(u):
                self._reduce(u)
        self.grads.finish()

    def grad_norm_sq(self) -> torch.Tensor:
        return self.grads.norm_sq()

    def zero_grad(self) -> None:
        self.grads.zero()
        self.before_backward()

    # -- the optimizer step --------------------------------------------------------------
    def optimizer_built(self, optimizer) -> None:
        bind_shard_map(optimizer, lambda: build_shard_map(self))     # an optimizer of whole tensors (Muon)
        self.states.prepare(optimizer)
        self.grads = choose_grad_sink(self, optimizer)

    def step_optimizer(self, optimizer, grad_multiplier: float = 1.0) -> None:
        """Step the masters and publish them as model parameters."""
        self.release_all()
        self.grads.step(optimizer, grad_multiplier)
        for u in self._published:
            u.shard.copy_(u.master, non_blocking=True)
        self.gather_after_step()

    def gather_after_step(self) -> None:
        """All-gather the shards the step wrote into every rank's whole parameters (stages 1-2;
        later, in ``wait_optimizer``, while a tier's step is still writing them)."""
        self.states.after_step(self._gather_shards)

    def _gather_shards(self) -> None:
        inflight, n = [], 0      # at most allgather_bucket_size elements in flight at once
        for u in self._gathered_after_step:
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
        self.states.wait(keep_speculation)

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
        return memory_tensors(self, self._master_list, self.grads.in_flight())

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
        from .loader import import_state
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
