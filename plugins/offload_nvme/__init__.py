"""Offload tier "nvme" (ZeRO-Infinity): states in files on a local NVMe disk.

One options table serves both slots, with DeepSpeed's names (``offload_optimizer`` /
``offload_param`` plus the ``aio`` section, whose keys live in the same table here)::

    [offload.optimizer]            [offload.param]            # zero.plugin = "stage3"
    plugin = "nvme"                plugin = "nvme"
    nvme_path = "/local_nvme"      nvme_path = "/local_nvme"
    buffer_count = 4               buffer_count = 5
    pipeline_read = true           buffer_size = 1e8
    pipeline_write = true          max_in_cpu = 1e9
    block_size = 1048576           queue_depth = 32           # aio keys, either table

Options that belong to one table only (``pipeline_read``, ``pipeline_write``,
``reuse_resident``, ``fast_init``: optimizer; ``max_in_cpu``: param) are rejected in
the other with a message. DeepSpeed's ``single_submit`` / ``overlap_events``
describe libaio's submission; our swapper has one fixed behaviour (each request
submitted on its own as a slot frees, completions overlapping the next submissions:
single_submit = false, overlap_events = true). Those values are accepted silently;
the other values are accepted with a one-line warning that they change nothing.

The tier: :class:`NVMeOffload` (``device`` = cpu; ``empty`` = host tensors;
``plan(...)`` checks buffers, memory and disk before anything is allocated;
``swapper`` = the :class:`~.swapper.AsyncSwapper`, created on first use; ``close``
removes the files).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.memory import GB, host_available_bytes
from zeroplug.options import opt
from zeroplug.slots import OffloadDevice

from .swapper import (ALIGN, AsyncSwapper, SwapError, SwapFuture, SwapIOError, SwapMemoryError,
                      SwapPathError, SwapPlan, SwapSpaceError, clean_stale, plan)

__all__ = ["NVMeOptions", "NVMeOffload", "AsyncSwapper", "SwapFuture", "SwapPlan", "plan", "clean_stale",
           "SwapError", "SwapSpaceError", "SwapPathError", "SwapIOError", "SwapMemoryError"]

log = logging.getLogger("zeroplug")

#: defaults that depend on the table: (optimizer, param)
_DEFAULTS = {"buffer_count": (4, 5), "buffer_size": (None, int(1e8)), "max_in_cpu": (None, int(1e9)),
             "pipeline_read": (True, None), "pipeline_write": (True, None), "fast_init": (True, None),
             "reuse_resident": (True, None)}
_ONLY = {"max_in_cpu": "offload.param", "pipeline_read": "offload.optimizer",
         "pipeline_write": "offload.optimizer", "fast_init": "offload.optimizer",
         "reuse_resident": "offload.optimizer"}


@dataclass(frozen=True)
class NVMeOptions:
    nvme_path: str = opt("", "Directory on a local NVMe disk for the swap files (required). Each run "
                             "uses a private subdirectory there, removed at exit.")
    buffer_count: int | None = opt(None, "Swap buffers (page-aligned; pinned with pin_memory and CUDA), "
                                         "reused in turn. Default 4 for [offload.optimizer], 5 for "
                                         "[offload.param].", min=1)
    buffer_size: int | None = opt(None, "Elements per swap buffer; must hold the largest parameter "
                                        "(param) or sub-group (optimizer). Default 1e8 for [offload.param]; "
                                        "the largest sub-group for [offload.optimizer].", min=1)
    max_in_cpu: int | None = opt(None, "[offload.param] only: parameter elements kept in CPU memory "
                                       "instead of on NVMe (default 1e9).", min=0)
    pin_memory: bool = opt(True, "Page-locked swap buffers (faster host-device copies; only with CUDA).")
    pipeline_read: bool | None = opt(None, "[offload.optimizer] only: read the next sub-group's states "
                                           "while the current one steps (default true).")
    pipeline_write: bool | None = opt(None, "[offload.optimizer] only: write a sub-group's states back "
                                            "while the next one steps (default true).")
    reuse_resident: bool | None = opt(None, "[offload.optimizer] only: keep the sub-groups stepped last in "
                                            "host memory (unwritten) until the next step, which runs in the "
                                            "opposite order and starts with them: saves writing and reading "
                                            "them each step; host memory between steps stays within the "
                                            "step's own peak (default true).")
    fast_init: bool | None = opt(None, "[offload.optimizer] only: zeroplug always creates the optimizer "
                                       "states at the first step (DeepSpeed's fast_init = true); false is "
                                       "accepted with a note, as it changes nothing (default true).")
    block_size: int = opt(1048576, "Bytes per I/O request (DeepSpeed aio.block_size); a multiple of 4096.",
                          min=4096)
    # Note: 32 x 16 measured on the H100 machine's disk (docs/benchmarks.md): 2.74 GB/s write,
    # 2.22 read, against 2.12 / 2.01 with 8 x 4 and dd's 1.42 / 1.70 in the same run.
    queue_depth: int = opt(32, "I/O requests in flight per swapper (aio.queue_depth); at most thread_count "
                               "of them are inside the kernel at once.", min=1)
    thread_count: int = opt(16, "I/O worker threads (aio.thread_count, aio.intra_op_parallelism).", min=1,
                            alias=("intra_op_parallelism",))
    single_submit: bool = opt(False, "DeepSpeed aio.single_submit: accepted; our swapper always submits "
                                     "requests one by one as slots free (true changes nothing).")
    overlap_events: bool = opt(True, "DeepSpeed aio.overlap_events: accepted; completions always overlap "
                                     "new submissions (false changes nothing).")

    def validate(self, path: str) -> None:
        kind = 1 if path.endswith("param") else 0
        if not self.nvme_path or not self.nvme_path.strip():
            raise ConfigError(f"{path}.nvme_path is required with plugin = \"nvme\": set it to a directory on "
                              f"a local NVMe disk, e.g. nvme_path = \"/local_nvme\"", key=f"{path}.nvme_path")
        for name, table in _ONLY.items():
            if getattr(self, name) is not None and not path.endswith(table.split(".")[1]):
                raise ConfigError(f"{path}.{name} applies to [{table}] only (as in DeepSpeed); remove it "
                                  f"from [{path}]", key=f"{path}.{name}")
        if self.block_size % ALIGN:
            raise ConfigError(f"{path}.block_size = {self.block_size} must be a multiple of {ALIGN} "
                              f"(O_DIRECT alignment), e.g. {max(ALIGN, self.block_size // ALIGN * ALIGN)}",
                              key=f"{path}.block_size")
        for name, defaults in _DEFAULTS.items():   # the table's defaults (frozen: set once, here)
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[kind])
        moot = [f"{n} = {str(v).lower()}" for n, v, ours in (("single_submit", self.single_submit, False),
                                                              ("overlap_events", self.overlap_events, True))
                if v != ours]
        if self.fast_init is False:
            log.warning("%s.fast_init = false changes nothing: zeroplug creates the optimizer states at the "
                        "first step and writes only the initial master weights to NVMe at start", path)
        if moot:
            log.warning("%s: %s changes nothing: zeroplug's swapper submits each request as a slot frees and "
                        "overlaps completions with new submissions; tune queue_depth, thread_count and "
                        "block_size instead", path, " and ".join(moot))

    def resolved(self, kind: str) -> "NVMeOptions":
        """These options with the defaults of ``kind`` ("optimizer" or "param") filled in."""
        import dataclasses
        i = 1 if kind == "param" else 0
        return dataclasses.replace(self, **{n: d[i] for n, d in _DEFAULTS.items() if getattr(self, n) is None})


class NVMeOffload(OffloadDevice):
    """States staged in host memory and kept in files under ``nvme_path`` between uses."""
    Options = NVMeOptions

    def __init__(self, options, run, kind):
        super().__init__(options.resolved(kind), run, kind)
        self.allocated = 0
        self._swapper: AsyncSwapper | None = None
        self._plan: SwapPlan | None = None
        self._element_size = 4 if kind == "optimizer" else 2

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty(self, numel, dtype):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        avail = host_available_bytes()
        if nbytes > avail:
            raise MemoryError(
                f"offload.{self.kind} = \"nvme\" needs {nbytes / GB:.2f} GiB of host memory to stage this buffer "
                f"({self.allocated / GB:.2f} GiB already taken) but only {avail / GB:.2f} GiB is available; "
                f"stage fewer sub-groups at once (zero.sub_group_size), use more ranks, or free host memory")
        pin = self.options.pin_memory and torch.cuda.is_available()
        self.allocated += nbytes
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)

    #: the partitioner keeps each sub-group's states in files between steps
    swaps_states = True
    #: DeepSpeed's top-level [aio] table gives defaults for block_size, queue_depth, ...
    shared_tables = ("aio",)

    @property
    def offloaded(self) -> bool:
        return True

    def plan_swap(self, total_bytes: int, largest_numel: int, element_size: int | None = None,
                  num_files: int = 0) -> SwapPlan:
        """Check before allocating: buffer_size >= ``largest_numel``, buffers fit in host memory,
        the swap files (``total_bytes``) fit at nvme_path. Sizes the swapper's buffers."""
        if self._swapper is not None:
            raise SwapError("NVMe swap: plan_swap() must run before the swapper is first used", self.options.nvme_path)
        if element_size is not None:
            self._element_size = element_size
        self._plan = plan(total_bytes, largest_numel, self.options, element_size=self._element_size,
                          num_files=num_files, where=f"offload.{self.kind}")
        return self._plan

    @property
    def swapper(self) -> AsyncSwapper:
        """The swapper, created on first use (buffers sized by plan(), else buffer_size or 1e8)."""
        if self._swapper is None:
            o = self.options
            size = self._plan.buffer_numel if self._plan else (o.buffer_size or int(1e8))
            self._swapper = AsyncSwapper(
                o.nvme_path, buffer_count=o.buffer_count, buffer_size=size, element_size=self._element_size,
                block_size=o.block_size, queue_depth=o.queue_depth, thread_count=o.thread_count,
                pin_memory=o.pin_memory)
        return self._swapper

    def close(self) -> None:
        if self._swapper is not None:
            self._swapper.close()
            self._swapper = None



@hookimpl
def zeroplug_register_offload_devices(register):
    register("nvme", NVMeOffload)
