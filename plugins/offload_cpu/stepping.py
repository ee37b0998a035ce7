"""How the host tier (host.py) steps, publishes and lands gradients: decided once, into
small objects the hot methods call without testing a flag (:mod:`zeroplug.modes`).

Chosen when the tier plans its layout (:meth:`HostTier.start_movement`):

* copies (:data:`COPIES`): ``StreamCopies`` on a CUDA training device (D2H of gradients and
  H2D of parameters on side streams, ordered by events), ``HostCopies`` otherwise (plain
  synchronous copies: how CI runs the same code);
* publisher (:data:`PUBLISHERS`), how a stepped fp32 master becomes model-dtype shards:
  ``NoPublish`` (the stage gathers from the masters: ``layout.publish`` false),
  ``UploadChunks`` (shards on the GPU: chunks through an fp32 device buffer on the h2d
  stream, cast there), ``ScatterInMemory`` (shards in memory on the host), ``ScatterThrough``
  (shards out of memory: through ``layout.write_shard``);
* landing (:data:`LANDINGS`), where a reduced gradient lands: ``ExactLanding`` (the masters'
  ``.grad``) or ``DelayedLanding`` (the delayed update's landing buffer, publishing units
  early).

Chosen when the optimizer is known (``prepare``, or the first step when a tier has no
``prepare`` of its own), after the GPU lane and the speculative step are decided:

* sub-group step (:data:`SUB_GROUP_STEPS`): ``StepOnly`` (nothing to publish),
  ``FusedPublish`` (an optimizer with ``step_group`` writes the model-dtype copy in its own
  pass, straight into host shards or into a host ring that goes up), ``StepThenPublish``
  (any torch optimizer; then the publisher);
* schedule (:data:`SCHEDULES`): ``Overlapped`` (the CPU steps on the worker thread after
  step() returns) or ``Serial``; the delayed update wraps either (``DelayedFirst``).
"""
from __future__ import annotations

import threading

import torch

from zeroplug.modes import Modes
from zeroplug.tiers import SubGroupOptimizer, step_group


def _nothing(*args) -> None:
    return None


# -- copies: CUDA side streams, or plain copies ----------------------------------------------

COPIES = Modes("host tier copies")


@COPIES.register
class HostCopies:
    """A CPU training device: every copy is synchronous, nothing to order."""

    @classmethod
    def applies(cls, tier) -> bool:
        return True

    def __init__(self, tier):
        pass

    def grad(self, dst, src, accumulate: bool) -> None:
        if accumulate:
            dst.add_(src)
        else:
            dst.copy_(src)

    def uploads_after_compute(self) -> None:
        """The h2d stream's next work follows the current stream's."""

    def compute_after_uploads(self) -> None:
        """The current stream's later work follows every upload queued so far."""

    def compute_after(self, event) -> None:
        """The current stream's later work follows ``event`` (None: nothing)."""

    def grads_landed(self) -> None:
        """Block until every gradient copy queued so far is in host memory."""

    def grads_event(self):
        """An event after every gradient copy queued so far (None: they are done)."""
        return None


