"""Where a step's GPU time goes: compute kernels, collectives, copies, and what of the
collectives no compute hides, read from a ``torch.profiler`` trace of a few steps.

    with Timeline(device) as tl:          # CUDA only; records torch.profiler's device events
        for _ in range(3):
            train_one_step()
    s = tl.summary(steps=3)               # per step, in milliseconds
    print(format_summary(s))

Kernels are classed by name: NCCL's kernels (``nccl...``) are *communication*, memcpy and
memset events are *copies*, every other kernel is *compute*. Per step, over the profiled window
(first device event to last): the busy time of each class (the union of its intervals, so
kernels running side by side on several streams count once), the communication time that no
compute kernel overlaps (*exposed*), the copies no compute overlaps, and *idle*: no kernel or
copy at all. The window's length per step is the GPU's step time; ``compute`` against the
window says how much of the step the GPU computes; ``exposed`` and ``idle`` name the rest.
``gaps`` lists the longest stretches with no compute kernel, with the kernel before and after
and the collectives running during the gap: where the compute stream waits, and on what.

:func:`analyse` takes the event list of a chrome trace (``prof.export_chrome_trace``), so a
saved trace can be read again (``python3 -m zeroplug.benchmarking.timeline TRACE.json``).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kernel:
    start_us: float
    end_us: float
    name: str
    stream: int
    kind: str       # "compute" | "comm" | "copy"


def classify(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return "copy"
    if name.lower().startswith("nccl") or "ncclDevKernel" in name or "ncclKernel" in name:
        return "comm"
    return "compute"


def device_events(trace_events: list[dict]) -> list[Kernel]:
    """The device-side events of a chrome trace: kernels, memcpys and memsets."""
    out = []
    for e in trace_events:
        cat = e.get("cat", "")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        name = e.get("name", "")
        stream = int((e.get("args") or {}).get("stream", e.get("tid", 0)) or 0)
        out.append(Kernel(start, start + dur, name, stream, classify(name, cat)))
    out.sort(key=lambda k: k.start_us)
    return out


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def subtract(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the merged intervals ``xs`` outside the merged intervals ``ys``."""
    out, j = [], 0
    for a, b in xs:
        cur = a
        while j < len(ys) and ys[j][1] <= cur:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


@dataclass
class Summary:
    steps: int
    window_ms: float            # per step: first device event to last, / steps
    compute_ms: float
    comm_ms: float
    copy_ms: float
    exposed_comm_ms: float      # communication with no compute kernel running beside it
    exposed_copy_ms: float
    idle_ms: float              # nothing at all on the device
    comm_kernels: dict = field(default_factory=dict)   # kind -> (count per step, ms per step)
    gaps: list = field(default_factory=list)            # (ms, kernel before, kernel after, comm during)


def _comm_kind(name: str) -> str:
    low = name.lower()
    for key in ("allgather", "reducescatter", "allreduce", "broadcast", "sendrecv"):
        if key in low:
            return key
    return "other"


def analyse(trace_events: list[dict], steps: int = 1, top_gaps: int = 8, min_gap_us: float = 50.0) -> Summary:
    ks = device_events(trace_events)
    if not ks:
        raise ValueError("the trace holds no device events (kernels, copies): was CUDA profiled?")
    by = {kind: union([(k.start_us, k.end_us) for k in ks if k.kind == kind]) for kind in ("compute", "comm", "copy")}
    window = (ks[0].start_us, max(k.end_us for k in ks))
    busy = union(by["compute"] + by["comm"] + by["copy"])
    n = max(1, steps)
    comm_kinds: dict[str, list[float]] = {}
    for k in ks:
        if k.kind == "comm":
            c = comm_kinds.setdefault(_comm_kind(k.name), [0, 0.0])
            c[0] += 1
            c[1] += k.end_us - k.start_us
    # the longest stretches between merged compute intervals; neighbours named for those only
    comp_u = by["compute"]
    longest = sorted(((a1 - b0, b0, a1) for (_, b0), (a1, _) in zip(comp_u, comp_u[1:]) if a1 - b0 >= min_gap_us),
                     reverse=True)[:top_gaps]
    compute = [k for k in ks if k.kind == "compute"]
    gaps = []
    for length_us, b0, a1 in longest:
        before = max((k for k in compute if k.end_us <= b0 + 1e-6), key=lambda k: k.end_us, default=None)
        after = min((k for k in compute if k.start_us >= a1 - 1e-6), key=lambda k: k.start_us, default=None)
        during = sorted({_comm_kind(k.name) for k in ks if k.kind == "comm" and k.start_us < a1 and k.end_us > b0})
        gaps.append((length_us / 1e3, before.name[:60] if before else "", after.name[:60] if after else "",
                     ",".join(during) or "-"))
    ms = 1e3 * n
    return Summary(
        steps=n, window_ms=(window[1] - window[0]) / ms,
        compute_ms=length(by["compute"]) / ms, comm_ms=length(by["comm"]) / ms, copy_ms=length(by["copy"]) / ms,
        exposed_comm_ms=length(subtract(by["comm"], by["compute"])) / ms,
        exposed_copy_ms=length(subtract(subtract(by["copy"], by["compute"]), by["comm"])) / ms,
        idle_ms=(window[1] - window[0] - length(busy)) / ms,
        comm_kernels={k: (c / n, d / ms) for k, (c, d) in sorted(comm_kinds.items())},
        gaps=gaps)


def format_summary(s: Summary, label: str = "") -> str:
    pct = (lambda x: f"{100 * x / s.window_ms:4.1f}%") if s.window_ms else (lambda x: "-")
    lines = [f"{label}GPU step {s.window_ms:7.1f} ms: compute {s.compute_ms:7.1f} ({pct(s.compute_ms)}), "
             f"NCCL {s.comm_ms:6.1f} of which exposed {s.exposed_comm_ms:6.1f} ({pct(s.exposed_comm_ms)}), "
             f"copies {s.copy_ms:5.1f} exposed {s.exposed_copy_ms:5.1f}, idle {s.idle_ms:6.1f} ({pct(s.idle_ms)})"]
    if s.comm_kernels:
        lines.append("    collectives per step: " + "; ".join(
            f"{k} {c:.0f} kernels {d:.1f} ms" for k, (c, d) in s.comm_kernels.items()))
    for g in s.gaps:
        lines.append(f"    gap {g[0]:6.2f} ms  after {g[1]!r} before {g[2]!r}  NCCL during: {g[3]}")
    return "\n".join(lines)


class Timeline:
    """Records the device events of the steps run inside it (``torch.profiler``, CUDA)."""

    def __init__(self, device):
        self.device = device
        self.prof = None
        self.events: list[dict] = []

    def __enter__(self):
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize(self.device)
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        import os
        import tempfile

        import torch
        torch.cuda.synchronize(self.device)
        self.prof.__exit__(*exc)
        if exc[0] is None:
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            try:
                self.prof.export_chrome_trace(path)
                with open(path) as f:
                    self.events = json.load(f).get("traceEvents", [])
            finally:
                os.unlink(path)
        return False

    def summary(self, steps: int = 1) -> Summary:
        return analyse(self.events, steps)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": [e for e in self.events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]}, f)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python3 -m zeroplug.benchmarking.timeline TRACE.json [STEPS]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        events = json.load(f).get("traceEvents", [])
    print(format_summary(analyse(events, int(argv[1]) if len(argv) > 1 else 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
