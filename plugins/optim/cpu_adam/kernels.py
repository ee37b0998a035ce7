"""The two step implementations of :class:`~.optimizer.CPUAdam`, and the building and
probing of the compiled one.

``compile`` (for conversions / lp copies / grad_scale, where it works)
    One ``torch.compile`` d (inductor, C++/OpenMP, vectorised) elementwise kernel over the
    whole sub-group: load p, g (any float dtype), m, v; compute in fp32; store p, m, v and
    optionally the bf16/fp16 copy.  ``dynamic=True``: one compilation per (adamw, grad
    dtype, lp dtype) serves every size and storage offset.  Needs a working C++ compiler
    at run time; the first call of each variant compiles it (slow with a cold inductor
    cache; docs/benchmarks.md) and checks it against the eager path on a 1M-element probe, for
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
ops / ``_foreach`` ops per L2-sized chunk, on intra-op threads or on a thread pool: slower
than one kernel over the sub-group (fork/join and dispatch overhead per chunk).

Moments in bf16 or block-quantised 8-bit (``state`` "bf16" / "int8", the last key element;
int8 steps take the fused C kernel of :mod:`.native` unless it is unavailable or
``impl`` is "compile" / "eager"):
the compiled kernel loads them, steps in fp32 and stores them rounded, or decodes, steps and
encodes again each block of 256 elements (:mod:`zeroplug.quantized_states`) in its one pass;
the eager path walks the sub-group in chunks of whole blocks, widening each chunk's moments
into fp32 scratch for ATen's fused kernel and narrowing them back. Neither holds an fp32 copy
of a whole state.

This module imports nothing from zeroplug but that state format (which imports only torch),
nor from :mod:`.optimizer`, so that the files can be used on their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import torch

from zeroplug.quantized_states import BLOCK, dequantize_blocks, midpoints, qmap, quantize_

log = logging.getLogger("zeroplug")

# Eager path: elements per thread in one chunk (p, g, m, v, g32 of a chunk stay in L2).
_EAGER_CHUNK_PER_THREAD = 1 << 16
#: how cpu_adam may hold Adam's moments: fp32, bf16, or block-quantised 8-bit codes
STATE_KINDS = ("fp32", "bf16", "int8")
# Step value fed to the fused ATen kernel when bias_correction=False: beta ** 2**40
# underflows to 0 for every beta < 1, so both corrections become exactly 1.
_NO_BIAS_CORRECTION_STEP = float(2**40)


# --------------------------------------------------------------------------- kernels
# Scalars travel in one fp32 tensor so that changing lr / step never recompiles:
#   sc = [grad_scale, wd (Adam: L2) or 1 - lr*wd (AdamW), beta1, 1-beta1, beta2, 1-beta2,
#         1/sqrt(bc2), eps, -step_size]
# The step is memory bound only if the arithmetic stays cheap: one sqrt and one division
# per element (the bias correction of the denominator is a multiplication by its
# reciprocal, as in DeepSpeed's CPU-Adam), no select / lerp.  Scalars are fp32, as torch
# rounds Python scalars for fp32 tensors; results match torch.optim.Adam(W) to a few ulp.
def _adam_math(p, g, m, v, sc, adamw: bool):
    """The new p, m and v (fp32) from p, g, m, v (m and v widened to fp32 here)."""
    gf = g.to(torch.float32) * sc[0]
    if adamw:
        p_decayed = p * sc[1]
    else:
        p_decayed = p
        gf = gf + p * sc[1]
    m_new = m.to(torch.float32) * sc[2] + sc[3] * gf
    v_new = v.to(torch.float32) * sc[4] + (sc[5] * gf) * gf
    denom = v_new.sqrt() * sc[6] + sc[7]
    p_new = p_decayed + (sc[8] * m_new) / denom
    return p_new, m_new, v_new


def _adam_update(p, g, m, v, sc, adamw: bool):
    """p, m, v updated in place (m and v fp32 or bf16: rounded to nearest on the store);
    returns the new p (for the low-precision copy)."""
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, adamw)
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    return p_new


def _q8_moments(p, g, mc, ma, vc, va, qs, qu, sc, adamw: bool):
    """The new p, m, v of block-quantised moments ((blocks, BLOCK) views of flat tensors)."""
    m = qs[mc.view(-1, BLOCK).to(torch.int32) + 128] * ma[:, None]
    v = qu[vc.view(-1, BLOCK).to(torch.int32)] * va[:, None]
    return _adam_math(p.view(-1, BLOCK), g.view(-1, BLOCK), m, v, sc, adamw)


def _q8_absmax(p, g, mc, ma, vc, va, qs, qu, sc, adamw: bool):
    """Pass 1 of the block-quantised step: each block's new absmax of m and v (nothing stored)."""
    _, m_new, v_new = _q8_moments(p, g, mc, ma, vc, va, qs, qu, sc, adamw)
    return m_new.abs().amax(1), v_new.amax(1)