@COPIES.register(before=HostCopies)
class StreamCopies(HostCopies):
    @classmethod
    def applies(cls, tier) -> bool:
        return tier.cuda

    def __init__(self, tier):
        self.device, self.d2h, self.h2d = tier.train_device, tier.d2h, tier.h2d

    def grad(self, dst, src, accumulate: bool) -> None:
        if accumulate:          # accumulation: rare path, synchronous
            dst.add_(src.to("cpu", torch.float32))
            return
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.d2h)     # the allocator keeps src until the copy is done

    def uploads_after_compute(self) -> None:
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    def compute_after_uploads(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    def compute_after(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def grads_landed(self) -> None:
        self.d2h.synchronize()

    def grads_event(self):
        return self.d2h.record_event()


# -- publishing a stepped master into model-dtype shards ----------------------------------

PUBLISHERS = Modes("host tier publisher")


@PUBLISHERS.register
class ScatterThrough:
    """Shards out of memory: each is filled through ``layout.write_shard`` and written back."""

    @classmethod
    def applies(cls, tier) -> bool:
        return True

    def __init__(self, tier):
        self.tier = tier

    def publish(self, master, a: int, k: int) -> None:
        self.scatter(master, a, a + master.numel())

    def scatter(self, src, a: int, b: int) -> None:
        """``src`` (master elements [a, b)) into the shards of their units."""
        write = self.tier.layout.write_shard
        for u, x, y, s in self.tier.pieces(a, b):
            with write(u.index) as shard:
                shard[x:y].copy_(src[s:s + y - x])


@PUBLISHERS.register(before=ScatterThrough)
class ScatterInMemory(ScatterThrough):
    @classmethod
    def applies(cls, tier) -> bool:
        return tier.layout.shards_in_memory

    def scatter(self, src, a: int, b: int) -> None:
        for u, x, y, s in self.tier.pieces(a, b):
            u.shard[x:y].copy_(src[s:s + y - x])


@PUBLISHERS.register(before=ScatterInMemory)
class UploadChunks(ScatterInMemory):
    """Shards on the GPU: the master goes up in chunks through the fp32 staging buffer on
    the h2d stream and is cast into them there."""

    @classmethod
    def applies(cls, tier) -> bool:
        units = tier.layout.units
        return tier.cuda and bool(units) and units[0].shard.device.type == "cuda"

    def publish(self, master, a: int, k: int) -> None:
        tier = self.tier
        with torch.cuda.stream(tier.h2d):
            tier.publish_chunks(master, a, a + master.numel())
            tier.events[k] = tier.h2d.record_event()


@PUBLISHERS.register(before=UploadChunks)
class NoPublish(ScatterInMemory):
    """The stage gathers the parameters from the masters: no shard to write."""

    @classmethod
    def applies(cls, tier) -> bool:
        return not tier.layout.publish

    def publish(self, master, a: int, k: int) -> None:
        pass


# -- where a reduced gradient lands ----------------------------------------------------------

LANDINGS = Modes("host tier gradient landing")


@LANDINGS.register
class ExactLanding:
    """Into the masters' ``.grad``; with a GPU lane on a CUDA device, a copy into sub-group k
    waits (GPU-side) for the lane's upload of k's previous gradient."""

    @classmethod
    def applies(cls, tier) -> bool:
        return True

    def __init__(self, tier):
        self.masters = tier.masters
        lane = tier.lane
        d2h = getattr(tier, "d2h", None)
        self.order = (lambda k: lane.order_after(k, d2h)) if lane is not None and tier.cuda else _nothing

    def buffer(self, k: int) -> torch.Tensor:
        return self.masters[k].grad

    def before_copy(self, k: int) -> None:
        self.order(k)

    def released(self, unit: int) -> None:
        """The backward is done with ``unit``'s shard in this step."""


@LANDINGS.register(before=ExactLanding)
class DelayedLanding(ExactLanding):
    """The delayed update (delayed.py): gradients land in the buffer its step does not read,
    and a unit whose gradient landed may take the new values early."""

    @classmethod
    def applies(cls, tier) -> bool:
        return tier.delayed is not None

    def __init__(self, tier):
        super().__init__(tier)
        self.delayed = tier.delayed
        self.buffer = self.delayed.landing
        self.released = self.delayed.released

    def before_copy(self, k: int) -> None:
        if not self.delayed.live:       # (the lane's work of the step in flight writes lp_next only)
            self.order(k)


# -- one sub-group's step ----------------------------------------------------------------------

SUB_GROUP_STEPS = Modes("host tier sub-group step")


@SUB_GROUP_STEPS.register
class StepThenPublish:
    """Any torch optimizer: step the sub-group alone, then publish its fp32 master."""

    @classmethod
    def applies(cls, tier, optimizer) -> bool:
        return True

    def __init__(self, tier, optimizer):
        self.tier = tier

    def prepare(self, groups: list[int]) -> None:
        """Allocate, ahead of the first step, what stepping ``groups`` needs."""

    def step(self, optimizer, k: int, mult: float, threads):
        """Step sub-group k with gradient multiplier ``mult`` and publish it; returns the CUDA
        event of its upload from the host ring, if it went through one (else None)."""
        tier = self.tier
        step_group(optimizer, k, grad_multiplier=mult)    # this sub-group only
        tier.publish_master(tier.masters[k], tier.ranges[k][0], k)
        return None


@SUB_GROUP_STEPS.register(before=StepThenPublish)
class FusedPublish(StepThenPublish):
    """Note: an optimizer with step_group (cpu_adam) writes the model-dtype copy in its own
    pass: straight into host shards, or into a pinned host ring that goes up at 2 bytes per
    element (sub-groups whose shards are on the GPU). Which of the two, per sub-group, is
    decided here once."""

    @classmethod
    def applies(cls, tier, optimizer) -> bool:
        return isinstance(optimizer, SubGroupOptimizer) and tier.layout.shards_in_memory

    def __init__(self, tier, optimizer):
        super().__init__(tier, optimizer)
        self.via_ring = [tier.lp_on_device(a, b) for a, b in tier.ranges]

    def prepare(self, groups: list[int]) -> None:
        # Note: page-locking the ring (2 x the largest sub-group: 4 GB at DeepSpeed's
        # sub_group_size 1e9) touches every page, which does not belong in a training step.
        if any(self.via_ring[k] for k in groups):
            self.ring()

    def step(self, optimizer, k: int, mult: float, threads):
        if not self.via_ring[k]:
            a, b = self.tier.ranges[k]
            lp = [u.shard[x:y] for u, x, y, _ in self.tier.pieces(a, b)]
            step_group(optimizer, k, lp_out=lp, grad_multiplier=mult, threads=threads)
            return None
        return self.step_into_ring(optimizer, k, mult, threads)

    def step_into_ring(self, optimizer, k: int, mult: float, threads):
        tier = self.tier
        a, b = tier.ranges[k]
        ring = self.ring()
        prev = tier.events.pop(("staging", k % 2), None)
        if prev is not None:
            prev.synchronize()       # the upload of sub-group k - 2 read this buffer
        lp = ring[k % 2][:b - a]
        step_group(optimizer, k, lp_out=lp, grad_multiplier=mult, threads=threads)
        with torch.cuda.stream(tier.h2d):
            for u, x, y, s in tier.pieces(a, b):
                u.shard[x:y].copy_(lp[s:s + y - x], non_blocking=True)
            tier.events[("staging", k % 2)] = tier.h2d.record_event()
        return tier.events.get(("staging", k % 2))

    def ring(self) -> list[torch.Tensor]:
        """The two host model-dtype buffers that a fused step writes and the uploads read, each
        the size of the largest sub-group (``tier.host_staging``)."""
        tier = self.tier
        size = max(hi - lo for lo, hi in tier.ranges)
        while len(tier.host_staging) < 2:
            tier.host_staging.append(tier.empty(size, tier.layout.param_dtype))
        return tier.host_staging


@SUB_GROUP_STEPS.register(before=FusedPublish)
class StepOnly(StepThenPublish):
    """The stage gathers from the masters (``layout.publish`` false): nothing to write."""

    @classmethod
    def applies(cls, tier, optimizer) -> bool:
        return not tier.layout.publish

    def step(self, optimizer, k: int, mult: float, threads):
        step_group(optimizer, k, grad_multiplier=mult, threads=threads)
        return None


# -- the whole step ------------------------------------------------------------------------------

SCHEDULES = Modes("host tier step schedule")


def _nothing_kept(optimizer, multiplier):
    return [], {}


@SCHEDULES.register
class Serial:
    """The GPU lane's sub-groups queued first (the GPU works while the CPU steps the rest),
    those a speculative step kept left as they are, the rest stepped before step() returns."""
    threads = None

    @classmethod
    def applies(cls, tier, optimizer) -> bool:
        return True

    def __init__(self, tier, optimizer):
        self.tier = tier
        spec, lane = tier.speculation, tier.lane
        self.validate = spec.validate if spec is not None else _nothing_kept
        self.lane_sync = lane.synchronize if lane is not None else _nothing

    def step(self, optimizer, mult: float) -> None:
        tier = self.tier
        groups, masters, ranges = optimizer.param_groups, tier.masters, tier.ranges
        lane = tier.lane_groups      # empty unless a lane was made
        for k in sorted(lane):
            tier.lane.enqueue(groups[k], optimizer.state, k, masters[k], ranges[k][0], mult)
        kept, uploads = self.validate(optimizer, mult)     # what the backward stepped and still holds
        cpu_groups = [k for k in range(len(ranges)) if k not in lane and k not in kept]
        threads = self.threads

        def step_one(k: int) -> None:
            tier.step_sub_group(optimizer, k, mult, threads)

        self.run(optimizer, step_one, cpu_groups, set(lane) | set(kept), uploads)

    def run(self, optimizer, step_one, cpu_groups, done, uploads) -> None:
        tier = self.tier
        tier.sub_group_loop(optimizer, step_one, cpu_groups)
        self.lane_sync()                # host readers of the states may come next
        tier.publish_finished()


@SCHEDULES.register(before=Serial)
class Overlapped(Serial):
    """The CPU's sub-groups stepped on the worker thread after step() returns, in forward
    order; the stage waits for each unit's own sub-group (host.py's module doc)."""

    @classmethod
    def applies(cls, tier, optimizer) -> bool:
        return isinstance(optimizer, SubGroupOptimizer) and tier.layout.shards_in_memory and tier.overlaps()

    def __init__(self, tier, optimizer):
        super().__init__(tier, optimizer)
        self.threads = tier.overlap_threads()
        self.lane_events = tier.lane.events if tier.lane is not None else {}

    def run(self, optimizer, step_one, cpu_groups, done, uploads) -> None:
        """``done``: sub-groups not stepped here (the GPU lane's, queued on the device, and
        those the backward stepped speculatively, with their upload events ``uploads``)."""
        tier = self.tier
        stepped = [threading.Event() for _ in tier.ranges]
        uploaded = {k: self.lane_events[k] for k in done if k in self.lane_events}
        uploaded.update(uploads)
        for k in done:
            stepped[k].set()      # queued on the GPU, or stepped by the backward's jobs
        events = tier.events

        def run() -> None:
            for k in cpu_groups:
                step_one(k)
                ev = events.get(("staging", k % 2))
                if ev is not None:
                    uploaded[k] = ev
                stepped[k].set()

        tier.run_in_background(run, stepped, uploaded)
        tier.overlapped_steps += 1


class DelayedFirst:
    """The delayed update (delayed.py): past its warm-up the whole step runs in the
    background and its values reach the shards one step late; before, ``inner`` steps."""

    def __init__(self, tier, inner, fused: bool):
        self.delayed, self.inner, self.fused = tier.delayed, inner, fused

    def step(self, optimizer, mult: float) -> None:
        if self.delayed.due(optimizer):
            self.delayed.start(optimizer, self.fused, mult)
            return
        self.inner.step(optimizer, mult)


def choose_schedule(tier, optimizer):
    """The step's schedule for ``optimizer`` (the lane and speculation decided already)."""
    schedule = SCHEDULES.pick(tier, optimizer)(tier, optimizer)
    if tier.delayed is None:
        return schedule
    fused = isinstance(optimizer, SubGroupOptimizer) and tier.layout.shards_in_memory
    return DelayedFirst(tier, schedule, fused)
