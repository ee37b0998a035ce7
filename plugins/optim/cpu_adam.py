"""CPU Adam / AdamW at memory-bandwidth speed, in PyTorch only.

``CPUAdam`` steps fp32 CPU parameters (usually the flat, contiguous sub-groups of an
offloaded ZeRO shard) with the semantics of ``torch.optim.AdamW`` (``adamw_mode=True``:
decoupled weight decay) or ``torch.optim.Adam`` (``adamw_mode=False``: L2 decay added to
the gradient), plus DeepSpeed's ``bias_correction`` switch.

An Adam step is memory bound: the fp32 step reads p, g, m, v and writes p, m, v (28 bytes
per element) and does a sqrt and a division per element, which a vector unit hides behind
the memory traffic.  So what matters is that every element is touched exactly once.  The
offload update (``step_param(p, grad=bf16, lp_out=bf16)``) must in the same single pass
convert the gradient, apply ``grad_scale`` and write the low-precision copy of the
parameter; done with separate torch ops that would be 4-5 passes over memory.

Two implementations, picked per call (``impl="auto"``, the default):

``compile`` (for conversions / lp copies / grad_scale, where it works)
    One ``torch.compile`` d (inductor, C++/OpenMP, vectorised) elementwise kernel over the
    whole sub-group: load p, g (any float dtype), m, v; compute in fp32; store p, m, v and
    optionally the bf16/fp16 copy.  ``dynamic=True``: one compilation per (adamw, grad
    dtype, lp dtype) serves every size and storage offset.  Needs a working C++ compiler
    at run time; the first call of each variant compiles it (seconds; up to a minute with
    a cold inductor cache) and checks it against the eager path on a 1M-element probe, for
    results and for speed (a compiled kernel more than 1.3x slower than the eager path is
    not used).  Any failure falls back to ``eager`` with a warning.
``eager``
    ``torch._fused_adam(w)_`` (ATen's vectorised, multi-threaded single-pass CPU kernel).
    A plain fp32 step (fp32 grad, ``grad_scale=1``, no lp copy) is one call over the whole
    tensor; ``auto`` always takes it, because it is already one pass at memory speed
    (measured equal to the compiled kernel) and needs no compiler.  When the gradient must
    be converted / scaled or an lp copy written, the tensor is walked in cache-sized chunks
    (64K elements per thread) so that the conversion, the step and the copy-out of a chunk
    all hit L2 instead of streaming the whole tensor 3 times.

Measured and dropped: compiled calls per fixed-size chunk (``dynamic=False``), and torch
ops / ``_foreach`` ops per L2-sized chunk, on intra-op threads or on a thread pool: 1.3-4x
slower than one kernel over the sub-group (fork/join and dispatch overhead per chunk).

Tensors below ``_MIN_COMPILE_NUMEL`` always use ``eager`` (a compiled call costs ~30-40 us
of guard and wrapper overhead).  Set ``ZEROPLUG_CPU_ADAM_IMPL=eager`` (or
``CPUAdam(..., impl="eager")``) to force the fallback; ``impl="compile"`` makes compile
failures errors instead of warnings.

This module imports nothing from zeroplug so that it can be used on its own.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable

import torch

__all__ = ["CPUAdam", "compile_status"]

_IMPL_ENV = "ZEROPLUG_CPU_ADAM_IMPL"
_IMPLS = ("auto", "compile", "eager")
# Below this many elements a sub-group takes the eager path (compiled-call overhead).
_MIN_COMPILE_NUMEL = 1 << 16
# Eager path: elements per thread in one chunk (p, g, m, v, g32 of a chunk stay in L2).
_EAGER_CHUNK_PER_THREAD = 1 << 16
# Step value fed to the fused ATen kernel when bias_correction=False: beta ** 2**40
# underflows to 0 for every beta < 1, so both corrections become exactly 1.
_NO_BIAS_CORRECTION_STEP = float(2**40)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- kernels
# Scalars travel in one fp32 tensor so that changing lr / step never recompiles:
#   sc = [grad_scale, wd (Adam: L2) or 1 - lr*wd (AdamW), beta1, 1-beta1, beta2, 1-beta2,
#         1/sqrt(bc2), eps, -step_size]
# The step is memory bound only if the arithmetic stays cheap: one sqrt and one division
# per element (the bias correction of the denominator is a multiplication by its
# reciprocal, as in DeepSpeed's CPU-Adam), no select / lerp.  Scalars are fp32, as torch
# rounds Python scalars for fp32 tensors; results match torch.optim.Adam(W) to a few ulp.
def _adam_math(p, g, m, v, sc, adamw: bool):
    gf = g.to(torch.float32) * sc[0]
    if adamw:
        p = p * sc[1]
    else:
        gf = gf + p * sc[1]
    m_new = m * sc[2] + sc[3] * gf
    v_new = v * sc[4] + (sc[5] * gf) * gf
    denom = v_new.sqrt() * sc[6] + sc[7]
    p_new = p + (sc[8] * m_new) / denom
    return p_new, m_new, v_new


def _kernel_adamw(p, g, m, v, sc):
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, True)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)


def _kernel_adam(p, g, m, v, sc):
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, False)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)


def _kernel_adamw_lp(p, g, m, v, lp, sc):
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, True)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    lp.copy_(p_new)


def _kernel_adam_lp(p, g, m, v, lp, sc):
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, False)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    lp.copy_(p_new)


_KERNELS = {
    (True, False): _kernel_adamw,
    (False, False): _kernel_adam,
    (True, True): _kernel_adamw_lp,
    (False, True): _kernel_adam_lp,
}


class _Compiled:
    """Process-wide lazily compiled kernels.

    One ``torch.compile`` d function per (adamw, has lp) pair; each (adamw, grad dtype,
    lp dtype) variant is probed once (compiled and checked) before first use.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: dict[tuple, Callable] = {}
        self.ok: dict[tuple, bool] = {}
        self.speed: dict[tuple, dict] = {}
        self.errors: dict[tuple, str] = {}

    def get(self, key: tuple, strict: bool) -> Callable | None:
        """key = (adamw, grad dtype, lp dtype or None)."""
        ok = self.ok.get(key)
        if ok is None:
            with self.lock:
                ok = self.ok.get(key)
                if ok is None:
                    ok = self._build(key, strict)
        if not ok:
            if strict:
                raise RuntimeError(
                    f"cpu_adam: compiled kernel unavailable ({self.errors.get(key)})"
                )
            return None
        return self.fns[(key[0], key[2] is not None)]

    def _build(self, key: tuple, strict: bool) -> bool:
        adamw, gdt, lpdt = key
        try:
            if not hasattr(torch, "compile"):
                raise RuntimeError("torch.compile is not available")
            if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0"):
                raise RuntimeError("TORCHDYNAMO_DISABLE is set")
            fkey = (adamw, lpdt is not None)
            if fkey not in self.fns:
                self.fns[fkey] = torch.compile(_KERNELS[fkey], dynamic=True, fullgraph=True)
            self.speed[key] = _probe(self.fns[fkey], adamw, gdt, lpdt, check_speed=not strict)
            self.ok[key] = True
        except Exception as e:  # compiler missing, inductor error, wrong result, ...
            msg = f"{type(e).__name__}: {e}".strip()
            self.ok[key] = False
            self.errors[key] = msg[:2000]
            if strict:
                raise RuntimeError(f"cpu_adam: compiled kernel unavailable ({msg[:500]})") from e
            warnings.warn(
                f"cpu_adam: torch.compile kernel unavailable for {_key_str(key)}, "
                f"using the eager path ({msg[:300]})",
                RuntimeWarning,
                stacklevel=4,
            )
        return self.ok[key]


