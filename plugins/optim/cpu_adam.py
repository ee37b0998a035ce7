"""CPU Adam / AdamW at memory-bandwidth speed, in PyTorch only.

``CPUAdam`` steps fp32 CPU parameters (usually the flat, contiguous sub-groups of an
offloaded ZeRO shard) with the semantics of ``torch.optim.AdamW`` (``adamw_mode=True``:
decoupled weight decay) or ``torch.optim.Adam`` (``adamw_mode=False``: L2 decay added to
the gradient), plus DeepSpeed's ``bias_correction`` switch.

An Adam step is memory bound: the fp32 step reads p, g, m, v and writes p, m, v (28 bytes
per element) and does a sqrt and a division per element, which a vector unit hides behind
the memory traffic.  So what matters is that every element is touched exactly once.  The
offload update (``step_param(p, grad=bf16, lp_out=bf16)``) must in the same single pass
convert the gradient, apply the gradient multiplier and write the low-precision copy of the
parameter; done with separate torch ops that would be 4-5 passes over memory.

Two implementations, picked per call (``impl="auto"``, the default): ``compile``, one
``torch.compile`` d kernel over the whole sub-group (for conversions / lp copies /
multipliers, where it works), or ``eager``, ATen's fused single-pass kernel. Both, and how
the compiled kernel is built and checked, are in :mod:`.cpu_adam_kernels`.

Tensors below ``_MIN_COMPILE_NUMEL`` always use ``eager`` (a compiled call costs ~30-40 us
of guard and wrapper overhead).  Set ``ZEROPLUG_CPU_ADAM_IMPL=eager`` (or
``CPUAdam(..., impl="eager")``) to force the fallback; ``impl="compile"`` makes compile
failures errors instead of warnings.

This module and :mod:`.cpu_adam_kernels` import nothing else from zeroplug, so that the
two files can be used on their own.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Iterable

import torch

from . import cpu_adam_kernels as kernels
from .cpu_adam_kernels import compile_status, eager_update, scalars

__all__ = ["CPUAdam", "compile_status"]

_IMPL_ENV = "ZEROPLUG_CPU_ADAM_IMPL"
_IMPLS = ("auto", "compile", "eager")
# Below this many elements a sub-group takes the eager path (compiled-call overhead).
_MIN_COMPILE_NUMEL = 1 << 16
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- optimizer
class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 CPU parameters, one fused pass over memory per sub-group.

    State uses torch's names (``step`` as a float32 0-dim tensor, ``exp_avg``,
    ``exp_avg_sq``) so that state dicts load into ``torch.optim.AdamW`` and back.

    It is a :class:`zeroplug.tiers.SubGroupOptimizer`: :meth:`step_group` steps one param
    group with a gradient multiplier applied inside the one pass (the engine folds
    loss-scale unscaling and clipping into it).
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
        threads: int | None = None,
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
        # the compiled kernel's OpenMP threads when a call names none (None: torch's count)
        self.threads = int(threads) if threads else None
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
        self.__dict__.setdefault("threads", None)
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

    def init_group_states(self, k: int) -> None:
        """Allocate param group ``k``'s moments now (zeroplug.tiers.SubGroupOptimizer): an
        offload tier calls it inside ``initialize`` so the first step allocates nothing."""
        for p in self.param_groups[k]["params"]:
            self._init_state(p)

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
        fn = kernels.COMPILED.get(key, strict=self.impl == "compile", threads=self.threads)
        return "compile" if fn is not None else "eager"

    def kernel_variants(self, grad_dtypes, lp_dtype) -> list[tuple]:
        """The compiled variants (adamw, grad dtype, lp dtype) that steps with these dtypes
        use: the keys :meth:`warm_up` takes (none when every such step is eager)."""
        if self.impl == "eager":
            return []
        largest = max((p.numel() for g in self.param_groups for p in g["params"]), default=0)
        if largest < _MIN_COMPILE_NUMEL and self.impl != "compile":
            return []           # every call takes the eager path (compiled-call overhead)
        modes = sorted({bool(g["adamw_mode"]) for g in self.param_groups})
        lp = torch.empty(0, dtype=lp_dtype) if lp_dtype is not None else None
        return [(m, g, lp_dtype) for m in modes for g in dict.fromkeys(grad_dtypes)
                if self._wants_compiled(g, lp, 0.5, _MIN_COMPILE_NUMEL)]

    def warm_up(self, keys, thread_counts=(None,)) -> dict:
        """Build (or load from inductor's cache) and probe each variant in ``keys`` for each
        thread count (None: this optimizer's ``threads``), so that no step compiles. Returns
        ``{key: "compile" | "eager"}``; failures fall back to eager as in a step."""
        out = {}
        for key in keys:
            for t in thread_counts:
                fn = kernels.COMPILED.get(key, strict=self.impl == "compile", threads=t or self.threads)
                out[key] = "compile" if fn is not None else "eager"
        return out

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
        grad_multiplier: float = 1.0,
        threads: int | None = None,
    ) -> None:
        """Step one parameter (sub-group) in one fused pass.

        ``grad`` defaults to ``p.grad``; fp32, bf16 or fp16, converted inside the pass and
        multiplied by ``grad_multiplier``.
        ``lp_out`` (bf16/fp16/fp32, ``p.numel()`` elements) receives the updated parameter
        rounded to its dtype in the same pass; it may also be a list of contiguous tensors
        of one dtype that together hold ``p.numel()`` elements, filled in order (the
        parameter shards of the units a sub-group spans).  Safe to call from a worker
        thread while other parameters' gradients are still arriving. ``threads``: the
        compiled kernel's OpenMP threads (default: the optimizer's ``threads``, else all of
        torch's; fewer leave cores to a training loop running beside the step; the eager
        path ignores it).
        """
        if grad is None:
            grad = p.grad
            if grad is None:
                raise ValueError("step_param: no grad given and p.grad is None")
        self._step(p, self._find_group(p), grad, lp_out, float(grad_multiplier), threads)

    @torch.no_grad()
    def step_group(self, k: int, lp_out=None, grad_multiplier: float = 1.0, threads: int | None = None) -> None:
        """Step param group ``k`` alone (an offloaded sub-group:
        :meth:`zeroplug.tiers.SubGroupOptimizer.step_group`). ``lp_out`` (with a group of one
        tensor), ``grad_multiplier`` and ``threads`` as in :meth:`step_param`."""
        params = [p for p in self.param_groups[k]["params"] if p.grad is not None]
        if lp_out is not None and len(params) != 1:
            raise ValueError("cpu_adam.step_group: lp_out needs a param group of one tensor")
        for p in params:
            self.step_param(p, lp_out=lp_out, grad_multiplier=grad_multiplier, threads=threads)

    def _step(self, p, group, grad, lp_out, grad_scale, threads=None) -> None:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise TypeError(f"cpu_adam steps fp32 CPU tensors, got {p.dtype} on {p.device}")
        if grad.is_sparse:
            raise RuntimeError("cpu_adam does not support sparse gradients")
        if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"cpu_adam: grad must be fp32/bf16/fp16 on CPU, got {grad.dtype}")
        if grad.numel() != p.numel():
            raise ValueError(f"cpu_adam: grad has {grad.numel()} elements, param {p.numel()}")
        pieces = None
        if isinstance(lp_out, (list, tuple)):
            pieces = list(lp_out)
            if (not pieces or len({t.dtype for t in pieces}) != 1 or any(not t.is_contiguous() for t in pieces)
                    or sum(t.numel() for t in pieces) != p.numel()):
                raise ValueError("cpu_adam: lp_out pieces must be contiguous tensors of one dtype "
                                 "holding p.numel() elements together")
            lp_out = pieces[0]
        if lp_out is not None and (
            lp_out.dtype not in _LP_DTYPES
            or (pieces is None and lp_out.numel() != p.numel())
            or any(t.device.type != "cpu" for t in (pieces or [lp_out]))
        ):
            raise ValueError("cpu_adam: lp_out must be a CPU bf16/fp16/fp32 tensor of p.numel()")
        n = p.numel()
        fn = None
        threads = threads or self.threads
        if self._wants_compiled(grad.dtype, lp_out, grad_scale, n):
            key = (bool(group["adamw_mode"]), grad.dtype,
                   lp_out.dtype if lp_out is not None else None)
            fn = kernels.COMPILED.get(key, strict=self.impl == "compile", threads=threads)
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
        if pieces is not None:      # one kernel call per piece, the same step for all
            lp_out, lpc, s0 = None, True, 0
            for t in pieces:
                e = s0 + t.numel()
                small = t.numel() < _MIN_COMPILE_NUMEL and self.impl != "compile"  # call overhead
                self._kernel(None if small else fn, pf[s0:e], gf[s0:e], mf[s0:e], vf[s0:e], t.view(-1), step_t, hp,
                             bias_correction, grad_scale)
                s0 = e
        else:
            lpf, lpc = _flat(lp_out) if lp_out is not None else (None, True)
            self._kernel(fn, pf, gf, mf, vf, lpf, step_t, hp, bias_correction, grad_scale)
        # Non-contiguous tensors were stepped through contiguous copies: write back.
        if not pc:
            p.detach().copy_(pf.view_as(p))
        if not mc:
            m.copy_(mf.view_as(m))
        if not vc:
            v.copy_(vf.view_as(v))
        if not lpc:
            lp_out.copy_(lpf.view_as(lp_out))

    def _kernel(self, fn, pf, gf, mf, vf, lpf, step_t, hp, bias_correction, grad_scale) -> None:
        """The update of flat contiguous views: compiled ``fn`` or, failing that, eager."""
        if fn is not None:
            sc = scalars(hp, float(step_t.item()), bias_correction, grad_scale)
            try:
                if lpf is not None:
                    fn(pf, gf, mf, vf, lpf, sc)
                else:
                    fn(pf, gf, mf, vf, sc)
            except Exception as e:  # a (re)compilation failed: nothing was written yet
                if self.impl == "compile":
                    raise
                key = (hp["adamw"], gf.dtype, lpf.dtype if lpf is not None else None)
                kernels.COMPILED.failed(key, e)
                warnings.warn(f"cpu_adam: compiled kernel failed ({e!r:.300}); using eager",
                              RuntimeWarning, stacklevel=3)
                fn = None
        if fn is None:
            scratch = getattr(self._tls, "scratch", None)
            if scratch is None:
                scratch = self._tls.scratch = {}
            eager_update(pf, gf, mf, vf, lpf, step_t, hp, bias_correction, grad_scale, scratch)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """1-D view of ``t`` (detached) and whether it aliases ``t``'s memory."""
    t = t.detach()
    if t.is_contiguous():
        return t.view(-1), True
    return t.contiguous().view(-1), False
