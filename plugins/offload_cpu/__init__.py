"""Offload tiers "none" (states stay on the training device) and "cpu" (pinned host memory,
the optimizer step on the CPU: :mod:`.host`, and a share of it on the GPU: :mod:`.gpu_lane`)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug import hookimpl
from zeroplug.errors import ConfigError, HostMemoryError
from zeroplug.flat import mixed_grad_ok
from zeroplug.launch import local_ranks
from zeroplug.observe.memory import GB, host_available_bytes
from zeroplug.options import opt
from zeroplug.tiers import (
    HostBytes, OffloadTier, TierCapabilities, full_precision_states, optimizer_state_bytes, reads_grad_dtype,
)

from .host import GRANULARITY, HostTier

log = logging.getLogger("zeroplug")

#: gpu_step_ratio = "auto" on a GPU: the share that measured best (docs/benchmarks.md)
AUTO_GPU_STEP_RATIO = 0.4


class NoOffload(OffloadTier):
    """States live on the training device, with the model (nothing is offloaded)."""
    @dataclass(frozen=True)
    class Options:
        pass


@dataclass(frozen=True)
class CPUOptions:
    pin_memory: bool = opt(True, "Page-locked host buffers: faster copies, memory others cannot use.")
    gpu_step_ratio: float | Literal["auto"] = opt(
        "auto", "Share of the offloaded optimizer step (in elements) that the GPU computes while the CPU "
                "steps the rest: those sub-groups' states stay in host memory and are streamed H2D, stepped "
                "by torch's fused AdamW and streamed back. 0 = cpu_adam steps everything; \"auto\" = "
                f"{AUTO_GPU_STEP_RATIO} for stage 3 with per-module gathering on a GPU (where the step can overlap the "
                "next forward) with one rank on the host, else 0 (measured: it pays there, not beside the serial "
                "stage-2 step nor beside other ranks' steps on the same host). Needs "
                "cpu_adam and pin_memory.",
        min=0.0, max=1.0)
    gpu_resident_ratio: float = opt(
        0.0, "Share of the optimizer step (in elements) whose fp32 master and Adam moments stay in GPU memory "
             "(allocated in initialize, 12 bytes per element): torch's fused AdamW steps them there, only "
             "the gradient comes H2D and only the model-dtype copy goes out, so they cost no host memory "
             "traffic for the states. DeepSpeed's offload_optimizer `ratio` (the share offloaded) becomes "
             "1 - ratio here. gpu_step_ratio then shares out the other sub-groups. Checkpoints and "
             "offload_states copy these states to the host and back. Needs a CUDA device, cpu_adam and "
             "pin_memory; not with delayed_update. 0 = every state in host memory.",
        min=0.0, max=1.0)
    gpu_step_chunk: int = opt(1 << 23, "Elements per H2D/D2H chunk of the GPU step; three chunk buffers "
                                       "(18-20 bytes per element: 0.5 GB by default) live on the GPU.",
                              min=1 << 10)
    grad_dtype: Literal["auto", "fp32"] = opt(
        "auto", "Dtype of the gradient shard in host memory: \"auto\" = the model's dtype (bf16/fp16) where that "
                "holds the reduced gradient exactly (one rank, or reduce_dtype = the model dtype; no gradient "
                "accumulation; cpu_adam): half the D2H bytes and 2 bytes less host memory traffic per element, the "
                "same values; else fp32.")
    overlap_step: bool = opt(True, "Stage 3: the CPU steps sub-groups on a worker thread while the next "
                                   "forward runs (each unit waits for its own sub-group; the same values "
                                   "as false; docs/benchmarks.md has the step times).")
    overlap_step_threads: int = opt(0, "CPU threads of the overlapped step's kernel; 0 = all of torch's "
                                       "intra-op threads but one, which is left to the training loop.", min=0)
    speculative_step: bool | Literal["auto"] = opt(
        False, "Step each sub-group on the CPU during the backward, as soon as its gradients are final, "
                "guessing that the step neither clips (gradient_clipping) nor overflows (fp16); the step then "
                "keeps those sub-groups, or restores them from a copy taken before and redoes them with the real "
                "factor (or skips). Bit-identical to false either way. Costs a copy of master and optimizer "
                "states (12 bytes per element, read and written before each speculative sub-group step; host "
                "memory for the sub-groups that step during a backward, allocated at their first). "
                "\"auto\" = only on a GPU, not beside the overlapped stage-3 step (overlap_step), and only while the last "
                "4 steps neither clipped nor overflowed; "
                "true = always; false (the default: the copy's traffic cost more than the earlier start gained "
                "on the 4-GPU host, docs/benchmarks.md) = never. Not with delayed_update (ignored, with a warning when true); "
                "the GPU lane's sub-groups step at the step as before. docs/architecture.md, \"Speculative "
                "step\".")
    delayed_update: bool = opt(
        False, "ZeRO-Offload's one-step delayed parameter update: after delayed_update_warmup exact steps, the "
               "CPU step of step t runs during the forward and backward of step t+1, which therefore sees the "
               "parameters of step t-1 (stale by one step; not bit-identical to the exact path). It costs loss, "
               "more on longer runs (docs/benchmarks.md, \"Delayed parameter update\"). Costs one more "
               "host gradient buffer and one host model-dtype copy per element. docs/architecture.md, "
               "\"Delayed parameter update\", has what each forward sees and what a checkpoint holds.")
    delayed_update_warmup: int = opt(40, "Exact optimizer steps (counted by the optimizer's own step count, "
                                         "so a resumed run counts the steps before its checkpoint) before "
                                         "delayed_update starts.", min=0)
    host_memory_limit_gb: float = opt(0.0, "Fail early if this tier would need more host memory than "
                                           "this many GiB; 0 = what the machine has available.", min=0.0)


class CPUOffload(HostTier):
    """States in (pinned) CPU memory; the optimizer steps them there (cpu_adam, or "auto")."""
    Options = CPUOptions

    def __init__(self, options, run, kind):
        super().__init__(options, run, kind)
        self._registered: list[torch.Tensor] = []      # host buffers we page-locked
        self.resident_groups: set[int] = set()         # sub-groups whose states live on the GPU

    @property
    def capabilities(self) -> TierCapabilities:
        # Note: resident sub-groups' host states are stale between steps, so readers go
        # through export / import_, which copy them down and up.
        return TierCapabilities(offloaded=True, in_memory=not self.resident_groups, granularity=GRANULARITY,
                                publish_optional=not self.options.delayed_update)

    def resident_device_ok(self) -> bool:
        """Whether the training device can hold resident states (a GPU)."""
        return self.cuda

    def plan(self, layout) -> None:
        super().plan(layout)
        ratio = self.options.gpu_resident_ratio
        if self.kind != "optimizer" or ratio <= 0:
            return
        from .gpu_lane import assign
        why = None
        if not self.resident_device_ok():
            why = "it needs a CUDA training device (on a CPU the states are in host memory already)"
        elif self.delayed is not None:
            why = "not with delayed_update"
        if why is not None:
            if self.run.rank == 0:
                log.warning("[zeroplug] offload.optimizer.gpu_resident_ratio = %s ignored: %s", ratio, why)
            return
        self.resident_groups = assign([sg.numel for sg in layout.sub_groups], ratio)
        need = 12 * sum(layout.sub_groups[k].numel for k in self.resident_groups)
        free = torch.cuda.mem_get_info(self.train_device)[0] if self.cuda else need
        if need > free:
            raise ConfigError(
                f"offload.optimizer.gpu_resident_ratio = {ratio} keeps {need / GB:.2f} GiB of optimizer states "
                f"on the GPU but only {free / GB:.2f} GiB is free there; lower it (or set 0)")

    def host_bytes(self, numel, param_dtype):
        if numel <= 0:
            return HostBytes()
        psize = torch.empty((), dtype=param_dtype).element_size()
        pinned = self.options.pin_memory and torch.cuda.is_available()
        if self.kind == "param":
            n = psize * numel
            what = f"{numel:,} parameter elements x {psize} bytes"
        else:
            # Note: the gradient shard is in the model dtype only where grad_dtype() will
            # find it exact (one rank, no accumulation, an optimizer that reads it); the
            # layout that decides it does not exist yet, so the rule is applied to the config
            batch = self.run.config.batch
            exact = (self.options.grad_dtype == "auto" and self.run.world_size == 1
                     and batch.gradient_accumulation_steps == 1 and psize < 4 and mixed_grad_ok()
                     and reads_grad_dtype(self.run, param_dtype, torch.device("cpu")))
            gb = psize if exact else 4
            states = optimizer_state_bytes(self.run, torch.device("cpu"))
            delayed = gb + psize if self.options.delayed_update else 0
            per = 4 + gb + states + delayed
            n = int(per * numel)
            what = (f"{numel:,} master elements x {per:g} bytes: master 4 + gradient {gb} + optimizer states "
                    f"{states:g}" + (f" + delayed update {delayed}" if delayed else ""))
        return HostBytes(pinned=n, what=what) if pinned else HostBytes(pageable=n, what=what)

    def check_memory(self, nbytes, what):
        limit = self.options.host_memory_limit_gb * GB or host_available_bytes()
        source = ("offload.%s.host_memory_limit_gb" % self.kind if self.options.host_memory_limit_gb
                  else "available host memory (MemAvailable)")
        pin = "pinned " if self.options.pin_memory and torch.cuda.is_available() else ""
        if self.run.rank == 0:
            log.info("[zeroplug] offload.%s = cpu: %.2f GiB of %shost memory per rank for %s",
                     self.kind, nbytes / GB, pin, what)
        if nbytes > limit:
            raise HostMemoryError(
                f"offload.{self.kind} = \"cpu\" needs {nbytes / GB:.2f} GiB of {pin}host memory per rank "
                f"({what}) but {source} is {limit / GB:.2f} GiB. Use more ranks (the shard shrinks "
                f"with world size), offload to nvme, or raise the limit")

    def grad_dtype(self) -> torch.dtype:
        """The model's dtype where it holds every reduced gradient exactly (``grad_dtype``),
        else fp32.

        Note: with one rank (or a reduction in the model dtype) the reduced gradient is the
        model-dtype gradient itself, so a bf16 shard loses nothing; cpu_adam widens it
        inside its one pass. That is 2 bytes less per element to copy D2H, to write and to
        read again: the offloaded step is bound by host memory traffic."""
        exact = self.layout.exact_grad_dtype
        if (self.options.grad_dtype != "auto" or exact == torch.float32
                or not reads_grad_dtype(self.run, exact, self.device) or not mixed_grad_ok()):
            return torch.float32
        return exact

    def overlaps(self) -> bool:
        return self.options.overlap_step and self.layout.gathers_per_unit and self.layout.shards_in_memory

    def overlap_threads(self) -> int:
        """The step's kernel threads while the training loop runs beside it.

        Note: a kernel with one OpenMP thread per core, next to a busy training-loop thread,
        runs at the pace of its preempted thread at every barrier. One core is left to the
        loop (docs/benchmarks.md)."""
        return self.options.overlap_step_threads or max(1, torch.get_num_threads() - 1)

    def delayed_warmup(self) -> int | None:
        return self.options.delayed_update_warmup if self.options.delayed_update else None

    def speculative_mode(self, device):
        mode = self.options.speculative_step
        if self.kind != "optimizer" or mode is False:
            return False
        if mode == "auto":
            # Note: on a CPU device the backward and the speculative step share the cores,
            # so stepping during the backward only moves the step's time into it. With the
            # overlapped stage-3 step the CPU step already runs beside the next forward, and
            # the backward steps the sub-groups that forward needs last: only the copy's
            # traffic is added (docs/benchmarks.md, the 4-GPU table).
            return "auto" if device.type == "cuda" and not self.overlaps() else False
        return True

    def speculation_refused(self, why):
        if self.run.rank == 0:
            log.warning("[zeroplug] offload.optimizer.speculative_step = true ignored: %s", why)

    def gpu_step_ratio(self) -> float:
        r = self.options.gpu_step_ratio
        if r == "auto":
            # Note: the lane pays beside the overlapped stage-3 step; in the serial stage-2
            # step the CPU kernel's threads already fill host memory bandwidth
            # (docs/benchmarks.md). The rule looks at how the stage gathers, not at
            # overlap_step itself, so that switching overlap_step never changes which lane
            # steps what (values stay bit-identical between the overlapped and the serial step).
            # Note: with several ranks on one host the lane costs speed: their streams share
            # the host's memory bandwidth with every rank's CPU step (docs/benchmarks.md,
            # "Two GPUs under torchrun").
            alone = local_ranks() == 1
            return AUTO_GPU_STEP_RATIO if self.cuda and self.layout.gathers_per_unit and alone else 0.0
        return float(r)

    def make_lane(self, optimizer, ranges, fused: bool) -> None:
        from .gpu_lane import GPULane, assign
        ratio = self.gpu_step_ratio()
        resident = self.resident_groups
        why = None
        if ratio <= 0 and not resident:
            return
        small = not full_precision_states(optimizer)
        auto = self.options.gpu_step_ratio == "auto" and not resident
        if (small or not self.layout.publish) and auto:
            return      # "auto" picks no lane for states it cannot step, nor without shards to write
        if not self.layout.publish:
            why = ("the parameters are gathered from the masters (zero.stage3_params_from_masters): the lane "
                   "writes model-dtype shards")
        elif small:
            why = ("the optimizer holds its states in bf16 or int8 (optimizer.state_dtype), which the GPU lane "
                   "(torch's fused AdamW) does not step")
        elif not fused or not all(g.get("bias_correction", False) for g in optimizer.param_groups):
            why = ("it needs optimizer cpu_adam (or auto) with bias_correction = true, and parameters "
                   "not on nvme")
        elif self.cuda and not (self.options.pin_memory and all(
                u.shard.device.type != "cpu" or u.shard.is_pinned() for u in self.layout.units)):
            why = "it needs pin_memory = true (asynchronous copies)"
        if why is not None:
            if self.run.rank == 0:
                named = [f"gpu_step_ratio = {ratio}"] if ratio else []
                if resident:
                    named.append(f"gpu_resident_ratio = {self.options.gpu_resident_ratio}")
                log.warning("[zeroplug] offload.optimizer.%s ignored: %s", " and ".join(named), why)
            self.resident_groups = set()      # never moved: the host states are current
            return
        sizes = [b - a for a, b in ranges]
        rest = [k for k in range(len(ranges)) if k not in resident]
        streamed = {rest[i] for i in assign([sizes[k] for k in rest], ratio)}
        self.lane_groups = streamed | resident
        if not self.lane_groups:
            return
        largest = max(sizes[k] for k in self.lane_groups)
        self.lane = GPULane(self, self.options.gpu_step_chunk, largest)
        for k in sorted(resident):
            self.lane.make_resident(k, optimizer.state, self.masters[k])
        if self.run.rank == 0:
            total = max(1, ranges[-1][1])
            n = sum(sizes[k] for k in streamed)
            r = sum(sizes[k] for k in resident)
            log.info("[zeroplug] offload.optimizer: the GPU steps %d of %d sub-groups (%.0f%% of %d elements "
                     "streamed, %.2f GiB of chunk buffers; %.0f%% resident, %.2f GiB), cpu_adam the rest",
                     len(self.lane_groups), len(ranges), 100.0 * n / total, ranges[-1][1],
                     self.lane.gpu_bytes() / 2**30, 100.0 * r / total, self.lane.resident_bytes() / 2**30)

    # -- resident sub-groups outside the step --------------------------------------------
    def _resident(self, k: int) -> bool:
        return self.lane is not None and k in self.lane.resident

    @contextmanager
    def export(self, k, optimizer):
        if self._resident(k):
            self.lane.synchronize()
            self.lane.to_host(k, optimizer.state, self.masters[k])
        yield self.masters[k]

    @contextmanager
    def import_(self, k, optimizer):
        yield self.masters[k]
        if self._resident(k):
            self.lane.synchronize()
            self.lane.from_host(k, optimizer.state, self.masters[k])

    def empty(self, numel, dtype):
        t = torch.empty(numel, dtype=dtype, device="cpu")
        # Note: torch's caching pinned allocator rounds every block up to a power of two
        # (a 5.7 GB master becomes 8 GB); page-locking our own exact-size buffer costs
        # only what it holds.
        self.pin(t)
        return t

    def pin(self, t: torch.Tensor) -> None:
        """Page-lock a host tensor's storage (no-op when pinned already or pinning is off)."""
        if not (self.options.pin_memory and torch.cuda.is_available()) or not t.numel() or t.is_pinned():
            return
        base = t.untyped_storage()
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.nbytes(), 0)
        if int(err) != 0:
            raise HostMemoryError(f"offload.{self.kind} = \"cpu\": pinning {base.nbytes() / GB:.2f} GiB failed "
                                  f"(CUDA error {int(err)}); set pin_memory = false or free memory")
        self._registered.append(torch.empty(0, dtype=torch.uint8).set_(base))

    def stash(self, key, data, non_blocking=False):
        if data.device.type == "cpu":
            return False                       # already in host memory
        pin = self.options.pin_memory and torch.cuda.is_available()
        where = torch.empty(data.numel(), dtype=data.dtype, pin_memory=pin)
        # Note: freeing the source right after an async copy on the same stream is safe: the
        # caching allocator hands the block out again only to later work on that stream.
        where.copy_(data, non_blocking=non_blocking and pin)
        self._stash[key] = where
        return True

    def unstash(self, key, out, non_blocking=False):
        where = self._stash.pop(key)
        out.copy_(where, non_blocking=non_blocking and where.is_pinned())

    def close(self):
        super().close()
        while self._registered:
            t = self._registered.pop()
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _resident_lane(engine):
    tier = engine.offload_optimizer
    lane = tier.lane if isinstance(tier, CPUOffload) else None
    return lane if lane is not None and lane.resident else None


@hookimpl
def zeroplug_offload_states(engine, include, device):
    """Resident GPU states leave GPU memory with the states they belong to."""
    lane = _resident_lane(engine)
    if lane is None:
        return
    which = ((0,) if "hp_params" in include else ()) + ((1, 2) if "optim_states" in include else ())
    lane.park(which)


@hookimpl
def zeroplug_reload_states(engine):
    lane = _resident_lane(engine)
    if lane is not None:
        lane.unpark()


@hookimpl
def zeroplug_register_offload_devices(register):
    register("none", NoOffload)
    register("cpu", CPUOffload)