def _key_str(key: tuple) -> str:
    return f"{'adamw' if key[0] else 'adam'} grad={key[1]} lp={key[2]}"


_COMPILED = _Compiled()


def compile_status() -> dict[str, Any]:
    """Which compiled variants were built or failed (and why): for reports and tests."""
    return {
        "ok": [_key_str(k) for k, v in _COMPILED.ok.items() if v],
        "probe_seconds": {_key_str(k): v for k, v in _COMPILED.speed.items() if v},
        "failed": {_key_str(k): _COMPILED.errors.get(k, "") for k, v in _COMPILED.ok.items()
                   if not v},
    }


# Probe size: inductor sizes its OpenMP parallelism from the first example it sees, even
# with dynamic shapes (a 4K probe compiled a single-threaded kernel on a 16-core box:
# 850 Mparams/s against 5,300 for ATen's fused kernel).  A large, odd probe keeps every
# thread busy on any machine (>= min_chunk_size elements per thread up to ~2K threads).
_PROBE_NUMEL = (1 << 20) + 3
# A compiled variant slower than this factor x the eager path on the probe is not used.
_MAX_SLOWDOWN = 1.3


def _probe(fn: Callable, adamw: bool, gdt: torch.dtype, lpdt: torch.dtype | None,
           check_speed: bool) -> dict:
    """Compile ``fn`` for this variant; check it against the eager path (and its speed)."""
    n = _PROBE_NUMEL
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(gdt)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    lp = torch.empty(n, dtype=lpdt) if lpdt is not None else None
    ref = [p.clone(), m.clone(), v.clone()]
    ref_lp = torch.empty_like(lp) if lp is not None else None
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, adamw=adamw)
    step = torch.tensor(3.0)
    sc = _scalars(hp, 3.0, True, 0.5)
    args = (p, g, m, v, lp, sc) if lpdt is not None else (p, g, m, v, sc)
    scratch: dict = {}

    def eager():
        _eager_update(ref[0], g, ref[1], ref[2], ref_lp, step, hp, True, 0.5, scratch)

    with torch.no_grad():
        fn(*args)
        eager()
        for a, b in zip((p, m, v), ref):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                raise RuntimeError("compiled kernel disagrees with the eager reference")
        if lpdt is not None and not torch.equal(lp, p.to(lpdt)):
            raise RuntimeError("compiled kernel wrote a wrong low-precision copy")
        if not check_speed:
            return {}
        t_c, t_e = [], []
        for _ in range(5):  # interleaved, best of 5: robust to a noisy neighbour
            t = time.perf_counter()
            fn(*args)
            t_c.append(time.perf_counter() - t)
            t = time.perf_counter()
            eager()
            t_e.append(time.perf_counter() - t)
    speed = {"compiled_s": min(t_c), "eager_s": min(t_e)}
    if speed["compiled_s"] > _MAX_SLOWDOWN * speed["eager_s"]:
        raise RuntimeError(
            f"compiled kernel is slower than the eager path on {n} elements "
            f"({1e3 * speed['compiled_s']:.2f} ms vs {1e3 * speed['eager_s']:.2f} ms)"
        )
    return speed


