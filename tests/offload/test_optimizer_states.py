"""cpu_adam's smaller optimizer states (optimizer.state_dtype = "bf16" / "int8"): the step
against a plain-torch reference of the same quantisation, bf16 / int8 against fp32 states,
the conversions between the forms, and the option's errors.

The reference below is written from the format's description (bitsandbytes' blockwise 8-bit
Adam: blocks of 256, an fp32 absmax per block, the nearest entry of the dynamic-tree code),
not from zeroplug's code: a table built by its definition, decoding by indexing, encoding by
an argmin over the table."""
from __future__ import annotations

import pytest
import torch

from zeroplug.plugins.optim.cpu_adam import CPUAdam

B = 256


def ref_table(signed: bool) -> torch.Tensor:
    """The dynamic-tree code: for decade d = 0..6, the midpoints of 2^d (signed, per sign) or
    2^(d+1) (unsigned) equal steps between 0.1 and 1, times 10^(d-6); plus 0 and 1."""
    vals = [0.0, 1.0]
    for d in range(7):
        k = 2 ** d if signed else 2 ** (d + 1)
        for i in range(k):
            lo, hi = 0.1 + 0.9 * i / k, 0.1 + 0.9 * (i + 1) / k
            x = (lo + hi) / 2 * 10.0 ** (d - 6)
            vals += [x, -x] if signed else [x]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def ref_decode(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    signed = codes.dtype == torch.int8
    idx = codes.long() + (128 if signed else 0)
    blk = torch.arange(codes.numel()) // B
    return (ref_table(signed)[idx] * absmax.double()[blk]).float()


def ref_encode(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    signed = dtype == torch.int8
    table = ref_table(signed)
    n = x.numel()
    absmax = torch.stack([x[i:i + B].abs().max() for i in range(0, n, B)]).float()
    blk = torch.arange(n) // B
    scale = torch.where(absmax[blk] > 0, absmax[blk], torch.ones(())).double()
    idx = (x.double()[:, None] / scale[:, None] - table[None, :]).abs().argmin(1)
    return (idx - (128 if signed else 0)).to(dtype), absmax


def ref_step(p, g, m, v, step, lr, betas, eps, wd):
    """torch.optim.AdamW's update in plain float64 arithmetic (then fp32)."""
    b1, b2 = betas
    p, g, m, v = (t.double() for t in (p, g, m, v))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh, vh = m / (1 - b1 ** step), v / (1 - b2 ** step)
    p = p - lr * mh / (vh.sqrt() + eps)
    return p.float(), m.float(), v.float()


HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _state_from(opt, p):
    opt.init_group_states(0)        # allocated before the first step (as an offload tier does)
    st = opt.state[p]
    return (st["exp_avg"].clone(), st["exp_avg_absmax"].clone(), st["exp_avg_sq"].clone(),
            st["exp_avg_sq_absmax"].clone())


@pytest.mark.parametrize("impl", ["eager", "compile"])
@pytest.mark.parametrize("n", [3 * B + 77, (1 << 16) + 5 * B + 3])
def test_int8_step_matches_reference(impl, n):
    """Each step, from the same state: the same master (fp32 rounding), the codes the
    reference's argmin picks (a code may differ where a value lies on a rounding boundary
    within fp32 error) and the same absmax. Eager and compiled kernel, a partial last block;
    the compiled kernel is used at sizes above its minimum (the second n)."""
    if impl == "compile" and n < 1 << 16:
        pytest.skip("below the compiled kernel's minimum size the eager path runs")
    torch.manual_seed(0)
    p = torch.randn(n)
    opt = CPUAdam([p], impl=impl, state_dtype="int8", **HP)
    for step in range(1, 6):
        g = torch.randn(n) * (1 + step)
        mc, ma, vc, va = _state_from(opt, p)
        m0, v0 = ref_decode(mc, ma), ref_decode(vc, va)
        p0 = p.clone()
        opt.step_param(p, grad=g)
        rp, rm, rv = ref_step(p0, g, m0, v0, step, HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"])
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
        for key, want in (("exp_avg", ref_encode(rm, torch.int8)), ("exp_avg_sq", ref_encode(rv, torch.uint8))):
            codes, absmax = opt.state[p][key], opt.state[p][key + "_absmax"]
            torch.testing.assert_close(absmax, want[1], rtol=1e-5, atol=0)
            assert (codes != want[0]).float().mean() < 1e-3, key
            assert (codes.int() - want[0].int()).abs().max() <= 1, key


def test_int8_with_bf16_gradients_scale_and_lp_pieces():
    """The offload tier's call: bf16 gradient multiplied by grad_scale, the model-dtype copy
    written into a list of pieces whose borders are not block borders."""
    torch.manual_seed(1)
    n = 5 * B + 100
    p = torch.randn(n)
    opt = CPUAdam([p], impl="eager", state_dtype="int8", **HP)
    g = torch.randn(n).bfloat16()
    mc, ma, vc, va = _state_from(opt, p)
    p0 = p.clone()
    pieces = [torch.empty(k, dtype=torch.bfloat16) for k in (300, 1, 700, n - 1001)]
    opt.step_param(p, grad=g, lp_out=pieces, grad_multiplier=0.25)
    rp, _, _ = ref_step(p0, g.float() * 0.25, ref_decode(mc, ma), ref_decode(vc, va), 1, HP["lr"], HP["betas"],
                        HP["eps"], HP["weight_decay"])
    torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat(pieces), p.bfloat16())


@pytest.mark.parametrize("impl", ["eager", "compile"])
def test_bf16_states_are_the_rounded_fp32_step(impl):
    """bf16 moments: each step is the fp32 update from the widened bf16 moments, the moments
    stored rounded to nearest (within two bf16 ulps: the fp32 arithmetic rounds a hair differently
    from the float64 reference)."""
    torch.manual_seed(2)
    n = (1 << 16) + 123
    p = torch.randn(n)
    opt = CPUAdam([p], impl=impl, state_dtype="bf16", **HP)
    for step in range(1, 4):
        g = torch.randn(n)
        m0, v0 = (opt.state[p][k].float() for k in ("exp_avg", "exp_avg_sq")) if step > 1 else (
            torch.zeros(n), torch.zeros(n))
        p0 = p.clone()
        opt.step_param(p, grad=g, lp_out=torch.empty(n, dtype=torch.bfloat16))
        rp, rm, rv = ref_step(p0, g, m0, v0, step, HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"])
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
        for key, want in (("exp_avg", rm), ("exp_avg_sq", rv)):
            got = opt.state[p][key]
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2 ** -6, atol=1e-12)


def _train(state_dtype: str, steps: int = 200) -> tuple[torch.Tensor, float]:
    """A small regression trained by cpu_adam; (the weights, the last loss)."""
    torch.manual_seed(3)
    w_true = torch.randn(64, 32)
    x = torch.randn(512, 64)
    y = x @ w_true + 0.01 * torch.randn(512, 32)
    w = torch.zeros(64, 32)
    opt = CPUAdam([w], lr=3e-2, betas=(0.9, 0.999), weight_decay=0.0, impl="eager", state_dtype=state_dtype)
    loss = None
    for i in range(steps):
        xb, yb = x[(i * 64) % 512:][:64], y[(i * 64) % 512:][:64]
        err = xb @ w - yb
        loss = float(err.pow(2).mean())
        opt.step_param(w, grad=2 * xb.T @ err / err.numel())
    return w, loss


def test_small_states_train_like_fp32_states():
    """Stated tolerance: on this regression (400 steps, to the noise floor) the bf16 and int8
    runs end within 10% of the fp32 run's loss and their weights within 0.1% (relative L2)
    of the fp32 run's; a run that stepped on zeros or on garbage states would not."""
    w32, l32 = _train("fp32", 400)
    for sd in ("bf16", "int8"):
        w, loss = _train(sd, 400)
        assert abs(loss - l32) <= 0.1 * l32, (sd, loss, l32)
        assert (w - w32).norm() / w32.norm() <= 1e-3, sd


@pytest.mark.parametrize("src,dst", [("fp32", "int8"), ("int8", "fp32"), ("int8", "bf16"), ("bf16", "int8"),
                                     ("fp32", "bf16"), ("bf16", "fp32"), ("int8", "int8")])
def test_state_dict_loads_across_state_dtypes(src, dst):
    """The stated conversions: fp32 / bf16 -> int8 quantises, int8 -> fp32 / bf16 decodes,
    fp32 -> bf16 rounds, bf16 -> fp32 widens; int8 -> int8 keeps codes and absmax bit for bit."""
    torch.manual_seed(4)
    n = 4 * B + 9
    p = torch.randn(n)
    a = CPUAdam([p], impl="eager", state_dtype=src, **HP)
    for _ in range(3):
        a.step_param(p, grad=torch.randn(n))
    sd = a.state_dict()
    q = p.clone()
    b = CPUAdam([q], impl="eager", state_dtype=dst, **HP)
    b.load_state_dict(sd)
    st_a, st_b = a.state[p], b.state[q]
    assert float(st_b["step"]) == 3.0
    for key, code_dtype in (("exp_avg", torch.int8), ("exp_avg_sq", torch.uint8)):
        val_a = ref_decode(st_a[key], st_a[key + "_absmax"]) if src == "int8" else st_a[key].float()
        if dst == "int8":
            assert st_b[key].dtype == code_dtype
            if src == "int8":
                assert torch.equal(st_b[key], st_a[key]) and torch.equal(st_b[key + "_absmax"], st_a[key + "_absmax"])
                continue
            want = ref_encode(val_a, code_dtype)
            torch.testing.assert_close(st_b[key + "_absmax"], want[1], rtol=1e-6, atol=0)
            assert (st_b[key].int() - want[0].int()).abs().max() <= 1
        else:
            dt = torch.bfloat16 if dst == "bf16" else torch.float32
            assert st_b[key].dtype == dt and key + "_absmax" not in st_b
            # decoded in fp32 here, in float64 by the reference: one fp32 rounding apart
            tol = 2 ** -23 if src == "int8" and dst == "fp32" else 0
            torch.testing.assert_close(st_b[key].float(), val_a.to(dt).float(), rtol=tol, atol=0)
    # the loaded optimizer steps on from there
    b.step_param(q, grad=torch.randn(n))


def test_state_dtype_refused_where_torch_steps(tmp_path):
    """adamw with state_dtype int8, and auto where it picks adamw: one-line ConfigErrors."""
    import zeroplug
    from zeroplug.errors import ConfigError
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r'optimizer.state_dtype = "int8": torch\'s Adam kernels step fp32'):
        zeroplug.initialize(model, config={"optimizer": {"plugin": "adamw", "state_dtype": "int8"}})
    with pytest.raises(ConfigError, match="optimizer.state_dtype = 'fp8'.*expected 'fp32' or 'bf16' or 'int8'"):
        zeroplug.initialize(model, config={"optimizer": {"plugin": "cpu_adam", "state_dtype": "fp8"}})


def test_deepspeed_keys_become_bf16_states():
    """DeepSpeed's bf16 optimizer states on the host map to state_dtype = "bf16"; without
    offload_optimizer they are ignored with a note (torch's kernels step fp32 states)."""
    from zeroplug.convert import from_deepspeed
    off = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    raw = from_deepspeed({**off, "bf16": {"enabled": True, "bf16_optimizer_states": True}})
    assert raw["optimizer"]["state_dtype"] == "bf16"
    raw = from_deepspeed({**off, "optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": False}}})
    assert raw["optimizer"]["state_dtype"] == "bf16" and raw["optimizer"]["plugin"] == "auto"
    notes: list[str] = []
    raw = from_deepspeed({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
                         notes)
    assert "state_dtype" not in raw.get("optimizer", {})
    assert any("bf16.bf16_optimizer_states = true ignored" in n for n in notes)
