"""The copies between the device and the host, and what orders them.

On CUDA, two side streams: one carries device-to-host copies during the forward, the other
host-to-device copies during the backward (PCIe moves both ways at once). Each copy waits on
an event of the compute stream (the values it reads, or the memory it writes, were last
touched there) and records an event that the compute stream, or the host when it must bound
what is in flight, waits on; nothing synchronises the device. On the CPU there is nothing to
overlap: each copy happens when asked and its event is None (already complete). Either way
the same tensors are copied into newly allocated memory, so the rest of the code path is the
same on both.
"""
from __future__ import annotations

import torch


class CopyLanes:
    """Copies out to host memory and back for ``device`` (a CUDA device: asynchronous, on side
    streams; else synchronous); ``pin_memory``: page-locked host buffers (CUDA only)."""

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin_memory = pin_memory and self.cuda
        self.out_stream = torch.cuda.Stream(device) if self.cuda else None
        self.in_stream = torch.cuda.Stream(device) if self.cuda else None

    def _after_compute(self, stream):
        """``stream`` waits for what the compute stream has queued so far."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.wait_event(ready)

    def copy_out(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A host copy of ``t`` (same shape and strides) and the event of its completion."""
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        if not self.cuda:
            host.copy_(t)
            return host, None
        self._after_compute(self.out_stream)
        with torch.cuda.stream(self.out_stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.out_stream)
        # Note: the caching allocator may hand t's memory to the compute stream once the last
        # reference goes; this keeps it until the copy stream is past the copy as well.
        t.record_stream(self.out_stream)
        return host, done

    def copy_in(self, host: torch.Tensor, after) -> tuple[torch.Tensor, object]:
        """A device copy of ``host`` (written once ``after``, its own copy out, completed) and
        the event of its completion."""
        t = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=self.device)
        if not self.cuda:
            t.copy_(host)
            return t, None
        # Note: t is the compute stream's memory, maybe just freed by work still queued there
        self._after_compute(self.in_stream)
        with torch.cuda.stream(self.in_stream):
            if after is not None:
                self.in_stream.wait_event(after)
            t.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.in_stream)
        t.record_stream(self.in_stream)      # freed unused (its graph dropped): kept until written
        return t, done

    def use(self, done) -> None:
        """The compute stream waits for the copy ``done`` (no host wait)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    @staticmethod
    def finished(done) -> bool:
        return done is None or done.query()

    @staticmethod
    def wait(done) -> None:
        """The host waits for the copy ``done`` (bounding what is in flight)."""
        if done is not None:
            done.synchronize()
