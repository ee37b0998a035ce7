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

from zeroplug.flat import FlatLayout, sub_group_ranges
from zeroplug.slots import Partitioner

from .options import ZeroOptions
from .unit import Unit


def hidden_size(module: torch.nn.Module) -> int:
    """The model's hidden size as DeepSpeed's "auto" values mean it: the largest input width."""
    h = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            h = max(h, min(m.in_features, m.out_features))
        elif isinstance(m, torch.nn.Embedding):
            h = max(h, m.embedding_dim)
    return h or 1024


class FlatPartitioner(Partitioner):
    Options = ZeroOptions
    stage = 0
    shard_optimizer = False
    shard_grads = False
    shard_params = False

    # -- setup ----------------------------------------------------------------------
    def setup(self, module, precision, offload_optimizer, offload_param):
        run = self.run
        self.module, self.precision, self.comm = module, precision, run.comm
        self.device = run.device
        self.pdtype, self.rdtype = precision.param_dtype, precision.reduce_dtype
        self.layout_world = run.world_size if self.shard_optimizer else 1
        self.layout_rank = run.rank if self.shard_optimizer else 0
        self.offload_optimizer, self.offload_param = offload_optimizer, offload_param
        h = hidden_size(module)
        o = self.options
        self.bucket_size = h * h if o.reduce_bucket_size == "auto" else o.reduce_bucket_size
        self._pending: list = []       # (unit, handle, out) reductions in flight
        self._prepare_module(module)
        groups = self._group_params(module)
        self.units = [self._make_unit(i, g) for i, g in enumerate(groups)]
        self.unit_of = {p: u for u in self.units for p in u.params}
        self._make_masters()
        self.offload = None
        self.swap = None
        if self.offloaded:
            from .offload_path import OffloadPath
            self.offload = OffloadPath(self)
        if getattr(self.offload_optimizer, "swaps_states", False):
            from .swap import SubGroupSwap
            self.swap = SubGroupSwap(self, self.offload_optimizer)
            self.swap.swap_out_all()        # the masters start on NVMe
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
        for p in module.parameters():
            if p.is_floating_point():
                p.data = p.data.to(self.device, self.pdtype)
        for b in module.buffers():
            b.data = b.data.to(self.device)

    def _group_params(self, module) -> list[list[torch.nn.Parameter]]:
        """Consecutive trainable parameters in buckets of at most ``bucket_size`` elements."""
        groups, cur, n = [], [], 0
        for p in module.parameters():     # deduplicated: tied weights appear once
            if not p.requires_grad:
                continue
            if cur and n + p.numel() > self.bucket_size:
                groups.append(cur)
                cur, n = [], 0
            cur.append(p)
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
            for p, g in zip(params, layout.views(unit.grad_flat)):
                p.grad = g
        return unit

    def _make_masters(self):
        tier = self.offload_optimizer
        self.offloaded = tier.offloaded
        self.alias = self.pdtype == torch.float32 and not self.offloaded
        if self.alias:
            for u in self.units:
                u.master = u.shard
                u.master.grad = (u.grad_flat[u.lo:u.hi] if not self.shard_grads
                                 else torch.zeros_like(u.shard))
            self._master_list = [u.master for u in self.units]
            return
        total = sum(u.hi - u.lo for u in self.units)
        if getattr(tier, "swaps_states", False):
            return self._make_swapped_masters(tier, total)
        # fp32 master + gradient here, and Adam's two fp32 moments created beside them
        gdt = self._host_grad_dtype()
        gb = torch.finfo(gdt).bits // 8
        tier.plan((12 + gb) * total, f"{total:,} fp32 master elements: master 4 + gradient {gb} + "
                                     f"optimizer states 8 bytes each")
        self.master_flat = tier.empty(total, torch.float32)
        self.master_grad_flat = tier.empty(total, gdt)
        self.master_grad_flat.zero_()
        off = 0
        for u in self.units:
            n = u.hi - u.lo
            u.master = self.master_flat[off:off + n]
            u.master.copy_(u.shard)
            _set_grad(u.master, self.master_grad_flat[off:off + n])
            off += n
        self._master_list = []
        self.sub_group_ranges = (self._unit_aligned_ranges() if self.offloaded
                                 else sub_group_ranges(total, self.options.sub_group_size))
        for a, b in self.sub_group_ranges:
            t = self.master_flat[a:b]
            _set_grad(t, self.master_grad_flat[a:b])
            self._master_list.append(t)

    def _host_grad_dtype(self) -> torch.dtype:
        """The offloaded gradient shard's dtype: the model's where it holds every reduced
        gradient exactly (see the cpu tier's grad_dtype), else fp32.

        Note: with one rank (or a reduction in the model dtype) the reduced gradient is the
        model-dtype gradient itself, so a bf16 shard loses nothing; cpu_adam widens it
        inside its one pass. That is 2 bytes less per element to copy D2H, to write and to
        read again: the offloaded step is bound by host memory traffic."""
        cfg = self.run.config
        opt = cfg.slot("optimizer").name
        if (not self.offloaded or getattr(self.offload_optimizer.options, "grad_dtype", "fp32") != "auto"
                or self.pdtype == torch.float32 or cfg.batch.gradient_accumulation_steps != 1
                or not (self.comm.world_size == 1 or self.rdtype == self.pdtype)
                or not (opt == "cpu_adam" or (opt == "auto" and self.device.type != "cpu"))
                or not _mixed_grad_ok()):
            return torch.float32
        return self.pdtype

    def _unit_groups(self) -> list[list[Unit]]:
        """Offloaded sub-groups: consecutive whole units up to sub_group_size elements (a
        larger unit is a sub-group of its own), the same for every tier, so that moving
        the optimizer between tiers changes no arithmetic."""
        groups, cur, n = [], [], 0
        for u in self.units:
            size = u.hi - u.lo
            if cur and n + size > self.options.sub_group_size:
                groups.append(cur)
                cur, n = [], 0
            cur.append(u)
            n += size
        if cur:
            groups.append(cur)
        return groups

    def _unit_aligned_ranges(self) -> list[tuple[int, int]]:
        out, off = [], 0
        for g in self._unit_groups():
            size = sum(u.hi - u.lo for u in g)
            out.append((off, off + size))
            off += size
        return out

    def _make_swapped_masters(self, tier, total: int) -> None:
        """Sub-groups of whole units, each master its own tensor, so each can be swapped
        out (storage freed) while the others stay; the gradient shard is one flat buffer."""
        groups = self._unit_groups()
        largest = max(sum(u.hi - u.lo for u in g) for g in groups)
        # master, m and v of every element in files; masters staged one sub-group at a time
        tier.plan_swap(12 * total, largest, element_size=4, num_files=3 * len(groups))
        self.master_flat = None
        self.master_grad_flat = tier.empty(total, torch.float32)
        self.master_grad_flat.zero_()
        self._master_list, self.sub_group_ranges, off = [], [], 0
        for g in groups:
            size = sum(u.hi - u.lo for u in g)
            t = tier.empty(size, torch.float32)
            t.grad = self.master_grad_flat[off:off + size]
            pos = 0
            for u in g:
                k = u.hi - u.lo
                u.master = t[pos:pos + k]
                u.master.copy_(u.shard)
                u.master.grad = t.grad[pos:pos + k]
                pos += k
            self._master_list.append(t)
            self.sub_group_ranges.append((off, off + size))
            off += size

    def master_params(self):
        return self._master_list

    def optimizer_params(self):
        """What the optimizer is built over: one param group per sub-group when offloaded,
        so the offload path can step (and publish) sub-group by sub-group."""
        if self.offloaded:
            return [{"params": [t]} for t in self._master_list]
        return self._master_list

    # -- backward ---------------------------------------------------------------------
    def before_backward(self) -> None:
        for u in self.units:
            u.pending = len(u.trainable)
            u.reduced = False

    def _on_grad(self, p) -> None:
        u = self.unit_of[p]
        if self.shard_grads:
            if u.bucket is None:
                u.bucket = torch.zeros(u.layout.padded, dtype=self.rdtype, device=self.device)
            i = u.position[p]
            o, n = u.layout.offsets[i], u.layout.numels[i]
            u.bucket[o:o + n].view_as(p).copy_(p.grad)
            p.grad = None
        u.pending -= 1
        if u.pending == 0 and (self.shard_grads or self.run.at_boundary):
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        world = self.comm.world_size
        u.reduced = True
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
            handle = self.comm.reduce_scatter(out, buf, async_op=True)
        else:
            handle = self.comm.all_reduce(buf, async_op=True)
            out = buf
        if self.offload is not None:
            # Note: for NCCL, wait() only orders the current stream after the collective;
            # the host does not block, and the D2H copy then follows on a side stream.
            handle.wait()
            part = out if out.numel() == u.hi - u.lo else out[u.lo:u.hi]
            self.offload.grad_ready(u, part, first_micro=not self.shard_grads or self.run.first_micro_step)
        else:
            self._pending.append((u, handle, out))
            if not self.options.overlap_comm:
                self._drain()
        self._after_reduce(u)

    def _after_reduce(self, u: Unit) -> None:
        """Hook for stage 3: release the unit's gathered parameters."""

    def _drain(self) -> None:
        for u, handle, out in self._pending:
            handle.wait()
            if not self.shard_grads:
                if out is not u.grad_flat:
                    u.grad_flat.copy_(out)
                if not self.alias:
                    u.master.grad.copy_(u.grad_flat[u.lo:u.hi])
            else:
                part = out if out.numel() == u.hi - u.lo else out[u.lo:u.hi]
                u.master.grad.add_(part.to(u.master.grad.device, non_blocking=True))
        self._pending.clear()

    def finish_gradients(self) -> None:
        self.wait_optimizer()
        for u in self.units:
            if u.reduced or not u.trainable:
                continue
            if self.shard_grads and u.bucket is None:
                if self.offload is not None and self.run.first_micro_step:
                    u.master.grad.zero_()   # offloaded grads are overwritten, not zeroed each step
                continue            # no gradient reached this unit in this backward
            self._reduce(u)
        self._drain()
        if self.offload is not None:
            self.offload.wait_grads()

    def grad_norm_sq(self) -> torch.Tensor:
        if self.offload is not None:
            sq = self.offload.take_norm_sq()
            if sq is not None:
                if self.layout_world > 1:
                    self.comm.all_reduce(sq)
                return sq
        grads = [t.grad for t in self._master_list]
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch._foreach_norm(grads)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        if self.layout_world > 1:
            sq = sq.to(self.device)
            self.comm.all_reduce(sq)
        return sq

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_flat is not None:
                u.grad_flat.zero_()
            for p in u.trainable:
                if self.shard_grads:
                    p.grad = None
        if self.alias:
            if self.shard_grads:
                for u in self.units:
                    u.master.grad.zero_()
        elif self.offload is None:
            self.master_grad_flat.zero_()
        # Note: offloaded master grads are overwritten by the next boundary's copies (and
        # zeroed for units that got none), which saves a pass over host memory per step.
        self.before_backward()

    # -- the optimizer step --------------------------------------------------------------
    def step_optimizer(self, optimizer) -> None:
        """Step the masters and publish them as model parameters."""
        self.release_all()
        if self.offload is not None:
            self.offload.step(optimizer, self.sub_group_ranges)
        else:
            optimizer.step()
            if not self.alias:
                for u in self.units:
                    u.shard.copy_(u.master, non_blocking=True)
        self._gather_after_step()

    def _gather_after_step(self) -> None:
        if self.layout_world == 1:
            return
        inflight, n = [], 0      # at most allgather_bucket_size elements in flight at once
        for u in self.units:
            if inflight and n + u.numel > self.options.allgather_bucket_size:
                for h in inflight:
                    h.wait()
                inflight, n = [], 0
            inflight.append(self.comm.all_gather(u.full, u.shard, async_op=True))
            n += u.numel
        for h in inflight:
            h.wait()

    def wait_optimizer(self) -> None:
        if self.offload is not None:
            self.offload.wait_all()

    def can_overlap_step(self) -> bool:
        """Whether the offloaded step may still run after step_optimizer returns: only
        where every later use of a parameter or gradient waits for its own sub-group."""
        return False

    # -- views -------------------------------------------------------------------------
    def gathered_params(self):
        """Context in which every parameter holds its full value (a no-op below stage 3)."""
        from contextlib import nullcontext
        self.wait_optimizer()
        return nullcontext()

    def consolidated_state_dict(self, module) -> dict | None:
        with self.gathered_params():
            if self.run.rank != 0:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        self.wait_optimizer()
        out = {"lp_params": [u.full for u in self.units] + [u.shard for u in self.units if u.sharded_params],
               "lp_grads": [u.grad_flat for u in self.units if u.grad_flat is not None],
               "hp_params": [] if self.alias else list(self._master_list),
               "hp_grads": ([u.master.grad for u in self.units] if self.alias and self.shard_grads
                            else [] if self.alias else [self.master_grad_flat])}
        return out

    def checkpoint_state(self, optimizer=None, parts=None) -> dict:
        """This rank's world-size-independent checkpoint part (see checkpointing.py).

        The nvme tier with a ``parts`` writer (what save_checkpoint passes): each sub-group's
        master and optimizer states are brought in, written to a part file and freed, one
        sub-group at a time. Without one, every sub-group is brought in and the export is
        copied (the pieces would otherwise point into storages freed right after)."""
        from zeroplug.checkpoint import active_part_writer

        from .checkpointing import export_state
        self.wait_optimizer()
        if self.swap is None:       # parts: only for parameter shards on NVMe (stage 3)
            return export_state(self, optimizer, parts=parts)
        if parts is None:
            parts = active_part_writer()      # called through an override that does not pass it on
        if parts is not None:
            return export_state(self, optimizer, parts=parts)
        with self.swap.all_resident(optimizer):
            return _copy_tensors(export_state(self, optimizer))

    def load_checkpoint_state(self, states, optimizer=None, **flags) -> None:
        """Load from a :class:`zeroplug.checkpoint.ShardSet`; the nvme tier one sub-group at a time."""
        from .checkpointing import import_state
        self.wait_optimizer()
        return import_state(self, states, optimizer, **flags)

    @classmethod
    def construction_context(cls, options, run, precision):
        from contextlib import nullcontext
        return nullcontext()

    @classmethod
    def check_config(cls, config, choice) -> None:
        import logging

        from zeroplug.errors import ConfigError
        # Note: these are rules of the partitioner, whichever tier holds the parameters
        param = config.slot("offload.param").name
        if param != "none" and not cls.shard_params:
            raise ConfigError(f"offload.param.plugin = \"{param}\" needs zero.plugin = \"stage3\" (only stage 3 "
                              "shards parameters); offload the optimizer with [offload.optimizer] instead",
                              key="offload.param.plugin")
        if param != "none" and config.slot("offload.optimizer").name == "none":
            raise ConfigError(f"offload.param.plugin = \"{param}\" needs the optimizer offloaded too: add "
                              "[offload.optimizer] plugin = \"cpu\" or \"nvme\" (the fp32 masters update the "
                              "host shards)", key="offload.param.plugin")
        if cls.stage < 3:
            given = [k for k in config.raw.get("zero", {}) if k.startswith("stage3_")]
            if given:
                logging.getLogger("zeroplug").warning(
                    "[zeroplug] zero.%s applies to stage 3 only; %s ignores it", given[0], choice.name)


def _mixed_grad_ok() -> bool:
    """Whether this torch lets an fp32 tensor hold a gradient of another dtype."""
    try:
        _set_grad(torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def _set_grad(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t.grad = g``, also where g's dtype differs (an fp32 master, a bf16 gradient shard)."""
    if g.dtype != t.dtype and hasattr(t, "grad_dtype"):
        t.grad_dtype = None     # Note: torch >= 2.10 checks .grad's dtype unless told not to
    t.grad = g


def _copy_tensors(obj):
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_tensors(v) for v in obj)
    return obj


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
