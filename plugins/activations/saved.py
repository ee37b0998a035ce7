"""Checkpointed blocks' inputs in host memory from the forward to the block's recompute.

``saved_tensors_hooks`` entered around the model's forward see the checkpointed blocks' inputs
among the tensors saved outside checkpointed blocks (the embeddings, the head, the loss); only
the former leave the device (told apart by zeroplug.recompute), so that the tensors the
backward needs first (the loss's) are never copied. Nested checkpoints save through the outer
one, never through these hooks.

Forward: each block input is copied out on a side stream as soon as it is saved; its device
memory is let go once the copy is done. At most ``buffer_count`` copies are in flight: past
that, the host waits for the oldest. The last ones still held when the backward starts are
given back as they are (their blocks recompute first).

Backward: a block input's first use fetches it, and the next ``buffer_count`` ones the
backward will use (the earlier blocks', in reverse order of saving) are fetched ahead on the
other side stream; the compute stream waits on each copy's event just before its use.
"""
from __future__ import annotations

import collections
import weakref
from contextlib import contextmanager

import torch

from zeroplug.errors import HostMemoryError
from zeroplug.recompute import saved_by_checkpoint

from .lanes import CopyLanes


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: a host copy of the same strides holds exactly its elements."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Saved:
    """One block input while it is away: its host copy, and its device copy when it has one."""
    __slots__ = ("forward", "index", "host", "copied", "device", "fetched", "__weakref__")

    def __init__(self, forward, index, host, copied, device):
        self.forward, self.index = forward, index
        self.host, self.copied = host, copied       # the host copy and its completion
        self.device = device                        # the original, until its copy is retired
        self.fetched = None                         # (device copy, its completion), fetched ahead


class Forward:
    """One forward's offloaded tensors, in the order they were saved (weakly: autograd's saved
    tensors own them, so a graph that is dropped frees its host copies)."""
    __slots__ = ("saved", "seen", "kept", "__weakref__")

    def __init__(self):
        self.saved: list[weakref.ref] = []
        self.seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}   # id(tensor): one copy per tensor
        self.kept = 0       # bytes of block inputs left on the device (HostActivations.device_bytes)


#: the counters of HostActivations.stats
STATS = ("offloaded", "offloaded_bytes", "kept", "fetched", "prefetched", "kept_on_device")


def _release(held: list, nbytes: int) -> None:
    held[0] -= nbytes


class HostActivations:
    """The pack and unpack hooks, and their bookkeeping, for one engine."""

    def __init__(self, device: torch.device, pin_memory: bool, buffer_count: int, min_bytes: int,
                 device_bytes: int = 0):
        self.device_bytes = device_bytes        # the first block inputs of a forward, up to this, stay
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # Note: tensors name their index ("cuda:0"), and torch.device("cuda") equals none of them
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.lanes = CopyLanes(device, pin_memory)
        self.buffer_count = buffer_count
        self.min_bytes = min_bytes
        self._forward: Forward | None = None
        self._in_flight: collections.deque = collections.deque()   # weakrefs to Saved, oldest first
        self.stats = collections.Counter(dict.fromkeys(STATS, 0))
        self._live: weakref.WeakSet = weakref.WeakSet()       # every Saved whose graph is alive
        # this rank's share of the host memory left after the states (zeroplug.host_budget.host_room;
        # None: not counted) and where the number comes from
        self.room: int | None = None
        self.room_source = ""
        self._held = [0]        # host bytes of the Saved alive (a list: the finalizers add to it)

    def host_bytes(self) -> int:
        """Host bytes held now by the block inputs of graphs still alive."""
        return self._held[0]

    def _check_room(self, nbytes: int) -> None:
        if self.room is None or self._held[0] + nbytes <= self.room:
            return
        from zeroplug.observe.memory import GB
        raise HostMemoryError(
            f"[activation_checkpointing] plugin = \"cpu\": the checkpointed blocks' inputs need more host memory "
            f"than this rank's share of what the host has left after the states ({self.room / GB:.2f} GiB: "
            f"{self.room_source}); {self._held[0] / GB:.2f} GiB are held and the next input takes "
            f"{nbytes / GB:.3f} GiB. Fix: shorter sequences or a smaller micro batch; more ranks per sequence "
            f"(sequence.sequence_parallel_size); less offloaded state; or keep them on the device "
            f"(activation_checkpointing.plugin = \"none\")")

    @contextmanager
    def hooks(self):
        """Around one training forward."""
        previous, self._forward = self._forward, Forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._forward = previous

    # -- forward -----------------------------------------------------------------------------
    def _eligible(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.device == self.device and t.layout == torch.strided
                and not (t.is_leaf and t.requires_grad)          # parameters, and what the user holds
                and t.numel() * t.element_size() >= self.min_bytes and _dense(t)
                and saved_by_checkpoint(3))

    def _pack(self, t: torch.Tensor):
        fwd = self._forward
        if fwd is None or not self._eligible(t):
            return t
        hit = fwd.seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1]() is not None:
            return hit[1]()
        nbytes = t.numel() * t.element_size()
        if fwd.kept + nbytes <= self.device_bytes:
            fwd.kept += nbytes
            self.stats["kept_on_device"] += 1
            return t
        self._check_room(nbytes)
        host, copied = self.lanes.copy_out(t)
        s = Saved(fwd, len(fwd.saved), host, copied, t)
        fwd.saved.append(weakref.ref(s))
        self._live.add(s)
        self._held[0] += nbytes
        weakref.finalize(s, _release, self._held, nbytes)
        fwd.seen[id(t)] = (weakref.ref(t), weakref.ref(s))
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += host.numel() * host.element_size()
        self._in_flight.append(weakref.ref(s))
        self._retire()
        return s

    def _retire(self) -> None:
        """Lets go of the device memory of the block inputs whose copy is done; the host waits
        for the oldest ones while more than ``buffer_count`` are in flight."""
        q = self._in_flight
        while q:
            s = q[0]()
            if s is not None and s.device is not None:
                if len(q) > self.buffer_count:
                    self.lanes.wait(s.copied)
                elif not self.lanes.finished(s.copied):
                    return
                s.device = None
            q.popleft()

    # -- backward ----------------------------------------------------------------------------
    def _unpack(self, s):
        if not isinstance(s, Saved):
            return s
        if s.device is not None:            # never left: the copy out was not retired yet
            t, s.device = s.device, None
            self.stats["kept"] += 1
        else:
            if s.fetched is None:
                s.fetched = self.lanes.copy_in(s.host, s.copied)
                self.stats["fetched"] += 1
            (t, done), s.fetched = s.fetched, None
            self.lanes.use(done)
        self._prefetch(s)
        return t

    def _prefetch(self, s: Saved) -> None:
        """Fetches the next ``buffer_count`` block inputs the backward will use (saved before ``s``)."""
        ahead, saved = 0, s.forward.saved
        for j in range(s.index - 1, -1, -1):
            if ahead >= self.buffer_count:
                return
            nxt = saved[j]()
            if nxt is None:
                continue
            ahead += 1
            if nxt.device is None and nxt.fetched is None:
                nxt.fetched = self.lanes.copy_in(nxt.host, nxt.copied)
                self.stats["prefetched"] += 1
