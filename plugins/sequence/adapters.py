"""Where the sequence strategy meets a model, without editing the model.

Two kinds of models take part:

* Hugging Face decoder models (Llama, Qwen2/3, Mistral and the others whose attention goes
  through transformers' ``AttentionInterface``): the attention is registered as
  ``"zeroplug_ulysses"`` and named in ``model.config._attn_implementation``; the causal LM's
  ``forward`` is wrapped so that the positions are the slice's global ones and the loss is
  computed from the last hidden states over the group (tiled when asked).
* Models of one's own (the reference GPT) that follow a small protocol: attention modules
  hold the attention itself in an ``attend(q, k, v)`` attribute (``[B, H, T, hd]`` each,
  causal); the root's ``forward`` takes ``position_ids``; and, for the loss, a
  ``head_loss(hidden, targets)`` method beside an ``nn.Linear`` named ``head`` (targets
  aligned with the positions, -100 ignored).

Either way, modules registered under the name ``mlp`` (position-wise) compute in tiles along
the sequence when the strategy tiles the MLP. Every change is undone by :meth:`Attached.undo`.
"""
from __future__ import annotations

import functools
import math
import weakref

import torch

from zeroplug.errors import ConfigError

from .exchange import ulysses_attention
from .groups import SequenceGroup
from .loss import group_mean, shift_labels as shift_labels_fn, tokens_max
from .tiles import head_loss_sum, tiled_call

KEY = "sequence.sequence_parallel_size"
HF_NAME = "zeroplug_ulysses"

#: attention module -> the Attached whose group it exchanges in (Hugging Face models: the one
#: registered attention function serves every model)
_ATTENTION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Tiles:
    """The chunk sizes in tokens (0: never tiled) and, per forward, the most tokens any rank holds."""

    def __init__(self, mlp_tokens: int, loss_tokens: int, fp32_budget: int):
        self.mlp_tokens, self.loss_tokens, self.fp32_budget = mlp_tokens, loss_tokens, fp32_budget
        self.tokens = 0       # the most tokens (batch x local sequence) of any rank in this forward

    def chunks(self, per_chunk: int) -> int:
        return max(1, math.ceil(self.tokens / per_chunk)) if per_chunk else 1

    def fp32(self, params) -> bool:
        """Sum the chunks' gradients in fp32 when that fits the tile budget."""
        return sum(p.numel() for p in params) * 4 <= self.fp32_budget


class Attached:
    """The changes made to one model; ``undo()`` takes them back."""

    def __init__(self, model: torch.nn.Module, group: SequenceGroup, tiles: Tiles, ignore_index: int,
                 run, tile_mlp: bool, tile_loss: bool):
        self.model, self.group, self.tiles, self.ignore_index = model, group, tiles, ignore_index
        self.run, self.tile_mlp, self.tile_loss = run, tile_mlp, tile_loss
        self._undo: list = []
        self.mlps = 0            # MLP modules computed in tiles
        self.loss = False        # whether the loss is computed here

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- per forward -------------------------------------------------------------------
    def hook_forward(self, batched_positions: bool, max_positions: int | None = None) -> None:
        """At each forward of the model, on every rank: the tile counts follow the longest local
        sequence of any rank, and a slice without ``position_ids`` (keyword, or the third
        argument) gets its global positions (``[B, T]`` or ``[T]``)."""
        group, tiled = self.group, bool(self.mlps or self.loss and self.tile_loss and self.tiles.loss_tokens)
        if not (tiled or group.distributed):
            return

        def pre_forward(module, args, kwargs):
            x = args[0] if args else next((kwargs[k] for k in ("input_ids", "idx", "inputs_embeds")
                                           if kwargs.get(k) is not None), None)
            if x is None:
                return None
            B, T = x.shape[:2]
            if tiled:
                self.tiles.tokens = tokens_max(B * T, self.run.comm, self.run.device)
            if not group.distributed or kwargs.get("position_ids") is not None or (len(args) > 2 and
                                                                                    args[2] is not None):
                return None
            if isinstance(max_positions, int) and T * group.degree > max_positions:
                raise ValueError(f"a sequence of {T} x {group.degree} = {T * group.degree} tokens exceeds the "
                                 f"model's {max_positions} positions")
            pos = torch.arange(group.rank * T, (group.rank + 1) * T, device=x.device)
            return args, {**kwargs, "position_ids": pos.unsqueeze(0).expand(B, -1) if batched_positions else pos}
        handle = self.model.register_forward_pre_hook(pre_forward, with_kwargs=True)
        self._undo.append(handle.remove)

    # -- the MLP -------------------------------------------------------------------------
    def tile_mlps(self) -> None:
        if not self.tile_mlp or not self.tiles.mlp_tokens:
            return
        for name, m in self.model.named_modules():
            if name.rsplit(".", 1)[-1] != "mlp" or _is_moe(m):
                continue
            params = [p for p in m.parameters()]
            orig = m.forward

            def forward(x, *args, _orig=orig, _params=params, **kwargs):
                if args or kwargs or not torch.is_tensor(x) or x.dim() != 3:
                    return _orig(x, *args, **kwargs)
                chunks = self.tiles.chunks(self.tiles.mlp_tokens)
                return tiled_call(_orig, x, _params, chunks, self.tiles.fp32(_params))
            m.forward = forward
            self._undo.append(functools.partial(_restore_forward, m))
            self.mlps += 1

    # -- the loss --------------------------------------------------------------------------
    def loss_of(self, hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor) -> torch.Tensor:
        """The sample's mean loss from this rank's final hidden states and aligned targets."""
        chunks = self.tiles.chunks(self.tiles.loss_tokens) if self.tile_loss else 1
        params = [head.weight] + ([head.bias] if head.bias is not None else [])
        local = head_loss_sum(hidden, head.weight, head.bias, targets, self.ignore_index, chunks,
                              self.tiles.fp32(params))
        return group_mean(local, (targets != self.ignore_index).sum(), self.group)


