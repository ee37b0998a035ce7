"""Host copies of a checkpoint's tensors, for a save that writes in the background.

A rank's state as :func:`zeroplug.checkpoint.save_checkpoint` builds it holds zero-copy
views of live memory (the partitioner's shards, masters and optimizer states). An
asynchronous save cannot write from them while training goes on, so it copies them into
host buffers first: :func:`split` separates what must be copied at once (small values
that the forward itself changes: counters, the loss scaler, RNG states, module buffers,
the caller's ``client_state``) from the big tensors, which only the optimizer step
changes; :class:`Staging` copies those into its buffers (pinned for CUDA tensors, copied
on a stream of its own) while the next forward and backward run, and the engine waits for
that copy before its next optimizer step.

The buffers are kept between saves (one save's worth of host memory for the run: a new
allocation, and page-locking it, would cost more than the copy) and let go by
:meth:`Staging.close`.
"""
from __future__ import annotations

import logging

import torch

from .files import piece_view

log = logging.getLogger("zeroplug")

ALIGN = 64          # bytes: every staged tensor starts at a multiple (any dtype's alignment)


def _copied(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def split(state: dict, buffers: set[int]) -> tuple[dict, list[tuple[dict, object, torch.Tensor]]]:
    """``state`` (a rank file's dict) with every tensor that may change before the next
    optimizer step copied now, and the places ``(container, key, tensor)`` of the big
    tensors left to stage: the pieces of ``model.pieces`` and the ``model.extras`` that
    are not module buffers (``buffers``: the data pointers of the module's buffers, which
    a training forward updates)."""
    later: list = []
    out = {k: _copied(v) for k, v in state.items() if k != "model"}
    model = dict(state["model"])
    pieces = {}
    for name, plist in model.get("pieces", {}).items():
        new = []
        for pc in plist:
            pc = dict(pc)
            for key in ("param", "master"):
                if torch.is_tensor(pc.get(key)):
                    later.append((pc, key, pc[key]))
            if "optim" in pc:
                pc["optim"] = dict(pc["optim"])
                for key, t in pc["optim"].items():
                    later.append((pc["optim"], key, t))
            new.append(pc)
        pieces[name] = new
    model["pieces"] = pieces
    extras = {}
    for k, v in model.get("extras", {}).items():
        if torch.is_tensor(v) and v.data_ptr() not in buffers:
            extras[k] = v
            later.append((extras, k, v))
        else:
            extras[k] = _copied(v)
    model["extras"] = extras
    for key in ("optim_scalars", "optim_groups", "optim_keys"):
        if key in model:
            model[key] = _copied(model[key])
    out["model"] = model
    return out, later


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def staged_bytes(tensors) -> int:
    """Host bytes :meth:`Staging.copy` needs for ``tensors``."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


class Staging:
    """Host buffers that hold one save's tensors, reused from save to save."""

    def __init__(self):
        self.pageable: torch.Tensor | None = None     # copies of host tensors
        self.pinned: torch.Tensor | None = None       # copies of CUDA tensors
        self._registered = False
        self.stream = None

    @property
    def held(self) -> int:
        return sum(b.numel() for b in (self.pageable, self.pinned) if b is not None)

    def _buffer(self, which: str, nbytes: int) -> torch.Tensor:
        buf = getattr(self, which)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if which == "pinned":
            self._unpin()
        setattr(self, which, None)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if which == "pinned":
            # Note: torch's pinned allocator rounds a block up to a power of two; page-locking
            # our own exact-size buffer costs only what it holds.
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            self._registered = int(err) == 0
            if not self._registered:
                log.warning("[zeroplug] asynchronous checkpoint: page-locking %.2f GiB of host memory failed "
                            "(CUDA error %d); the copies from the GPU are synchronous", nbytes / 2**30, int(err))
        setattr(self, which, buf)
        return buf

    def copy(self, places, after=None) -> None:
        """Copy every ``(container, key, tensor)`` into the buffers and put the copy (a view
        whose storage is exactly it, for ``torch.save``) in its place. ``after``: a CUDA
        event that the copies from the GPU wait for (the work that produced the values)."""
        cuda = [p for p in places if p[2].device.type == "cuda"]
        host = [p for p in places if p[2].device.type != "cuda"]
        if host:
            self._fill(self._buffer("pageable", staged_bytes(t for _, _, t in host)), host)
        if cuda:
            device = cuda[0][2].device
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
            torch.cuda.set_device(device)
            with torch.cuda.stream(self.stream):
                if after is not None:
                    self.stream.wait_event(after)
                self._fill(self._buffer("pinned", staged_bytes(t for _, _, t in cuda)), cuda,
                           non_blocking=self._registered)
            self.stream.synchronize()

    @staticmethod
    def _fill(buf: torch.Tensor, places, non_blocking: bool = False) -> None:
        at = 0
        for container, key, src in places:
            n = src.numel() * src.element_size()
            dst = buf[at:at + n].view(src.dtype).view(src.shape)
            dst.copy_(src.detach(), non_blocking=non_blocking)
            container[key] = piece_view(dst)
            at += _aligned(n)

    def _unpin(self) -> None:
        if self._registered and self.pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self.pinned.data_ptr())
        self._registered = False

    def close(self) -> None:
        self._unpin()
        self.pinned = self.pageable = None
