"""cpu_adam: semantics equal torch.optim.AdamW / Adam (and DeepSpeed's bias_correction
switch), on both implementation paths (compiled kernel and eager fallback)."""

from __future__ import annotations

import importlib
import io
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch


def _load():
    try:
        from zeroplug.plugins.optim.cpu_adam import kernels as cpu_adam_kernels, optimizer as cpu_adam

        return cpu_adam, cpu_adam_kernels
    except Exception:  # package not installed / sibling plugin mid-edit: load the files
        pkg = types.ModuleType("_zeroplug_optim")  # a bare package: optim/__init__.py is not run
        pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "plugins" / "optim" / "cpu_adam")]
        sys.modules[pkg.__name__] = pkg
        return (importlib.import_module("_zeroplug_optim.optimizer"),
                importlib.import_module("_zeroplug_optim.kernels"))


ca, ck = _load()
CPUAdam = ca.CPUAdam

# Smallest size that takes the compiled path; odd so the vector tail is exercised.
BIG = ca._MIN_COMPILE_NUMEL + 4465
SIZES = {"eager": [0, 1, 7, 4099], "compile": [5, BIG]}


@pytest.fixture(params=["eager", "compile"])
def impl(request):
    """Each test runs on both paths; "compile" is skipped where no compiler works."""
    if request.param == "compile":
        try:
            CPUAdam([torch.zeros(1)], impl="compile").implementation(torch.float32, None, BIG)
        except RuntimeError as e:
            pytest.skip(f"torch.compile kernel unavailable: {e}")
    return request.param