def _restore_forward(m: torch.nn.Module) -> None:
    m.__dict__.pop("forward", None)


def _is_moe(m: torch.nn.Module) -> bool:
    """Mixtures of experts route tokens and return more than the hidden states: not tiled."""
    name = type(m).__name__.lower()
    return "moe" in name or "expert" in name or hasattr(m, "experts")


def _check_heads(what: str, heads: int, kv_heads: int, degree: int) -> None:
    if heads % degree:
        raise ConfigError(f"{KEY} = {degree} does not divide the model's {heads} attention heads ({what}): "
                          f"each rank of a group attends with heads / {degree} of them; pick a divisor of {heads}",
                          key=KEY)
    if kv_heads % degree and degree % kv_heads:
        raise ConfigError(f"{KEY} = {degree} and the model's {kv_heads} key-value heads ({what}) neither divide "
                          f"the other: each rank needs whole key-value heads; pick a divisor or a multiple of "
                          f"{kv_heads} that divides {heads}", key=KEY)


# -- models of one's own (the reference GPT) ------------------------------------------------

def attach_own(a: Attached) -> bool:
    """The protocol of the module docstring; False when the model has no ``attend`` attention."""
    model, group = a.model, a.group
    attention = [m for m in model.modules() if callable(getattr(m, "attend", None))
                 and not isinstance(getattr(m, "attend"), torch.nn.Module)]
    if not attention:
        return False
    if group.distributed:
        for m in attention:
            heads = getattr(m, "n_head", None) or getattr(m, "num_heads", None)
            if isinstance(heads, int):
                _check_heads(type(m).__name__, heads, heads, group.degree)
            orig = m.__dict__.get("attend")
            m.attend = functools.partial(_own_attend, comm=group.comm)
            a._undo.append(functools.partial(_set_or_drop, m, "attend", orig))
    a.tile_mlps()
    head = getattr(model, "head", None)
    if callable(getattr(model, "head_loss", None)) and isinstance(head, torch.nn.Linear) and (
            group.distributed or a.tile_loss and a.tiles.loss_tokens):
        model.head_loss = lambda x, targets: a.loss_of(x, head, targets)
        a._undo.append(functools.partial(_set_or_drop, model, "head_loss", None))
        a.loss = True
    elif group.distributed:
        raise ConfigError(f"{KEY} = {group.degree}: the model has no head_loss(hidden, targets) beside an "
                          f"nn.Linear `head`, so its loss would be each slice's own mean; give it one "
                          f"(zeroplug.plugins.sequence.adapters), or use [sequence] plugin = \"none\"", key=KEY)
    a.hook_forward(batched_positions=False, max_positions=getattr(model, "max_positions", None))
    return True


