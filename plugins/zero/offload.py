"""Where the optimizer's states are stepped: the stage's side of the offload contract
(:mod:`zeroplug.tiers`, :class:`Offloaded`), or the training device (:class:`OnDevice`, which
has nothing to wait for). The partitioner holds one of the two as ``states`` and calls it
without asking which.

The stage hands the tier its layout once, each unit's reduced gradient shard as it
appears in backward, and asks it to step the sub-groups and (stage 3) to wait before a
unit is gathered. What happens to the bytes in between is the tier's business.

The global gradient norm stays with the stage: with no gradient accumulation each
reduced shard adds its squared norm to a device scalar as it is handed over, so the
norm needs no pass over host memory.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from zeroplug.tiers import Layout, SubGroup, UnitShard


class Offloaded:
    def __init__(self, part, groups: list[list]):
        self.part, self.tier = part, part.offload_optimizer
        self.gpu_norm = part.run.config.batch.gradient_accumulation_steps == 1
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=part.device)
        self.waited: set[int] = set()     # sub-groups waited for since the step began
        self.deferred: list = []          # run once the step in flight is waited for (after_step)
        units, sub_groups, off = [], [], 0
        for g in groups:
            start, pos = off, []
            for u in g:
                pos.append(len(units))
                units.append(UnitShard(u.index, off, u.shard))
                off += u.hi - u.lo
            sub_groups.append(SubGroup(start, off, tuple(pos), g[0].group))
        exact = part.pdtype if (part.pdtype != torch.float32
                                and part.run.config.batch.gradient_accumulation_steps == 1
                                and (part.comm.world_size == 1 or part.rdtype == part.pdtype)) else torch.float32
        ptier = part.offload_param
        by_index = {u.index: u for u in part.units}

        def write(i: int):      # the shards the param tier holds go through it
            return ptier.update(i) if i in part.param_tier_units else nullcontext(by_index[i].shard)
        layout = Layout(units=tuple(units), sub_groups=tuple(sub_groups), param_dtype=part.pdtype,
                        device=part.device, exact_grad_dtype=exact, gathers_per_unit=part.gathers_per_unit(),
                        shards_in_memory=not part.params_offloaded or ptier.capabilities.in_memory,
                        write_shard=write, publish=not part.params_from_masters)
        self.tier.plan(layout)
        masters = self.tier.masters
        self.sub_group_of: dict[int, int] = {}
        for k, g in enumerate(groups):
            for u in g:
                u.master = self.tier.unit_masters[u.index]
                if u.hi > u.lo:     # an empty shard on this rank belongs to no sub-group
                    self.sub_group_of[u.index] = k
        self.masters = list(masters)        # what the optimizer steps: one per sub-group
        self.groups = [sg.group for sg in sub_groups]     # their parameter groups
        self.sub_group_ranges = [(sg.start, sg.end) for sg in sub_groups]

    # -- backward ------------------------------------------------------------------------
    def grad_ready(self, u, src: torch.Tensor, first_micro: bool) -> None:
        """``src``: this rank's reduced gradient shard of unit ``u`` on the device."""
        if first_micro and self.gpu_norm:
            self.norm_sq += src.float().pow(2).sum()
        self.tier.grad_ready(u.index, src, accumulate=not first_micro)

    def no_grad(self, u) -> None:
        """No gradient reached ``u`` in this window (its shard in the tier is overwritten,
        not zeroed, each step)."""
        self.tier.grad_ready(u.index, None, accumulate=False)

    def discard(self) -> None:
        """Before a forward or a state read, and after a skipped step: a speculation of the
        tier that no step validated is undone."""
        self.tier.speculate(None, None)

    def wait_grads(self) -> None:
        self.tier.grads_landed()

    def take_norm_sq(self) -> torch.Tensor | None:
        """The squared norm accumulated on the device during backward (None: compute on host)."""
        if not self.gpu_norm:
            return None
        out, self.norm_sq = self.norm_sq, torch.zeros_like(self.norm_sq)
        return out

    # -- the step ------------------------------------------------------------------------
    def prepare(self, optimizer) -> None:
        self.tier.prepare(optimizer)

    def step(self, optimizer, grad_multiplier: float) -> None:
        self.waited.clear()
        self.tier.step(optimizer, grad_multiplier)

    def wait_unit(self, u) -> None:
        """Before ``u`` is gathered: its sub-group is stepped and published."""
        k = self.sub_group_of.get(u.index)
        if k is not None:
            self.tier.wait(k)
            self.waited.add(k)

    def unit_ready(self, u, by_timing: bool) -> bool:
        """Whether ``u`` can be gathered without waiting for the step.

        Note: with ``by_timing`` false the answer follows from this rank's program order
        alone (no step in flight, or ``u``'s sub-group waited for since the step began), so
        every rank gives the same one. With several ranks a gather is a collective; decided
        by each rank's CPU-step progress, the ranks started their gathers at different points
        of the forward, and a two-GPU job (NCCL, 1.3B stage 3 + CPU offload) hung; decided by
        program order it runs to the end."""
        k = self.sub_group_of.get(u.index)
        if k is None:
            return True
        if by_timing:
            return self.tier.ready(k)
        return not self.tier.in_flight() or k in self.waited

    def wait_all(self) -> None:
        self.tier.wait_all()

    def wait(self, keep_speculation: bool = False) -> None:
        """Every step in flight done (a speculation undone unless ``keep_speculation``), and
        what :meth:`after_step` put off run."""
        if not keep_speculation:
            self.discard()
        self.tier.wait_all()
        deferred, self.deferred = self.deferred, []
        for fn in deferred:
            fn()

    def after_step(self, now, late=None) -> None:
        """Run ``now()`` once the step's values are in the shards.

        Note: a tier whose step is still running when step() returns (the cpu tier's
        overlapped step and delayed_update) writes this rank's shards when it is waited
        for; ``now()`` would read the old values, so ``late()`` runs instead (default:
        ``now()`` at the next :meth:`wait`)."""
        if not self.pending:
            now()
        elif late is not None:
            late()
        else:
            self.deferred.append(now)

    @property
    def pending(self) -> bool:
        return self.tier.in_flight()


class OnDevice:
    """States on the training device, stepped in engine.step(): nothing runs after it returns."""
    pending = False

    def discard(self) -> None:
        pass

    def prepare(self, optimizer) -> None:
        pass

    def wait(self, keep_speculation: bool = False) -> None:
        pass

    def after_step(self, now, late=None) -> None:
        now()

    def wait_unit(self, u) -> None:
        pass

    def unit_ready(self, u, by_timing: bool) -> bool:
        return True
