"""The overlapped CPU-offload path: used when the optimizer's masters live off the
training device (``[offload.optimizer] plugin = "cpu"``).

Timeline of one step on a GPU::

    backward  |== grads of unit k reduced ==>| norm^2 (GPU) | D2H (side stream) into pinned bf16 or fp32 |
    step      wait D2H | CPU steps sub-group 0 | sub-group 1 | ... |
    publish              | H2D sub-group 0 (side stream) + cast into bf16 shards | 1 | ...
    next forward waits (GPU-side only) for the last H2D
    GPU lane  a share of the sub-groups streamed through torch's fused AdamW (gpu_lane.py),
              queued before the CPU starts, so both lanes step at once

The gradient shard is in the model dtype where that is exact (partitioner._host_grad_dtype).

Note: the global gradient norm (clipping) and the overflow flag need every gradient,
so the CPU step starts after backward: the "safe overlap" of issue D. Stepping
sub-groups during backward would mean speculating that the step is not clipped and
not overflowed, keeping the pre-step states to redo the step when it is (one more
copy of master, m and v: 12 bytes per element). How often the speculation would hold
on the benchmark workload was not measured (a char-level run's norm fell below 1.0
after about 40 steps). Not done.

Note: the next forward does not wait for the whole step (stage 3, ``overlap_step``):
the CPU steps sub-groups in forward order on a worker thread and engine.step()
returns at once. A unit is gathered only after its sub-group is stepped and
published, a gradient is copied into a sub-group's buffer only after that sub-group
has stepped, and anything else that reads the states (checkpoints, offload_states,
gathered_params, the next engine.step) waits for the whole step first. Every value
is the one the serial step computes; only the time at which it is ready moves. Below
stage 3 there is no per-unit hook to wait at, so the step finishes inside engine.step().

Note: on a CPU-only run the same code runs with synchronous copies, which is how CI
tests it against the in-memory path (overlapped steps included).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch


class OffloadPath:
    def __init__(self, part):
        self.part = part
        self.device = part.device
        self.cuda = self.device.type == "cuda"
        self.gpu_norm = part.run.config.batch.gradient_accumulation_steps == 1
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        # master offset of each unit, to map a sub-group's master range onto unit shards
        self.unit_offsets, off = [], 0
        for u in part.units:
            self.unit_offsets.append(off)
            off += u.hi - u.lo
        self.staging: list[torch.Tensor] = []        # device fp32 ring (master copied, then cast)
        self.host_staging: list[torch.Tensor] = []   # host model-dtype ring (written by step_param)
        self.events: dict[int, torch.cuda.Event] = {}
        # the overlapped step: which sub-group each unit's master lies in, and its progress
        self.sub_group_of: dict[int, int] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._future = None                        # the step in flight (None: nothing pending)
        self._stepped: list[threading.Event] = []  # set when sub-group k is stepped and published
        self._uploaded: dict[int, object] = {}     # k -> CUDA event of its H2D (device shards)
        self.overlapped_steps = 0                  # a statistic for tests and benchmarks
        self.lane = None                           # the GPU lane (gpu_lane.py), made at the first step
        self.lane_groups: set[int] = set()         # sub-groups it steps
        self._lane_decided = False

    def _gpu_step_ratio(self) -> float:
        o = self.part.offload_optimizer.options
        r = getattr(o, "gpu_step_ratio", 0.0)
        if r == "auto":
            # Note: measured on the H100 machine, the lane pays beside the overlapped stage-3
            # step (1.3B: 0.506 against 0.573 s in one call). In the serial stage-2 step the
            # CPU kernel's 16 threads already fill host memory bandwidth: 0.485 -> 0.529 s.
            # The rule looks at the stage and its per-unit hooks, not at overlap_step itself,
            # so that switching overlap_step never changes which lane steps what (values stay
            # bit-identical between the overlapped and the serial step).
            from zeroplug.plugins.offload_cpu import AUTO_GPU_STEP_RATIO
            staged = bool(getattr(self.part, "units_of_module", None))
            return AUTO_GPU_STEP_RATIO if self.cuda and staged else 0.0
        return float(r)

    def _make_lane(self, optimizer, ranges, fused: bool) -> None:
        """Decide, once, which sub-groups the GPU lane steps (see gpu_lane.py)."""
        import logging

        from .gpu_lane import GPULane, assign
        ratio = self._gpu_step_ratio()
        tier = self.part.offload_optimizer
        why = None
        if ratio <= 0:
            return
        if not fused or not all(g.get("bias_correction", False) for g in optimizer.param_groups):
            why = ("it needs optimizer cpu_adam (or auto) with bias_correction = true, and parameters "
                   "not on nvme")
        elif self.cuda and not (tier.options.pin_memory and getattr(self.part.offload_param.options,
                                                                       "pin_memory", True)):
            why = "it needs pin_memory = true (asynchronous copies)"
        if why is not None:
            if self.part.run.rank == 0:
                logging.getLogger("zeroplug").warning(
                    "[zeroplug] offload.optimizer.gpu_step_ratio = %s ignored: %s", ratio, why)
            return
        self.lane_groups = assign([b - a for a, b in ranges], ratio)
        if not self.lane_groups:
            return
        largest = max(ranges[k][1] - ranges[k][0] for k in self.lane_groups)
        self.lane = GPULane(self, tier.options.gpu_step_chunk, largest)
        if self.part.run.rank == 0:
            n = sum(ranges[k][1] - ranges[k][0] for k in self.lane_groups)
            logging.getLogger("zeroplug").info(
                "[zeroplug] offload.optimizer: the GPU steps %d of %d sub-groups (%.0f%% of %d elements; "
                "%.2f GiB of chunk buffers), cpu_adam the rest", len(self.lane_groups), len(ranges),
                100.0 * n / max(1, ranges[-1][1]), ranges[-1][1], self.lane.gpu_bytes() / 2**30)

    def lp_on_device(self, a: int, b: int) -> bool:
        """Whether the model-dtype shards of master elements [a, b) are on the training device."""
        return all(u.shard.device.type != "cpu" for u, _, _, _ in self._pieces(a, b))

    # -- backward: one unit's reduced gradient -----------------------------------------
    def grad_ready(self, u, src: torch.Tensor, first_micro: bool) -> None:
        """``src``: this rank's reduced gradient shard of unit ``u`` on the device."""
        self.wait_unit(u, device=False)     # the previous step has read this gradient buffer
        dst = u.master.grad
        if self.lane is not None and self.cuda:     # ... and the GPU lane's H2D of it is done
            self.lane.order_after(self.sub_group_of_unit(u), self.d2h)
        if first_micro and self.gpu_norm:
            self.norm_sq += src.float().pow(2).sum()
        if not self.cuda:
            if first_micro:
                dst.copy_(src)
            else:
                dst.add_(src)
            return
        if not first_micro:     # accumulation: rare path, synchronous
            dst.add_(src.to("cpu", torch.float32))
            return
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.d2h)     # the allocator keeps src until the copy is done

    def wait_grads(self) -> None:
        if self.cuda:
            self.d2h.synchronize()

    def take_norm_sq(self) -> torch.Tensor | None:
        """The squared norm accumulated on the device during backward (None: compute on host)."""
        if not self.gpu_norm:
            return None
        out, self.norm_sq = self.norm_sq, torch.zeros_like(self.norm_sq)
        return out

    # -- the step, sub-group by sub-group ---------------------------------------------
    def step(self, optimizer, ranges: list[tuple[int, int]]) -> None:
        groups = optimizer.param_groups
        masters = self.part.master_params()
        # Note: an optimizer with step_param (cpu_adam) writes the model-dtype copy in its
        # own pass: straight into host shards, or into a pinned staging buffer that goes
        # up at 2 bytes per element; otherwise the fp32 master is copied and cast.
        fused = hasattr(optimizer, "step_param") and getattr(self.part, "pswap", None) is None
        mult = optimizer.grad_multiplier() if fused else 1.0
        overlapped = fused and self.part.swap is None and self.part.can_overlap_step()
        threads = self.overlap_threads() if overlapped else None
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        if self.part.swap is None and not self._lane_decided:
            self._lane_decided = True
            self._make_lane(optimizer, ranges, fused)
        lane = self.lane_groups      # empty unless a lane was made (fused, no swap)
        for k in sorted(lane):      # queued first: the GPU works while the CPU steps the rest
            self.lane.enqueue(optimizer, k, masters[k], ranges[k][0], mult)
        cpu_groups = [k for k in range(len(ranges)) if k not in lane]

        def step_one(k: int) -> None:
            a, b = ranges[k]
            if fused:
                lp = self._lp_target(k, a, b)
                optimizer.step_param(masters[k], lp_out=lp, grad_scale=mult, threads=threads)
                if not isinstance(lp, list):
                    self._upload(lp, a, b, k)
                return
            optimizer.param_groups = [groups[k]]      # step this sub-group only
            try:
                optimizer.step()
            finally:
                optimizer.param_groups = groups
            self.publish(masters[k], a, k)

        if self.part.swap is not None:
            self.part.swap.step(optimizer, step_one, self.publish_done)
        elif overlapped:
            self._start_overlapped(step_one, ranges, cpu_groups, lane)
            return
        else:
            for k in cpu_groups:
                step_one(k)
        if lane:
            self.lane.synchronize()     # host readers of the states may come next
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    # -- the overlapped step ------------------------------------------------------------
    def overlap_threads(self) -> int:
        """The step's kernel threads while the training loop runs beside it.

        Note: a kernel with one OpenMP thread per core, next to a busy training-loop thread,
        runs at the pace of its preempted thread at every barrier: measured 0.57 s instead
        of 0.35 s for the 1.3B step on the H100 machine. One core is left to the loop."""
        n = getattr(self.part.offload_optimizer.options, "overlap_step_threads", 0)
        return n or max(1, torch.get_num_threads() - 1)

    def sub_group_of_unit(self, u) -> int | None:
        if not self.sub_group_of:
            ranges = self.part.sub_group_ranges
            for v, off in zip(self.part.units, self.unit_offsets):
                if v.hi > v.lo:     # an empty shard on this rank belongs to no sub-group
                    self.sub_group_of[v.index] = next(k for k, (a, b) in enumerate(ranges) if a <= off < b)
        return self.sub_group_of.get(u.index)

    def _start_overlapped(self, step_one, ranges, cpu_groups, lane) -> None:
        self.sub_group_of_unit(self.part.units[0])      # the map, built once
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="zeroplug-cpu-step")
        self._stepped = [threading.Event() for _ in ranges]
        self._uploaded = {k: self.lane.events[k] for k in lane if k in self.lane.events}
        for k in lane:
            self._stepped[k].set()      # queued on the GPU: waiting is the device's business

        def run() -> None:
            for k in cpu_groups:
                step_one(k)
                if self.cuda:
                    ev = self.events.get(("staging", k % 2))
                    if ev is not None:
                        self._uploaded[k] = ev
                self._stepped[k].set()

        self._future = self._worker.submit(run)
        self.overlapped_steps += 1

    def wait_unit(self, u, device: bool = True) -> None:
        """Unit ``u``'s sub-group is stepped and (``device``) its upload ordered before the
        current stream's next work. Returns at once when no step is in flight."""
        fut = self._future
        if fut is None:
            return
        k = self.sub_group_of.get(u.index)
        if k is None:
            return
        while not self._stepped[k].wait(0.5):
            if fut.done():          # the step failed before reaching k
                self.wait_all()
        if device and self.cuda:
            ev = self._uploaded.get(k)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)

    def unit_ready(self, u) -> bool:
        """No wait needed before gathering ``u`` (for prefetching without blocking)."""
        k = self.sub_group_of.get(u.index)
        return self._future is None or k is None or self._stepped[k].is_set()

    def wait_all(self) -> None:
        """The step in flight is finished (its error, if any, raised here)."""
        fut, self._future = self._future, None
        if fut is None:
            return
        try:
            fut.result()
        except BaseException as exc:
            # the step ran on after engine.step() returned: the engine learns here that it
            # failed part-way (RunContext.failed), and refuses to go on or to save
            run = self.part.run
            run.failed = run.failed or f"the overlapped optimizer step failed ({type(exc).__name__}: {exc})"
            raise
        finally:
            if self.lane is not None:
                self.lane.synchronize()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    @property
    def pending(self) -> bool:
        return self._future is not None

    def _pieces(self, a: int, b: int):
        """(unit, unit offset x, unit offset y, master offset) for master range [a, b)."""
        for u, off in zip(self.part.units, self.unit_offsets):
            x, y = max(a, off), min(b, off + u.hi - u.lo)
            if x < y:
                yield u, x - off, y - off, x - a

    def _lp_target(self, k: int, a: int, b: int):
        """Where sub-group k's model-dtype values go: the host shards themselves (a list of
        slices), or the staging buffer its upload reads (a tensor)."""
        if not self.lp_on_device(a, b):
            return [u.shard[x:y] for u, x, y, _ in self._pieces(a, b)]
        size = max(hi - lo for lo, hi in self.part.sub_group_ranges)
        while len(self.host_staging) < 2:
            self.host_staging.append(self.part.offload_optimizer.empty(size, self.part.pdtype))
        prev = self.events.pop(("staging", k % 2), None)
        if prev is not None:
            prev.synchronize()       # the upload of sub-group k - 2 read this buffer
        return self.host_staging[k % 2][:b - a]

    def _upload(self, src: torch.Tensor, a: int, b: int, k: int) -> None:
        with torch.cuda.stream(self.h2d):
            for u, x, y, s in self._pieces(a, b):
                u.shard[x:y].copy_(src[s:s + y - x], non_blocking=True)
            self.events[("staging", k % 2)] = self.h2d.record_event()

    def _staging(self, k: int, n: int) -> torch.Tensor:
        size = max(b - a for a, b in self.part.sub_group_ranges)
        while len(self.staging) < 2:
            self.staging.append(torch.empty(size, dtype=torch.float32, device=self.device))
        return self.staging[k % 2][:n]

    def publish(self, master: torch.Tensor, a: int, k: int) -> None:
        """Master elements [a, a + numel) into the model-dtype shards of their units."""
        b = a + master.numel()
        if self.cuda and self.part.units[0].shard.device.type == "cuda":
            with torch.cuda.stream(self.h2d):
                src = self._staging(k, b - a)
                src.copy_(master, non_blocking=True)
                self._scatter(src, a, b)
                self.events[k] = self.h2d.record_event()
        else:
            self._scatter(master, a, b)

    def publish_done(self, k: int) -> None:
        """Block until sub-group k's upload no longer reads its host master."""
        event = self.events.pop(k, None)
        if event is not None:
            event.synchronize()

    def _scatter(self, src: torch.Tensor, a: int, b: int) -> None:
        pswap = getattr(self.part, "pswap", None)
        for u, x, y, s in self._pieces(a, b):
            if pswap is None:
                u.shard[x:y].copy_(src[s:s + y - x])
                continue
            with pswap.writing(u):      # a shard on NVMe: fill a host copy, write it back
                u.shard[x:y].copy_(src[s:s + y - x])
