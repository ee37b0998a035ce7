"""Stage 3 parameter shards on NVMe (``[offload.param] plugin = "nvme"``).

The first ``max_in_cpu`` elements of the shards the stage hands over stay in host memory;
the rest live in swap files. A shard on NVMe is read into host memory ahead of use (the
stage prefetches in the order it recorded in the previous step), uploaded by the stage,
and its host copy dropped once the upload is done; the optimizer's publish writes new
values straight into a fresh host shard and back to the file.
"""
from __future__ import annotations

from contextlib import contextmanager

from zeroplug.flat import alloc_storage, free_storage


class ParamSwap:
    def __init__(self, tier):
        self.tier = tier
        self.shards: dict = {}                  # unit -> its host shard tensor
        self.on_nvme: set[int] = set()          # units whose shard lives in a file
        self.resident: set[int] = set()         # ... of those, read into host memory now
        self.reads: dict[int, object] = {}      # reads in flight
        self.uploads: dict[int, object] = {}    # the last upload that read each shard (a CUDA event)
        self.held = 0                           # > 0 inside all_in(): nothing is dropped

    def place(self, units) -> None:
        """Keep the first max_in_cpu elements in memory; write the rest out."""
        budget, used, out = self.tier.options.max_in_cpu, 0, []
        for u in units:
            self.shards[u.index] = u.shard
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

    def start_read(self, i: int) -> None:
        if i in self.on_nvme and i not in self.resident and i not in self.reads:
            alloc_storage(self.shards[i])
            self.reads[i] = self.swapper.read(("param", i), self.shards[i])

    def ensure(self, i: int) -> None:
        """The unit's host shard holds its values (before an upload)."""
        if i not in self.on_nvme:
            return
        self.start_read(i)
        f = self.reads.pop(i, None)
        if f is not None:
            f.wait()
        self.resident.add(i)

    def drop(self, i: int, after=None) -> None:
        """Free the host copy of a released unit (its file still holds the values) once
        ``after`` (the CUDA event of the upload that read it) is done."""
        if after is not None:
            self.uploads[i] = after
        if i not in self.resident or self.held:
            return
        after = self.uploads.get(i)
        if after is not None:
            after.synchronize()             # the DMA from the host shard has finished
        free_storage(self.shards[i])
        self.resident.discard(i)

    @contextmanager
    def writing(self, i: int):
        """New values (the optimizer's publish) go into a fresh host shard, then the file."""
        shard = self.shards[i]
        if i not in self.on_nvme:
            yield shard
            return
        f = self.reads.pop(i, None)
        if f is not None:
            f.wait()
        alloc_storage(shard)
        yield shard
        self.swapper.write(("param", i), shard).wait()
        free_storage(shard)
        self.resident.discard(i)

    @contextmanager
    def all_in(self):
        """Every shard in host memory for the block (checkpoint save), read-only."""
        units = sorted(self.on_nvme)
        for i in units:
            self.start_read(i)              # every read in flight, then wait for each
        for i in units:
            self.ensure(i)
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            for i in units:
                self.drop(i)
