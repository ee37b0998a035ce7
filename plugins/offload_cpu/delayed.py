"""The cpu tier's one-step delayed parameter update (``[offload.optimizer] delayed_update``,
ZeRO-Offload's "DPU").

After ``delayed_update_warmup`` exact steps, ``step()`` hands the whole CPU step of
step t (and the GPU lane's share) to the worker thread and returns at once; the step's
model-dtype values go into a host buffer of their own (``lp_next``), not into the
parameter shards. The forward and backward of step t+1 therefore run on the values the
shards already hold: those of step t-1's update. The boundary of step t+1 (the stage's
``wait_all`` before it reads gradients) waits for the step of t and publishes ``lp_next``
into the shards, which the forward of step t+2 reads::

    step    t-1          t            t+1          t+2
    GPU     fwd/bwd(p0)  fwd/bwd(p0)  fwd/bwd(p1)  fwd/bwd(p2)     p_i: values after update i
    CPU                  update 1 ... update 2 ... update 3 ...    (update i reads g of step i)

Note: the backward of step t+1 writes its gradients while the step of t still reads
those of step t, so there are two host gradient buffers: backward writes the "landing"
one, the masters' ``.grad`` point at the other while a step is in flight, and the boundary
swaps them.

Note: publishing is a copy of every element (host to host with the parameters offloaded,
else an upload). A unit's shard is free to take the new values as soon as the backward
of step t+1 is done with it, which is when its reduced gradient reaches the tier
(``grad_ready``; without gradient accumulation, the last read of that shard in the step).
So ``grad_ready`` queues that unit's copy on the worker thread behind the update, and the
copies run during the rest of the backward instead of between it and the next forward;
the boundary copies only what the worker has not (units that got no gradient call, or
all of them with gradient accumulation, when later micro-batches still read the shards).

Note: ``wait_all`` is also what a checkpoint, ``gathered_params`` and ``close`` call, so
they see the finished step published: masters, optimizer states and parameter shards
agree. The forward after such a call sees the newest values (one step fresher than
without the call), and a run resumed from the checkpoint makes the same steps as the
run that saved it.
"""
from __future__ import annotations

import threading

import torch

from zeroplug.flat import set_grad
from zeroplug.tiers import step_group


