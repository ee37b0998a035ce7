"""cpu_adam's native (C) kernel (optimizer.state_dtype = "int8" / "bf16", and "fp32" with
impl="native"): its 8-bit encoder against quantize_ bit for bit, its step against the same update written with
torch ops (decode or widen, Adam's fp32 math in cpu_adam_kernels' order, quantize_ or round:
equal bit for bit, every element), against the compiled and eager paths, its build cache, its
self-check and its fallback."""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
import warnings

import pytest
import torch

from zeroplug.plugins.optim.cpu_adam import native as cpu_adam_native
from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam.kernels import scalars
from zeroplug.quantized_states import BLOCK, dequantize, midpoints, quantize, quantize_

B = BLOCK
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def nat():
    return cpu_adam_native.LOADER.get(strict=True)


@pytest.fixture(scope="module", params=["default", "gathers"])
def kernel(request, nat):
    """The kernel as built for this machine, and built with gathers for its table loads (the
    AVX-512 build's code, here with two AVX2 gathers for each 16-wide one)."""
    if request.param == "default":
        return nat
    try:
        return cpu_adam_native.Native(cpu_adam_native.build(("-DZP_GATHER=1",)))
    except RuntimeError as e:       # no AVX2 or AVX-512 here
        pytest.skip(f"no gather build here: {str(e)[:200]}")


def _blocks_with_absmax_one(vals: torch.Tensor) -> torch.Tensor:
    """``vals`` in blocks of 255 plus a 1.0 each: the encoder sees them unscaled."""
    k = (vals.numel() + B - 2) // (B - 1)
    vals = torch.cat([vals, torch.zeros(k * (B - 1) - vals.numel())]).view(k, B - 1)
    return torch.cat([vals, torch.ones(k, 1)], 1).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_encoder_equals_quantize(kernel, dtype):
    """The codes and absmax of quantize_ (torch.bucketize over the midpoints), bit for bit: on
    every midpoint and its two fp32 neighbours, 0, -0, tiny values, 1, random values, all-zero
    blocks and a partial last block."""
    signed = dtype == torch.int8
    mids = midpoints(signed)
    inf = torch.tensor(float("inf"))
    edge = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                      torch.tensor([0.0, -0.0, 1e-30, 2.0 ** -24, 2.0 ** -23, 2.0 ** -22, 1.0])])
    if not signed:
        edge = edge.abs()
    gen = torch.Generator().manual_seed(0)
    edge = _blocks_with_absmax_one(edge[torch.randperm(edge.numel(), generator=gen)])
    rnd = torch.randn(50 * B + 77, generator=gen) * torch.rand(50 * B + 77, generator=gen) ** 8
    rnd[3 * B:5 * B] = 0.0                      # all-zero blocks
    for x in (edge, rnd if signed else rnd.abs(), torch.zeros(B + 3), torch.tensor([0.5])):
        want_c, want_a = torch.empty(x.numel(), dtype=dtype), torch.empty((x.numel() + B - 1) // B)
        quantize_(x.clone(), want_c, want_a)
        got_c, got_a = torch.empty_like(want_c), torch.empty_like(want_a)
        kernel.encode(x.clone(), got_c, got_a)
        assert torch.equal(got_a, want_a)
        assert torch.equal(got_c, want_c), (got_c != want_c).sum()


def torch_step(p, g, st, lp, sc, adamw):
    """The same update with torch ops: decode, cpu_adam_kernels' fp32 math (the scalars'
    layout and operation order), quantize_. Returns (p, m codes, m absmax, v codes, v absmax,
    lp)."""
    if len(st) == 4:
        mc, ma, vc, va = st
        m, v = dequantize(mc, ma), dequantize(vc, va)
    else:
        m, v = st[0].float(), st[1].float()
    gf = g.float() * sc[0]
    if adamw:
        pd = p * sc[1]
    else:
        pd = p
        gf = gf + p * sc[1]
    m = m * sc[2] + sc[3] * gf
    v = v * sc[4] + (sc[5] * gf) * gf
    # Note: the IEEE square root (correctly rounded: fp64's, rounded), as C's sqrtf; torch's
    # vectorised fp32 sqrt may differ in the last bit
    p = pd + (sc[8] * m) / (v.double().sqrt().float() * sc[6] + sc[7])
    out = [p]
    if len(st) == 2:
        out += [m.to(st[0].dtype), v.to(st[0].dtype)]
    for x, dt in ((m, torch.int8), (v, torch.uint8)) if len(st) == 4 else ():
        codes, absmax = torch.empty(x.numel(), dtype=dt), torch.empty((x.numel() + B - 1) // B)
        quantize_(x, codes, absmax)
        out += [codes, absmax]
    return out + [p.to(lp.dtype) if lp is not None else None]


def _case(n, gdt, seed=0, zero_blocks=True, form="int8"):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 3).to(gdt)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    if zero_blocks and n > 3 * B:
        g[B:3 * B] = 0
        m[B:3 * B] = 0
        v[B:3 * B] = 0
    if form == "bf16":
        return p, g, [m.bfloat16(), v.bfloat16()]
    if form == "fp32":
        return p, g, [m, v]
    return p, g, [*quantize(m, torch.int8), *quantize(v, torch.uint8)]


@pytest.mark.parametrize("n", [1, B - 1, B, 7 * B + 131, 40 * B])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["int8", "bf16", "fp32"])
def test_step_equals_torch_ops(kernel, n, adamw, gdt, form):
    """p, the moments (codes and absmax, bf16 or fp32) and the copy equal the torch-op step bit
    for bit: Adam and AdamW, each gradient dtype, grad_scale != 1, every copy dtype and none,
    bias correction on and off, a partial last block, all-zero blocks, several thread counts."""
    if not kernel.supports(gdt, None):
        pytest.skip("compiler without _Float16")
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, adamw=adamw)
    for lpdt, grad_scale, threads, bc in ((None, 1.0, 1, True), (torch.bfloat16, 0.5, 2, True),
                                          (torch.float16, 0.25, 3, False), (torch.float32, 2.0, 2, True)):
        p, g, st = _case(n, gdt, form=form)
        sc = scalars(hp, 3.0, bc, grad_scale)
        want = torch_step(p.clone(), g, [t.clone() for t in st], torch.empty(n, dtype=lpdt) if lpdt else None,
                          sc, adamw)
        lp = torch.full((n,), 7.0, dtype=lpdt) if lpdt else None
        kernel.step(p, g, st, lp, sc, adamw, threads)
        what_ = ("p", "m codes", "m absmax", "v codes", "v absmax") if form == "int8" else ("p", "m", "v")
        for got, exp, what in zip([p, *st, lp], want, what_ + ("lp",)):
            if exp is None:
                continue
            assert torch.equal(got, exp), (what, lpdt, threads, (got != exp).sum())


