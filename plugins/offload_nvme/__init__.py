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

The tier: :class:`~.tier.NVMeOffload`: the cpu tier's host path (gradients D2H, the
step on the CPU, published values H2D) with sub-group states in swap files between
steps (:mod:`.swap`: read ahead, write behind, ``reuse_resident``), stage-3 parameter
shards in swap files beyond ``max_in_cpu`` (:mod:`.param_swap`) and ``offload_states``
through the same swapper.
"""
from __future__ import annotations

from zeroplug import hookimpl

from .options import NVMeOptions
from .swapper import (ALIGN, AsyncSwapper, SwapError, SwapFuture, SwapIOError, SwapMemoryError,  # noqa: F401
                      SwapPathError, SwapPlan, SwapSpaceError, clean_stale, plan)
from .tier import NVMeOffload

__all__ = ["NVMeOptions", "NVMeOffload", "AsyncSwapper", "SwapFuture", "SwapPlan", "plan", "clean_stale",
           "SwapError", "SwapSpaceError", "SwapPathError", "SwapIOError", "SwapMemoryError"]


@hookimpl
def zeroplug_register_offload_devices(register):
    register("nvme", NVMeOffload)
