"""The reference GPT model and the training data behind ``zeroplug train`` (zeroplug.plugins.workload)."""

from __future__ import annotations

import math

import pytest
import torch

from zeroplug.plugins.workload import data, models

TINY = models.GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4)


# ---------------------------------------------------------------------------- models


def test_1_3b_param_count_exact_on_meta():
    cfg = models.PRESETS["1.3B"]
    with torch.device("meta"):
        model = models.GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert models.num_params(model) == 1_416_744_960
    assert models.param_count(cfg) == 1_416_744_960


@pytest.mark.parametrize("name", ["125M", "350M", "2.7B", "char-tiny"])
def test_param_count_formula_matches_model(name):
    cfg = models.PRESETS[name]
    with torch.device("meta"):
        model = models.GPT(cfg)
    assert models.num_params(model) == models.param_count(cfg)


def test_presets_match_workload():
    expect = {
        "125M": (12, 768, 12), "350M": (24, 1024, 16), "1.3B": (24, 2048, 16),
        "2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40),
    }
    for name, (n_layer, d_model, n_head) in expect.items():
        cfg = models.PRESETS[name]
        assert (cfg.n_layer, cfg.d_model, cfg.n_head) == (n_layer, d_model, n_head)
        assert (cfg.vocab_size, cfg.seq_len) == (50_304, 1_024)
    assert models.PRESETS["char-tiny"].vocab_size == 256


def test_flops_per_token():
    cfg = models.PRESETS["1.3B"]
    base = 6 * 1_416_744_960 + 12 * 24 * 2048 * 1024
    assert models.flops_per_token(cfg, 1024) == base
    ck = cfg.with_(activation_checkpointing=True)
    assert models.flops_per_token(ck, 1024) == pytest.approx(base * 4 / 3)
    assert models.flops_per_token(cfg, 512) == 6 * 1_416_744_960 + 12 * 24 * 2048 * 512


def test_forward_backward_shapes_and_init_loss():
    torch.manual_seed(0)
    model = models.GPT(TINY)
    x = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    logits = model(x)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    loss = model(x, torch.randint(0, TINY.vocab_size, (3, TINY.seq_len)))
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.15
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_loss_is_fp32_for_bf16_model():
    torch.manual_seed(0)
    model = models.GPT(TINY).to(torch.bfloat16)
    x = torch.randint(0, TINY.vocab_size, (2, 8))
    assert model(x).dtype == torch.bfloat16
    assert model(x, x).dtype == torch.float32


def test_causal():
    torch.manual_seed(0)
    model = models.GPT(TINY).eval()
    x = torch.randint(0, TINY.vocab_size, (1, TINY.seq_len))
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_init_values_and_determinism():
    torch.manual_seed(123)
    m1 = models.GPT(TINY)
    torch.manual_seed(123)
    m2 = models.GPT(TINY)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p1, p2), n
    blk = m1.blocks[0]
    assert torch.equal(blk.attn.qkv.bias, torch.zeros_like(blk.attn.qkv.bias))
    assert torch.equal(blk.ln1.weight, torch.ones_like(blk.ln1.weight))
    assert torch.equal(m1.ln_f.bias, torch.zeros_like(m1.ln_f.bias))
    assert m1.head.bias is None
    big = models.GPT(TINY.with_(d_model=128, n_head=4)).blocks[0].mlp.fc.weight
    assert abs(big.std().item() - 0.02) < 0.001