def _close(a: torch.Tensor, b: torch.Tensor, rtol=1e-6, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _params(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def _run_pair(ref_cls, impl, adamw_mode, steps=100, **hp):
    sizes = SIZES[impl]
    init = _params(sizes)
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    # two groups (different lr / decay) so per-group scalars are checked
    ref = ref_cls([{"params": a[:1]}, {"params": a[1:], "lr": 3e-3}], **hp)
    opt = CPUAdam(
        [{"params": b[:1]}, {"params": b[1:], "lr": 3e-3}], adamw_mode=adamw_mode, impl=impl, **hp
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        if step == steps // 2:  # a scheduler changes lr mid-run
            for go in (ref.param_groups, opt.param_groups):
                go[1]["lr"] = 1e-3
        ref.step()
        opt.step()
    for x, y in zip(a, b):
        _close(y.detach(), x.detach())
    for x, y in zip(a, b):
        sa, sb = ref.state[x], opt.state[y]
        assert sb["step"].dtype == torch.float32 and sb["step"].dim() == 0
        assert float(sb["step"]) == steps
        _close(sb["exp_avg"], sa["exp_avg"])
        _close(sb["exp_avg_sq"], sa["exp_avg_sq"])
    return opt


def test_matches_torch_adamw(impl):
    opt = _run_pair(torch.optim.AdamW, impl, True, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert opt.implementation(torch.float32, None, BIG) == impl


def test_matches_torch_adam_l2(impl):
    _run_pair(torch.optim.Adam, impl, False, lr=1e-2, weight_decay=0.05, eps=1e-6)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_no_bias_correction_vs_reference(impl, adamw_mode):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    (init,) = _params([SIZES[impl][-1]])
    p = init.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    q = torch.nn.Parameter(init.clone())
    opt = CPUAdam([q], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                  adamw_mode=adamw_mode, bias_correction=False, impl=impl)
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        g = torch.randn(p.shape, generator=gen)
        q.grad = g.clone()
        opt.step()
        # DeepSpeed CPU-Adam with bias_correction=False, written out
        if adamw_mode:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * m / (v.sqrt() + eps)
    _close(q.detach(), p)


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grad_and_lp_out(impl, lp_dtype):
    n = SIZES[impl][-1]
    (init,) = _params([n])
    g32 = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-2
    g16 = g32.to(torch.bfloat16)
    a = torch.nn.Parameter(init.clone())
    b = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    opt = CPUAdam([b], lr=1e-2, weight_decay=0.1, impl=impl)
    lp = torch.full((n,), float("nan"), dtype=lp_dtype)
    g16_before = g16.clone()
    for _ in range(3):
        a.grad = g16.float()
        ref.step()
        opt.step_param(b, g16, lp_out=lp)
        assert torch.equal(lp, b.detach().to(lp_dtype))  # exactly the rounded fp32 param
    assert torch.equal(g16, g16_before)  # the gradient buffer is read, never written
    _close(b.detach(), a.detach())
    assert opt.implementation(torch.bfloat16, lp_dtype, n) == impl


def test_grad_scale(impl):
    n = SIZES[impl][-1]
    (init,) = _params([n])
    g = torch.randn(n, generator=torch.Generator().manual_seed(4))
    a = torch.nn.Parameter(init.clone())
    b = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    opt = CPUAdam([b], lr=1e-2, weight_decay=0.1, impl=impl)
    g_before = g.clone()
    for s in (0.25, 0.5, 3.0):
        a.grad = g * s
        ref.step()
        opt.step_param(b, g, grad_multiplier=s)
    assert torch.equal(g, g_before)
    _close(b.detach(), a.detach())
    _close(opt.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"])


def test_step_group_multiplier_equals_torch_fused_grad_scale(impl):
    """``step_group(k, grad_multiplier=m)`` computes what torch's fused AdamW computes with
    its own ``grad_scale`` of 1 / m (the engine's multiplier, :func:`zeroplug.tiers.fp32_multiplier`),
    and cpu_adam has no ``grad_scale`` attribute of its own: the multiplier is an argument."""
    from zeroplug.tiers import SubGroupOptimizer, fp32_multiplier, step_group
    n = SIZES[impl][-1]
    (init,) = _params([n])
    a = torch.nn.Parameter(init.clone())
    b = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1, fused=True)
    opt = CPUAdam([b], lr=1e-2, weight_decay=0.1, impl=impl)
    assert isinstance(opt, SubGroupOptimizer) and not isinstance(ref, SubGroupOptimizer)
    for i, factor in enumerate((0.25, 2.0, 1.0)):
        g = torch.randn(n, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        m = fp32_multiplier(factor)
        step_group(ref, 0, grad_multiplier=m)       # torch: its grad_scale, set around its step
        assert getattr(ref, "grad_scale", None) is None
        step_group(opt, 0, grad_multiplier=m)
    assert torch.equal(b.grad, g)            # the gradient itself is not touched
    assert not hasattr(opt, "grad_scale")
    _close(b.detach(), a.detach())
    _close(opt.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"])


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float32])
def test_lp_out_pieces_equal_one_buffer(impl, lp_dtype):
    """lp_out as a list of pieces (a sub-group's unit shards) gets what one buffer gets."""
    n = SIZES[impl][-1] + 3000
    cuts = [0, 1, 2000, n // 2, n]
    (init,) = _params([n])
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    oa, ob = CPUAdam([a], lr=1e-2, impl=impl), CPUAdam([b], lr=1e-2, impl=impl)
    one = torch.empty(n, dtype=lp_dtype)
    store = torch.full((n + 10,), 7.0, dtype=lp_dtype)          # pieces in another layout
    pieces = [store[x + 2:y + 2] for x, y in zip(cuts, cuts[1:])]
    for i in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        oa.step_param(a, g, lp_out=one, grad_multiplier=0.5)
        ob.step_param(b, g, lp_out=pieces, grad_multiplier=0.5)
    assert torch.equal(a.detach(), b.detach())
    assert torch.equal(torch.cat(pieces), one)
    assert torch.equal(one, b.detach().to(lp_dtype))             # the rounding of the fp32 parameter
    assert store[:2].eq(7).all() and store[n + 2:].eq(7).all()   # nothing outside the pieces
    with pytest.raises(ValueError, match="pieces"):
        ob.step_param(b, g, lp_out=pieces[:-1])


def test_eager_chunk_boundaries(monkeypatch):
    """Converted / lp paths walk the tensor in chunks: sizes around chunk multiples."""
    monkeypatch.setattr(ck, "_EAGER_CHUNK_PER_THREAD", 64)
    chunk = 64 * torch.get_num_threads()
    sizes = [chunk - 1, chunk, chunk + 1, 3 * chunk + 17]
    init = _params(sizes)
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    ref = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.01)
    opt = CPUAdam(b, lr=1e-2, weight_decay=0.01, impl="eager")
    lps = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    for _ in range(5):
        for x, y, lp in zip(a, b, lps):
            g = torch.randn(x.shape).to(torch.float16)
            x.grad = g.float() * 2.0
            opt.step_param(y, g, lp_out=lp, grad_multiplier=2.0)
        ref.step()
    for x, y, lp in zip(a, b, lps):
        _close(y.detach(), x.detach())
        assert torch.equal(lp, y.detach().to(torch.bfloat16))


def test_compile_failure_falls_back(monkeypatch):
    """No C++ compiler / inductor error: warn, step through the eager path."""
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    a = torch.nn.Parameter(torch.randn(BIG))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    opt = CPUAdam([b], lr=1e-2, weight_decay=0.1)
    g = torch.randn(BIG).to(torch.bfloat16)
    lp = torch.empty(BIG, dtype=torch.bfloat16)
    a.grad = g.float()
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        opt.step_param(b, g, lp_out=lp)
    ref.step()
    _close(b.detach(), a.detach())
    assert torch.equal(lp, b.detach().to(torch.bfloat16))
    assert opt.implementation(torch.bfloat16, torch.bfloat16, BIG) == "eager"
    assert "no C++ compiler" in str(ca.compile_status()["failed"])
    b.grad = g.float()
    with pytest.raises(RuntimeError, match="compiled kernel unavailable"):
        CPUAdam([b], impl="compile").step()


def test_slow_compiled_kernel_not_used(monkeypatch):
    """The probe times the compiled kernel: one slower than eager is not used."""
    try:
        CPUAdam([torch.zeros(1)], impl="compile").implementation(torch.float32, None, BIG)
    except RuntimeError as e:
        pytest.skip(f"torch.compile kernel unavailable: {e}")
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())
    monkeypatch.setattr(ck, "_MAX_SLOWDOWN", 0.0)  # anything counts as too slow
    opt = CPUAdam([torch.zeros(1)])
    with pytest.warns(RuntimeWarning, match="slower than the eager path"):
        assert opt.implementation(torch.bfloat16, torch.bfloat16, BIG) == "eager"
    # a forced compile skips the speed check
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())
    assert CPUAdam([torch.zeros(1)], impl="compile").implementation(
        torch.bfloat16, torch.bfloat16, BIG) == "compile"


def test_auto_routing():
    """auto: plain fp32 steps use ATen's fused kernel; conversions use the compiled one."""
    opt = CPUAdam([torch.zeros(3)])
    assert opt.implementation(torch.float32, None, BIG) == "eager"
    assert opt.implementation(torch.bfloat16, torch.bfloat16, 100) == "eager"  # tiny
    off = opt.implementation(torch.bfloat16, torch.bfloat16, BIG)
    built = "adamw grad=torch.bfloat16 lp=torch.bfloat16" in ca.compile_status()["ok"]
    assert off == ("compile" if built else "eager")


def test_amsgrad_raises():
    msg = 'cpu_adam does not implement amsgrad; use optimizer.plugin = "adamw"'
    with pytest.raises(ValueError, match=msg):
        CPUAdam([torch.zeros(3)], amsgrad=True)


def test_bad_impl_and_env(monkeypatch):
    with pytest.raises(ValueError):
        CPUAdam([torch.zeros(3)], impl="turbo")
    monkeypatch.setenv("ZEROPLUG_CPU_ADAM_IMPL", "eager")
    opt = CPUAdam([torch.zeros(3)])
    assert opt.impl == "eager" and opt.implementation(numel=1 << 24) == "eager"


def test_state_dict_round_trip(impl):
    n = SIZES[impl][-1]
    init = _params([n, 33])
    a = [torch.nn.Parameter(t.clone()) for t in init]
    opt = CPUAdam(a, lr=1e-2, weight_decay=0.1, impl=impl)
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(12)]
    for gs in grads[:6]:
        for x, g in zip(a, gs):
            x.grad = g
        opt.step()
    buf = io.BytesIO()  # through bytes, as a checkpoint would (no shared tensors)
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    fresh = CPUAdam(b, lr=0.5, weight_decay=0.0, impl=impl)  # hyper-params come from sd
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 1e-2
    # torch can read it too
    c = [torch.nn.Parameter(x.detach().clone()) for x in a]
    tref = torch.optim.AdamW(c, lr=1e-2, weight_decay=0.1)
    buf.seek(0)
    tref.load_state_dict(torch.load(buf))
    for gs in grads[6:]:
        for x, y, z, g in zip(a, b, c, gs):
            x.grad, y.grad, z.grad = g, g.clone(), g.clone()
        opt.step()
        fresh.step()
        tref.step()
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        assert torch.equal(opt.state[x]["exp_avg_sq"], fresh.state[y]["exp_avg_sq"])
        _close(x.detach(), z.detach())
    assert float(fresh.state[b[0]]["step"]) == 12


def test_step_param_leaves_others_untouched(impl):
    n = SIZES[impl][-1]
    p, q = (torch.nn.Parameter(t) for t in _params([n, n]))
    p.grad = torch.randn(n)
    q.grad = torch.randn(n)
    q_before, qg_before, p_before = q.detach().clone(), q.grad.clone(), p.detach().clone()
    opt = CPUAdam([p, q], lr=1e-2, impl=impl)
    opt.step_param(p)
    assert torch.equal(q.detach(), q_before) and torch.equal(q.grad, qg_before)
    assert len(opt.state[q]) == 0
    assert not torch.equal(p.detach(), p_before)
    assert float(opt.state[p]["step"]) == 1
    with pytest.raises(ValueError):
        opt.step_param(torch.nn.Parameter(torch.zeros(n)), torch.zeros(n))


def test_step_param_from_worker_threads_matches_step(impl):
    """An offload tier steps sub-group k on a worker while k+1 is still arriving."""
    n = SIZES[impl][-1]
    init = _params([n, n + 3, 11])
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    ref = CPUAdam(a, lr=1e-2, weight_decay=0.1, impl=impl)
    opt = CPUAdam(b, lr=1e-2, weight_decay=0.1, impl=impl)
    with ThreadPoolExecutor(max_workers=1) as pool:
        for _ in range(3):
            for x, y in zip(a, b):
                g = torch.randn(x.shape)
                x.grad = g
                y.grad = g.clone()
            ref.step()
            futs = [pool.submit(opt.step_param, y) for y in b]
            for f in futs:
                f.result()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_non_contiguous_param(impl):
    w = torch.randn(300, 400 if impl == "eager" else 300).t()  # transposed view
    a = torch.nn.Parameter(w.clone())  # clone keeps the transposed strides
    b = torch.nn.Parameter(w.clone())
    assert not b.is_contiguous()
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1)
    opt = CPUAdam([b], lr=1e-2, weight_decay=0.1, impl=impl)
    for _ in range(3):
        g = torch.randn(w.shape)
        a.grad, b.grad = g, g.clone()
        ref.step()
        opt.step()
    _close(b.detach(), a.detach())