@pytest.mark.parametrize("form", ["int8", "fp32"])
def test_thread_counts_agree(nat, form):
    n = 100 * B + 5
    outs = []
    for threads in (1, 2, 5):
        p, g, st = _case(n, torch.bfloat16, seed=3, form=form)
        lp = torch.empty(n, dtype=torch.bfloat16)
        nat.step(p, g, st, lp, scalars(dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                                             adamw=True), 1.0, True, 1.0), True, threads)
        outs.append([p, *st, lp])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def _opt_state(opt, p):
    st = opt.state[p]
    if "exp_avg_absmax" not in st:
        return [st["exp_avg"], st["exp_avg_sq"]]
    return [st["exp_avg"], st["exp_avg_absmax"], st["exp_avg_sq"], st["exp_avg_sq_absmax"]]


SIDE_N = (1 << 16) + 3 * B + 17     # past the compiled kernel's minimum size, a partial last block


def _side_by_side(new, old, **kw):
    """Three offload-tier steps (bf16 gradient, grad_scale 0.5, bf16 copy) of CPUAdam with
    impl ``new`` and ``old`` from the same state; asserts the masters agree to fp32 rounding
    and the copies but for rare rounding-boundary flips, yields each step's (new, old) state
    pairs, then starts the next step of both from the same state (the paths' ulps must not
    accumulate)."""
    n = SIDE_N
    torch.manual_seed(0)
    p0 = torch.randn(n)
    ps = {impl: p0.clone() for impl in (new, old)}
    opts = {impl: CPUAdam([ps[impl]], impl=impl, **kw, **HP) for impl in ps}
    assert opts[new].implementation(torch.bfloat16, torch.bfloat16, n, 0.5) == "native"
    yield opts
    for _ in range(3):
        g = torch.randn(n).bfloat16()
        lps = {}
        for impl, opt in opts.items():
            lps[impl] = torch.empty(n, dtype=torch.bfloat16)
            opt.step_param(ps[impl], grad=g, lp_out=lps[impl], grad_multiplier=0.5)
        torch.testing.assert_close(ps[new], ps[old], rtol=1e-5, atol=1e-6)
        assert (lps[new] != lps[old]).float().mean() < 1e-3
        yield list(zip(_opt_state(opts[new], ps[new]), _opt_state(opts[old], ps[old])))
        for a, b in zip(_opt_state(opts[old], ps[old]), _opt_state(opts[new], ps[new])):
            a.copy_(b)
        ps[old].copy_(ps[new])


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("form,old", [("int8", "eager"), ("int8", "compile"), ("bf16", "eager")])
def test_native_against_the_old_paths(adamw_mode, old, form):
    """CPUAdam with impl="auto" (native) and with the eager / compiled kernels, from the same
    state, several steps of the offload tier's call (bf16 gradient, grad_scale, bf16 copy):
    the same master to fp32 rounding, codes (bf16 moments) equal but for rare
    rounding-boundary flips.

    Note: bf16 states against the compiled kernel are left to test_optimizer_states (every
    variant compiled in one process counts against dynamo's recompile limit of the one
    kernel function the fp32 and bf16 variants share)."""
    steps = _side_by_side("auto", old, state_dtype=form, adamw_mode=adamw_mode)
    next(steps)
    for pairs in steps:
        for a, b in pairs:
            if a.dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
            elif a.dtype == torch.bfloat16:
                # one bf16 ulp where the fp32 values round apart; a first moment that cancels
                # to near 0 differs by more, relative to itself (ATen's fused step lerps)
                assert (a != b).float().mean() < 1e-2
                torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6)
            else:
                assert (a != b).float().mean() < 1e-3
                assert (a.int() - b.int()).abs().max() <= 1