def _count_below(x, mids):
    """How many of the 255 ascending ``mids`` are below each ``x`` (``torch.bucketize``'s
    answer), by an 8-step branch-free binary search of table loads.

    Note: inductor lowers ``torch.bucketize`` with its input in a buffer of its own (a
    whole-tensor fp32 buffer here); table loads stay in the element-wise loop."""
    idx = torch.zeros_like(x, dtype=torch.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        idx = idx + torch.where(mids[idx + (step - 1)] < x, step, 0).to(torch.int32)
    return idx


def _per_element(t):
    """Each block's value for each of its elements (flat): an index expression in inductor,
    no buffer."""
    return t.view(-1, 1).expand(-1, BLOCK).reshape(-1)


def _q8_apply(p, g, mc, ma, vc, va, qs, qu, mids_s, mids_u, am_m, am_v, sc, adamw: bool):
    """Pass 2: the same update again, flat, encoded with the blocks' new absmax; p and the
    codes written in place (the caller stores the absmax after it: a write of ``ma`` here,
    which every element reads, kept the new moments in whole-tensor buffers); returns the
    new p.

    Note: flat, with the block values indexed per element: the same loop nest for every
    store, so inductor makes it one element-wise kernel (in blocks of rows it kept
    whole-tensor buffers of the new p, m and v for the flat stores)."""
    m = qs[mc.to(torch.int32) + 128] * _per_element(ma)
    v = qu[vc.to(torch.int32)] * _per_element(va)
    p_new, m_new, v_new = _adam_math(p, g, m, v, sc, adamw)
    p.copy_(p_new)
    for x, am, codes, mids, off in ((m_new, am_m, mc, mids_s, 128), (v_new, am_v, vc, mids_u, 0)):
        inv = torch.where(am > 0, 1.0 / am, torch.zeros_like(am))
        codes.copy_((_count_below(x * _per_element(inv), mids) - off).to(codes.dtype))
    return p_new


def _make_kernel(adamw: bool, has_lp: bool, state: str = "fp32") -> Callable | tuple[Callable, Callable]:
    """The function compiled for one (AdamW or Adam, with or without lp copy, state kind)
    variant; for "int8" its two passes (each block's new absmax, then the update encoded
    with it).

    Note: one function that reduces each block's new values and encodes them made inductor
    keep whole-tensor fp32 buffers of the new moments between its loops; two passes, a pure
    reduction and a pure element-wise update, keep nothing but the absmax, at the cost of
    reading the codes and the gradient twice."""
    if state == "int8":
        def absmax_pass(p, g, mc, ma, vc, va, qs, qu, sc):
            return _q8_absmax(p, g, mc, ma, vc, va, qs, qu, sc, adamw)
        if has_lp:
            def update_pass(p, g, mc, ma, vc, va, qs, qu, ms, mu, am_m, am_v, lp, sc):
                lp.copy_(_q8_apply(p, g, mc, ma, vc, va, qs, qu, ms, mu, am_m, am_v, sc, adamw))
        else:
            def update_pass(p, g, mc, ma, vc, va, qs, qu, ms, mu, am_m, am_v, sc):
                _q8_apply(p, g, mc, ma, vc, va, qs, qu, ms, mu, am_m, am_v, sc, adamw)
        return absmax_pass, update_pass
    if has_lp:
        def kernel(p, g, m, v, lp, sc):
            lp.copy_(_adam_update(p, g, m, v, sc, adamw))
    else:
        def kernel(p, g, m, v, sc):
            _adam_update(p, g, m, v, sc, adamw)
    return kernel


_KERNELS = {(adamw, has_lp, state): _make_kernel(adamw, has_lp, state)
            for adamw in (True, False) for has_lp in (True, False) for state in STATE_KINDS}


def state_of(key: tuple) -> str:
    """The state kind of a variant key (adamw, grad dtype, lp dtype[, state kind]): fp32 when
    the key names none."""
    return key[3] if len(key) > 3 else "fp32"


def _compile(adamw: bool, has_lp: bool, threads: int | None, state: str = "fp32") -> Callable:
    """The compiled kernel. Note: inductor's default Python binding holds the GIL for the
    whole kernel call (tens of ms per sub-group), which stalls every other Python thread,
    e.g. the training loop launching the next forward while a worker thread steps
    (``overlap_step``); its C++ wrapper releases the GIL at the same speed (measured with
    tests/benchmarks/cpu_adam_gil.py). ZEROPLUG_CPU_ADAM_RELEASE_GIL=0 keeps the default
    binding. ``threads`` fixes the kernel's OpenMP team size (``cpp.threads``)."""
    options: dict[str, Any] = {}
    if os.environ.get("ZEROPLUG_CPU_ADAM_RELEASE_GIL", "1") not in ("", "0"):
        options["cpp_wrapper"] = True
    if threads:
        options["cpp.threads"] = int(threads)
    # the on-disk FX graph cache makes a later process load the kernel instead of building it
    options["fx_graph_cache"] = True
    fns = _KERNELS[(adamw, has_lp, state)]
    if state != "int8":
        return torch.compile(fns, dynamic=True, fullgraph=True, options=options)
    absmax_pass, update_pass = (torch.compile(f, dynamic=True, fullgraph=True, options=options) for f in fns)

    def two_passes(p, g, mc, ma, vc, va, qs, qu, ms, mu, *rest):
        am_m, am_v = absmax_pass(p, g, mc, ma, vc, va, qs, qu, rest[-1])
        update_pass(p, g, mc, ma, vc, va, qs, qu, ms, mu, am_m, am_v, *rest)
        ma.copy_(am_m)
        va.copy_(am_v)
    return two_passes


class CompiledKernels:
    """Process-wide lazily compiled kernels.

    One ``torch.compile`` d function per (adamw, has lp, threads); each (adamw, grad dtype,
    lp dtype) variant is probed (compiled and checked against the eager path) with each
    thread count before its first use. Note: the thread count is fixed in the kernel
    (``cpp.threads``) rather than read from OpenMP at call time, because the step may run on
    a worker thread whose OpenMP setting is not the one torch was given (torchrun's
    ``OMP_NUM_THREADS=1``, say), and a fixed count keys inductor's on-disk cache."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: dict[tuple, Callable] = {}
        self.ok: dict[tuple, bool] = {}
        self.ready: set[tuple] = set()        # (key, threads) probed
        self.speed: dict[tuple, dict] = {}
        self.errors: dict[tuple, str] = {}
        self.compiler_error: str | None = None  # "no C++ compiler": said once
        # a background warm-up (warmup.py): steps wait for it rather than compiling
        self.warming: threading.Event | None = None
        self.warm_up_threads: set[int] = set()
        # while a first build runs: steps take the eager kernel instead of waiting (cpu_adam's
        # ``while_building``)
        self.eager_while_warming = False

    def failed(self, key: tuple, exc: BaseException) -> None:
        """Variant ``key`` failed in a step (a recompilation, say): later steps take the eager
        kernel, and :func:`compile_status` says why."""
        self.ok[key] = False
        self.errors[key] = f"{type(exc).__name__}: {exc}"[:2000]

    def building(self) -> bool:
        """Whether a background warm-up (on another thread) is still running."""
        ev = self.warming
        return ev is not None and not ev.is_set() and threading.get_ident() not in self.warm_up_threads

    def wait_warm_up(self) -> None:
        ev = self.warming
        if ev is not None and not ev.is_set() and threading.get_ident() not in self.warm_up_threads:
            ev.wait()

    def get(self, key: tuple, strict: bool, threads: int | None = None) -> Callable | None:
        """key = (adamw, grad dtype, lp dtype or None); ``threads``: OpenMP threads of the
        kernel (None: torch.get_num_threads() when it is compiled)."""
        if (key, threads) not in self.ready and self.ok.get(key) is not False:
            if self.eager_while_warming and not strict and self.building():
                return None
            self.wait_warm_up()
            with self.lock:
                if (key, threads) not in self.ready and self.ok.get(key) is not False:
                    self._build(key, strict, threads)
        if not self.ok.get(key):
            if strict:
                raise RuntimeError(
                    f"cpu_adam: compiled kernel unavailable ({self.errors.get(key)})"
                )
            return None
        return self.fns[(key[0], key[2] is not None, threads, state_of(key))]

    def _build(self, key: tuple, strict: bool, threads: int | None) -> None:
        adamw, gdt, lpdt = key[:3]
        first = key not in self.ok
        try:
            if not hasattr(torch, "compile"):
                raise RuntimeError("torch.compile is not available")
            if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0"):
                raise RuntimeError("TORCHDYNAMO_DISABLE is set")
            missing = compiler_missing()
            if missing:
                raise _NoCompiler(missing)
            fkey = (adamw, lpdt is not None, threads, state_of(key))
            if fkey not in self.fns:
                self.fns[fkey] = _compile(*fkey)
            # the speed check races the eager kernel on torch's own threads: only a kernel with
            # at least as many threads is a fair match (a rank given fewer cores is not slow)
            fair = threads is None or threads >= torch.get_num_threads()
            speed = _timed_probe(self.fns[fkey], key, threads, check_speed=first and not strict and fair)
            if first:
                self.speed[key] = speed
            self.ok[key] = True
            self.ready.add((key, threads))
        except Exception as e:  # compiler missing, inductor error, wrong result, ...
            msg = f"{type(e).__name__}: {e}".strip()
            self.ok[key] = False
            self.errors[key] = msg[:2000]
            if strict:
                raise RuntimeError(f"cpu_adam: compiled kernel unavailable ({msg[:500]})") from e
            if isinstance(e, _NoCompiler):
                if self.compiler_error is None:     # once per process, not once per variant
                    self.compiler_error = str(e)
                    log.warning("[zeroplug] cpu_adam: %s: using the eager kernel (ATen's fused Adam; the "
                                "same update, slower when gradients are converted)", e)
                    warnings.warn(f"cpu_adam: {e}: using the eager kernel", RuntimeWarning, stacklevel=4)
                return
            warnings.warn(
                f"cpu_adam: torch.compile kernel unavailable for {key_str(key)}, "
                f"using the eager path ({msg[:300]})",
                RuntimeWarning,
                stacklevel=4,
            )


class _NoCompiler(RuntimeError):
    pass


def remember_isa_checks(path: str) -> None:
    """Keep the answers of inductor's vector-ISA checks in the JSON file ``path``.

    Note: before inductor builds a CPU kernel, or loads one from its cache, it asks which
    vector ISAs (AVX2, AVX-512, AMX, ...) the machine can use, by compiling a test program
    per candidate and loading it in a child Python, which imports torch on some versions:
    a slow check, in every process. The answer depends only on the CPU, the compiler
    and torch, which the directory of ``path`` is keyed by (the warm-up's cache), so each
    check runs once per machine: this wraps ``VecISA.check_build`` (every check goes
    through it) with a lookup in ``path``, and records new answers there. Where torch has
    no such method, nothing changes (inductor checks as before)."""
    try:
        from torch._inductor import cpu_vec_isa
        check = cpu_vec_isa.VecISA.check_build
    except (ImportError, AttributeError):
        return
    if getattr(check, "remembered_in", None) == path:
        return
    check = getattr(check, "checks_for_real", check)
    try:
        with open(path) as f:
            known = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        known = {}

    lock = threading.Lock()

    def check_build(isa, code: str) -> bool:
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        key = f"{type(isa).__name__} {getattr(isa, '_arch_flags', '')} {digest}"
        with lock:      # compiles on several threads must not write the file while it changes
            if key not in known:
                known[key] = bool(check(isa, code))
                try:        # a temporary file made exclusively, at a random name
                    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                               dir=os.path.dirname(path) or ".")
                    try:
                        with os.fdopen(fd, "w") as f:
                            json.dump(known, f, indent=1)
                        os.replace(tmp, path)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        raise
                except OSError:
                    pass            # unwritable: the next process checks again
            return known[key]

    check_build.remembered_in = path
    check_build.checks_for_real = check
    cpu_vec_isa.VecISA.check_build = check_build


def compiler_missing() -> str | None:
    """Why inductor cannot build a C++ kernel here (no compiler found), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:         # another torch layout: let the compile itself tell
        return None
    try:
        get_cpp_compiler()
    except Exception as e:
        from torch._inductor import config
        cxx = [c for c in getattr(config.cpp, "cxx", ()) if c] or ["g++"]
        if type(e).__name__ != "InvalidCxxCompiler" and any(shutil.which(c) for c in cxx):
            # Note: not a missing compiler. Inductor imports its cache module lazily inside
            # the search; while a warm-up thread imports inductor beside this one, that can
            # surface as an AttributeError of a partly initialised module. The compiler is on
            # the PATH, so the build itself will say if it cannot run.
            return None
        return f"no C++ compiler found (looked for {', '.join(cxx)}: {type(e).__name__}); install g++ or set CXX"
    return None


def _timed_probe(fn: Callable, key: tuple, threads: int | None, check_speed: bool) -> dict:
    """_probe with progress lines: a cold compile takes up to a minute (inductor's cache
    makes later runs on the machine fast)."""
    what = key_str(key) + (f" threads={threads}" if threads else "")
    log.info("[zeroplug] cpu_adam: compiling the %s kernel (once per machine, up to a minute)", what)
    t0 = time.perf_counter()
    out = _probe(fn, key[0], key[1], key[2], check_speed=check_speed, state=state_of(key))
    log.info("[zeroplug] cpu_adam: %s kernel ready in %.1f s", what, time.perf_counter() - t0)
    return out


def key_str(key: tuple) -> str:
    state = state_of(key)
    states = f" states={state}" if state != "fp32" else ""
    return f"{'adamw' if key[0] else 'adam'} grad={key[1]} lp={key[2]}{states}"


COMPILED = CompiledKernels()


def compile_status() -> dict[str, Any]:
    """Which compiled variants were built or failed (and why): for reports and tests."""
    return {
        "ok": [key_str(k) for k, v in COMPILED.ok.items() if v],
        "probe_seconds": {key_str(k): v for k, v in COMPILED.speed.items() if v},
        "failed": {key_str(k): COMPILED.errors.get(k, "") for k, v in COMPILED.ok.items()
                   if not v},
    }


# Probe size: inductor sizes its OpenMP parallelism from the first example it sees, even
# with dynamic shapes (a 4K probe compiled a single-threaded kernel, which on a many-core
# machine is several times slower than ATen's fused kernel).  A large, odd probe keeps every
# thread busy on any machine (>= min_chunk_size elements per thread up to ~2K threads).
_PROBE_NUMEL = (1 << 20) + 3
# A compiled variant slower than this factor x the eager path on the probe is not used.
_MAX_SLOWDOWN = 1.3


def _probe(fn: Callable, adamw: bool, gdt: torch.dtype, lpdt: torch.dtype | None,
           check_speed: bool, state: str = "fp32") -> dict:
    """Compile ``fn`` for this variant; check it against the eager path (and its speed)."""
    n = _PROBE_NUMEL
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(gdt)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    lp = torch.empty(n, dtype=lpdt) if lpdt is not None else None
    if state == "bf16":
        st = [m.bfloat16(), v.bfloat16()]
    elif state == "int8":
        from zeroplug.quantized_states import quantize
        st = [*quantize(m, torch.int8), *quantize(v, torch.uint8)]
    else:
        st = [m, v]
    ref = [p.clone()] + [t.clone() for t in st]
    ref_lp = torch.empty_like(lp) if lp is not None else None
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, adamw=adamw)
    step = torch.tensor(3.0)
    sc = scalars(hp, 3.0, True, 0.5)
    scratch: dict = {}

    def compiled():
        done = compiled_call(fn, state, p, g, st, lp, sc)
        assert done == n // BLOCK * BLOCK if state == "int8" else done == n

    def eager():
        if state == "fp32":
            eager_update(ref[0], g, ref[1], ref[2], ref_lp, step, hp, True, 0.5, scratch)
        else:
            eager_small_states(ref[0], g, ref[1:], ref_lp, step, hp, True, 0.5, scratch, state)

    with torch.no_grad():
        compiled()
        eager()
        cut = n // BLOCK * BLOCK if state == "int8" else n     # the tail is the caller's (eager)
        if not torch.allclose(p[:cut], ref[0][:cut], rtol=1e-5, atol=1e-6):
            raise RuntimeError("compiled kernel disagrees with the eager reference")
        for a, b in zip(st, ref[1:]):
            part = cut if a.numel() == n else cut // BLOCK      # codes or the blocks' absmax
            a, b = a[:part], b[:part]
            if a.dtype in (torch.int8, torch.uint8):        # a code may flip at a rounding boundary
                if (a != b).float().mean() > 1e-4:
                    raise RuntimeError("compiled kernel disagrees with the eager reference (codes)")
            elif not torch.allclose(a.float(), b.float(), rtol=1e-2 if state != "fp32" else 1e-5,
                                    atol=1e-6):
                raise RuntimeError("compiled kernel disagrees with the eager reference")
        if lpdt is not None and not torch.equal(lp[:cut], p[:cut].to(lpdt)):
            raise RuntimeError("compiled kernel wrote a wrong low-precision copy")
        if not check_speed:
            return {}
        t_c, t_e = [], []
        for _ in range(5):  # interleaved, best of 5: robust to a noisy neighbour
            t = time.perf_counter()
            compiled()
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


def scalars(hp: dict, step: float, bias_correction: bool, grad_scale: float) -> torch.Tensor:
    """The compiled kernel's scalar arguments for one step (``sc`` above); ``grad_scale`` is
    the gradient multiplier."""
    lr, b1, b2, wd, eps = hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"], hp["eps"]
    if bias_correction:
        bc1 = 1.0 - b1**step
        inv_bc2_sqrt = 1.0 / (1.0 - b2**step) ** 0.5
    else:
        bc1 = inv_bc2_sqrt = 1.0
    decay = 1.0 - lr * wd if hp["adamw"] else wd
    vals = [grad_scale, decay, b1, 1.0 - b1, b2, 1.0 - b2, inv_bc2_sqrt, eps, -(lr / bc1)]
    return torch.tensor(vals, dtype=torch.float32)


def compiled_call(fn, state: str, p, g, st, lp, sc) -> int:
    """Call compiled ``fn`` on flat p, g, the moments ``st`` ((m, v), or (m codes, m absmax,
    v codes, v absmax) for "int8") and ``lp`` (or None). Returns how many leading elements it
    stepped: all of them, or for "int8" the whole blocks (the caller steps the rest)."""
    if state != "int8":
        args = (p, g, *st, lp, sc) if lp is not None else (p, g, *st, sc)
        fn(*args)
        return p.numel()
    full = p.numel() // BLOCK * BLOCK
    if full == 0:
        return 0
    mc, ma, vc, va = st
    tables = (qmap(True), qmap(False), midpoints(True), midpoints(False))
    head = (p[:full], g[:full], mc[:full], ma[:full // BLOCK], vc[:full], va[:full // BLOCK], *tables)
    fn(*head, lp[:full], sc) if lp is not None else fn(*head, sc)
    return full


def eager_small_states(p, g, st, lp, step_t, hp, bias_correction, grad_scale, scratch, state: str) -> None:
    """fp32 ``p`` with moments ``st`` in bf16 ((m, v)) or block-quantised ((m codes, m absmax,
    v codes, v absmax)): walked in chunks of whole blocks, each chunk's moments widened into
    fp32 scratch, stepped by ATen's fused kernel and rounded (bf16) or encoded (int8) back."""
    fused = torch._fused_adamw_ if hp["adamw"] else torch._fused_adam_
    if not bias_correction:
        step_t = torch.tensor(_NO_BIAS_CORRECTION_STEP)
    kw = dict(lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"],
              eps=hp["eps"], amsgrad=False, maximize=False)
    n = p.numel()
    if n == 0:
        return
    chunk = _EAGER_CHUNK_PER_THREAD * max(1, torch.get_num_threads())     # a multiple of BLOCK
    size = min(n, chunk)
    names = ("m32", "v32", "g32") + (("idx",) if state == "int8" else ())
    bufs = {}
    for name in names:
        buf = scratch.get(name)
        dt = torch.int32 if name == "idx" else torch.float32
        if buf is None or buf.numel() < size:
            buf = scratch[name] = torch.empty(size, dtype=dt)
        bufs[name] = buf
    convert = g.dtype != torch.float32 or grad_scale != 1.0
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        k = e - s
        m32, v32 = bufs["m32"][:k], bufs["v32"][:k]
        if state == "int8":
            mc, ma, vc, va = st
            b = s // BLOCK
            dequantize_blocks(mc[s:e], ma[b:], m32, bufs["idx"][:k])
            dequantize_blocks(vc[s:e], va[b:], v32, bufs["idx"][:k])
        else:
            m32.copy_(st[0][s:e])
            v32.copy_(st[1][s:e])
        gc = g[s:e]
        if convert:
            gb = bufs["g32"][:k]
            gb.copy_(gc)
            if grad_scale != 1.0:
                gb.mul_(grad_scale)
            gc = gb
        pc = p[s:e]
        fused([pc], [gc], [m32], [v32], [], [step_t], **kw)
        if state == "int8":
            quantize_(m32, mc[s:e], ma[b:], bufs["idx"][:k])
            quantize_(v32, vc[s:e], va[b:], bufs["idx"][:k])
        else:
            st[0][s:e].copy_(m32)
            st[1][s:e].copy_(v32)
        if lp is not None:
            lp[s:e].copy_(pc)


def eager_update(p, g, m, v, lp, step_t, hp, bias_correction, grad_scale, scratch) -> None:
    """The step of flat views through ATen's fused kernel (``grad_scale``: the gradient
    multiplier); chunked through L2 when g needs converting or lp is written."""
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