def _own_attend(q, k, v, comm):
    if q.shape[1] % comm.world_size:
        raise ValueError(f"{q.shape[1]} attention heads are not divisible by {KEY} = {comm.world_size}")
    return ulysses_attention(q, k, v, comm)


def _set_or_drop(obj, name: str, value) -> None:
    if value is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, value)


# -- Hugging Face models -------------------------------------------------------------------

def is_hf(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(cfg, "_attn_implementation") and hasattr(model, "get_output_embeddings")


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: ``[B, H, s, D]`` of this rank's slice in, ``[B, s, H, D]`` out."""
    a = _ATTENTION.get(module)
    if a is None:
        raise RuntimeError(f"{type(module).__name__}: config._attn_implementation = {HF_NAME!r} on a model that "
                           "no zeroplug engine set up (sequence parallelism); set it back to \"sdpa\"")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__}: {HF_NAME} computes causal attention only")
    window = kwargs.get("sliding_window")
    total = query.shape[2] * a.group.degree
    if isinstance(window, int) and 0 < window < total:
        raise ValueError(f"{type(module).__name__}: a sliding window of {window} tokens over a sequence of {total}: "
                         f"sequence parallelism computes full causal attention; use sequences of at most "
                         f"{window} tokens or a model without a sliding window")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__}: attention logit soft-capping is not supported by {HF_NAME}")
    out = ulysses_attention(query, key, value, a.group.comm, scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def _set_attention(model, name: str) -> None:
    """The attention implementation a Hugging Face model (and its sub-models) calls."""
    model.set_attn_implementation(name)


def attach_hf(a: Attached) -> None:
    model, group = a.model, a.group
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0) and (group.distributed or a.tile_loss):
            raise ConfigError(f"{KEY}: the model scales its logits (config.{attr}), which zeroplug's loss over "
                              f"a sequence does not do; use [sequence] plugin = \"none\"", key=KEY)
    if group.distributed:
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if not isinstance(heads, int):
            raise ConfigError(f"{KEY} = {group.degree}: the model's config names no num_attention_heads", key=KEY)
        _check_heads(type(model).__name__, heads, kv, group.degree)
        if not hasattr(model, "set_attn_implementation"):
            import transformers
            raise ConfigError(f"{KEY} = {group.degree} with a Hugging Face model needs a transformers that has "
                              f"PreTrainedModel.set_attn_implementation (this one is {transformers.__version__}): "
                              f"upgrade it", key=KEY)
        from transformers import AttentionInterface
        AttentionInterface.register(HF_NAME, _hf_attention)
        for m in model.modules():
            if hasattr(m, "layer_idx") and hasattr(m, "head_dim"):
                _ATTENTION[m] = a
        before = cfg._attn_implementation
        _set_attention(model, HF_NAME)
        a._undo.append(functools.partial(_set_attention, model, before))
    a.tile_mlps()
    head = model.get_output_embeddings()
    base = getattr(model, "base_model", None)
    takes_loss = isinstance(head, torch.nn.Linear) and base is not None and base is not model
    if not takes_loss and group.distributed:
        raise ConfigError(f"{KEY} = {group.degree}: {type(model).__name__} is not a causal LM with a linear "
                          f"head over a base model (model.base_model, get_output_embeddings())", key=KEY)
    if takes_loss and (group.distributed or a.tile_loss and a.tiles.loss_tokens):
        _wrap_hf_forward(a, base, head)
    a.hook_forward(batched_positions=True)


def _wrap_hf_forward(a: Attached, base: torch.nn.Module, head: torch.nn.Linear) -> None:
    """The causal LM's forward: the base model's last hidden states, then the loss over the group."""
    model, group = a.model, a.group
    orig = model.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                inputs_embeds=None, **kwargs):
        if group.distributed and attention_mask is not None:
            if not bool(attention_mask.all()):
                raise ValueError("attention_mask with padding under sequence parallelism: slice the batch with "
                                 "zeroplug.plugins.sequence.shard_batch (it turns right padding into ignored "
                                 "labels); left padding and packed sequences are not supported")
            attention_mask = None
        if labels is None and shift_labels is None:
            return orig(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, **kwargs)
        kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   inputs_embeds=inputs_embeds, **kwargs)
        hidden = out[0]
        if shift_labels is None:
            shift_labels = shift_labels_fn(labels, group, a.ignore_index)
        loss = a.loss_of(hidden, head, shift_labels)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))
    model.forward = forward
    a._undo.append(functools.partial(_restore_forward, model))
    a.loss = True