def test_impl_env_forces_the_old_path(monkeypatch):
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")
    opt = CPUAdam([torch.zeros(1 << 17)], state_dtype="int8")
    assert opt.implementation(torch.bfloat16, torch.bfloat16, 1 << 17, 0.5) == "eager"
    assert CPUAdam([torch.zeros(8)], impl="auto", state_dtype="int8").implementation(numel=8) == "native"
    assert CPUAdam([torch.zeros(8)], impl="auto", state_dtype="bf16").implementation(numel=8) == "native"
    assert CPUAdam([torch.zeros(8)], impl="auto").implementation(numel=8) == "eager"       # fp32 states


def test_build_is_cached_privately(tmp_path, monkeypatch):
    """The library lands in zeroplug's cache directory (0700 folder, a file of this user),
    renamed into place; a build waits while another process holds the build lock; a second
    build finds the library instead of compiling again."""
    monkeypatch.setenv("ZEROPLUG_CACHE_DIR", str(tmp_path / "cache"))
    from zeroplug.locks import try_lock
    from zeroplug.plugins.optim.cpu_adam.cache import cache_root
    d = os.path.join(cache_root(), cpu_adam_native.SUBDIR)
    os.makedirs(d, mode=0o700)
    held = try_lock(os.path.join(d, cpu_adam_native.LOCK_NAME), mode=0o600)
    assert held is not None
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("path", cpu_adam_native.build()))
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and not [f for f in os.listdir(d) if f.endswith(".so")]     # waiting for the lock
    held.release()
    t.join(600)
    path = out["path"]
    assert path.startswith(os.path.realpath(tmp_path / "cache"))
    assert os.path.dirname(path) == os.path.realpath(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.stat(path).st_uid == os.getuid()
    assert [f for f in os.listdir(d) if f.startswith(".")] == []       # no temporary file left
    mtime = os.stat(path).st_mtime_ns
    assert cpu_adam_native.build() == path and os.stat(path).st_mtime_ns == mtime
    assert cpu_adam_native.Native(path).supports(torch.bfloat16, torch.bfloat16)


def test_no_compiler_falls_back_with_one_warning(tmp_path, monkeypatch):
    """Without a compiler: one warning, then the compiled / eager path (the step still works);
    impl="native" makes it an error."""
    monkeypatch.setenv("ZEROPLUG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    loader = cpu_adam_native.Loader()
    monkeypatch.setattr(cpu_adam_native, "LOADER", loader)
    monkeypatch.setattr("zeroplug.plugins.optim.cpu_adam.optimizer.NATIVE", loader)
    with pytest.raises(RuntimeError, match="no C compiler"):
        loader.get(strict=True)
    loader = cpu_adam_native.Loader()
    monkeypatch.setattr("zeroplug.plugins.optim.cpu_adam.optimizer.NATIVE", loader)
    n = 3 * B + 5
    p = torch.randn(n)
    opt = CPUAdam([p], impl="auto", state_dtype="int8", **HP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.get()
        loader.get()
        opt.step_param(p, grad=torch.randn(n))
    assert len([w for w in caught if "native" in str(w.message)]) == 1
    assert opt.implementation(numel=n) == "eager"
    assert torch.isfinite(p).all() and opt.state[p]["exp_avg_absmax"].max() > 0


def test_self_check_rejects_a_wrong_kernel(nat, monkeypatch):
    """A library whose step writes wrong codes (a kernel miscompiled for the CPU, say) fails
    the check that runs before its first use."""
    cpu_adam_native.self_check(nat)
    step = nat.step

    def wrong(p, g, st, lp, sc, adamw, threads):
        step(p, g, st, lp, sc, adamw, threads)
        st[2][::7] += 3
    monkeypatch.setattr(nat, "step", wrong)
    with pytest.raises(RuntimeError, match="disagrees"):
        cpu_adam_native.self_check(nat)


def test_exit_skips_a_self_check_not_begun_and_waits_for_one_under_way(monkeypatch):
    """The background build's self-check runs torch ops: at exit one not begun is skipped (no
    torch work starts in a daemon thread while the interpreter ends) and one under way is
    waited for."""
    loader = cpu_adam_native.Loader()
    loader._at_exit()
    loader.load()
    assert loader.native is None and loader.error is None

    began, release = threading.Event(), threading.Event()
    check = cpu_adam_native.self_check

    def slow_check(native):
        began.set()
        release.wait(30)
        check(native)
    monkeypatch.setattr(cpu_adam_native, "self_check", slow_check)
    loader = cpu_adam_native.Loader()
    loader.start()
    assert began.wait(120)
    threading.Timer(0.5, release.set).start()
    t0 = time.perf_counter()
    loader._at_exit()
    assert time.perf_counter() - t0 >= 0.4 and not loader.thread.is_alive()
    assert loader.native is not None


def test_step_releases_the_gil(nat):
    """The overlapped step calls the kernel on a worker thread: Python code keeps running on
    the main thread during the call (ctypes releases the GIL for it). With a long switch
    interval the main thread runs only while the worker gives the GIL up by itself."""
    n = 40 * (1 << 16)
    p, g, st = _case(n, torch.bfloat16, zero_blocks=False)
    sc = scalars(dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, adamw=True), 1.0, True, 1.0)
    done = threading.Event()
    spins, during = [0], []

    def worker():
        for _ in range(3):
            before = spins[0]
            nat.step(p, g, st, None, sc, True, 1)
            during.append(spins[0] - before)
        done.set()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.25)
    try:
        t = threading.Thread(target=worker)
        t.start()
        while not done.is_set():
            spins[0] += 1
        t.join()
    finally:
        sys.setswitchinterval(interval)
    assert min(during) > 100, during


# --------------------------------------------------------------------------- fp32 moments
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
def test_fp32_states_through_cpu_adam_equal_torch_ops(nat, adamw_mode, bias_correction, gdt):
    """CPUAdam(impl="native") with fp32 moments: each step's p, m, v and copy equal the torch-op
    update with the step's scalars bit for bit (odd size; grad_scale != 1; a whole copy, a copy
    in pieces, none; 1 and 3 threads)."""
    if not nat.supports(gdt, torch.float16):
        pytest.skip("compiler without _Float16")
    n = 9 * B + 77
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen)
    opt = CPUAdam([p], impl="native", adamw_mode=adamw_mode, bias_correction=bias_correction, **HP)
    assert opt.implementation(gdt, torch.bfloat16, n, 0.5) == "native"
    hp = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], weight_decay=HP["weight_decay"],
              eps=HP["eps"], adamw=adamw_mode)
    ref = [p.clone(), torch.zeros(n), torch.zeros(n)]
    for step, (lp, gs, threads) in enumerate(((torch.empty(n, dtype=torch.bfloat16), 0.5, 3),
                                              ([torch.empty(1000, dtype=torch.float16),
                                                torch.empty(n - 1000, dtype=torch.float16)], 2.0, 1),
                                              (None, 1.0, None)), start=1):
        g = (torch.randn(n, generator=gen) * 3).to(gdt)
        opt.step_param(p, grad=g, lp_out=lp, grad_multiplier=gs, threads=threads)
        lpw = torch.cat(lp) if isinstance(lp, list) else lp
        want = torch_step(ref[0], g, ref[1:], lpw, scalars(hp, float(step), bias_correction, gs), adamw_mode)
        ref = want[:3]
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        for got, exp, what in zip((p, st["exp_avg"], st["exp_avg_sq"], lpw), want, ("p", "m", "v", "lp")):
            if exp is not None:
                assert torch.equal(got, exp), (step, what, (got != exp).sum())


