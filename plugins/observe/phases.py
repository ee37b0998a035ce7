"""Where a step's time goes: forward, backward, waiting for gradients, optimizer, other.

The engine announces the start of each phase (``zeroplug_phase``) and this clock marks it; a phase lasts until the next mark. On CUDA
a mark records an event on the current stream, so a phase is the time the stream took
to get from one mark to the next (work launched in it, and any wait in it for copies,
other streams or the host); no synchronisation happens until :meth:`PhaseClock.take`,
which the engine calls only on the steps it reports. On the CPU a mark reads the clock.
"""
from __future__ import annotations

import time

import torch

class PhaseClock:
    #: marks kept at most (a loop that never steps must not grow the list)
    LIMIT = 256

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase: str) -> None:
        """``phase`` starts now (and the phase before it ends)."""
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record(torch.cuda.current_stream(self.device))
        else:
            stamp = time.perf_counter()
        if len(self.marks) >= self.LIMIT:
            self.marks.clear()
        self.marks.append((phase, stamp))

    def take(self, keep: bool) -> dict[str, float]:
        """Seconds per phase since the previous ``take`` (``phase_<name>`` keys) if ``keep``;
        forgets the marks either way, but the last one opens the next step's "other"."""
        out: dict[str, float] = {}
        if keep and len(self.marks) > 1:
            if self.cuda:
                self.marks[-1][1].synchronize()
            for (name, a), (_, b) in zip(self.marks, self.marks[1:]):
                dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
                out[f"phase_{name}"] = out.get(f"phase_{name}", 0.0) + dt
        self.marks = [("other", self.marks[-1][1])] if self.marks else []
        return out
