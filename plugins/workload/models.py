"""The reference GPT model (docs: WORKLOAD.md) and its size presets.

A GPT-2 style decoder: token embedding + learned position embedding; N pre-LN blocks of
[LayerNorm -> fused QKV Linear (d->3d, bias) -> causal scaled_dot_product_attention ->
Linear (d->d, bias) -> residual; LayerNorm -> Linear (d->4d) -> GELU -> Linear (4d->d) ->
residual]; final LayerNorm; untied Linear head (d->vocab, no bias); cross-entropy in fp32.

Initialisation happens inside each submodule's constructor (``reset_parameters``), in
creation order, so that a partitioning context that intercepts module construction (ZeRO
stage 3's ``zeroplug.init``) sees exactly the values an ordinary construction would give,
for the same torch seed and the same device.

Standalone: imports only torch, the stdlib and :mod:`.presets` (the sizes, without torch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .presets import PRESETS, GPTConfig, get_preset

INIT_STD = 0.02


# --------------------------------------------------------------------------------------
# Layers that initialise themselves (in their constructor, via reset_parameters).


class Linear(nn.Linear):
    """nn.Linear with weight ~ N(0, 0.02) and zero bias."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
            if self.bias is not None:
                nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with weight ~ N(0, 0.02)."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


# nn.LayerNorm already initialises to ones / zeros in its constructor.


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention over ``[B, H, T, hd]`` queries, keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=True)
        # Note: the attention itself, a plain attribute so that a plugin can replace it on an
        # instance without editing the model (sequence parallelism exchanges heads for
        # sequence around it: zeroplug.plugins.sequence)
        self.attend = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        qkv = self.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)  # 3, B, H, T, hd
        q, k, v = qkv.unbind(0)
        y = self.attend(q, k, v)  # B, H, T, hd
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.d_model, 4 * cfg.d_model, bias=True)
        self.act = nn.GELU()
        self.out = Linear(4 * cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """``GPT(cfg)``; ``forward(idx, targets=None, position_ids=None)`` -> logits (B, T, vocab),
    or the mean cross-entropy loss (a 0-dim fp32 tensor; targets of -100 are left out) when
    ``targets`` is given. ``position_ids`` (B, T) or (T,): the tokens' positions (default
    0 .. T-1; a slice of a longer sequence passes its own)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def max_positions(self) -> int:
        return self.cfg.seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if position_ids is None:
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
            position_ids = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(position_ids)
        use_ckpt = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_ckpt:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.head(x)
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The head over the final hidden states ``x`` and the mean cross entropy against
        ``targets`` (fp32). Note: a method of its own so that a plugin can replace it on an
        instance (a loss computed in tiles, never holding all the logits)."""
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------------------
# Sizes and FLOPs.


def num_params(model: nn.Module) -> int:
    """Number of (distinct) parameter elements of ``model``, as allocated locally.

    Works on the meta device. Under ZeRO stage 3 parameters may be partitioned; then use
    ``param_count(cfg)``, which needs no model."""
    return sum(p.numel() for p in model.parameters())


def param_count(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)``, computed from the config alone."""
    V, S, L, d = cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.d_model
    per_block = (
        2 * 2 * d  # two LayerNorms
        + d * 3 * d + 3 * d  # fused QKV
        + d * d + d  # attention output
        + d * 4 * d + 4 * d  # MLP in
        + 4 * d * d + d  # MLP out
    )
    return V * d + S * d + L * per_block + 2 * d + d * V


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (WORKLOAD.md): 6 * params + 12 * layers * d_model * seq,
    times 4/3 when activation checkpointing recomputes the forward."""
    seq = cfg.seq_len if seq_len is None else seq_len
    flops = 6 * param_count(cfg) + 12 * cfg.n_layer * cfg.d_model * seq
    if cfg.activation_checkpointing:
        flops = flops * 4 / 3
    return float(flops)


def init_loss(cfg: GPTConfig) -> float:
    """Expected loss at initialisation (uniform prediction): ln(vocab)."""
    return math.log(cfg.vocab_size)


__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "causal_attention",
    "MLP",
    "Linear",
    "Embedding",
    "PRESETS",
    "get_preset",
    "num_params",
    "param_count",
    "flops_per_token",
    "init_loss",
]