def _scalars(hp: dict, step: float, bias_correction: bool, grad_scale: float) -> torch.Tensor:
    lr, b1, b2, wd, eps = hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"]
    if bias_correction:
        bc1 = 1.0 - b1**step
        inv_bc2_sqrt = 1.0 / (1.0 - b2**step) ** 0.5
    else:
        bc1 = inv_bc2_sqrt = 1.0
    decay = 1.0 - lr * wd if hp["adamw"] else wd
    vals = [grad_scale, decay, b1, 1.0 - b1, b2, 1.0 - b2, inv_bc2_sqrt, eps, -(lr / bc1)]
    return torch.tensor(vals, dtype=torch.float32)


def _eager_update(p, g, m, v, lp, step_t, hp, bias_correction, grad_scale, scratch) -> None:
    """ATen fused kernel; chunked through L2 when g needs converting or lp is written."""
    fused = torch._fused_adamw_ if hp["adamw"] else torch._fused_adam_
    if not bias_correction:
        step_t = torch.tensor(_NO_BIAS_CORRECTION_STEP)
    kw = dict(
        lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"],
        eps=hp["eps"], amsgrad=False, maximize=False,
    )
    n = p.numel()
    convert = g.dtype != torch.float32 or grad_scale != 1.0
    if not convert and lp is None:
        fused([p], [g], [m], [v], [], [step_t], **kw)
        return
    chunk = _EAGER_CHUNK_PER_THREAD * max(1, torch.get_num_threads())
    buf = None
    if convert:
        buf = scratch.get("g32")
        if buf is None or buf.numel() < min(n, chunk):
            buf = scratch["g32"] = torch.empty(min(n, chunk) if n else 0, dtype=torch.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pc = p[s:e]
        gc = g[s:e]
        if convert:
            b = buf[: e - s]
            b.copy_(gc)
            if grad_scale != 1.0:
                b.mul_(grad_scale)
            gc = b
        fused([pc], [gc], [m[s:e]], [v[s:e]], [], [step_t], **kw)
        if lp is not None:
            lp[s:e].copy_(pc)


# --------------------------------------------------------------------------- optimizer
class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 CPU parameters, one fused pass over memory per sub-group.

    State uses torch's names (``step`` as a float32 0-dim tensor, ``exp_avg``,
    ``exp_avg_sq``) so that state dicts load into ``torch.optim.AdamW`` and back.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        impl: str | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError(
                'cpu_adam does not implement amsgrad; use optimizer.plugin = "adamw" on the '
                "GPU or set amsgrad = false"
            )
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        impl = (impl or os.environ.get(_IMPL_ENV) or "auto").lower()
        if impl not in _IMPLS:
            raise ValueError(f"cpu_adam impl must be one of {_IMPLS}, got {impl!r}")
        self.impl = impl
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            adamw_mode=adamw_mode, bias_correction=bias_correction, amsgrad=False,
        )
        super().__init__(params, defaults)
        self._group_of: dict[int, tuple] = {}
        self._tls = threading.local()
        self._state_lock = threading.Lock()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("impl", "auto")
        self._group_of = {}
        self._tls = threading.local()
        self._state_lock = threading.Lock()

    def __getstate__(self) -> dict:
        d = super().__getstate__()
        for k in ("_group_of", "_tls", "_state_lock"):
            d.pop(k, None)
        return d

    # -- helpers ------------------------------------------------------------------
    def _find_group(self, p: torch.Tensor) -> dict:
        hit = self._group_of.get(id(p))
        if hit is None or hit[0] is not p:
            self._group_of = {
                id(q): (q, grp) for grp in self.param_groups for q in grp["params"]
            }
            hit = self._group_of.get(id(p))
            if hit is None:
                raise ValueError("step_param: tensor is not a parameter of this optimizer")
        return hit[1]

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            with self._state_lock:
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format
                    )
        return state

    def _wants_compiled(self, grad_dtype, lp_out, grad_scale, numel) -> bool:
        if self.impl == "eager" or numel < _MIN_COMPILE_NUMEL:
            return False
        if self.impl == "compile":
            return True
        # auto: a plain fp32 step is already one pass in ATen's fused kernel (measured
        # equal to the compiled kernel); compile only where a conversion / copy is fused.
        return grad_dtype != torch.float32 or lp_out is not None or grad_scale != 1.0

    def implementation(
        self, grad_dtype=torch.float32, lp_dtype=None, numel=1 << 20, grad_scale=1.0,
        adamw_mode: bool | None = None,
    ) -> str:
        """Which path a call with these arguments takes: "compile" or "eager".

        May compile (and probe) the kernel variant on first use.
        """
        lp = torch.empty(0, dtype=lp_dtype) if lp_dtype is not None else None
        if not self._wants_compiled(grad_dtype, lp, grad_scale, numel):
            return "eager"
        if adamw_mode is None:
            adamw_mode = bool(self.param_groups[0]["adamw_mode"])
        key = (adamw_mode, grad_dtype, lp_dtype)
        fn = _COMPILED.get(key, strict=self.impl == "compile")
        return "compile" if fn is not None else "eager"

    # -- stepping -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step(p, group, p.grad, None, 1.0)
        return loss

    @torch.no_grad()
    def step_param(
        self,
        p: torch.Tensor,
        grad: torch.Tensor | None = None,
        lp_out: torch.Tensor | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        """Step one parameter (sub-group) in one fused pass.

        ``grad`` defaults to ``p.grad``; fp32, bf16 or fp16, converted inside the pass and
        multiplied by ``grad_scale``.  ``lp_out`` (bf16/fp16/fp32, ``p.numel()`` elements)
        receives the updated parameter rounded to its dtype in the same pass.  Safe to
        call from a worker thread while other parameters' gradients are still arriving.
        """
        if grad is None:
            grad = p.grad
            if grad is None:
                raise ValueError("step_param: no grad given and p.grad is None")
        self._step(p, self._find_group(p), grad, lp_out, float(grad_scale))

    def _step(self, p, group, grad, lp_out, grad_scale) -> None:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise TypeError(f"cpu_adam steps fp32 CPU tensors, got {p.dtype} on {p.device}")
        if grad.is_sparse:
            raise RuntimeError("cpu_adam does not support sparse gradients")
        if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"cpu_adam: grad must be fp32/bf16/fp16 on CPU, got {grad.dtype}")
        if grad.numel() != p.numel():
            raise ValueError(f"cpu_adam: grad has {grad.numel()} elements, param {p.numel()}")
        if lp_out is not None and (
            lp_out.dtype not in _LP_DTYPES
            or lp_out.numel() != p.numel()
            or lp_out.device.type != "cpu"
        ):
            raise ValueError("cpu_adam: lp_out must be a CPU bf16/fp16/fp32 tensor of p.numel()")
        n = p.numel()
        fn = None
        if self._wants_compiled(grad.dtype, lp_out, grad_scale, n):
            key = (bool(group["adamw_mode"]), grad.dtype,
                   lp_out.dtype if lp_out is not None else None)
            fn = _COMPILED.get(key, strict=self.impl == "compile")
        state = self._init_state(p)
        step_t = state["step"]
        step_t += 1
        if n == 0:
            return
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        hp = dict(
            lr=float(lr), beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            adamw=bool(group["adamw_mode"]),
        )
        bias_correction = bool(group["bias_correction"])

        # Flat contiguous views (detached: in-place writes into leaves that require grad).
        pf, pc = _flat(p)
        gf = grad.detach().reshape(-1) if grad.is_contiguous() else grad.detach().flatten()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        mf, mc = _flat(m)
        vf, vc = _flat(v)
        lpf, lpc = _flat(lp_out) if lp_out is not None else (None, True)

        if fn is not None:
            sc = _scalars(hp, float(step_t.item()), bias_correction, grad_scale)
            try:
                if lpf is not None:
                    fn(pf, gf, mf, vf, lpf, sc)
                else:
                    fn(pf, gf, mf, vf, sc)
            except Exception as e:  # a (re)compilation failed: nothing was written yet
                if self.impl == "compile":
                    raise
                key = (hp["adamw"], gf.dtype, lpf.dtype if lpf is not None else None)
                _COMPILED.ok[key] = False
                _COMPILED.errors[key] = f"{type(e).__name__}: {e}"[:2000]
                warnings.warn(f"cpu_adam: compiled kernel failed ({e!r:.300}); using eager",
                              RuntimeWarning, stacklevel=3)
                fn = None
        if fn is None:
            scratch = getattr(self._tls, "scratch", None)
            if scratch is None:
                scratch = self._tls.scratch = {}
            _eager_update(pf, gf, mf, vf, lpf, step_t, hp, bias_correction, grad_scale, scratch)
        # Non-contiguous tensors were stepped through contiguous copies: write back.
        if not pc:
            p.detach().copy_(pf.view_as(p))
        if not mc:
            m.copy_(mf.view_as(m))
        if not vc:
            v.copy_(vf.view_as(v))
        if not lpc:
            lp_out.copy_(lpf.view_as(lp_out))


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """1-D view of ``t`` (detached) and whether it aliases ``t``'s memory."""
    t = t.detach()
    if t.is_contiguous():
        return t.view(-1), True
    return t.contiguous().view(-1), False
