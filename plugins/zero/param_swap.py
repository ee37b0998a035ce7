"""Stage 3 parameter shards on NVMe (``[offload.param] plugin = "nvme"``).

The first ``max_in_cpu`` elements of (non-persistent) shards stay in host memory; the
rest live in swap files. A unit on NVMe is read into its host shard ahead of use —
the prefetcher starts reads in the order recorded in the previous step — uploaded,
and its host copy dropped once the upload is done; the optimizer's publish writes new
values straight into a fresh host shard and back to the file.
"""
from __future__ import annotations

from contextlib import contextmanager

from zeroplug.flat import alloc_storage, free_storage


class ParamSwap:
    def __init__(self, part, tier):
        self.part, self.tier = part, tier
        self.on_nvme: set[int] = set()          # unit indices whose shard lives in a file
        self.resident: set[int] = set()         # ... of those, read into host memory now
        self.reads: dict[int, object] = {}      # reads in flight
        self.held = 0                           # > 0 inside all_in(): nothing is dropped

    def place(self, units) -> None:
        """Keep the first max_in_cpu elements in memory; write the rest out."""
        budget, used, out = self.tier.options.max_in_cpu, 0, []
        for u in units:
            if u.persistent:
                continue
            n = u.shard.numel()
            if used + n <= budget:
                used += n
            else:
                out.append(u)
        if not out:
            return
        size = out[0].shard.element_size()
        self.tier.plan_swap(sum(u.shard.numel() for u in out) * size, max(u.shard.numel() for u in out),
                            element_size=size, num_files=len(out))
        self.swapper = self.tier.swapper
        writes = [self.swapper.write(("param", u.index), u.shard) for u in out]
        for u, f in zip(out, writes):
            f.wait()
            free_storage(u.shard)
            self.on_nvme.add(u.index)

    def start_read(self, u) -> None:
        i = u.index
        if i in self.on_nvme and i not in self.resident and i not in self.reads:
            alloc_storage(u.shard)
            self.reads[i] = self.swapper.read(("param", i), u.shard)

    def ensure(self, u) -> None:
        """The unit's host shard holds its values (before an upload)."""
        if u.index not in self.on_nvme:
            return
        self.start_read(u)
        f = self.reads.pop(u.index, None)
        if f is not None:
            f.wait()
        self.resident.add(u.index)

    def drop(self, u) -> None:
        """Free the host copy of a released unit (its file still holds the values)."""
        if u.index not in self.resident or self.held:
            return
        event = getattr(u, "upload_event", None)
        if event is not None:
            event.synchronize()             # the DMA from the host shard has finished
        free_storage(u.shard)
        self.resident.discard(u.index)

    @contextmanager
    def writing(self, u):
        """New values (the optimizer's publish) go into a fresh host shard, then the file."""
        if u.index not in self.on_nvme:
            yield
            return
        f = self.reads.pop(u.index, None)
        if f is not None:
            f.wait()
        alloc_storage(u.shard)
        yield
        self.swapper.write(("param", u.index), u.shard).wait()
        free_storage(u.shard)
        self.resident.discard(u.index)

    @contextmanager
    def all_in(self):
        """Every shard in host memory for the block (checkpoint save), read-only."""
        units = [u for u in self.part.units if u.index in self.on_nvme]
        for u in units:
            self.start_read(u)              # every read in flight, then wait for each
        for u in units:
            self.ensure(u)
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            for u in units:
                self.drop(u)