class DelayedUpdate:
    def __init__(self, tier):
        self.tier = tier                   # the host tier (host.py) whose step it delays
        self.warmup = tier.delayed_warmup()
        self.live = False                  # a delayed step is in flight (set on the main thread only)
        self.lp_next: torch.Tensor | None = None   # the in-flight step's model-dtype values
        self.grads: list[list[torch.Tensor]] | None = None   # two buffers' per-sub-group gradient views
        self.landing_buf = 0               # which one backward writes
        self.steps = 0                     # a statistic: delayed steps started
        self.supported = tier.layout.shards_in_memory and tier.kind == "optimizer"
        # units whose shard the backward of this step no longer reads may be published early
        self.early = tier.run.config.batch.gradient_accumulation_steps == 1
        self.publishing: list = []         # the worker's copies of single units (futures)
        self.published: set[int] = set()   # units published since the update in flight started
        self.early_units = 0               # a statistic: units published before the boundary

    def landing(self, k: int) -> torch.Tensor:
        """Sub-group k's gradient buffer that backward writes now."""
        if self.grads is None:
            return self.tier.masters[k].grad
        return self.grads[self.landing_buf][k]

    def due(self, optimizer) -> bool:
        """Whether this step is delayed: past the warm-up, counted by the optimizer's own step
        count (restored from checkpoints, equal on every rank)."""
        if not self.supported or not self.tier.masters:
            return False
        st = optimizer.state.get(self.tier.masters[0], {})
        return float(st.get("step", 0)) >= self.warmup

    def _buffers(self) -> None:
        tier = self.tier
        total = tier.ranges[-1][1]
        self.lp_next = tier.empty(total, tier.layout.param_dtype)
        first = [m.grad for m in tier.masters]
        other = tier.empty(total, first[0].dtype).zero_()
        self.grads = [first, [other[a:b] for a, b in tier.ranges]]
        self.landing_buf = 0

    def start(self, optimizer, fused: bool, mult: float) -> None:
        """Start step t in the background; the gradients of step t+1 land in the other buffer."""
        tier = self.tier
        if self.grads is None:
            self._buffers()
        self.landing_buf = 1 - self.landing_buf      # the masters' .grad keep this step's gradients
        groups, masters, ranges, lp_next = optimizer.param_groups, tier.masters, tier.ranges, self.lp_next
        lane = tier.lane_groups
        for k in sorted(lane):      # queued on the GPU's side streams; model-dtype values into lp_next
            tier.lane.enqueue(groups[k], optimizer.state, k, masters[k], ranges[k][0], mult, lp_host=lp_next)
        cpu_groups = [k for k in range(len(ranges)) if k not in lane]
        threads = tier.overlap_threads()

        def run() -> None:
            for k in cpu_groups:
                a, b = ranges[k]
                if fused:
                    step_group(optimizer, k, lp_out=lp_next[a:b], grad_multiplier=mult, threads=threads)
                else:
                    step_group(optimizer, k, grad_multiplier=mult)
                    lp_next[a:b].copy_(masters[k])

        done = threading.Event()
        done.set()
        self.live = True
        self.steps += 1
        # the shards are not written: no unit waits; wait_all settles the update (below)
        tier.run_in_background(run, [done] * len(ranges), {}, follow_up=self)

    def before_wait(self) -> None:
        """``wait_all`` waits for the update in flight (set on the main thread)."""
        self.live = False

    def after_wait(self) -> None:
        self.finish()

    def released(self, unit: int) -> None:
        """The backward no longer reads ``unit``'s shard in this step (its reduced gradient
        arrived): its new values may go in, on the worker, once the update is done."""
        if not (self.live and self.early) or unit in self.published:
            return
        self.published.add(unit)
        a, b = self.tier.grad_at[unit]
        if b > a:
            self.publishing.append(self.tier.step_worker().submit(self._publish, a, b))

    def _publish(self, a: int, b: int) -> bool:
        """Master elements [a, b) of ``lp_next`` into their shards; True if it queued an upload."""
        tier, uploaded = self.tier, False
        if tier.lane is not None and tier.cuda:
            for k, (lo, hi) in enumerate(tier.ranges):
                ev = tier.lane.events.get(k) if k in tier.lane_groups and lo < b and a < hi else None
                if ev is not None:
                    ev.synchronize()        # the lane's copy into lp_next is done
        for u, x, y, s in tier.pieces(a, b):
            src = self.lp_next[a + s:a + s + y - x]
            if tier.cuda and u.shard.device.type != "cpu":
                with torch.cuda.stream(tier.h2d):
                    u.shard[x:y].copy_(src, non_blocking=True)
                uploaded = True
            else:
                u.shard[x:y].copy_(src)
        return uploaded

    def finish(self) -> None:
        """The step in flight is done (``wait_all``): its gradients' buffer is free for the next
        backward, and its values are in the parameter shards (those the worker has not
        copied yet are copied now)."""
        tier = self.tier
        for m, g in zip(tier.masters, self.grads[self.landing_buf]):
            set_grad(m, g)          # the masters' .grad: the newest gradients (norm, accumulation)
        uploaded = False
        for fut in self.publishing:
            uploaded = fut.result() or uploaded
        self.early_units += len(self.publishing)
        for unit, (a, b) in tier.grad_at.items():
            if unit not in self.published and b > a:
                uploaded = self._publish(a, b) or uploaded
        self.publishing, self.published = [], set()
        if uploaded:
            tier.h2d.synchronize()      # the next step writes lp_next again
            torch.cuda.current_stream(tier.train_device).wait_stream(tier.h2d)