@pytest.mark.parametrize("adamw_mode,old", [(True, "eager"), (False, "eager"), (True, "compile")])
def test_fp32_states_native_against_the_old_paths(adamw_mode, old):
    """impl="native" with fp32 moments against the eager and compiled kernels, from the same
    state, several steps of the offload tier's call (bf16 gradient, grad_scale, bf16 copy): the
    same master and moments to fp32 rounding, the copies equal but for rare rounding-boundary
    flips."""
    steps = _side_by_side("native", old, adamw_mode=adamw_mode)
    opts = next(steps)
    assert opts[old].implementation(torch.bfloat16, torch.bfloat16, SIDE_N, 0.5) == old
    for pairs in steps:
        for a, b in pairs:
            assert a.dtype == b.dtype == torch.float32
            # a few ulps of the typical value; a first moment that cancels to near 0 differs by
            # more, relative to itself (ATen's fused step lerps)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fp32_states_take_the_native_kernel_only_when_asked(monkeypatch):
    """auto keeps fp32 moments on the compiled / eager paths (and warms the compiled variants
    up); impl="native" or ZEROPLUG_CPU_ADAM_IMPL=native steps them natively (no compiled
    variant to warm up) and its failures are errors."""
    n = 1 << 17
    auto = CPUAdam([torch.zeros(n)], impl="auto")
    assert auto.implementation(torch.float32, None, n, 1.0) == "eager"
    assert auto.kernel_variants([torch.bfloat16], torch.bfloat16) == [(True, torch.bfloat16, torch.bfloat16)]
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "native")
    env = CPUAdam([torch.zeros(n)])
    assert env.impl == "native" and env.state_dtype == "fp32"
    assert env.implementation(torch.float32, None, n, 1.0) == "native"
    assert env.implementation(torch.bfloat16, torch.bfloat16, 8, 0.5) == "native"      # every size
    assert env.kernel_variants([torch.bfloat16], torch.bfloat16) == []
    loader = cpu_adam_native.Loader()
    loader.error = "RuntimeError: no C compiler found"
    monkeypatch.setattr("zeroplug.plugins.optim.cpu_adam.optimizer.NATIVE", loader)
    p = torch.zeros(8)
    with pytest.raises(RuntimeError, match="native kernel unavailable"):
        CPUAdam([p], impl="native").step_param(p, grad=torch.ones(8))


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_engine_with_native_fp32_states_matches_the_default(monkeypatch, prec):
    """Stage 3 with the optimizer offloaded to the CPU (cpu_adam, fp32 moments; clipping makes
    the gradient multiplier != 1; bf16: bf16 gradients and the model-dtype copy in the same
    pass), a few steps with ZEROPLUG_CPU_ADAM_IMPL=native against the default path: the native
    kernel steps every sub-group, and losses and weights agree to fp32 rounding."""
    from tests.support.toy import ToyNet, engine_losses
    cfg = {"zero": {"plugin": "stage3", "reduce_bucket_size": 500, "sub_group_size": 700},
           "precision": {"plugin": prec}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
           "offload": {"optimizer": {"plugin": "cpu"}},
           "batch": {"micro_batch_size": 8, "gradient_clipping": 0.5}, "monitor": {"plugin": "none"}}
    calls = []
    loaded = cpu_adam_native.LOADER.get(strict=True)    # built and self-checked: the steps' kernel
    real = loaded.step

    def counted(p, g, st, lp, sc, adamw, threads):
        calls.append((g.dtype, None if lp is None else lp.dtype, st[0].dtype))
        return real(p, g, st, lp, sc, adamw, threads)
    monkeypatch.setattr(loaded, "step", counted)
    monkeypatch.delenv("ZEROPLUG_CPU_ADAM_IMPL", raising=False)
    l0, e0 = engine_losses(ToyNet, 4, 8, cfg)
    assert e0.optimizer.impl == "auto" and calls == []
    sd0 = e0.consolidated_state_dict()
    e0.close()
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "native")
    l1, e1 = engine_losses(ToyNet, 4, 8, cfg)
    assert e1.optimizer.impl == "native"
    groups = len(e1.optimizer.param_groups)
    assert groups > 1 and len(calls) == 4 * groups
    assert {c[2] for c in calls} == {torch.float32}
    if prec == "bf16":
        assert {c[:2] for c in calls} == {(torch.bfloat16, torch.bfloat16)}
    sd1 = e1.consolidated_state_dict()
    e1.close()
    assert max(abs(a - b) / abs(a) for a, b in zip(l0, l1)) <= (1e-6 if prec == "fp32" else 2e-3)
    for k in sd0:
        torch.testing.assert_close(sd1[k].float(), sd0[k].float(), rtol=1e-5,
                                   atol=1e-6 if prec == "fp32" else 2e-2, msg=k)


