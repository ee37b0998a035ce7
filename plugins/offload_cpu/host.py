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
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zeroplug.flat import set_grad
from zeroplug.slots import takes_grad_scale
from zeroplug.tiers import (
    OffloadTier, SubGroupOptimizer, TierCapabilities, init_group_states, optimizer_state_bytes, step_group,
)

from .delayed import DelayedUpdate
from .speculative import Speculation

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
    """

    #: the GPU lane (gpu_lane.py) that steps a share of the sub-groups, when ``make_lane`` made one
    lane = None
    _worker: ThreadPoolExecutor | None = None   # the step worker (step_worker())
    _future = None                              # the step in flight (None: nothing pending)

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
        self._lane_decided = False
        self.delayed = DelayedUpdate(self) if self.delayed_warmup() is not None else None
        self.speculation: Speculation | None = None    # made by prepare when speculative_step allows

    def lp_on_device(self, a: int, b: int) -> bool:
        """Whether the model-dtype shards of master elements [a, b) are on the training device."""
        return all(u.shard.device.type != "cpu" for u, _, _, _ in self.pieces(a, b))

    # -- backward: one unit's reduced gradient -----------------------------------------
    def grad_ready(self, unit, src, accumulate) -> None:
        k = self.sub_group_of.get(unit)
        if k is None:       # no elements on this rank
            return
        self._land(k, unit, src, accumulate)
        if self.speculation is not None:
            self.speculation.landed(k)

    def _land(self, k: int, unit, src, accumulate) -> None:
        a, b = self.grad_at[unit]
        base = self.ranges[k][0]
        live = self.delayed is not None and self.delayed.live
        grads = self.delayed.landing(k) if self.delayed is not None else self.masters[k].grad
        dst = grads[a - base:b - base]
        self._wait_host(k)                  # the previous step has read this gradient buffer
        if src is None:
            dst.zero_()
            if live:
                self.delayed.released(unit)
            return
        if self.lane is not None and self.cuda and not live:   # ... and the GPU lane's H2D of it is done
            self.lane.order_after(k, self.d2h)
        if not self.cuda:
            if accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)
        elif accumulate:          # accumulation: rare path, synchronous
            dst.add_(src.to("cpu", torch.float32))
        else:
            self.d2h.wait_stream(torch.cuda.current_stream(self.train_device))
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
            src.record_stream(self.d2h)     # the allocator keeps src until the copy is done
        if live:
            self.delayed.released(unit)     # the backward is done with this unit's shard

    def grads_landed(self) -> None:
        if self.cuda:
            self.d2h.synchronize()

    # -- the step, sub-group by sub-group ---------------------------------------------
    def prepare(self, optimizer) -> None:
        """Decide the GPU lane and allocate every optimizer state inside ``initialize``.

        Note: created lazily, Adam's moments (8 bytes per element: 11 GB for 1.3B, the
        lane's share page-locked) made the first step several times slower than the next.
        The host ring the fused step writes the model-dtype copy into is allocated here too."""
        if self.kind != "optimizer" or self._lane_decided:
            return
        self._lane_decided = True
        fused = isinstance(optimizer, SubGroupOptimizer) and self.layout.shards_in_memory
        self.make_lane(optimizer, self.ranges, fused)
        on_host = [k for k in range(len(self.ranges)) if k not in self.lane_groups]
        for k in range(len(self.ranges)):
            if k in self.lane_groups:
                for p in optimizer.param_groups[k]["params"]:
                    self.lane.states(optimizer.state, p)
            else:
                init_group_states(optimizer, k)
        # Note: page-locking the ring (2 x the largest sub-group: 4 GB at DeepSpeed's
        # sub_group_size 1e9) touches every page, which does not belong in a training step.
        if fused and self.layout.publish and any(self.lp_on_device(*self.ranges[k]) for k in on_host):
            self._host_ring()
        self._prepare_speculation(optimizer, fused)

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
        if self.speculation is None:
            return False
        if loss_scale is None:
            self.speculation.discard()
            return False
        return self.speculation.begin(optimizer, loss_scale)

    def grads_final(self, k: int) -> None:
        """Sub-group k's gradients of this window are all here (or on their way, on d2h)."""
        if k in self.lane_groups:
            return
        # Note: every copy into k was queued on d2h (or was synchronous): an event there
        # after them also follows the backward work that wrote k's gradients and read its
        # parameters, so k's new values may go up once it is done.
        self.speculation.final(k, self.d2h.record_event() if self.cuda else None)

    def publish_finished(self) -> None:
        """The current stream's later work follows every upload queued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.train_device).wait_stream(self.h2d)

    def step(self, optimizer, grad_multiplier: float = 1.0) -> None:
        groups = optimizer.param_groups
        masters = self.masters
        ranges = self.ranges
        fused = isinstance(optimizer, SubGroupOptimizer) and self.layout.shards_in_memory
        mult = grad_multiplier
        overlapped = fused and self.overlaps()
        threads = self.overlap_threads() if overlapped else None
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.train_device))
        if not self._lane_decided:
            self._lane_decided = True
            self.make_lane(optimizer, ranges, fused)
        lane = self.lane_groups      # empty unless a lane was made
        if self.delayed is not None and self.delayed.due(optimizer):
            self.delayed.start(optimizer, fused, mult)
            return
        for k in sorted(lane):      # queued first: the GPU works while the CPU steps the rest
            self.lane.enqueue(groups[k], optimizer.state, k, masters[k], ranges[k][0], mult)
        kept, uploads = [], {}
        if self.speculation is not None:     # what the backward stepped and still holds
            kept, uploads = self.speculation.validate(optimizer, mult)
        cpu_groups = [k for k in range(len(ranges)) if k not in lane and k not in kept]

        def step_one(k: int) -> None:
            self.step_sub_group(optimizer, k, mult, threads)

        if overlapped:
            self._start_overlapped(step_one, cpu_groups, set(lane) | set(kept), uploads)
            return
        self.sub_group_loop(optimizer, step_one, cpu_groups)
        if lane:
            self.lane.synchronize()     # host readers of the states may come next
        if self.cuda:
            torch.cuda.current_stream(self.train_device).wait_stream(self.h2d)

    def step_sub_group(self, optimizer, k: int, mult: float, threads):
        """Step sub-group k with gradient multiplier ``mult`` and publish it; returns the CUDA
        event of its upload from the host ring, if it went through one (else None)."""
        a, b = self.ranges[k]
        if not self.layout.publish:     # the stage gathers from the masters: nothing to write
            step_group(optimizer, k, grad_multiplier=mult, threads=threads)
            return None
        if isinstance(optimizer, SubGroupOptimizer) and self.layout.shards_in_memory:
            # Note: an optimizer with step_group (cpu_adam) writes the model-dtype copy in its
            # own pass: straight into host shards, or into a pinned staging buffer that goes
            # up at 2 bytes per element; otherwise the fp32 master is copied and cast.
            lp = self._lp_target(k, a, b)
            step_group(optimizer, k, lp_out=lp, grad_multiplier=mult, threads=threads)
            if not isinstance(lp, list):
                self._upload(lp, a, b, k)
                return self.events.get(("staging", k % 2))
            return None
        step_group(optimizer, k, grad_multiplier=mult)    # this sub-group only
        self.publish_master(self.masters[k], a, k)
        return None

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

    def run_in_background(self, run, stepped: list[threading.Event], uploaded: dict) -> None:
        """Run ``run`` (a step) on :meth:`step_worker` and return: from now on ``wait(k)`` and
        ``ready(k)`` follow ``stepped[k]`` (set once sub-group k's shards hold their new values)
        and ``uploaded[k]`` (the CUDA event of their upload, if any; ``run`` may add to it), and
        ``wait_all()`` / ``in_flight()`` follow ``run`` itself."""
        self._stepped, self._uploaded = stepped, uploaded
        self._future = self.step_worker().submit(run)

    def _start_overlapped(self, step_one, cpu_groups, done, uploads) -> None:
        """``done``: sub-groups not stepped here (the GPU lane's, queued on the device, and
        those the backward stepped speculatively, with their upload events ``uploads``)."""
        stepped = [threading.Event() for _ in self.ranges]
        lane_events = self.lane.events if self.lane is not None else {}
        uploaded = {k: lane_events[k] for k in done if k in lane_events}
        uploaded.update(uploads)
        for k in done:
            stepped[k].set()      # queued on the GPU, or stepped by the backward's jobs

        def run() -> None:
            for k in cpu_groups:
                step_one(k)
                if self.cuda:
                    ev = self.events.get(("staging", k % 2))
                    if ev is not None:
                        uploaded[k] = ev
                stepped[k].set()

        self.run_in_background(run, stepped, uploaded)
        self.overlapped_steps += 1

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
        if self.cuda:
            ev = self._uploaded.get(k)
            if ev is not None:
                torch.cuda.current_stream(self.train_device).wait_event(ev)

    def ready(self, k: int) -> bool:
        return self._future is None or self._stepped[k].is_set()

    def wait_all(self) -> None:
        fut, self._future = self._future, None
        if fut is None:
            return
        delayed = self.delayed is not None and self.delayed.live
        if delayed:
            self.delayed.live = False
        try:
            fut.result()
        except BaseException as exc:
            # the step ran on after engine.step() returned: the engine learns here that it
            # failed part-way (RunContext.failed), and refuses to go on or to save
            run = self.run
            run.failed = run.failed or f"the overlapped optimizer step failed ({type(exc).__name__}: {exc})"
            raise
        finally:
            if self.lane is not None:
                self.lane.synchronize()
        if self.cuda:
            torch.cuda.current_stream(self.train_device).wait_stream(self.h2d)
        if delayed:
            self.delayed.finish()

    def in_flight(self) -> bool:
        return self._future is not None

    # -- publishing ------------------------------------------------------------------------
    def pieces(self, a: int, b: int):
        """(unit, unit offset x, unit offset y, master offset) for master range [a, b)."""
        for u in self.layout.units:
            x, y = max(a, u.start), min(b, u.start + u.numel)
            if x < y:
                yield u, x - u.start, y - u.start, x - a

    def _lp_target(self, k: int, a: int, b: int):
        """Where sub-group k's model-dtype values go: the host shards themselves (a list of
        slices), or the staging buffer its upload reads (a tensor)."""
        if not self.lp_on_device(a, b):
            return [u.shard[x:y] for u, x, y, _ in self.pieces(a, b)]
        self._host_ring()
        prev = self.events.pop(("staging", k % 2), None)
        if prev is not None:
            prev.synchronize()       # the upload of sub-group k - 2 read this buffer
        return self.host_staging[k % 2][:b - a]

    def _host_ring(self) -> list[torch.Tensor]:
        """The two host model-dtype buffers that a fused step writes and the uploads read, each
        the size of the largest sub-group (allocated by ``prepare``)."""
        size = max(hi - lo for lo, hi in self.ranges)
        while len(self.host_staging) < 2:
            self.host_staging.append(self.empty(size, self.layout.param_dtype))
        return self.host_staging

    def _upload(self, src: torch.Tensor, a: int, b: int, k: int) -> None:
        with torch.cuda.stream(self.h2d):
            for u, x, y, s in self.pieces(a, b):
                u.shard[x:y].copy_(src[s:s + y - x], non_blocking=True)
            self.events[("staging", k % 2)] = self.h2d.record_event()

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
        if not self.layout.publish:
            return
        b = a + master.numel()
        if self.cuda and self.layout.units[0].shard.device.type == "cuda":
            with torch.cuda.stream(self.h2d):
                self.publish_chunks(master, a, b)
                self.events[k] = self.h2d.record_event()
        else:
            self._scatter(master, a, b)

    def publish_chunks(self, master: torch.Tensor, a: int, b: int) -> None:
        """Master elements [a, b) through the staging buffer into their shards, in chunks."""
        buf = self._staging()
        for s in range(0, b - a, buf.numel()):
            e = min(b - a, s + buf.numel())
            src = buf[:e - s]
            src.copy_(master[s:e], non_blocking=True)
            self._scatter(src, a + s, a + e)

    def publish_done(self, k: int) -> None:
        """Block until sub-group k's upload no longer reads its host master."""
        event = self.events.pop(k, None)
        if event is not None:
            event.synchronize()

    def _scatter(self, src: torch.Tensor, a: int, b: int) -> None:
        in_memory = self.layout.shards_in_memory
        for u, x, y, s in self.pieces(a, b):
            if in_memory:
                u.shard[x:y].copy_(src[s:s + y - x])
                continue
            with self.layout.write_shard(u.index) as shard:   # a shard out of memory: filled, written back
                shard[x:y].copy_(src[s:s + y - x])

    def close(self) -> None:
        super().close()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
