"""The "nvme" tier: the cpu tier's host path with states in swap files between uses."""
from __future__ import annotations

import torch

from zeroplug.observe.memory import GB, host_available_bytes
from zeroplug.plugins.offload_cpu.host import HostTier
from zeroplug.tiers import HostBytes, TierCapabilities, optimizer_state_bytes

from .options import NVMeOptions
from .param_swap import ParamSwap
from .swap import SubGroupSwap
from .swapper import COPY_THREADS, AsyncSwapper, SwapError, SwapPlan, plan

#: offload_states' swapper: bounce buffers of this many bytes (the states are any size)
STATES_BUFFER_BYTES = 1 << 26


class NVMeOffload(HostTier):
    """States staged in host memory and kept in files under ``nvme_path`` between uses."""
    Options = NVMeOptions
    #: DeepSpeed's top-level [aio] table gives defaults for block_size, queue_depth, ...
    shared_tables = ("aio",)

    def __init__(self, options, run, kind):
        super().__init__(options.resolved(kind), run, kind)
        self.allocated = 0
        self._swapper: AsyncSwapper | None = None
        self._plan: SwapPlan | None = None
        self._element_size = 4 if kind == "optimizer" else 2
        self.swap: SubGroupSwap | None = None       # kind "optimizer": sub-groups in files
        self.pswap: ParamSwap | None = None         # kind "param": shards in files

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(offloaded=True, in_memory=False)

    @classmethod
    def cpu_workers(cls, options, run, kind) -> dict[str, int]:
        """The swapper's copy threads (its I/O threads wait for the disk)."""
        return {"copy": COPY_THREADS}

    def host_bytes(self, numel, param_dtype):
        """Kind "optimizer": the gradient shard and, while the tier starts, the masters
        (written to the swap files then); the optimizer's states live in the files. Kind
        "param": the shards kept in memory (max_in_cpu). The swap buffers, sized by the
        largest sub-group, are checked when the tier plans its swap."""
        pinned = self.options.pin_memory and torch.cuda.is_available()
        if self.kind == "param":
            size = torch.empty((), dtype=param_dtype).element_size()
            keep = min(numel, self.options.max_in_cpu or 0)
            buffers = (self.options.buffer_count or 0) * min(numel, self.options.buffer_size or 0) * size
            n = size * keep + buffers
            what = (f"{keep:,} parameter elements kept in memory (max_in_cpu) x {size} bytes + swap buffers "
                    f"{buffers / 2**30:.2f} GiB")
        else:
            n, what = 8 * numel, f"{numel:,} master elements x 8 bytes: gradient 4 + master 4 until it is swapped out"
        return HostBytes(pinned=n, what=what) if pinned else HostBytes(pageable=n, what=what)

    def prepare(self, optimizer) -> None:
        """Nothing ahead: each sub-group's states are created when it is first brought in
        (they live in files between uses; all of them at once would not fit in memory)."""

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
            size, element_size, count = (self._plan.buffer_numel if self._plan else (o.buffer_size or int(1e8)),
                                         self._element_size, o.buffer_count)
            if self.kind not in ("optimizer", "param"):      # offload_states: bytes of any size
                size, element_size, count = STATES_BUFFER_BYTES, 1, 2
            self._swapper = AsyncSwapper(
                o.nvme_path, buffer_count=count, buffer_size=size, element_size=element_size,
                block_size=o.block_size, queue_depth=o.queue_depth, thread_count=o.thread_count,
                pin_memory=o.pin_memory)
        return self._swapper

    # -- plan --------------------------------------------------------------------------------
    def plan(self, layout) -> None:
        """Kind "optimizer": sub-groups of whole units, each master its own tensor, so each can
        be swapped out (storage freed) while the others stay; the gradient shard is one flat
        buffer in host memory (see swap.py). Kind "param": the shards beyond max_in_cpu go out."""
        self.layout = layout
        if self.kind == "param":
            self.pswap = ParamSwap(self)
            self.pswap.place(layout.units)
            return
        groups = layout.sub_groups
        total = sum(sg.numel for sg in groups)
        largest = max(sg.numel for sg in groups)
        # master and the optimizer's states of every element in files (Adam's m and v: 8 bytes
        # in fp32, fewer in bf16 or int8); masters staged one sub-group at a time
        sb = optimizer_state_bytes(self.run, torch.device("cpu"))
        self.plan_swap(int((4 + sb) * total), largest, element_size=4, num_files=3 * len(groups))
        self.grad_flat = self.empty(total, torch.float32)
        self.grad_flat.zero_()
        self.masters = []
        for sg in groups:
            t = self.empty(sg.numel, torch.float32)
            t.grad = self.grad_flat[sg.start:sg.end]
            for i in sg.units:
                u = layout.units[i]
                self.unit_masters[u.index] = t[u.start - sg.start:u.start - sg.start + u.numel]
                self.unit_masters[u.index].copy_(u.shard)
            self.masters.append(t)
        self.start_movement()
        self.swap = SubGroupSwap(self)
        self.swap.swap_out_all()        # the masters start on NVMe

    # -- kind "optimizer" --------------------------------------------------------------
    def sub_group_loop(self, optimizer, step_one, order) -> None:
        self.swap.step(optimizer, step_one, self.publish_done)

    def export(self, k, optimizer):
        return self.swap.resident(k, dirty=False, optimizer=optimizer)

    def import_(self, k, optimizer):
        return self.swap.resident(k, dirty=True, optimizer=optimizer)

    # -- kind "param" ------------------------------------------------------------------
    def fetch(self, unit):
        self.pswap.ensure(unit)

    def prefetch(self, unit):
        if unit not in self.pswap.on_nvme:
            return False
        self.pswap.start_read(unit)
        return True

    def evict(self, unit, after=None):
        self.pswap.drop(unit, after)

    def update(self, unit):
        return self.pswap.writing(unit)

    def absent(self, unit):
        return self.pswap is not None and unit in self.pswap.on_nvme

    def all_in(self):
        return self.pswap.all_in()

    # -- offload_states ------------------------------------------------------------------
    def stash(self, key, data, non_blocking=False):
        self.swapper.write(("states", key), data).wait()
        return True

    def unstash(self, key, out, non_blocking=False):
        self.swapper.read(("states", key), out).wait()
        self.swapper.delete(("states", key))

    def close(self) -> None:
        super().close()
        if self._swapper is not None:
            self._swapper.close()
            self._swapper = None
