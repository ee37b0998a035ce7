"""The GPU lane of the cpu tier's optimizer step (``[offload.optimizer] gpu_step_ratio``).

With the cpu tier every fp32 master and Adam moment lives in pinned host memory and
cpu_adam steps them. The CPU kernel is bound by the memory bandwidth its cores can
pull, while the GPU and its PCIe link sit idle during the step. The GPU lane takes a share of the sub-groups:
their master, gradient and moments go H2D in chunks on a side stream, torch's own
fused AdamW kernel (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)``
runs) steps them, and master, moments and the model-dtype copy come back D2H (or,
when the parameter shards are on the GPU, the model-dtype copy goes straight into
them). The host only launches copies and kernels; the states never leave host
memory between steps, so host and GPU memory budgets are those of the cpu tier plus
``nbuf`` chunk buffers on the GPU.

Note: the two lanes run at once and share the host's memory bandwidth, so together they
step well under twice the CPU's elements per second (docs/benchmarks.md has the figures
of ``tests/benchmarks/stream_step_probe.py``). ``gpu_step_ratio`` is the share of
elements the GPU lane takes; sub-groups are dealt to the lane that would finish them
first, so both lanes walk the model in forward order and the next forward (which
waits for each unit's sub-group) is never held up by one lane running ahead.

Note: a sub-group always takes the same lane (the assignment depends only on the
sub-group sizes and the ratio), so the overlapped and the serial step give the same
values bit for bit. The two lanes' kernels are different code (torch's fused AdamW and
cpu_adam), so a sub-group's values differ in the last bits between ratio 0 and > 0;
both follow torch.optim.AdamW within the tolerances of the offload tests.

Resident sub-groups (``gpu_resident_ratio``): a share of the sub-groups keeps its fp32
master and Adam moments in GPU memory for the tier's life (copied up once, inside
``initialize``). The lane steps them with the same kernel and the same chunks; only the gradient
goes H2D (from the host gradient buffer, in the model dtype where that is exact) and only
the model-dtype copy goes out (D2H into host shards, or device to device into GPU shards).
The host master and moments of such a sub-group are stale between steps: the tier's
``export`` copies them down and ``import_`` copies them up again (checkpoints), and
``offload_states`` frees and refills the GPU copies.

Note: on a CPU-only run the same code runs with synchronous copies and torch's CPU
fused AdamW, which is how CI tests the lane's bookkeeping (chunks, step counts,
model-dtype pieces, checkpoints).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


def assign(sizes: list[int], ratio: float) -> set[int]:
    """Sub-groups (indices into ``sizes``) for the GPU lane: each goes to the lane whose
    share-normalised load would be smaller after taking it."""
    if ratio <= 0:
        return set()
    if ratio >= 1:
        return set(range(len(sizes)))
    gpu, cpu, out = 0, 0, set()
    for k, n in enumerate(sizes):
        if (gpu + n) / ratio <= (cpu + n) / (1 - ratio):
            out.add(k)
            gpu += n
        else:
            cpu += n
    return out


class GPULane:
    def __init__(self, tier, chunk: int, largest: int, nbuf: int = 3):
        self.tier = tier                            # the cpu tier (host.py) whose sub-groups it steps
        self.device = tier.train_device
        self.cuda = tier.cuda
        self.pdtype = tier.layout.param_dtype
        self.gdtype = tier.grad_flat.dtype          # a model-dtype host gradient lands in a buffer of it first
        self.chunk = max(1, min(chunk, largest))     # no buffer larger than the largest sub-group
        self.nbuf = nbuf
        self._bufs: list[list[torch.Tensor]] = []
        self._free: list = [None] * nbuf           # CUDA event: buffer j's last D2H is done
        self._next = 0                              # the buffer the next chunk uses
        self.events: dict[int, object] = {}         # k -> event: sub-group k is back on the host
        if self.cuda:
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device)   # also runs the kernels
        self._step = torch.zeros((), dtype=torch.float32, device=self.device)
        self._scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.elements = 0                           # a statistic: elements stepped here so far
        self.timing = False                         # record the GPU span of each step (benchmarks)
        self._span: list = [None, None]             # (start, end) CUDA events of the current step
        self.resident: dict[int, tuple[torch.Tensor, ...]] = {}   # k -> (master, exp_avg, exp_avg_sq) here
        self._parked: dict[tuple[int, int], torch.Tensor] = {}      # (k, position) -> host copy (offload_states)

    def gpu_bytes(self) -> int:
        """GPU memory the lane's chunk buffers take (master, grad, m, v in fp32 + lp)."""
        g = self.gdtype
        extra = torch.finfo(g).bits // 8 if g != torch.float32 else 0
        return self.nbuf * self.chunk * (16 + torch.finfo(self.pdtype).bits // 8 + extra)

    def resident_bytes(self) -> int:
        """GPU memory of the resident sub-groups (fp32 master and two moments)."""
        return sum(12 * t[0].numel() for t in self.resident.values())

    # -- resident sub-groups ------------------------------------------------------------
    def make_resident(self, k: int, state, master: torch.Tensor) -> None:
        """Sub-group k's master and moments go up once and live here from now on."""
        self.resident[k] = tuple(torch.empty(master.numel(), dtype=torch.float32, device=self.device)
                                 for _ in range(3))
        self.from_host(k, state, master)

    def from_host(self, k: int, state, master: torch.Tensor) -> None:
        """The host master and moments of resident sub-group k (loaded, say) into its GPU copies."""
        st = self.states(state, master)
        for d, h in zip(self.resident[k], (master, st["exp_avg"], st["exp_avg_sq"])):
            d.copy_(h.reshape(-1))

    def to_host(self, k: int, state, master: torch.Tensor) -> None:
        """Resident sub-group k's master and moments into their host tensors (to be read)."""
        st = self.states(state, master)
        for h, d in zip((master, st["exp_avg"], st["exp_avg_sq"]), self.resident[k]):
            h.view(-1).copy_(d)

    def park(self, which: tuple[int, ...]) -> None:
        """``offload_states``: the resident tensors at positions ``which`` (0 master, 1 and 2
        the moments) are copied to host memory and their GPU memory is freed."""
        self.synchronize()
        for k, ts in self.resident.items():
            for i in which:
                t = ts[i]
                if (k, i) in self._parked or not t.untyped_storage().size():
                    continue
                self._parked[(k, i)] = t.to("cpu", copy=True)
                t.untyped_storage().resize_(0)

    def unpark(self) -> None:
        """``reload_states``: the parked tensors back into GPU memory."""
        for (k, i), host in self._parked.items():
            t = self.resident[k][i]
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(host)
        self._parked.clear()

    def _buffers(self, j: int) -> list[torch.Tensor]:
        while len(self._bufs) <= j:
            f32 = [torch.empty(self.chunk, dtype=torch.float32, device=self.device) for _ in range(4)]
            lp = torch.empty(self.chunk, dtype=self.pdtype, device=self.device)
            g = self.gdtype
            g16 = torch.empty(self.chunk, dtype=g, device=self.device) if g != torch.float32 else None
            self._bufs.append(f32 + [lp, g16])
        return self._bufs[j]

    def states(self, state, p: torch.Tensor) -> dict:
        """cpu_adam's state of ``p``, its moments in page-locked memory (async copies need it)."""
        st = state[p]
        tier = self.tier
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = tier.empty(p.numel(), torch.float32).zero_().view_as(p)
            st["exp_avg_sq"] = tier.empty(p.numel(), torch.float32).zero_().view_as(p)
        elif self.cuda:
            for key in ("exp_avg", "exp_avg_sq"):
                tier.pin(st[key])       # loaded from a checkpoint into a plain tensor
        return st

    def enqueue(self, group: dict, state, k: int, master: torch.Tensor, a: int, mult: float,
                lp_host: torch.Tensor | None = None) -> None:
        """Start the step of sub-group k (master elements [a, a + numel); ``group``: its param
        group, ``state``: the optimizer's state). On a GPU this returns once the work is
        queued; ``events[k]`` marks its end. ``lp_host``: a host buffer over all master
        elements that takes the model-dtype values instead of the shards (delayed update)."""
        st = self.states(state, master)
        st["step"] += 1
        n = master.numel()
        self.elements += n
        if n == 0:
            return
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        hp = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                  weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                  amsgrad=False, maximize=False)
        host = (master.view(-1), master.grad.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1))
        resident = self.resident.get(k)
        if resident is not None:        # only the gradient comes from the host
            host = (None, host[1], None, None)
        on_gpu = self.cuda and self.tier.lp_on_device(a, a + n) and lp_host is None
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))   # the gradients' D2H
            if self.timing and self._span[0] is None:
                self._span[0] = torch.cuda.Event(enable_timing=True)
                self._span[0].record(self.h2d)
        with torch.cuda.stream(self.d2h) if self.cuda else nullcontext():   # stream-ordered: no host sync
            self._step.fill_(float(st["step"]))
            self._scale.fill_(1.0 / mult)
        scale = None if mult == 1.0 else self._scale
        for x in range(0, n, self.chunk):
            y = min(n, x + self.chunk)
            j = self._next
            self._next = (j + 1) % self.nbuf
            bufs = [t[:y - x] if t is not None else None for t in self._buffers(j)]
            if resident is not None:
                bufs[0], bufs[2], bufs[3] = (t[x:y] for t in resident)
            if not self.cuda:
                self._chunk(bufs, host, x, y, a, kernel, hp, scale, on_gpu, lp_host)
                continue
            with torch.cuda.stream(self.h2d):
                if self._free[j] is not None:
                    self.h2d.wait_event(self._free[j])
                g16 = bufs[5]
                for d, h in zip(bufs, host):
                    if h is None:
                        continue                                # resident: already here
                    if d is bufs[1] and g16 is not None:
                        g16.copy_(h[x:y], non_blocking=True)    # 2 bytes over the link, widened here
                        d.copy_(g16)
                    else:
                        d.copy_(h[x:y], non_blocking=True)
                ready = self.h2d.record_event()
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(ready)
                self._chunk(bufs, host, x, y, a, kernel, hp, scale, on_gpu, lp_host)
                self._free[j] = self.d2h.record_event()
        if self.cuda:
            self.events[k] = self._free[(self._next - 1) % self.nbuf]
            if self.timing:
                self._span[1] = torch.cuda.Event(enable_timing=True)
                self._span[1].record(self.d2h)

    def span_seconds(self) -> float | None:
        """GPU time from the step's first H2D to its last D2H (``timing`` on); waits for it."""
        start, end = self._span
        self._span = [None, None]
        if start is None or end is None:
            return None
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def _chunk(self, bufs, host, x, y, a, kernel, hp, scale, on_gpu, lp_host=None) -> None:
        bp, bg, bm, bv, blp, _ = bufs
        if not self.cuda:
            for d, h in zip(bufs, host):
                if h is not None:
                    d.copy_(h[x:y])
        kernel([bp], [bg], [bm], [bv], [], [self._step], grad_scale=scale, found_inf=None, **hp)
        blp.copy_(bp)
        for h, d in zip((host[0], host[2], host[3]), (bp, bm, bv)):
            if h is not None:       # (resident: the states stay here)
                h[x:y].copy_(d, non_blocking=True)
        if lp_host is not None:
            lp_host[a + x:a + y].copy_(blp, non_blocking=self.cuda)
            return
        for u, ux, uy, s in self.tier.pieces(a + x, a + y):
            src = blp[s:s + uy - ux]
            if on_gpu or not self.cuda:
                u.shard[ux:uy].copy_(src)
            else:
                u.shard[ux:uy].copy_(src, non_blocking=True)

    def order_after(self, k: int, stream) -> None:
        """GPU-side: ``stream``'s next work runs after sub-group k's lane work."""
        ev = self.events.get(k)
        if ev is not None:
            stream.wait_event(ev)

    def synchronize(self) -> None:
        """Block until every queued chunk is back on the host."""
        if self.cuda:
            self.d2h.synchronize()
        self.events.clear()
