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
the compiled kernel is built and checked, are in :mod:`.kernels`. Moments held
as int8 or bf16 (``state_dtype``) take a third, ``native``: our own fused C kernel
(:mod:`.native`), at every size; ``impl="native"`` makes its failures errors,
``impl="compile"`` (or ``eager``) never uses it. fp32 moments take the native kernel only
with ``impl="native"`` (``ZEROPLUG_CPU_ADAM_IMPL=native``); ``auto`` keeps them on the
compiled / eager paths.

Tensors below ``_MIN_COMPILE_NUMEL`` always use ``eager`` (a compiled call costs ~30-40 us
of guard and wrapper overhead).  Set ``ZEROPLUG_CPU_ADAM_IMPL=eager`` (or
``CPUAdam(..., impl="eager")``) to force the fallback; ``impl="compile"`` makes compile
failures errors instead of warnings.

``state_dtype`` ("fp32", "bf16", "int8") is how Adam's moments are held: fp32, bf16
(rounded to nearest on every store), or block-quantised 8-bit codes with one fp32 absmax per
256 elements (:mod:`zeroplug.quantized_states`; ``exp_avg`` int8 codes and
``exp_avg_absmax``, ``exp_avg_sq`` uint8 codes and ``exp_avg_sq_absmax``). The step reads and
writes them in that form; the master stays fp32.