def test_rejects_wrong_inputs():
    p = torch.nn.Parameter(torch.zeros(8))
    opt = CPUAdam([p])
    with pytest.raises(ValueError):
        opt.step_param(p)  # no grad
    with pytest.raises(ValueError):
        opt.step_param(p, torch.zeros(9))
    with pytest.raises(ValueError):
        opt.step_param(p, torch.zeros(8), lp_out=torch.zeros(7, dtype=torch.bfloat16))
    q = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(TypeError):
        CPUAdam([q]).step_param(q, torch.zeros(8))


def test_threads_gives_the_same_values(impl):
    """A kernel with fewer OpenMP threads (the overlapped step's) computes the same bits."""
    n = SIZES[impl][-1] + 1001
    (init,) = _params([n])
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    oa, ob = CPUAdam([a], lr=1e-2, impl=impl), CPUAdam([b], lr=1e-2, impl=impl)
    la, lb = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for i in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        oa.step_param(a, g, lp_out=la, grad_multiplier=0.5)
        ob.step_param(b, g, lp_out=lb, grad_multiplier=0.5, threads=1)
    assert torch.equal(a.detach(), b.detach()) and torch.equal(la, lb)
    assert torch.equal(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"])
    if impl == "compile":       # a separate kernel with a fixed team size was built
        assert any(k[2] == 1 for k in ck.COMPILED.fns)
