"""Stage 3: which units are gathered ahead of use, and which stay gathered for a reuse.

The stage picks one policy at setup from :data:`PREFETCH` (first that applies):

* :class:`CastOnly` — one rank (or a shard group of one) gathering from its masters: a gather
  is a cast on the compute stream, with no collective or upload to overlap or to save, so
  nothing is prefetched or kept gathered for reuse (the backward's casts cost less than
  holding the forward's tail);
* :class:`FollowTrace` — gathers started ahead in the order of the previous forward (and its
  reverse in backward), within ``stage3_prefetch_bucket_size`` and
  ``stage3_max_live_parameters``; units needed again within ``stage3_max_reuse_distance``
  stay gathered.
"""
from __future__ import annotations

from zeroplug.modes import Modes
from .unit import FREE

PREFETCH = Modes("prefetch policy")


def choose_prefetch(part) -> "FollowTrace":
    return PREFETCH.pick(part)(part)


@PREFETCH.register
class FollowTrace:
    @classmethod
    def applies(cls, part) -> bool:
        return True

    def __init__(self, part):
        self.part = part
        self.units = part.all_units
        self.options = part.options
        # Note: with ``by_timing`` false a unit's readiness follows from this rank's program
        # order alone, so every rank starts the same gathers (offload.py, unit_ready)
        self.by_timing = part.layout_world == 1

    def ahead(self, order: list[int], start: int) -> None:
        """Start gathers for the units after position ``start`` of ``order``."""
        part = self.part
        budget, live = part.prefetch_size, part.live_numel()
        first = True
        for idx in order[start + 1:]:
            u = self.units[idx]
            if u.state != FREE:
                first = False
                continue
            # Note: the next unit is always prefetched when live parameters allow, even if it
            # is larger than the bucket (any bucket but 0): a whole block (12 x hidden^2) is
            # larger than "auto"'s 0.9 x hidden^2 and than a DeepSpeed JSON's usual 5e7 at
            # 1.3B, and a block never fetched ahead leaves every gather and upload on the
            # critical path.
            over = budget < u.numel and not (first and budget > 0)
            if over or live + u.numel > self.options.stage3_max_live_parameters:
                break
            first = False
            if not part.states.unit_ready(u, by_timing=self.by_timing):
                break                           # its sub-group is still stepping: fetched on use
            if not u.source.prefetch(u):
                part.begin_gather(u)            # (a shard out of memory is only read ahead)
            part.prefetch_count += 1
            budget -= u.numel
            live += u.numel

    def reused_soon(self, u, backward_follows: bool = False) -> bool:
        """Whether ``u`` runs again within stage3_max_reuse_distance elements of execution,
        following the recorded order (as DeepSpeed counts it, backward included).

        Note: the backward visits the units in reverse, starting with the last ones of
        the forward: the tail of the forward (the head, the last blocks) is needed again
        after 2 x the elements that follow it, so it stays gathered instead of being
        freed and uploaded again (with offloaded parameters: an H2D on the backward's
        critical path)."""
        part = self.part
        prev, pos = part.trace_prev, len(part.trace_cur)
        limit = self.options.stage3_max_reuse_distance
        dist = 0
        for idx in prev[pos:]:
            if idx == u.index:
                return dist <= limit
            dist += self.units[idx].numel
        # the backward's reuse is predicted only while this forward follows the recorded one
        return (backward_follows and 2 * dist <= limit
                and 0 < pos <= len(prev) and prev[:pos] == part.trace_cur)


@PREFETCH.register(before=FollowTrace)
class CastOnly(FollowTrace):
    @classmethod
    def applies(cls, part) -> bool:
        return part.layout_world == 1 and part.lp_from_master and not part.params_from_masters

    def ahead(self, order, start) -> None:
        pass

    def reused_soon(self, u, backward_follows: bool = False) -> bool:
        return False
