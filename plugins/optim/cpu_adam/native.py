"""cpu_adam's own fused C kernel: block-quantised 8-bit moments (``state_dtype = "int8"``),
bf16 (``"bf16"``) and, where ``impl="native"`` asks, fp32 (``"fp32"``).

The 8-bit format is :mod:`zeroplug.quantized_states` (bitsandbytes' block-wise dynamic-tree
code). The step is ours: ``native.c`` decodes a block of 256 elements of m and v, applies
the Adam(W) update in fp32 (the math and operation order of
:func:`.kernels.scalars` / ``_adam_math``), takes the block's new absmax, encodes
it and writes p, the codes, the absmax and the optional bf16/fp16/fp32 copy of p, all while
the block is in L1: one pass, each byte read or written once, no fp32 copy of a state.
Its codes equal :func:`zeroplug.quantized_states.quantize_` 's (``torch.bucketize`` over the
table's midpoints) bit for bit, through a bucket table keyed by the top 16 bits of the
scaled value (:func:`encode_tables`): one table load and a compare per element. bf16 moments
take the same loop, widened on the load and rounded to nearest even on the store, and fp32
moments the same loop again, loaded and stored as they are.

Note: the torch.compile'd kernel (kernels.py) cannot do this at memory speed:
inductor does not vectorise its table loads, and it needs two passes (the absmax, then the
update) to keep no whole-tensor buffer.

Built on first use with the system C compiler (``$CC`` or ``cc``; ``-O3 -march=native
-fopenmp``, no torch headers) into ``<zeroplug's cache>/native/`` (the per torch version and
CPU directory of :func:`.cache.cache_root`, created 0700; a directory that another
user could write is not used: a private temporary one is), written to a temporary file and
renamed, keyed by a hash of the source, the compiler's version and the flags, so that a
machine builds it once (one process at a time, under a file lock beside it). Loaded with ctypes, which releases the GIL during the call (the
overlapped step runs it on a worker thread). The OpenMP thread count is given per call.
Where it cannot be built or loaded, cpu_adam warns once and takes the compiled or eager
path; ``ZEROPLUG_CPU_ADAM_IMPL=compile`` (or ``eager``) never uses it. fp32 moments take it
only with ``impl="native"`` (whose failures are errors), as the self-check covers.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from zeroplug.locks import wait_lock
from zeroplug.quantized_states import BLOCK, dequantize, midpoints, qmap, quantize, quantize_
from zeroplug.trust import code_dir_problem, make_dirs

from .cache import cache_root
from .kernels import scalars

log = logging.getLogger("zeroplug")

SOURCE = Path(__file__).with_name("native.c")
SUBDIR = "native"
LOCK_NAME = "build.lock"
ABI = 5
# Note: -ffp-contract=off keeps each operation rounded on its own (no fused multiply-add), as
# torch's fp32 ops round; -fno-math-errno lets sqrtf vectorise (the kernel reads no errno).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
# Note: compilers tuned for AVX-512 CPUs default to 256-bit vectors for plain loops; this
# kernel is compute-heavy per byte (table lookups, sqrt, division), so it takes the full width.
X86_FLAGS = ("-mprefer-vector-width=512",)
# The encode buckets: magnitudes below 2**-24 (under every nonzero midpoint) share the lowest
# bucket, those from 1.0 up (and NaN) the highest.
LO_KEY = (127 - 24) << 7
HI_KEY = 127 << 7
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, None: 3}
_c_p = ctypes.c_void_p


def _key_of(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).bitwise_right_shift(16).bitwise_and(0x7FFF)


def encode_tables(signed: bool) -> torch.Tensor:
    """The 2 * nkeys encode buckets (int32): bucket i (x >= 0) or nkeys + i (x < 0) holds the
    x whose magnitude's top 16 bits are LO_KEY + i (clamped). Its entry is base << 16 | low:
    base = the midpoints below the bucket, low = the low 16 bits of the one midpoint inside
    it (its top 16 are the bucket's), or where none is, 0xffff (x >= 0) / 0 (x < 0), which no
    x of the bucket passes. Raises if a bucket holds two midpoints (the encode would be
    wrong)."""
    keys = torch.arange(LO_KEY, HI_KEY + 1, dtype=torch.int32)
    lo = (keys << 16).view(torch.float32).double()
    hi = ((keys << 16) | 0xFFFF).view(torch.float32).double()
    lo[0], hi[-1] = 0.0, float("inf")
    mids32 = midpoints(signed)
    mids = mids32.double()
    bits = mids32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = []
    for sign, (a, b) in ((0, (lo, hi)), (1, (-hi, -lo))):
        below = (mids[None, :] < a[:, None]).sum(1).to(torch.int64)
        inside = (mids[None, :] >= a[:, None]) & (mids[None, :] <= b[:, None])
        count = inside.sum(1)
        if int(count.max()) > 1:
            raise RuntimeError("a bucket of the 8-bit encode holds two midpoints")
        mbits = (inside.to(torch.int64) * bits[None, :]).sum(1)
        has = count > 0
        if bool(((mbits >> 16) != (keys.to(torch.int64) | (sign << 15)))[has].any()):
            raise RuntimeError("an 8-bit encode bucket's midpoint lies outside it")
        low = torch.where(has, mbits & 0xFFFF, torch.full_like(mbits, 0 if sign else 0xFFFF))
        out.append((below << 16) | low)
    entries = torch.cat(out)
    assert int(entries.max()) < 1 << 31
    return entries.to(torch.int32).contiguous()


def flags() -> tuple[str, ...]:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return FLAGS + (X86_FLAGS if x86 else ())


def _torch_step(p, g, st, lpdt, sc, adamw):
    """The update in torch ops (the self-check's reference): (p, *moments in st's form, lp)."""
    if len(st) == 4:
        m, v = dequantize(st[0], st[1]), dequantize(st[2], st[3])
    else:
        m, v = st[0].float(), st[1].float()
    form = st[0].dtype
    gf = g.float() * sc[0]
    pd = p * sc[1] if adamw else p
    if not adamw:
        gf = gf + p * sc[1]
    m = m * sc[2] + sc[3] * gf
    v = v * sc[4] + (sc[5] * gf) * gf
    p = pd + (sc[8] * m) / (v.double().sqrt().float() * sc[6] + sc[7])
    if len(st) == 4:
        out = [p]
        for x, dt, absmax in ((m, torch.int8, st[1]), (v, torch.uint8, st[3])):
            codes, am = torch.empty(x.numel(), dtype=dt), torch.empty(absmax.numel())
            quantize_(x, codes, am)
            out += [codes, am]
    else:
        out = [p, m.to(form), v.to(form)]
    return out + [p.to(lpdt) if lpdt is not None else None]


def self_check(native: "Native") -> None:
    """Step states of each form (int8, bf16, fp32; odd size, all-zero blocks; bf16 gradient
    times 0.5 with a bf16 copy, and fp32 gradient without; Adam and AdamW; 1 and 3 threads)
    with ``native`` and with torch ops; raise where they disagree beyond rounding (a kernel
    miscompiled for this CPU is never used).

    Note: the reference takes the IEEE square root (fp64's, rounded), as C's sqrtf; torch's
    vectorised fp32 sqrt may differ in the last bit."""
    n = 5 * BLOCK + 37
    gen = torch.Generator().manual_seed(0)
    for form in ("int8", "bf16", "fp32"):
        for adamw, gdt, lpdt, threads in ((True, torch.bfloat16, torch.bfloat16, 3),
                                          (False, torch.float32, None, 1)):
            p = torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen).to(gdt)
            m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
            for t in (g, m, v):
                t[BLOCK:2 * BLOCK] = 0
            if form == "int8":
                st = [*quantize(m, torch.int8), *quantize(v, torch.uint8)]
            else:
                dt = torch.bfloat16 if form == "bf16" else torch.float32
                st = [m.to(dt), v.to(dt)]
            hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, adamw=adamw)
            sc = scalars(hp, 3.0, True, 0.5)
            want = _torch_step(p, g, st, lpdt, sc, adamw)
            lp = torch.empty(n, dtype=lpdt) if lpdt is not None else None
            native.step(p, g, st, lp, sc, adamw, threads)
            ok = torch.allclose(p, want[0], rtol=1e-5, atol=1e-6)
            for got, exp in zip(st, want[1:]):
                if got.dtype in (torch.int8, torch.uint8):
                    ok = (ok and int((got.int() - exp.int()).abs().max()) <= 1
                          and float((got != exp).float().mean()) < 1e-3)
                else:
                    ok = ok and torch.allclose(got.float(), exp.float(), rtol=1e-2 if got.dtype == torch.bfloat16
                                               else 1e-5, atol=0)
            if lp is not None:
                ok = ok and torch.equal(lp, p.to(lpdt))
            if not ok:
                raise RuntimeError(f"the native kernel ({native.path}) disagrees with the torch-op step "
                                   f"({form} states)")


class Native:
    """The loaded library and the tables its calls pass."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        if lib.zp_abi_version() != ABI:
            raise RuntimeError(f"{path}: ABI version {lib.zp_abi_version()}, expected {ABI}")
        lib.zp_adam_q8.restype = ctypes.c_int
        lib.zp_adam_q8.argtypes = ([ctypes.c_int64, _c_p, _c_p, ctypes.c_int, _c_p, _c_p, _c_p, _c_p, _c_p,
                                    ctypes.c_int, _c_p, ctypes.c_int, ctypes.c_int] + [_c_p] * 4
                                   + [ctypes.c_int32, ctypes.c_int32])
        lib.zp_adam_bf16.restype = ctypes.c_int
        lib.zp_adam_bf16.argtypes = [ctypes.c_int64, _c_p, _c_p, ctypes.c_int, _c_p, _c_p, _c_p, ctypes.c_int, _c_p,
                                     ctypes.c_int, ctypes.c_int]
        lib.zp_adam_f32.restype = ctypes.c_int
        lib.zp_adam_f32.argtypes = lib.zp_adam_bf16.argtypes
        lib.zp_q8_encode.restype = ctypes.c_int
        lib.zp_q8_encode.argtypes = ([ctypes.c_int64, _c_p, _c_p, _c_p, ctypes.c_int, _c_p, _c_p,
                                      ctypes.c_int32, ctypes.c_int32])
        self.lib, self.path = lib, path
        self.has_f16 = bool(lib.zp_has_f16())
        self.tables = {s: (qmap(s).contiguous(), encode_tables(s)) for s in (True, False)}
        self.nkeys = HI_KEY - LO_KEY + 1

    def supports(self, grad_dtype, lp_dtype) -> bool:
        return self.has_f16 or torch.float16 not in (grad_dtype, lp_dtype)

    def step(self, p, g, st, lp, sc: torch.Tensor, adamw: bool, threads: int) -> None:
        """The update of flat contiguous ``p`` (fp32), ``g``, the moments ``st`` = (m int8
        codes, m absmax, v uint8 codes, v absmax), (m bf16, v bf16) or (m fp32, v fp32), and
        ``lp`` (or None),
        with the scalars ``sc`` (:func:`.kernels.scalars`), on ``threads`` OpenMP
        threads."""
        n = p.numel()
        nb = (n + BLOCK - 1) // BLOCK
        q8 = len(st) == 4
        if q8:
            mc, ma, vc, va = st
            ok = (mc.dtype == torch.int8 and vc.dtype == torch.uint8 and ma.dtype == va.dtype == torch.float32
                  and ma.numel() >= nb and va.numel() >= nb)
        else:
            (mc, vc), ma, va = st, None, None
            ok = mc.dtype == vc.dtype and mc.dtype in (torch.bfloat16, torch.float32)
        if not (ok and p.dtype == torch.float32 and sc.dtype == torch.float32 and sc.numel() == 9):
            raise TypeError("cpu_adam native kernel: fp32 p and scalars, int8 / uint8 codes, bf16 or fp32 moments")
        if not (g.numel() == mc.numel() == vc.numel() == n and (lp is None or lp.numel() == n)):
            raise ValueError("cpu_adam native kernel: tensor sizes disagree")
        if any(t is not None and not t.is_contiguous() for t in (p, g, mc, ma, vc, va, lp, sc)):
            raise ValueError("cpu_adam native kernel: tensors must be contiguous")
        lpdt = lp.dtype if lp is not None else None
        head = (n, p.data_ptr(), g.data_ptr(), _DT[g.dtype])
        tail = (lp.data_ptr() if lp is not None else None, _DT[lpdt], sc.data_ptr(), int(bool(adamw)),
                max(1, int(threads)))
        if q8:
            ts, es = self.tables[True]
            tu, eu = self.tables[False]
            rc = self.lib.zp_adam_q8(*head, mc.data_ptr(), ma.data_ptr(), vc.data_ptr(), va.data_ptr(), *tail,
                                     ts.data_ptr(), es.data_ptr(), tu.data_ptr(), eu.data_ptr(), LO_KEY,
                                     self.nkeys)
        elif mc.dtype == torch.bfloat16:
            rc = self.lib.zp_adam_bf16(*head, mc.data_ptr(), vc.data_ptr(), *tail)
        else:
            rc = self.lib.zp_adam_f32(*head, mc.data_ptr(), vc.data_ptr(), *tail)
        if rc != 0:
            raise RuntimeError(f"cpu_adam native kernel: unsupported dtypes (grad {g.dtype}, lp {lpdt})")

    def encode(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> None:
        """:func:`zeroplug.quantized_states.quantize_` by this kernel's encoder (for tests)."""
        sgn = codes.dtype == torch.int8
        t, e = self.tables[sgn]
        assert x.is_contiguous() and codes.is_contiguous() and x.dtype == torch.float32
        self.lib.zp_q8_encode(x.numel(), x.data_ptr(), codes.data_ptr(), absmax.data_ptr(), int(sgn),
                              t.data_ptr(), e.data_ptr(), LO_KEY, self.nkeys)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or (shutil.which("gcc") if cc == "cc" else None)


def _library_name(cc: str, source: bytes, extra: tuple[str, ...]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    h = hashlib.sha256(source + b"\0" + version + b"\0" + " ".join(flags() + extra).encode() + cc.encode()).hexdigest()
    return f"cpu_adam_q8-{h[:20]}.so"


def _directory() -> tuple[str, str | None]:
    """(the directory to build in, a warning or None): zeroplug's cache where it is private,
    else a private temporary directory."""
    why = None
    try:
        d = os.path.join(cache_root(), SUBDIR)
        make_dirs(d, 0o700)
        why = code_dir_problem(d, tree=False)
        if why is None:
            return os.path.realpath(d), None
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    return tempfile.mkdtemp(prefix="zeroplug-native-"), f"zeroplug's cache directory is not used ({why})"


def build(extra: tuple[str, ...] = ()) -> str:
    """Build (or find, built before) the shared library; its path. Raises on failure.
    ``extra``: more compiler flags (``-DZP_GATHER=0``: scalar table loads, for benchmarks)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found (looked for {os.environ.get('CC') or 'cc'}; set CC)")
    source = SOURCE.read_bytes()
    d, why = _directory()
    if why:
        log.warning("[zeroplug] cpu_adam native kernel: %s; building in %s", why, d)
    path = os.path.join(d, _library_name(cc, source, tuple(extra)))
    if _built(path):
        return path
    # one process per machine builds (the ranks of a host start together); the others wait
    lock, _ = wait_lock(os.path.join(d, LOCK_NAME), "building cpu_adam's native kernel", timeout_s=900.0)
    try:
        if _built(path):
            return path
        _compile(cc, source, extra, d, path)
    finally:
        if lock is not None:
            lock.release()
    return path


def _built(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and os.path.isfile(path)


def _compile(cc: str, source: bytes, extra: tuple[str, ...], d: str, path: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".cpu_adam_q8-", suffix=".so", dir=d)
    os.close(fd)
    try:
        # the source is compiled from its text, so an installed package needs no writable folder
        r = subprocess.run([cc, *flags(), *extra, "-x", "c", "-", "-o", tmp], input=source, capture_output=True,
                           timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed ({r.returncode}): {r.stderr.decode(errors='replace')[-1500:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class Loader:
    """The process's library: built once (on a background thread started early, or by the
    first step), or the reason it is not available (said once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.native: Native | None = None
        self.error: str | None = None
        self.warned = False
        self.thread: threading.Thread | None = None
        # Note: the self-check runs torch ops; a daemon thread inside them when the interpreter
        # ends aborts the process ("terminate called without an active exception") after its
        # work is done. At exit a check not begun is skipped and one under way is waited for.
        self.phase = threading.Lock()
        self.exiting = False
        self.checking = False

    def disabled(self) -> bool:
        return self.error is not None

    def load(self) -> None:
        """Build and load the library (once; a failure is kept in ``error``, said by :meth:`get`)."""
        if self.native is None and self.error is None:
            with self.lock:
                if self.native is None and self.error is None:
                    try:
                        native = Native(build())
                        with self.phase:
                            if self.exiting:
                                return
                            self.checking = True
                        try:
                            self_check(native)
                        finally:
                            self.checking = False
                        self.native = native
                        log.info("[zeroplug] cpu_adam: native kernel %s", native.path)
                    except Exception as e:      # no compiler, build error, bad library: said once, by get
                        self.error = f"{type(e).__name__}: {e}"[:2000]

    def get(self, strict: bool = False) -> Native | None:
        self.load()
        if self.native is None:
            if strict:
                raise RuntimeError(f"cpu_adam: native kernel unavailable ({self.error})")
            if not self.warned:
                self.warned = True
                log.warning("[zeroplug] cpu_adam: native kernel unavailable (%s); using the "
                            "compiled or eager path", self.error)
                warnings.warn(f"cpu_adam: native kernel unavailable ({self.error[:300]}); using "
                              "the compiled or eager path", RuntimeWarning, stacklevel=3)
        return self.native

    def failed(self, exc: BaseException) -> None:
        """A call failed: later steps take the other paths."""
        self.error = f"{type(exc).__name__}: {exc}"[:2000]
        self.native = None

    def start(self) -> None:
        """Build on a background thread now, so that the first step finds it ready."""
        if self.native is None and self.error is None and not self.lock.locked():
            if self.thread is None:
                atexit.register(self._at_exit)
            self.thread = threading.Thread(target=self.load, name="zeroplug-native-build", daemon=True)
            self.thread.start()

    def _at_exit(self) -> None:
        with self.phase:
            self.exiting = True
            checking = self.checking
        if checking and self.thread is not None:
            self.thread.join(timeout=60.0)


LOADER = Loader()
