"""Long sequences on a GPU: the tiles, the attention with grouped key-value heads and the host
checkpoints on CUDA (side streams, pinned memory), against the same computation untiled. Skipped
without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zeroplug

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_grouped_attention_matches_repeated_heads():
    """enable_gqa on the fused kernels (or the repeat fallback) equals repeating the heads."""
    from zeroplug.plugins.sequence.exchange import causal_attention
    torch.manual_seed(0)
    q = torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = causal_attention(q, k, v)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_tiled_head_loss_bf16():
    from zeroplug.plugins.sequence.tiles import head_loss_sum
    torch.manual_seed(0)
    h = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 256, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, 32000, (8192,), device="cuda")
    want = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    gh, gw = torch.autograd.grad(want, (h, w))
    got = head_loss_sum(h, w, None, t, -100, chunks=7)
    th, tw = torch.autograd.grad(got, (h, w))
    assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
    for a, b in ((th, gh), (tw, gw)):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_long_sequence_step_on_one_gpu(kind):
    """16K tokens of the tiny models with tiles (chunks of 1,024) and checkpoints in pinned host
    memory: trains, the inputs went to the host and came back, losses as without either."""
    from tests.sequence.cases import build
    seq = 16384
    losses = {}
    for mechanisms in (False, True):
        model = build(kind, checkpointing=True, positions=seq)
        cfg = {"zero": {"plugin": "stage3"}, "precision": {"plugin": "fp32"},
               "optimizer": {"plugin": "sgd", "lr": 0.1}, "monitor": {"plugin": "none"},
               "batch": {"micro_batch_size": 1}}
        if mechanisms:
            cfg["sequence"] = {"plugin": "ulysses", "mlp_chunk_tokens": 1024, "loss_chunk_tokens": 1024}
            cfg["activation_checkpointing"] = {"plugin": "cpu", "min_offload_bytes": 0}
        engine = zeroplug.initialize(model, cfg, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, 64, (1, seq), device="cuda", generator=g)
        out = []
        for _ in range(2):
            loss = engine(x, x) if kind == "gpt" else engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        if mechanisms:
            assert engine.activations.stats["offloaded"] > 0
        engine.close()
        losses[mechanisms] = out
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) <= 1e-4 * abs(losses[False][0])
