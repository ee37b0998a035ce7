"""Stage 3: parameters sharded too; each module's parameters are gathered just
before its forward and its backward, and released after.

Prefetch follows the order in which units were fetched in the previous forward
(and its reverse in backward). When the order changes (eval, generation, a
conditional branch, a module used twice), nothing fails: a fetch of a unit that
was not prefetched gathers it on the spot, and every unit that was prefetched but
not used is drained (its gather waited for) and freed at the end of backward, at
the end of a forward that no backward follows (no_grad, eval), at the start of the
next forward and by ``release_all()``. A unit is never "still in
flight" when someone needs it freed: ``Unit.release`` waits for its gather first.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten

from zeroplug.errors import ConfigError, StateError
from zeroplug.flat import alloc_storage, free_storage
from zeroplug.tiers import Layout, UnitShard

from .flat_layout import FlatLayout
from .untraced import eager
from .partitioned_init import PartitionedInit, flush_pending, init_group, materialize
from .leaves import find_leaves, gatherers, owners, reachable_params
from .options import hidden_size
from .groups import shard_mesh
from .hpz import SecondaryFirst, SecondaryShard, check_hpz
from .partitioner import Stage2, check_materialized
from .prefetch import choose_prefetch
from .unit import FREE, INFLIGHT, READY, Unit


def check_params_from_masters(params_offloaded: bool, optimizer_tier) -> None:
    """zero.stage3_params_from_masters needs both tiers offloaded, the optimizer's keeping its
    masters in memory without model-dtype shards (``optimizer_tier``: its capabilities)."""
    if not params_offloaded or not optimizer_tier.offloaded:
        why = "needs offload.param and offload.optimizer (the masters in host memory are what it gathers)"
    elif not optimizer_tier.publish_optional:
        why = ("needs an offload.optimizer tier that keeps its masters in memory and can leave the model-dtype "
               "shards unwritten (capabilities.publish_optional: \"cpu\" without delayed_update)")
    else:
        return
    raise ConfigError(f"zero.stage3_params_from_masters = true {why}; set it to false",
                      key="zero.stage3_params_from_masters")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _opaque(flat) -> bool:
    """Whether a flattened output holds an object the hooks cannot look into (not a tensor,
    not a plain scalar): an object of the model's own, which may hold what a backward starts from."""
    return any(not torch.is_tensor(t) and not isinstance(t, (int, float, bool, str, type(None))) for t in flat)


