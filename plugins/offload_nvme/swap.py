"""Sub-group states in swap files between optimizer steps (the nvme tier, kind "optimizer").

Each sub-group's fp32 master and its elementwise optimizer states (Adam's m and v)
are written to the tier's swapper after the sub-group steps, and their storages are
resized to 0 bytes; before the next step they are resized and read back. Tensor
objects never change, so the optimizer's state dict and every view stay valid.

Note: with ``reuse_resident`` (the default) the order of the sub-groups alternates,
forward on one step and backward on the next, and the last R sub-groups a step
updates stay in host memory without being written (their files are stale until they
are written again). The next step, running the other way round, starts with exactly
those, so each step skips R writes and R reads. R = pipeline_read + pipeline_write
(at least 1) is the number of sub-groups the pipeline holds besides the one
stepping, so host memory does not grow: while sub-group i of the order steps the
pipeline holds i - 1 (being written), i and i + 1 (being read); the kept ones take
the slots of those, at the start of a step (0, 1, ... R - 1 already in, none being
written) and at its end (n - R ... n - 1 stepped and kept, none to read), and
between steps R sub-groups are resident, fewer than during a step. What reads or
writes states outside the step (``resident``, ``all_resident``, ``swap_out_all``)
goes by ``swapped``, so a resident sub-group is used as it is in memory.

Note: the fp32 gradient shard stays in host memory: it is written by the D2H copies
during backward in pieces that do not follow sub-groups, and swapping it would add a
write and a read of 4 bytes per element to every step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zeroplug.flat import alloc_storage, free_storage


def _elementwise(v, t) -> bool:
    return torch.is_tensor(v) and v.shape == t.shape


class SubGroupSwap:
    def __init__(self, tier):
        self.tier = tier
        self.swapper = tier.swapper
        self.masters = tier.masters
        self.optimizer = None             # known once the engine has built it
        self.out: dict[int, list] = {}    # k -> futures of writes in flight
        self.inn: dict[int, list] = {}    # k -> futures of reads in flight
        self.swapped: set[int] = set()    # sub-groups whose storages are freed
        self._reverse = False             # the next step runs backward (reuse_resident)
        self.reused = 0                   # sub-group writes and reads skipped so far (reuse_resident)

    def tensors(self, k: int) -> list[tuple[str, torch.Tensor]]:
        t = self.masters[k]
        out = [("master", t)]
        st = self.optimizer.state.get(t, {}) if self.optimizer is not None else {}
        out += [(name, v) for name, v in sorted(st.items()) if _elementwise(v, t)]
        return out

    # -- out -------------------------------------------------------------------------
    def start_out(self, k: int, dirty: bool = True) -> None:
        if dirty:
            self.out[k] = [self.swapper.write((k, name), t) for name, t in self.tensors(k)]

    def finish_out(self, k: int) -> None:
        for f in self.out.pop(k, []):
            f.wait()
        for _, t in self.tensors(k):
            free_storage(t)
        self.swapped.add(k)

    # -- in --------------------------------------------------------------------------
    def start_in(self, k: int) -> None:
        if k not in self.swapped or k in self.inn:
            return
        futures = []
        for name, t in self.tensors(k):
            alloc_storage(t)
            futures.append(self.swapper.read((k, name), t))
        self.inn[k] = futures

    def finish_in(self, k: int) -> None:
        self.start_in(k)
        for f in self.inn.pop(k, []):
            f.wait()
        self.swapped.discard(k)

    def swap_out_all(self) -> None:
        ks = [k for k in range(len(self.masters)) if k not in self.swapped]
        for k in ks:        # all in memory already: every write in flight at once
            self.start_out(k)
        for k in ks:
            self.finish_out(k)

    @contextmanager
    def all_resident(self, optimizer):
        """Every sub-group in memory for the block (checkpoint save), then the ones that
        were out back out (written only if the block created states for them)."""
        if optimizer is not None:
            self.optimizer = optimizer
        was_out = sorted(self.swapped)
        for k in was_out:
            self.start_in(k)
        for k in was_out:
            self.finish_in(k)
        try:
            yield
        finally:
            # states the block created (optimizer moments) are written out too
            have = set(self.swapper.keys())
            for k in was_out:
                self.start_out(k, dirty=any((k, name) not in have for name, _ in self.tensors(k)))
            for k in was_out:
                self.finish_out(k)

    @contextmanager
    def resident(self, k: int, dirty: bool = False, optimizer=None):
        """Sub-group ``k``'s states in memory for the block; written back after it if
        ``dirty`` (with every element-wise state the optimizer then holds for it, also
        ones the block created), and freed again. Checkpoints stream through this one
        sub-group at a time: views of the states must not outlive the block."""
        if optimizer is not None:
            self.optimizer = optimizer
        was_out = k in self.swapped
        self.finish_in(k)
        try:
            yield self.masters[k]
        finally:
            if was_out:
                self.start_out(k, dirty=dirty)
                self.finish_out(k)

    # -- the pipelined step --------------------------------------------------------------
    def kept(self) -> int:
        """How many sub-groups a step leaves resident and unwritten (0: reuse_resident off)."""
        o = self.tier.options
        if not getattr(o, "reuse_resident", False):
            return 0
        return max(1, int(bool(o.pipeline_read)) + int(bool(o.pipeline_write)))

    def step(self, optimizer, step_one, publish_done) -> None:
        """``step_one(k)`` steps and publishes sub-group k; ``publish_done(k)`` waits until
        the published copy no longer reads the master (H2D on a stream). With
        reuse_resident the order alternates and the last ``kept()`` sub-groups stay in
        memory, unwritten (see the module docstring)."""
        self.optimizer = optimizer
        o = self.tier.options
        n = len(self.masters)
        keep = self.kept()
        order = list(range(n - 1, -1, -1)) if keep and self._reverse else list(range(n))
        prev = None                            # the sub-group whose write is in flight
        for i, k in enumerate(order):
            if k not in self.swapped:
                self.reused += 1               # still in memory from the last step: no read
            self.finish_in(k)
            if o.pipeline_read and i + 1 < n:
                self.start_in(order[i + 1])    # read the next one while k steps
            step_one(k)
            publish_done(k)
            if i >= n - keep:                  # kept in memory, unwritten, for the next step
                cur = None
            else:
                self.start_out(k)
                cur = k
                if not o.pipeline_write:
                    self.finish_out(k)
                    cur = None
            if prev is not None:
                self.finish_out(prev)          # its write ran while k stepped
            prev = cur
        if prev is not None:
            self.finish_out(prev)
        if keep:
            self._reverse = not self._reverse