def test_init_happens_at_construction_in_creation_order():
    """Initialising each submodule as it is created (what a construction-intercepting
    partition context sees) must equal building the model normally."""
    torch.manual_seed(7)
    ref = models.GPT(TINY)
    # Snapshot each module's own parameters right after its constructor returns.
    snap: dict[int, list[torch.Tensor]] = {}
    # Intercept construction of every module class the GPT uses.
    classes = [models.Linear, models.Embedding, torch.nn.LayerNorm]
    saved = {c: c.__dict__.get("__init__") for c in classes}

    def wrap(cls):
        init = cls.__init__

        def new_init(self, *a, **k):
            init(self, *a, **k)
            if type(self) is cls:
                snap[id(self)] = [p.detach().clone() for p in self.parameters(recurse=False)]

        return new_init

    try:
        for c in classes:
            c.__init__ = wrap(c)
        torch.manual_seed(7)
        model = models.GPT(TINY)
    finally:
        for c, init in saved.items():
            if init is None:
                del c.__init__
            else:
                c.__init__ = init
    n_checked = 0
    for (name, m), (_, m_ref) in zip(model.named_modules(), ref.named_modules()):
        if id(m) in snap:
            for p_at_ctor, p_final, p_ref in zip(snap[id(m)], m.parameters(False), m_ref.parameters(False)):
                assert torch.equal(p_at_ctor, p_final), name
                assert torch.equal(p_at_ctor, p_ref), name
                n_checked += 1
    assert n_checked == sum(1 for _ in ref.parameters())


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    plain = models.GPT(TINY)
    ckpt = models.GPT(TINY.with_(activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    y = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    l1 = plain(x, y)
    l1.backward()
    l2 = ckpt(x, y)
    l2.backward()
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    for (n, p1), p2 in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_activation_checkpointing_actually_checkpoints():
    torch.manual_seed(0)
    model = models.GPT(TINY.with_(activation_checkpointing=True))
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    model(x, x).backward()
    assert len(calls) == 2  # forward + recomputation in backward
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(x)
    assert len(calls) == 1


# ---------------------------------------------------------------------------- data


def test_stdlib_corpus_nonempty_and_deterministic():
    a = data.stdlib_corpus(max_bytes=200_000)
    b = data.stdlib_corpus(max_bytes=200_000)
    assert isinstance(a, bytes) and len(a) == 200_000
    assert a == b
    assert b"def " in a and b"import " in a


def test_load_text_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        data.load_text(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt"):
        data.load_text(empty)
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"hello")
    assert data.load_text(ok) == b"hello"
    assert data.load_text(str(ok)) == b"hello"


CORPUS = bytes(range(256)) * 64  # 16 KiB, every byte value


def test_byte_batches_shapes_and_shift():
    it = data.ByteBatches(CORPUS, micro_batch=4, seq_len=32, seed=0)
    x, y = next(it)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.long
    # windows of a 0..255 ramp: y is x shifted by one
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, (x + 1) % 256)


def test_byte_batches_deterministic_per_seed_and_different_per_rank():
    def take(**kw):
        it = data.ByteBatches(CORPUS, micro_batch=4, seq_len=32, **kw)
        return torch.cat([next(it)[0] for _ in range(3)])

    assert torch.equal(take(seed=1), take(seed=1))
    assert not torch.equal(take(seed=1), take(seed=2))
    r0 = take(seed=1, rank=0, world_size=2)
    r1 = take(seed=1, rank=1, world_size=2)
    assert not torch.equal(r0, r1)
    assert torch.equal(r1, take(seed=1, rank=1, world_size=2))


def test_byte_batches_holdout_and_state():
    n = len(CORPUS)
    tail = torch.frombuffer(bytearray(CORPUS), dtype=torch.uint8)[n - int(n * 0.05):]
    it = data.ByteBatches(CORPUS, micro_batch=8, seq_len=16, seed=3)
    assert len(it.train_data) + len(it.eval_data) == n
    assert torch.equal(it.eval_data, tail)
    ex, ey = it.eval_batch()
    ex2, _ = it.eval_batch()
    assert ex.shape == (8, 16) and torch.equal(ex, ex2)
    # training windows stay in the training part: starts < len(train) - seq_len
    marked = bytearray(b"a" * (n - int(n * 0.05))) + bytearray(b"Z" * int(n * 0.05))
    it2 = data.ByteBatches(bytes(marked), micro_batch=64, seq_len=16, seed=0)
    for _ in range(20):
        x, y = next(it2)
        assert not (y == ord("Z")).any()
    state = it.state_dict()
    a = next(it)[0]
    it.load_state_dict(state)
    assert torch.equal(a, next(it)[0])


def test_byte_batches_errors():
    with pytest.raises(ValueError):
        data.ByteBatches(b"short", micro_batch=1, seq_len=32)
    with pytest.raises(ValueError):
        data.ByteBatches(CORPUS, micro_batch=1, seq_len=8, rank=2, world_size=2)


def test_random_tokens():
    it = data.RandomTokens(vocab_size=100, micro_batch=3, seq_len=10, seed=5)
    x, y = next(it)
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 100
    x2, _ = next(data.RandomTokens(vocab_size=100, micro_batch=3, seq_len=10, seed=5))
    assert torch.equal(x, x2)
    x3, _ = next(data.RandomTokens(vocab_size=100, micro_batch=3, seq_len=10, seed=5, rank=1))
    assert not torch.equal(x, x3)


def test_tiny_model_learns_bytes():
    """A few steps on the stdlib corpus lower the loss: model + data fit together."""
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab_size=256, seq_len=32, n_layer=1, d_model=32, n_head=2)
    model = models.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    it = data.ByteBatches(data.stdlib_corpus(max_bytes=100_000), micro_batch=16, seq_len=32, seed=0)
    ex, ey = it.eval_batch(32)
    with torch.no_grad():
        before = model(ex, ey).item()
    for _ in range(40):
        x, y = next(it)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = model(ex, ey).item()
    assert before > 5.0 and after < before - 1.5
