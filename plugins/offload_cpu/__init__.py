"""Offload tiers "none" (state stays on the training device) and "cpu" (pinned host memory)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug import hookimpl
from zeroplug.errors import HostMemoryError
from zeroplug.memory import GB, host_available_bytes
from zeroplug.options import opt
from zeroplug.slots import OffloadDevice

log = logging.getLogger("zeroplug")

#: gpu_step_ratio = "auto" on a GPU: the share measured best on the H100 machine (docs/benchmarks.md)
AUTO_GPU_STEP_RATIO = 0.4


class NoOffload(OffloadDevice):
    """States live on the training device."""
    @dataclass(frozen=True)
    class Options:
        pass


@dataclass(frozen=True)
class CPUOptions:
    pin_memory: bool = opt(True, "Page-locked host buffers: faster copies, memory others cannot use.")
    ratio: float = opt(1.0, "Fraction of the optimizer state to offload (only 1.0 is supported; see "
                            "gpu_step_ratio for putting the GPU to work on the step).", min=1.0, max=1.0)
    gpu_step_ratio: float | Literal["auto"] = opt(
        "auto", "Share of the offloaded optimizer step (in elements) that the GPU computes while the CPU "
                "steps the rest: those sub-groups' states stay in host memory and are streamed H2D, stepped "
                "by torch's fused AdamW and streamed back. 0 = cpu_adam steps everything; \"auto\" = "
                f"{AUTO_GPU_STEP_RATIO} for stage 3 with per-module gathering on a GPU (where the step can overlap the "
                "next forward), else 0 (measured: it pays there, not beside the serial stage-2 step). Needs "
                "cpu_adam and pin_memory.",
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
                                   "as false). On the H100 machine: 1.3B 0.590 s/step against 0.609-0.645 "
                                   "serial, 2.7B 1.09 s against 1.22 (docs/benchmarks.md).")
    overlap_step_threads: int = opt(0, "CPU threads of the overlapped step's kernel; 0 = all of torch's "
                                       "intra-op threads but one, which is left to the training loop.", min=0)
    host_memory_limit_gb: float = opt(0.0, "Fail early if this tier would need more host memory than "
                                           "this many GiB; 0 = what the machine has available.", min=0.0)


class CPUOffload(OffloadDevice):
    """States in (pinned) CPU memory; the optimizer steps there (cpu_adam with optimizer.plugin = "auto")."""
    Options = CPUOptions

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def offloaded(self) -> bool:
        return True

    def __init__(self, options, run, kind):
        super().__init__(options, run, kind)
        self._registered: list[torch.Tensor] = []      # host buffers we page-locked

    def plan(self, nbytes, what):
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

    def close(self):
        while self._registered:
            t = self._registered.pop()
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())



@hookimpl
def zeroplug_register_offload_devices(register):
    register("none", NoOffload)
    register("cpu", CPUOffload)