class Stage3(Stage2):
    """ZeRO-3: as stage 2, plus parameters sharded and gathered around each module's use."""
    stage = 3
    shard_params = True

    def setup(self, module, precision, offload_optimizer, offload_param, groups=None):
        o = self.options
        h = hidden_size(module)
        self.persist_threshold = 10 * h if o.stage3_param_persistence_threshold == "auto" \
            else o.stage3_param_persistence_threshold
        self.prefetch_size = int(0.9 * h * h) if o.stage3_prefetch_bucket_size == "auto" \
            else o.stage3_prefetch_bucket_size
        self.params_offloaded = offload_param.capabilities.offloaded
        # Note: with the masters on the training device, a model-dtype copy of each shard
        # would only repeat the master in fewer bits (2 bytes per element / world; on one rank
        # the whole model, 2 bytes per parameter, kept gathered). Without it, a gather casts
        # the master into the gather buffer, as FSDP2 casts its fp32 shards.
        self.lp_from_master = (not o.stage3_low_precision_shards and not self.params_offloaded
                               and not offload_optimizer.capabilities.offloaded
                               and precision.param_dtype != torch.float32)
        # Note: with both tiers in host memory the param tier's shard only repeats the host
        # master in fewer bits (2 bytes per element); without it a gather uploads the master
        # and casts it on the device (stage3_params_from_masters)
        self.params_from_masters = o.stage3_params_from_masters
        if self.params_from_masters:
            check_params_from_masters(self.params_offloaded, offload_optimizer.capabilities)
            self.lp_from_master = True
        flush_pending()
        self.leaves = set(find_leaves(module, o))
        self.leaf_gatherers = gatherers(module, self.leaves)    # a leaf, or the module that holds it
        self.upload = (torch.cuda.Stream(self.run.device)
                       if self.params_offloaded and self.run.device.type == "cuda" else None)
        super().setup(module, precision, offload_optimizer, offload_param, groups)
        self._setup_hpz(offload_optimizer)
        self.trace_prev: list[int] = []
        self.prefetch_count = 0     # gathers started ahead of use (a statistic: tests, monitors)
        self.trace_cur: list[int] = []
        self.path_key = 0           # a hash of trace_cur: what the ranks compare (zeroplug.faults)
        self._callback_queued = False
        self.units_of_module: dict[torch.nn.Module, list[Unit]] = {}
        self._stale: set[int] = set()   # persistent units to refill once their sub-group is stepped
        # what is gathered ahead of use and kept for reuse (prefetch.py)
        self.prefetch = choose_prefetch(self)
        # what the step leaves to refill or to mark stale (hpZ secondary shards)
        self._persistent = [u for u in self.units if u.persistent] if self.gathers_per_unit() else []
        self._secondaries = [u.secondary for u in self.all_units if u.secondary is not None]
        # the units without a model-dtype shard (filled from their masters for checkpoints)
        self._from_master = [u for u in self.units if u.source.from_master]
        if self.params_offloaded:       # the shards the param tier holds between uses
            held = [u for u in self.units if not u.persistent and u.source.tiered]
            self.param_tier_units = frozenset(u.index for u in held)
            offload_param.plan(Layout(units=tuple(UnitShard(u.index, 0, u.shard) for u in held),
                                      sub_groups=(), param_dtype=self.pdtype, device=self.device))
        if not self.gathers_per_unit():
            return      # Note: one rank holds everything whole: no hooks, no gathers, stage 2's speed
        for m, params in owners(module, self.leaves):
            us = sorted({self.unit_of[p].index for p in params if p in self.unit_of})
            if us:
                self.units_of_module[m] = [self.all_units[i] for i in us]
                self._hooks.append(m.register_forward_pre_hook(eager(self._pre_forward)))
                self._hooks.append(m.register_forward_hook(eager(self._post_forward)))
                self._hooks.append(m.register_state_dict_pre_hook(self._state_dict_pre_hook))
        self._hooks.append(module.register_forward_hook(eager(self._end_forward)))

    def tier_elements(self, module):
        """As stage 2's; with stage3_params_from_masters the param tier holds the frozen
        parameters' shards only."""
        out = super().tier_elements(module)
        if self.options.stage3_params_from_masters:
            out["param"] = max(0, out["param"] - out["optimizer"])
        return out

    def _setup_hpz(self, offload_optimizer) -> None:
        """ZeRO++ hpZ: a secondary shard per gathered unit within groups of ranks (hpz.py)."""
        size = self.options.zero_hpz_partition_size
        check_hpz(size, self.options, self.params_offloaded, offload_optimizer.capabilities.offloaded)
        if size <= 1:
            return
        mesh = shard_mesh(self.run.comm, size, key="zero.zero_hpz_partition_size")
        if mesh.replicate is None:
            return      # one group of every rank: the gathers are the secondary's already
        for u in self.all_units:
            if not u.persistent:
                u.secondary = SecondaryShard(mesh.shard, u.layout.padded, self.pdtype, self.device)
                u.source = SecondaryFirst(u.source)

    def _state_dict_pre_hook(self, module, prefix, keep_vars) -> None:
        """``module.state_dict()`` would hand out sharded parameters (no values): refuse."""
        if not keep_vars and any(u.state == FREE for u in self.units_of_module[module]):
            raise StateError(
                f"state_dict() of {prefix.rstrip('.') or type(module).__name__!r} under ZeRO stage 3: the "
                "parameters are sharded across ranks (and offloaded). Use engine.consolidated_state_dict() "
                "(every rank calls it; rank 0 gets the tensors), engine.save_16bit_model(path) or "
                "engine.save_pretrained(dir), or read it inside `with engine.gathered_parameters():`")

    # -- building units from (possibly pre-partitioned) parameters -------------------
    def _prepare_module(self, module):
        for name, p in module.named_parameters():
            check_materialized(name, p)
            if not p.is_floating_point():      # integer parameters: whole on every rank, as they are
                p.data = p.data.to(self.device)
        for b in module.buffers():
            b.data = b.data.to(self.device)

    def _group_params(self, module):
        """One unit per module and kind: its trainable parameters of each parameter group,
        and its frozen ones (sharded, gathered, never stepped). Integer parameters stay whole.
        A leaf module's units hold the parameters of every module inside it."""
        groups, assigned = [], set()
        in_model = {id(p) for p in module.parameters()}
        for m, params in owners(module, self.leaves):
            fresh: dict = {}
            for p in params:
                if p is None or id(p) in assigned or not p.is_floating_point():
                    continue
                g = init_group(p)
                if g is not None and m not in self.leaves and self._usable(g, in_model):
                    groups.append(g.params)
                    assigned.update(id(q) for q in g.params)
                    continue
                if g is not None:       # built by zeroplug.init, but its kinds differ: lay it out again
                    materialize(g)
                fresh.setdefault((p.requires_grad, self.groups.index(p)), []).append(p)
                assigned.add(id(p))
            groups.extend(fresh.values())
        return groups

    def _usable(self, g, in_model) -> bool:
        """A zeroplug.init group becomes a unit as it is when its parameters are all still in
        the model and of one kind (trainable or not, one parameter group)."""
        kinds = {(p.requires_grad, self.groups.index(p)) for p in g.params}
        return len(kinds) == 1 and all(id(p) in in_model for p in g.params)

    def _make_unit(self, index, params) -> Unit:
        world, rank = self.layout_world, self.layout_rank
        group = init_group(params[0])
        source = self._sources[params[0].requires_grad]
        # one rank keeps a unit whole (no gathers) unless it is gathered from its master
        whole = source.whole
        # the shard the param tier keeps (in host memory); gathered from its master instead, it
        # only seeds the master, on the device, and is freed after
        tiered = source.tiered
        if group is not None:
            layout, shard = group.layout, group.shard
            if layout.world_size != world or shard.dtype != self.pdtype:
                raise RuntimeError(
                    f"model was built by zeroplug.init for world size {layout.world_size} and "
                    f"{shard.dtype}, but the engine runs {world} ranks in {self.pdtype}; pass the same "
                    "config to zeroplug.init and zeroplug.initialize")
            full = torch.empty(layout.padded, dtype=self.pdtype, device=self.device)
            if whole:           # the shard is the whole buffer: one tensor, as in the plain path,
                full.copy_(shard)   # so optimizer updates of the shard reach the parameters
                shard = full
            elif world == 1:    # gathered from its master: the shard only seeds the master
                full.copy_(shard)
                shard = full.clone()
            else:
                free_storage(full)
            group.release()
        else:
            layout = FlatLayout.build(params, world)
            full = torch.empty(layout.padded, dtype=self.pdtype, device=self.device)
            layout.copy_in(full, [p.data.to(self.device, self.pdtype) for p in params])
            lo, hi = layout.shard_range(rank)
            shard = full[lo:hi] if whole or (world == 1 and tiered) else full[lo:hi].clone()
        if tiered:     # the shard lives in the param tier (pinned host memory)
            host = self.offload_param.empty(shard.numel(), self.pdtype)
            host.copy_(shard)
            shard = host
        unit = Unit(index, params, layout, full, rank, sharded_params=not whole, shard=shard, source=source.seed)
        unit.persistent = whole or layout.total <= self.persist_threshold
        unit.bind_params()
        if not unit.persistent:
            unit.mark_free()
        elif group is not None and world > 1:     # the whole copy, gathered from the init shards
            unit.state = FREE
            unit.start_gather(self.shard_comm, self.upload)
            unit.wait_gather()
        if not unit.persistent:
            unit.fetch_on_read(eager(lambda u=unit: self._fetch(u)))     # a read outside a module's forward
        return unit

    # -- forward / backward hooks -----------------------------------------------------
    def before_forward(self) -> None:
        super().before_forward()
        if self.trace_cur:
            self.trace_prev, self.trace_cur = self.trace_cur, []
        self.path_key = 0
        self.run.faults.forward_path(0)
        self.release_all()

    def begin_gather(self, u: Unit) -> None:
        """Start gathering the released unit ``u``."""
        self.states.wait_unit(u)       # an overlapped step has published this unit
        # faults: a forward's gather is compared across the ranks first; a backward's follows
        # from the forward's and is only named (zeroplug.faults; one rank: nothing to do)
        if _in_backward():
            self.run.faults.issued("all_gather", u.index, self.unit_name)
        else:
            self.run.faults.agree("all_gather", u.index, self.unit_name, str(self.path_key), self.trace_cur.copy)
        u.source.fetch(u)
        u.start_gather(self.shard_comm, self.upload)

    def _release(self, u: Unit) -> None:
        u.release()
        u.source.evict(u)

    def _fetch(self, u: Unit) -> None:
        if u.index in self._stale:
            self._refill(u)
        if u.state == FREE:
            self.begin_gather(u)
        u.wait_gather()

    def _refill(self, u: Unit) -> None:
        """A persistent unit's whole copy, from its shard after an overlapped step."""
        self._stale.discard(u.index)
        self.states.wait_unit(u)
        self.run.faults.agree("refill", u.index, self.unit_name)   # faults: compared first (one rank: nothing)
        u.fill_full(self.shard_comm, self.upload).wait()

    def live_numel(self) -> int:
        """Elements of the gathered (or in-flight) units that are not kept whole."""
        return sum(u.numel for u in self.all_units if not u.persistent and u.state != FREE)

    def _pre_forward(self, module, args) -> None:
        units = self.units_of_module[module]
        backward = _in_backward()
        for u in units:
            self._fetch(u)
            if not backward:
                pos = len(self.trace_cur)
                self.trace_cur.append(u.index)
                # faults: the backward's comparison includes the units the forward ran (zeroplug.faults):
                # a module one rank skipped, gathered ahead on every rank, changes what the backward gathers
                self.path_key = hash((self.path_key, u.index))
                self.run.faults.forward_path(self.path_key, self.trace_cur.copy, self.unit_name)
                prev = self.trace_prev
                if pos < len(prev) and prev[pos] == u.index:
                    self.prefetch.ahead(prev, pos)

    def _post_forward(self, module, args, output):
        units = self.units_of_module[module]
        # Note: a backward passes through this module when its output requires grad, also
        # when its own parameters are frozen (the input's gradient needs the weight).
        flat = tree_flatten(output)[0]
        outs = [t for t in flat if torch.is_tensor(t) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(outs)
        if _in_backward():
            return      # activation-checkpoint recompute: the backward that follows needs them
        if torch.is_grad_enabled() and not outs and _opaque(flat):
            # Note: an output the hooks cannot see into (an object of the model's own, say the
            # model's own forward returning its loss in one) may lead to a backward that needs
            # these units, with no output tensor to hook a gather on: they stay gathered until
            # reduced (frozen ones: the end of that backward, or the next forward)
            return
        if backward_follows:
            if module in self.leaf_gatherers:
                self._expect_grads(module, units, outs, args)
            for t in outs:
                t.register_hook(lambda grad, m=module: self._pre_backward(m))
            if any(not u.trainable for u in units):
                # frozen units are released once the gradient of the module's input exists
                # (trainable ones once their gradients are reduced)
                for t in tree_flatten(args)[0]:
                    if torch.is_tensor(t) and t.requires_grad:
                        t.register_hook(lambda grad, m=module: self._post_backward_frozen(m))
        for u in units:
            if not self.prefetch.reused_soon(u, backward_follows):
                self._release(u)

    def _expect_grads(self, module, units, outs, args) -> None:
        """A leaf's parameters that this backward will reach: the ones its forward used on
        this rank (an expert no token was routed to gets no gradient here).

        Note: reductions run in one fixed unit order on every rank, each once its unit's
        gradients are complete; a unit waiting for gradients that never come would hold its
        gathered parameters, and every unit after it, until the end of backward. Its unused
        parameters are reduced as zeros, so the ranks' sums stay exact."""
        reached = reachable_params(outs, [t for t in tree_flatten(args)[0] if torch.is_tensor(t)])
        for u in units:
            if u.trainable:
                u.expect = (u.expect or set()) | {id(p) for p in u.trainable if id(p) in reached}

    def before_backward(self, at_boundary: bool = True, first_micro_step: bool = True) -> None:
        super().before_backward(at_boundary, first_micro_step)
        for u in self.units:
            u.partial = bool(u.expect)    # (nothing reached: left to the end of backward)
            if u.partial:
                u.pending = len(u.expect)

    def _on_grad(self, p) -> None:
        u = self.unit_of[p]
        if u.partial and (u.reduced or u.expect is None or id(p) not in u.expect):
            name = next((n for m in self.leaves for n, q in m.named_parameters() if q is p), "")
            raise StateError(
                f"a gradient reached parameter {name!r} (shape {tuple(p.shape)}) of a leaf module although "
                "the leaf's forward did not use it on this rank: it was used outside the leaf module's "
                "forward. Use it only inside that module, or do not make the module a leaf "
                "(zero.stage3_leaf_modules, zero.stage3_auto_leaf_modules, zero.stage3_block_units, "
                "zeroplug.unset_leaf_modules)")
        super()._on_grad(p)

    def _post_backward_frozen(self, module) -> None:
        for u in self.units_of_module[module]:
            if not u.trainable:
                self._release(u)

    def _end_forward(self, module, args, output) -> None:
        """The root module's forward returned: with no backward to follow (no_grad, eval),
        nothing that was kept for reuse or prefetched may outlive it. An output that is
        not made of tensors (an object of the model's own) may still lead to a backward."""
        if _in_backward():
            return
        if torch.is_grad_enabled():
            leaves = tree_flatten(output)[0]
            if any(torch.is_tensor(t) and t.requires_grad for t in leaves) or _opaque(leaves):
                return
        self.release_all()

    def _pre_backward(self, module) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for u in self.units_of_module[module]:
            self._fetch(u)
            order = self.trace_cur[::-1]
            if u.index in order:
                self.prefetch.ahead(order, order.index(u.index))

    def _after_reduce(self, u: Unit) -> None:
        self._release(u)

    def _end_backward(self) -> None:
        self._callback_queued = False
        for u in self.units:
            u.expect = None     # (kept until now: zero_grad may run between forward and backward)
        self.release_all()

    def release_all(self) -> None:
        for u in self.all_units:
            self._release(u)

    # -- after the optimizer ------------------------------------------------------------
    def gathers_per_unit(self) -> bool:
        """Whether trainable units are gathered on use (else one rank keeps them whole)."""
        return not self._sources[True].whole

    def wait_optimizer(self, keep_speculation: bool = False) -> None:
        super().wait_optimizer(keep_speculation)
        for i in sorted(self._stale):
            self._refill(self.all_units[i])

    def gather_after_step(self) -> None:
        """Only persistent units are kept whole; the others are gathered at their next use
        (an hpZ secondary shard is stale now: that gather goes across every rank)."""
        for sec in self._secondaries:
            sec.fresh = False
        self.states.after_step(self._fill_persistent, late=self._mark_stale)

    def _fill_persistent(self) -> None:
        handles = [u.fill_full(self.shard_comm, self.upload) for u in self._persistent]
        for h in handles:
            h.wait()

    def _mark_stale(self) -> None:
        """A tier's step still writes the shards: persistent units are refilled on use."""
        self._stale.update(u.index for u in self.units if u.persistent)

    def checkpoint_state(self, optimizer=None, parts=None) -> dict:
        """Parameter shards out of memory with a ``parts`` writer: read in one sub-group's units
        at a time, their pieces written into that sub-group's part file (see checkpointing.py).
        Without one: every shard in and the export copied."""
        if self._from_master:
            with self._lp_shards():     # the pieces' model-dtype values: copies that outlive the shards
                out = super().checkpoint_state(optimizer, parts=parts)
                for pieces in out["pieces"].values():
                    for pc in pieces:
                        if "param" in pc:
                            pc["param"] = pc["param"].clone()
                return out
        from zeroplug.checkpoint import active_part_writer
        away = self.params_offloaded and not self.offload_param.capabilities.in_memory
        if away and parts is None:
            parts = active_part_writer()
        if not away or parts is not None:
            return super().checkpoint_state(optimizer, parts=parts)
        from .checkpointing import copy_tensors
        with self.offload_param.all_in():     # parameter shards read in
            return copy_tensors(super().checkpoint_state(optimizer))

    def load_checkpoint_state(self, states, optimizer=None, **flags) -> None:
        """import_state fills a shard out of memory one unit at a time; model-dtype shards
        that the masters replace exist for the load only."""
        if not self._from_master:
            return super().load_checkpoint_state(states, optimizer, **flags)
        with self._lp_shards():
            return super().load_checkpoint_state(states, optimizer, **flags)

    @contextmanager
    def _lp_shards(self):
        """The model-dtype shards of the units gathered from their masters, for the block."""
        units = self._from_master
        for u in units:
            alloc_storage(u.shard)
            u.shard.copy_(u.lp_source)
        try:
            yield
        finally:
            for u in units:
                free_storage(u.shard)

    @contextmanager
    def gathered_params(self, params=None, modifier_rank=None, check_writes: bool = False):
        from .writes import units_of, writes_kept
        self.wait_optimizer()
        units = units_of(self, params)
        for u in units:
            if u.state == FREE:
                self.begin_gather(u)
        for u in units:
            u.wait_gather()
        try:
            with writes_kept(self, units, params, modifier_rank, check_writes):
                yield
        finally:
            self.release_all()

    def consolidated_state_dict(self, module):
        if not self.options.stage3_gather_16bit_weights_on_model_save:
            raise RuntimeError("zero.stage3_gather_16bit_weights_on_model_save = false: the weights are "
                               "sharded; set it to true to save a consolidated model")
        return super().consolidated_state_dict(module)

    @classmethod
    def construction_context(cls, options, run, precision):
        return PartitionedInit(run, precision, shard_mesh(run.comm, options.shard_group_size))
