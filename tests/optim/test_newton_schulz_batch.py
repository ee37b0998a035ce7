"""Newton-Schulz on a batch of same-shape matrices (what a Muon step runs: one batched product
per product of the iteration) against the same iteration matrix by matrix.

Tolerance: bit for bit on the CPU (observed: torch's CPU bmm sums each matrix's products in
the order mm does, for these shapes, in bf16, fp16 and fp32). On the GPU cuBLAS may pick
another kernel, and so another summation order, for a batch than for one matrix: a few bf16
ulps of an entry, inside the Muon tests' bf16 bound (tests/optim/test_muon.py); the GPU test
states that bound.
"""
from __future__ import annotations

import pytest
import torch

from zeroplug.plugins.optim.newton_schulz import orthogonalize_deepspeed, orthogonalize_torch

SHAPES = [(48, 20), (20, 48), (32, 32)]


def _batch(shape, device="cpu"):
    return torch.randn(4, *shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_rule_batch_equals_one_by_one(shape, dtype):
    g = _batch(shape)
    got = orthogonalize_torch(g.clone(), dtype=dtype)
    want = torch.stack([orthogonalize_torch(x.clone(), dtype=dtype) for x in g])
    assert got.shape == g.shape and got.dtype == dtype
    assert torch.equal(got, want)


def test_torch_rule_one_matrix_is_torchs():
    """The one-matrix path is torch.optim.Muon's own function, bit for bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from zeroplug.plugins.optim.newton_schulz import TORCH_COEFFICIENTS
    for shape in SHAPES:
        g = _batch(shape)[0]
        assert torch.equal(orthogonalize_torch(g.clone()), _zeropower_via_newtonschulz(g.clone(), TORCH_COEFFICIENTS,
                                                                                        5, 1e-7))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_deepspeed_rule_batch_equals_one_by_one(shape, method):
    g = _batch(shape)
    got = orthogonalize_deepspeed(g.clone(), ns_method=method)
    want = torch.stack([orthogonalize_deepspeed(x.clone(), ns_method=method) for x in g])
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_rule_batch_on_gpu():
    """The 1.3B model's shapes on the GPU: within 8 bf16 ulps (2**-5) of the largest entry."""
    for shape in [(6144, 2048), (2048, 8192)]:
        g = torch.randn(3, *shape, device="cuda")
        got = orthogonalize_torch(g.clone())
        want = torch.stack([orthogonalize_torch(x.clone()) for x in g])
        assert (got.float() - want.float()).abs().max().item() <= 2 ** -5 * want.float().abs().max().item()