@pytest.mark.parametrize("impl,checks", [("native", False), ("auto", True)])
def test_native_fp32_run_skips_the_compiler_warm_up(monkeypatch, impl, checks):
    """With ZEROPLUG_CPU_ADAM_IMPL=native (fp32 states) initialize's warm-up neither imports
    inductor's compiler nor runs its vector-ISA checks (a minute beside the first steps on a
    fresh machine) and names no compiled variant; under auto it prepares them as before."""
    import zeroplug
    from zeroplug.plugins.optim.cpu_adam import warmup as cw
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", impl)
    prepared, started = [], []
    monkeypatch.setattr(cw, "_pick_vec_isa", lambda: prepared.append("isa"))
    monkeypatch.setattr(cw, "_import_compiler", lambda: prepared.append("import"))
    real_start = cw.WarmUp.start
    monkeypatch.setattr(cw.WarmUp, "start", lambda self: (started.append(self), real_start(self))[1])
    engine = zeroplug.initialize(torch.nn.Linear(64, 64), {
        "zero": {"plugin": "stage2"}, "optimizer": {"plugin": "cpu_adam"},
        "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}})
    try:
        (w,) = started
        assert w.wait(120) and w.error is None and w.keys == []
        assert w.compiled == checks
        assert prepared == (["import", "isa"] if checks else [])
        assert engine.optimizer.impl == impl
        x = torch.randn(4, 64)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


def test_thread_counts_reach_the_native_fp32_step(monkeypatch):
    """The tiers' step_group(threads=...) (the overlapped step's count) and the optimizer's own
    count (the cpu plan's) reach the native kernel as they reach the compiled one."""
    loaded = cpu_adam_native.LOADER.get(strict=True)
    seen = []
    real = loaded.step
    monkeypatch.setattr(loaded, "step", lambda *a: (seen.append(a[-1]), real(*a))[1])
    p = torch.randn(3 * B + 1)
    p.grad = torch.randn(3 * B + 1)
    opt = CPUAdam([p], impl="native", threads=3, **HP)
    opt.step_group(0)
    opt.step_group(0, threads=1)
    opt.step_param(p, grad=torch.randn(3 * B + 1).bfloat16(), lp_out=torch.empty(3 * B + 1, dtype=torch.bfloat16),
                   threads=2)
    assert seen == [3, 1, 2]
