"""States in host memory and how they move: the "cpu" tier's machinery, which the "nvme"
tier builds on (it adds swap files between steps).

Timeline of one step on a GPU::

    backward  |== grads of unit k reduced ==>| D2H (side stream) into pinned bf16 or fp32 |
    step      wait D2H | CPU steps sub-group 0 | sub-group 1 | ... |
    publish              | H2D sub-group 0 (side stream) + cast into bf16 shards | 1 | ...
    next forward waits (GPU-side only) for the last H2D
    GPU lane  a share of the sub-groups streamed through torch's fused AdamW (gpu_lane.py),
              queued before the CPU starts, so both lanes step at once

Note: the global gradient norm (clipping) and the overflow flag need every gradient,
so the exact step starts after backward. ``speculative_step`` (:mod:`.speculative`) steps
sub-groups during the backward as their gradients become final, guessing that the step
neither clips nor overflows, and redoes them exactly at the step when it does.

Note: the next forward does not wait for the whole step (``overlap_step``, when the stage
waits per unit): the CPU steps sub-groups in forward order on a worker thread and
engine.step() returns at once. The stage gathers a unit only after ``wait(k)`` for its
sub-group, a gradient is copied into a sub-group's buffer only after that sub-group has
stepped, and anything else that reads the states waits for the whole step first
(``wait_all``). Every value is the one the serial step computes; only the time at which
it is ready moves.

Note: on a CPU-only run the same code runs with synchronous copies, which is how CI
tests it against the in-memory path (overlapped steps included).

How the tier copies, publishes, lands gradients, steps a sub-group and schedules its step
is decided once (:mod:`.stepping`): the methods below call those objects and test no flag.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zeroplug.flat import set_grad
from zeroplug.slots import takes_grad_scale
from zeroplug.tiers import OffloadTier, SubGroupOptimizer, TierCapabilities, init_group_states, optimizer_state_bytes

from .delayed import DelayedUpdate
from .speculative import Speculation
from .stepping import COPIES, LANDINGS, PUBLISHERS, SUB_GROUP_STEPS, choose_schedule

#: elements of the fp32 device buffer that publishes a master without a fused copy (64 MiB)
PUBLISH_CHUNK = 1 << 24

#: Note: the most elements the host tier takes at a time (``capabilities.granularity``).
#: DeepSpeed's configs carry ``reduce_bucket_size`` 5e8 and ``sub_group_size`` 1e9, sizes
#: meant for collectives and NVMe buffers. In host memory they only delay the pipeline: a
#: gradient bucket reaches the host once the last of its 5e8 elements is produced, and a
#: stage-3 forward waits for the whole 1e9-element sub-group its first unit belongs to. 1e8
#: runs the 1.3B workload faster than DeepSpeed's sizes on stages 2 and 3 (docs/benchmarks.md,
#: "DeepSpeed's JSON as it is", has the figures).
GRANULARITY = 100_000_000


def _nothing(*args) -> None:
    return None


def _no_speculation(optimizer, loss_scale) -> bool:
    return False


class _NoFollowUp:
    """What a background step without a follow-up does when it is waited for."""

    def before_wait(self) -> None:
        pass

    def after_wait(self) -> None:
        pass


NO_FOLLOW_UP = _NoFollowUp()


class _Undecided:
    """The schedule before the optimizer is known: decides at the first step."""

    def __init__(self, tier):
        self.tier = tier

    def step(self, optimizer, mult: float) -> None:
        self.tier.decide_step(optimizer)
        self.tier.schedule.step(optimizer, mult)


class HostTier(OffloadTier):
    """Masters, gradients and optimizer states in host memory; the optimizer steps them there.

    A public base: the "cpu" tier and the "nvme" tier extend it, and so may a third party's
    tier whose states are staged in host memory. It implements the whole
    :class:`zeroplug.tiers.OffloadTier` contract for kind "optimizer" (gradient copies on a
    side stream, the step sub-group by sub-group, publishing, the overlapped step, the
    delayed update and the speculative step); kind "param" keeps the base class's defaults.

    A subclass provides ``Options`` (its TOML table) and may override:

    * what it decides: :meth:`check_memory`, :meth:`grad_dtype`, :meth:`overlaps`,
      :meth:`overlap_threads`, :meth:`make_lane`, :meth:`delayed_warmup`,
      :meth:`speculative_mode`, :meth:`speculation_refused` (defaults: no check, fp32
      gradients, a serial step, no lane, no delayed or speculative step);
    * where states live: :meth:`empty` (host buffers), ``capabilities``, and :meth:`plan`,
      which must set ``masters`` (one fp32 tensor per sub-group, each with its ``.grad``),
      ``unit_masters`` and ``layout``, then call :meth:`start_movement`; with states out of
      memory between uses, ``export`` / ``import_`` (the base's bring them in through
      ``acquire`` / ``release``);
    * the order of the step: :meth:`sub_group_loop` calls ``step_one(k)`` for each sub-group
      (the nvme tier reads ahead and writes behind around it, and calls
      :meth:`publish_done` before a master leaves memory).

    What a subclass (and :mod:`.delayed`, :mod:`.speculative`) may read: ``layout``,
    ``masters``, ``unit_masters``, ``ranges`` (each sub-group's [start, end) in the rank's
    master numbering), ``grad_at``, ``sub_group_of``, ``lane`` / ``lane_groups``, ``cuda``,
    ``train_device``, the ``d2h`` / ``h2d`` streams, :meth:`pieces`, :meth:`step_worker`,
    :meth:`run_in_background`, :meth:`step_sub_group` and :meth:`publish_master`. Names with
    a leading underscore are this class's own.

    The ways it works are objects decided once (:mod:`.stepping`): ``copies``,
    ``publisher`` and ``landing`` in :meth:`start_movement`; ``sub_group_step`` and
    ``schedule`` once the optimizer is known (``prepare``, else :meth:`decide_step` at the
    first step).
    """

    #: the GPU lane (gpu_lane.py) that steps a share of the sub-groups, when ``make_lane`` made one
    lane = None
    _worker: ThreadPoolExecutor | None = None   # the step worker (step_worker())
    _future = None                              # the step in flight (None: nothing pending)
    _speculate = staticmethod(_no_speculation)  # the speculative step's request (prepare sets it)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(offloaded=True, in_memory=True, granularity=GRANULARITY,
                                publish_optional=self.delayed_warmup() is None)

    # -- what a subclass decides ----------------------------------------------------------
    def check_memory(self, nbytes: int, what: str) -> None:
        """Raise a clear error now if ``nbytes`` of host memory (for ``what``) do not fit."""

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradient shard in host memory."""
        return torch.float32

    def overlaps(self) -> bool:
        """Whether the step may run on a worker thread after step() returns."""
        return False

    def overlap_threads(self) -> int | None:
        return None

    def make_lane(self, optimizer, ranges, fused: bool) -> None:
        """Decide, once, which sub-groups the GPU lane steps (the cpu tier has one)."""

    def delayed_warmup(self) -> int | None:
        """Exact steps before the one-step delayed update (:mod:`.delayed`); None: always exact."""
        return None

    def speculative_mode(self, device: torch.device) -> bool | str:
        """``speculative_step`` on training ``device`` (:mod:`.speculative`): True, "auto" or
        False (never)."""
        return False

    def speculation_refused(self, why: str) -> None:
        """``speculative_step`` cannot run here (``why``); the step stays exact and serial."""

    # -- plan --------------------------------------------------------------------------------
    def plan(self, layout) -> None:
        self.layout = layout
        if self.kind != "optimizer":
            return
        total = sum(sg.numel for sg in layout.sub_groups)
        # fp32 master + gradient here, and the optimizer's states created beside them (Adam's
        # two moments: 8 bytes in fp32, fewer as the optimizer declares: optimizer.state_dtype)
        gdt = self.grad_dtype()
        gb = torch.finfo(gdt).bits // 8
        sb = optimizer_state_bytes(self.run, self.device)
        # the delayed update: a second gradient buffer and the step's model-dtype copy
        delayed = gb + torch.finfo(layout.param_dtype).bits // 8 if self.delayed_warmup() is not None else 0
        extra = f" + delayed update {delayed}" if delayed else ""
        self.check_memory(int((4 + gb + sb + delayed) * total),
                          f"{total:,} fp32 master elements: master 4 + gradient {gb} + optimizer states "
                          f"{sb:g}{extra} bytes each")
        self.master_flat = self.empty(total, torch.float32)
        self.grad_flat = self.empty(total, gdt)
        self.grad_flat.zero_()
        for u in layout.units:
            self.unit_masters[u.index] = self.master_flat[u.start:u.start + u.numel]
            self.unit_masters[u.index].copy_(u.shard)
        self.masters = []
        for sg in layout.sub_groups:
            t = self.master_flat[sg.start:sg.end]
            set_grad(t, self.grad_flat[sg.start:sg.end])
            self.masters.append(t)
        self.start_movement()

    def start_movement(self) -> None:
        """The streams and bookkeeping of the step (after masters exist)."""
        layout = self.layout
        self.train_device = layout.device
        self.cuda = self.train_device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.train_device)
            self.h2d = torch.cuda.Stream(self.train_device)
        self.ranges = [(sg.start, sg.end) for sg in layout.sub_groups]
        self.sub_group_of: dict[int, int] = {}      # unit -> its sub-group (units with elements here)
        self.grad_at: dict[int, tuple[int, int]] = {}   # unit -> its gradient's [a, b) in the numbering
        for k, sg in enumerate(layout.sub_groups):
            for i in sg.units:
                u = layout.units[i]
                self.grad_at[u.index] = (u.start, u.start + u.numel)
                if u.numel:      # an empty shard on this rank belongs to no sub-group
                    self.sub_group_of[u.index] = k
        self.staging: list[torch.Tensor] = []        # device fp32 chunk (master copied, then cast)
        self.host_staging: list[torch.Tensor] = []   # host model-dtype ring (written by step_group)
        self.events: dict = {}
        self._future = None                        # the step in flight (None: nothing pending)
        self._stepped: list[threading.Event] = []  # set when sub-group k is stepped and published
        self._uploaded: dict[int, object] = {}     # k -> CUDA event of its H2D (device shards)
        self.overlapped_steps = 0                  # a statistic for tests and benchmarks
        self.lane = None                           # the GPU lane (gpu_lane.py), made by prepare
        self.lane_groups: set[int] = set()         # sub-groups it steps
        self._decided = False                      # the lane, sub-group step and schedule
        self.delayed = DelayedUpdate(self) if self.delayed_warmup() is not None else None
        self.speculation: Speculation | None = None    # made by prepare when speculative_step allows
        self._landed = _nothing                    # the speculation's count of landed units
        self._lane_sync = _nothing
        self._follow_up = NO_FOLLOW_UP             # of the step in flight (delayed update)
        # how it copies, publishes and lands gradients (stepping.py)
        self.copies = COPIES.pick(self)(self)
        self.publisher = PUBLISHERS.pick(self)(self)
        self.landing = LANDINGS.pick(self)(self)
        self.sub_group_step = None                 # and how it steps, once the optimizer is known
        self.schedule = _Undecided(self)

    def lp_on_device(self, a: int, b: int) -> bool:
        """Whether the model-dtype shards of master elements [a, b) are on the training device."""
        return all(u.shard.device.type != "cpu" for u, _, _, _ in self.pieces(a, b))

    # -- backward: one unit's reduced gradient -----------------------------------------
    def grad_ready(self, unit, src, accumulate) -> None:
        k = self.sub_group_of.get(unit)
        if k is None:       # no elements on this rank
            return
        self._land(k, unit, src, accumulate)
        self._landed(k)

    def _land(self, k: int, unit, src, accumulate) -> None:
        a, b = self.grad_at[unit]
        base = self.ranges[k][0]
        landing = self.landing
        dst = landing.buffer(k)[a - base:b - base]
        self._wait_host(k)                  # the previous step has read this gradient buffer
        if src is None:
            dst.zero_()
        else:
            landing.before_copy(k)          # ... and the GPU lane's H2D of it is done
            self.copies.grad(dst, src, accumulate)
        landing.released(unit)              # the backward is done with this unit's shard

    def grads_landed(self) -> None:
        self.copies.grads_landed()

    # -- the step, sub-group by sub-group ---------------------------------------------
    def prepare(self, optimizer) -> None:
        """Decide the GPU lane and allocate every optimizer state inside ``initialize``.

        Note: created lazily, Adam's moments (8 bytes per element: 11 GB for 1.3B, the
        lane's share page-locked) made the first step several times slower than the next.
        The host ring the fused step writes the model-dtype copy into is allocated here too."""
        if self.kind != "optimizer" or self._decided:
            return
        self._decided = True
        fused = isinstance(optimizer, SubGroupOptimizer) and self.layout.shards_in_memory
        self.make_lane(optimizer, self.ranges, fused)
        on_host = [k for k in range(len(self.ranges)) if k not in self.lane_groups]
        for k in range(len(self.ranges)):
            if k in self.lane_groups:
                for p in optimizer.param_groups[k]["params"]:
                    self.lane.states(optimizer.state, p)
            else:
                init_group_states(optimizer, k)
        self._prepare_speculation(optimizer, fused)
        self._choose(optimizer)
        self.sub_group_step.prepare(on_host)    # (the fused step's host ring)

    def decide_step(self, optimizer) -> None:
        """At the first step of a tier whose ``prepare`` did not run: the GPU lane, then how
        the tier steps (no speculation)."""
        self._decided = True
        fused = isinstance(optimizer, SubGroupOptimizer) and self.layout.shards_in_memory
        self.make_lane(optimizer, self.ranges, fused)
        self._choose(optimizer)

    def _choose(self, optimizer) -> None:
        """How the step runs, from the lane and speculation decided for ``optimizer``."""
        self.sub_group_step = SUB_GROUP_STEPS.pick(self, optimizer)(self, optimizer)
        self.landing = LANDINGS.pick(self)(self)
        self.schedule = choose_schedule(self, optimizer)
        if self.lane is not None:
            self._lane_sync = self.lane.synchronize
        if self.speculation is not None:
            self._speculate, self._landed = self.speculation.request, self.speculation.landed

    def _prepare_speculation(self, optimizer, fused: bool) -> None:
        mode = self.speculative_mode(self.train_device)
        if not mode:
            return
        why = None
        if self.delayed is not None:
            why = "not with delayed_update (its step already runs beside the next forward and backward)"
        elif not (fused and takes_grad_scale(optimizer)):
            why = ("it needs optimizer cpu_adam (or auto), and parameters in memory (not on an nvme tier "
                   "that keeps them out of memory)")
        if why is not None:
            if mode is True:
                self.speculation_refused(why)
            return
        self.speculation = Speculation(self, mode)

    # -- the speculative step (speculative.py) ----------------------------------------------
    def speculate(self, optimizer, loss_scale) -> bool:
        return self._speculate(optimizer, loss_scale)

    def grads_final(self, k: int) -> None:
        """Sub-group k's gradients of this window are all here (or on their way, on d2h)."""
        if k in self.lane_groups:
            return
        # Note: every copy into k was queued on d2h (or was synchronous): an event there
        # after them also follows the backward work that wrote k's gradients and read its
        # parameters, so k's new values may go up once it is done.
        self.speculation.final(k, self.copies.grads_event())

    def publish_finished(self) -> None:
        """The current stream's later work follows every upload queued so far."""
        self.copies.compute_after_uploads()

    def step(self, optimizer, grad_multiplier: float = 1.0) -> None:
        self.copies.uploads_after_compute()
        self.schedule.step(optimizer, grad_multiplier)

    def step_sub_group(self, optimizer, k: int, mult: float, threads):
        """Step sub-group k with gradient multiplier ``mult`` and publish it; returns the CUDA
        event of its upload from the host ring, if it went through one (else None)."""
        return self.sub_group_step.step(optimizer, k, mult, threads)

    def sub_group_loop(self, optimizer, step_one, order: list[int]) -> None:
        """Step the sub-groups in ``order`` (the nvme tier reads ahead and writes behind)."""
        for k in order:
            step_one(k)

    # -- the overlapped step ------------------------------------------------------------
    def step_worker(self) -> ThreadPoolExecutor:
        """The one thread that runs steps off the training loop (overlapped or delayed)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="zeroplug-cpu-step")
        return self._worker

    def run_in_background(self, run, stepped: list[threading.Event], uploaded: dict, follow_up=None) -> None:
        """Run ``run`` (a step) on :meth:`step_worker` and return: from now on ``wait(k)`` and
        ``ready(k)`` follow ``stepped[k]`` (set once sub-group k's shards hold their new values)
        and ``uploaded[k]`` (the CUDA event of their upload, if any; ``run`` may add to it), and
        ``wait_all()`` / ``in_flight()`` follow ``run`` itself. ``follow_up``: an object whose
        ``before_wait()`` and ``after_wait()`` ``wait_all`` calls around its wait (the latter
        once the step succeeded and its uploads are ordered)."""
        self._stepped, self._uploaded = stepped, uploaded
        self._follow_up = follow_up if follow_up is not None else NO_FOLLOW_UP
        self._future = self.step_worker().submit(run)

    def _wait_host(self, k: int) -> None:
        fut = self._future
        if fut is None:
            return
        while not self._stepped[k].wait(0.5):
            if fut.done():          # the step failed before reaching k
                self.wait_all()

    def wait(self, k: int) -> None:
        if self._future is None:
            return
        self._wait_host(k)
        self.copies.compute_after(self._uploaded.get(k))

    def ready(self, k: int) -> bool:
        return self._future is None or self._stepped[k].is_set()

    def wait_all(self) -> None:
        fut, self._future = self._future, None
        if fut is None:
            return
        follow_up, self._follow_up = self._follow_up, NO_FOLLOW_UP
        follow_up.before_wait()
        try:
            fut.result()
        except BaseException as exc:
            # the step ran on after engine.step() returned: the engine learns here that it
            # failed part-way (RunContext.failed), and refuses to go on or to save
            run = self.run
            run.failed = run.failed or f"the overlapped optimizer step failed ({type(exc).__name__}: {exc})"
            raise
        finally:
            self._lane_sync()
        self.copies.compute_after_uploads()
        follow_up.after_wait()

    def in_flight(self) -> bool:
        return self._future is not None

    # -- publishing ------------------------------------------------------------------------
    def pieces(self, a: int, b: int):
        """(unit, unit offset x, unit offset y, master offset) for master range [a, b)."""
        for u in self.layout.units:
            x, y = max(a, u.start), min(b, u.start + u.numel)
            if x < y:
                yield u, x - u.start, y - u.start, x - a

    def _staging(self) -> torch.Tensor:
        """The device buffer an optimizer without a fused copy (torch's Adam on the CPU)
        publishes through, one chunk at a time.

        Note: a chunk, not a sub-group: with DeepSpeed's default sub_group_size (1e9) a
        whole-sub-group fp32 ring held 8 GB of GPU memory. The copy and the cast run in
        order on the h2d stream, so one buffer is reused safely."""
        size = min(PUBLISH_CHUNK, max(b - a for a, b in self.ranges))
        if not self.staging:
            self.staging.append(torch.empty(size, dtype=torch.float32, device=self.train_device))
        return self.staging[0]

    def publish(self, k: int, optimizer) -> None:
        self.publish_master(self.masters[k], self.ranges[k][0], k)

    def publish_master(self, master: torch.Tensor, a: int, k: int) -> None:
        """Master elements [a, a + numel) into the model-dtype shards of their units."""
        self.publisher.publish(master, a, k)

    def publish_chunks(self, master: torch.Tensor, a: int, b: int) -> None:
        """Master elements [a, b) through the staging buffer into their shards, in chunks."""
        buf = self._staging()
        for s in range(0, b - a, buf.numel()):
            e = min(b - a, s + buf.numel())
            src = buf[:e - s]
            src.copy_(master[s:e], non_blocking=True)
            self.publisher.scatter(src, a + s, a + e)

    def publish_done(self, k: int) -> None:
        """Block until sub-group k's upload no longer reads its host master."""
        event = self.events.pop(k, None)
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        super().close()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
