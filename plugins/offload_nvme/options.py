"""Options of the nvme tier: one table serves both slots, with DeepSpeed's names."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from zeroplug.errors import ConfigError
from zeroplug.options import opt

from .directio import ALIGN

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
    # Note: 32 requests over 16 threads beat 8 over 4 in the swapper benchmark (docs/benchmarks.md).
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