This module and :mod:`.kernels` import nothing else from zeroplug but that state
format (and :mod:`.native`, which finds zeroplug's cache directory), so that the
files can be used on their own.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Iterable

import torch

from . import kernels
from .native import LOADER as NATIVE
from .kernels import STATE_KINDS, compile_status, compiled_call, eager_small_states, eager_update, scalars
from zeroplug.quantized_states import ABSMAX, BLOCK, dequantize, empty_state, is_codes, quantize

__all__ = ["CPUAdam", "compile_status", "native_steps", "resolve_impl"]

_IMPL_ENV = "ZEROPLUG_CPU_ADAM_IMPL"
_IMPLS = ("auto", "compile", "eager", "native")
# Below this many elements a sub-group takes the eager path (compiled-call overhead).
_MIN_COMPILE_NUMEL = 1 << 16
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Note: the first moment takes either sign, the second never a negative one: int8 codes of
# the signed table and uint8 codes of the unsigned one (zeroplug.quantized_states).
_CODES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def resolve_impl(impl: str | None = None) -> str:
    """The implementation ``CPUAdam(impl=impl)`` takes: ``impl``, else ``ZEROPLUG_CPU_ADAM_IMPL``,
    else "auto"."""
    out = (impl or os.environ.get(_IMPL_ENV) or "auto").lower()
    if out not in _IMPLS:
        raise ValueError(f"cpu_adam impl must be one of {_IMPLS}, got {out!r}")
    return out


def native_steps(state_dtype: str, impl: str | None = None) -> bool:
    """Whether ``CPUAdam(impl=impl, state_dtype=state_dtype)`` steps with the native kernel,
    where it is available: int8 or bf16 moments unless ``impl`` is "compile" / "eager", fp32
    moments with ``impl="native"``.

    Note: fp32 moments stay on the compiled / eager paths under ``auto`` until the native
    kernel's fp32 step is measured against the compiled one on the GPU machines' CPUs."""
    impl = resolve_impl(impl)
    if state_dtype == "fp32":
        return impl == "native"
    return impl in ("auto", "native")


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
        state_dtype: str = "fp32",
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
        self.impl = impl = resolve_impl(impl)
        if state_dtype not in STATE_KINDS:
            raise ValueError(f"cpu_adam state_dtype must be one of {STATE_KINDS}, got {state_dtype!r}")
        # how Adam's moments are held: fp32, bf16, or block-quantised 8-bit codes + per-block absmax
        self.state_dtype = state_dtype
        # the compiled kernel's OpenMP threads when a call names none (None: torch's count)
        self.threads = int(threads) if threads else None
        if self._native_states():
            NATIVE.start()      # built beside the rest of initialize, not in the first step
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
        self.__dict__.setdefault("state_dtype", "fp32")
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
                    for key in _MOMENTS:
                        if self.state_dtype == "int8":
                            codes, absmax = empty_state(p.numel(), _CODES[key])
                            state[key] = codes.view(p.shape)
                            state[key + ABSMAX] = absmax
                        else:
                            dt = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
                            state[key] = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then every moment converted to this optimizer's ``state_dtype``:
        fp32 / bf16 values are rounded (bf16), widened (fp32) or block-quantised (int8);
        block-quantised ones are decoded (fp32, bf16).

        Note: torch casts every tensor state of a floating parameter to the parameter's dtype
        as it loads (8-bit codes would become floats, and a state whose storage an nvme tier
        has freed would be read), so the tensors go past it and are put in place here."""
        held = {pid: {k: v for k, v in st.items() if k != "step" and torch.is_tensor(v)}
                for pid, st in state_dict["state"].items()}
        rest = {pid: {k: v for k, v in st.items() if k not in held[pid]} for pid, st in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if held.get(pid):
                self.state[p].update({k: v.to(device=p.device) for k, v in held[pid].items()})
        for p, state in self.state.items():
            self.convert_state(p, state)

    def convert_state(self, p: torch.Tensor, state: dict) -> None:
        """``state``'s moments, in whatever form, held as this optimizer's ``state_dtype``."""
        for key in _MOMENTS:
            cur = state.get(key)
            if not torch.is_tensor(cur):
                continue
            absmax = state.pop(key + ABSMAX, None)
            if is_codes(cur):
                if absmax is None:
                    raise ValueError(f"cpu_adam: state {key!r} holds 8-bit codes without {key + ABSMAX!r}")
                if self.state_dtype == "int8" and cur.dtype == _CODES[key]:
                    state[key + ABSMAX] = absmax
                    continue
                cur = dequantize(cur.reshape(-1), absmax).view(p.shape)
            if self.state_dtype == "int8":
                codes, absmax = quantize(cur, _CODES[key])
                state[key] = codes.view(p.shape)
                state[key + ABSMAX] = absmax
            else:
                dt = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
                state[key] = cur.to(dt, memory_format=torch.contiguous_format)

    def _native_states(self) -> bool:
        """Whether steps take the native kernel, where it is available (:func:`native_steps`)."""
        return native_steps(self.state_dtype, self.impl)

    def _native(self, grad_dtype, lp_dtype):
        """The native kernel for a step with these dtypes, or None (compiled / eager)."""
        if not self._native_states():
            return None
        nat = NATIVE.get(strict=self.impl == "native")
        if nat is not None and not nat.supports(grad_dtype, lp_dtype):
            if self.impl == "native":
                raise RuntimeError("cpu_adam: the native kernel was built without fp16 support")
            return None
        return nat

    def _wants_compiled(self, grad_dtype, lp_out, grad_scale, numel) -> bool:
        if self.impl in ("eager", "native") or numel < _MIN_COMPILE_NUMEL:
            return False
        if self.impl == "compile":
            return True
        # auto: a plain fp32 step is already one pass in ATen's fused kernel (measured
        # equal to the compiled kernel); compile only where a conversion / copy is fused.
        return (grad_dtype != torch.float32 or lp_out is not None or grad_scale != 1.0
                or self.state_dtype != "fp32")

    def implementation(
        self, grad_dtype=torch.float32, lp_dtype=None, numel=1 << 20, grad_scale=1.0,
        adamw_mode: bool | None = None,
    ) -> str:
        """Which path a call with these arguments takes: "native", "compile" or "eager".

        May compile (and probe) the kernel variant on first use.
        """
        if numel and self._native(grad_dtype, lp_dtype) is not None:
            return "native"
        lp = torch.empty(0, dtype=lp_dtype) if lp_dtype is not None else None
        if not self._wants_compiled(grad_dtype, lp, grad_scale, numel):
            return "eager"
        if adamw_mode is None:
            adamw_mode = bool(self.param_groups[0]["adamw_mode"])
        key = self._key(adamw_mode, grad_dtype, lp_dtype)
        fn = kernels.COMPILED.get(key, strict=self.impl == "compile", threads=self.threads)
        return "compile" if fn is not None else "eager"

    def _key(self, adamw: bool, grad_dtype, lp_dtype) -> tuple:
        """The compiled variant's key: (adamw, grad dtype, lp dtype[, state kind unless fp32])."""
        key = (bool(adamw), grad_dtype, lp_dtype)
        return key if self.state_dtype == "fp32" else key + (self.state_dtype,)

    def kernel_variants(self, grad_dtypes, lp_dtype) -> list[tuple]:
        """The compiled variants (adamw, grad dtype, lp dtype) that steps with these dtypes
        use: the keys :meth:`warm_up` takes (none when every such step is eager)."""
        if self.impl == "eager" or (self._native_states() and not NATIVE.disabled()):
            return []           # (the native kernel builds on its own thread)
        largest = max((p.numel() for g in self.param_groups for p in g["params"]), default=0)
        if largest < _MIN_COMPILE_NUMEL and self.impl != "compile":
            return []           # every call takes the eager path (compiled-call overhead)
        modes = sorted({bool(g["adamw_mode"]) for g in self.param_groups})
        lp = torch.empty(0, dtype=lp_dtype) if lp_dtype is not None else None
        return [self._key(m, g, lp_dtype) for m in modes for g in dict.fromkeys(grad_dtypes)
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
        native = self._native(grad.dtype, lp_out.dtype if lp_out is not None else None) if n else None
        if native is None and self._wants_compiled(grad.dtype, lp_out, grad_scale, n):
            key = self._key(group["adamw_mode"], grad.dtype, lp_out.dtype if lp_out is not None else None)
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
        if self.state_dtype == "int8":
            st = (mf, state["exp_avg" + ABSMAX], vf, state["exp_avg_sq" + ABSMAX])
        else:
            st = (mf, vf)
        if pieces is not None and self.state_dtype == "int8":
            # Note: the codes' blocks run across the pieces' borders, so the step is one call
            # over the whole sub-group and the pieces are copied from the updated master.
            self._kernel(fn, pf, gf, st, None, step_t, hp, bias_correction, grad_scale, native, threads)
            s0 = 0
            for t in pieces:
                t.view(-1).copy_(pf[s0:s0 + t.numel()])
                s0 += t.numel()
            lp_out, lpc = None, True
        elif pieces is not None:    # one kernel call per piece, the same step for all
            lp_out, lpc, s0 = None, True, 0
            for t in pieces:
                e = s0 + t.numel()
                small = t.numel() < _MIN_COMPILE_NUMEL and self.impl != "compile"  # call overhead
                self._kernel(None if small else fn, pf[s0:e], gf[s0:e], tuple(x[s0:e] for x in st),
                             t.view(-1), step_t, hp, bias_correction, grad_scale, native, threads)
                s0 = e
        else:
            lpf, lpc = _flat(lp_out) if lp_out is not None else (None, True)
            self._kernel(fn, pf, gf, st, lpf, step_t, hp, bias_correction, grad_scale, native, threads)
        # Non-contiguous tensors were stepped through contiguous copies: write back.
        if not pc:
            p.detach().copy_(pf.view_as(p))
        if not mc:
            m.copy_(mf.view_as(m))
        if not vc:
            v.copy_(vf.view_as(v))
        if not lpc:
            lp_out.copy_(lpf.view_as(lp_out))

    def _kernel(self, fn, pf, gf, st, lpf, step_t, hp, bias_correction, grad_scale, native=None,
                threads=None) -> None:
        """The update of flat contiguous views (``st``: the moments, as ``compiled_call``
        takes them): the ``native`` kernel (every element), compiled ``fn``
        or, failing either, eager. For block-quantised moments the compiled kernel steps the
        whole blocks and the eager path the last, shorter one."""
        done = 0
        if native is not None:
            sc = scalars(hp, float(step_t.item()), bias_correction, grad_scale)
            try:
                native.step(pf, gf, st, lpf, sc, hp["adamw"], threads or torch.get_num_threads())
                return
            except Exception as e:  # checked before the call: nothing was written
                if self.impl == "native":
                    raise
                NATIVE.failed(e)
                warnings.warn(f"cpu_adam: native kernel failed ({e!r:.300}); using eager",
                              RuntimeWarning, stacklevel=3)
        if fn is not None:
            sc = scalars(hp, float(step_t.item()), bias_correction, grad_scale)
            try:
                done = compiled_call(fn, self.state_dtype, pf, gf, st, lpf, sc)
            except Exception as e:  # a (re)compilation failed: nothing was written yet
                if self.impl == "compile":
                    raise
                key = self._key(hp["adamw"], gf.dtype, lpf.dtype if lpf is not None else None)
                kernels.COMPILED.failed(key, e)
                warnings.warn(f"cpu_adam: compiled kernel failed ({e!r:.300}); using eager",
                              RuntimeWarning, stacklevel=3)
                done = 0
        if done == pf.numel():
            return
        scratch = getattr(self._tls, "scratch", None)
        if scratch is None:
            scratch = self._tls.scratch = {}
        if self.state_dtype == "fp32":
            eager_update(pf, gf, st[0], st[1], lpf, step_t, hp, bias_correction, grad_scale, scratch)
            return
        if done:     # int8: the tail after the whole blocks (its absmax is the next one)
            b = done // BLOCK
            st = (st[0][done:], st[1][b:], st[2][done:], st[3][b:])
            pf, gf, lpf = pf[done:], gf[done:], lpf[done:] if lpf is not None else None
        eager_small_states(pf, gf, st, lpf, step_t, hp, bias_correction, grad_scale, scratch, self.state_dtype)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """1-D view of ``t`` (detached) and whether it aliases ``t``'s memory."""
    t = t.detach()
    if t.is_contiguous():
        return t.view(-1), True
    return t.contiguous().view(-1), False
