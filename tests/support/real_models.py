"""Tiny versions of the models users bring, built from configs in code (nothing downloaded).

Each builder returns a fresh model (seeded) and ``batch(step)``: the step's global batch as
keyword inputs whose ``.loss`` is a mean over equally many tokens per sample, so the mean
of per-rank micro-batch losses equals the global batch's loss.
"""
from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 4


def _tokens(step: int, n: int = GLOBAL_BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step % 2)     # two fixed batches: the loss falls
    return torch.randint(0, VOCAB, (n, seq), generator=g)


def llama(tied: bool = True):
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=tied)
    return T.LlamaForCausalLM(cfg)


def gpt2():
    import transformers as T
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return T.GPT2LMHeadModel(cfg)


def t5():
    import transformers as T
    cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     dropout_rate=0.0, decoder_start_token_id=0)
    return T.T5ForConditionalGeneration(cfg)


def mixtral():
    import transformers as T
    cfg = T.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=1, max_position_embeddings=64)
    return T.MixtralForCausalLM(cfg)


def bert():
    import transformers as T
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return T.BertForMaskedLM(cfg)


class SparseMoE(torch.nn.Module):
    """Top-1 routing over experts that are modules of their own: on a small batch some
    experts get no tokens on some ranks (and no gradient), others on every rank."""

    def __init__(self, d: int = 16, experts: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))
        self.norm = torch.nn.LayerNorm(d)      # called twice per forward
        self.head = torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = self.norm(self.embed(input_ids))
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for i, e in enumerate(self.experts):
            sel = choice == i
            if sel.any():
                out[sel] = e(h[sel])
        h = self.norm(h + out)
        # the head's weight used outside its module's forward: a loss of one's own
        logits = h @ self.head.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return type("Out", (), {"loss": loss})()


BUILDERS = {"llama": llama, "gpt2": gpt2, "t5": t5, "mixtral": mixtral, "bert": bert, "moe": SparseMoE}


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return BUILDERS[name]()


def batch(name: str, step: int, lo: int = 0, hi: int = GLOBAL_BATCH) -> dict:
    ids = _tokens(step)[lo:hi]
    if name == "t5":
        return {"input_ids": ids, "labels": torch.flip(ids, [1])}
    return {"input_ids": ids, "labels": ids.clone()}


# -- training the same model under zeroplug and plain torch --------------------------------
LR, WEIGHT_DECAY = 1e-2, 0.01


def config(stage: int, world: int, offload: str = "none", precision: str = "fp32", gas: int = 1,
           nvme_path: str | None = None, **zero) -> dict:
    cfg = {"zero": {"plugin": f"stage{stage}", **zero}, "precision": {"plugin": precision},
           "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
           "scheduler": {"plugin": "none"},
           "batch": {"micro_batch_size": GLOBAL_BATCH // (gas * world), "gradient_accumulation_steps": gas,
                     "gradient_clipping": 0.0, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if offload == "cpu":
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    elif offload == "nvme":
        cfg["offload"] = {"optimizer": {"plugin": "nvme", "nvme_path": nvme_path}}
    return cfg


def torch_losses(name: str, steps: int, prepare=None, groups=None) -> tuple[list[float], dict]:
    """Plain torch: AdamW over the trainable parameters, one global batch per step."""
    model = build(name)
    if prepare is not None:
        model = prepare(model)
    params = groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for s in range(steps):
        loss = model(**batch(name, s)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def zeroplug_losses(rank: int, world: int, name: str, cfg: dict, steps: int, prepare=None,
                    groups=None, use_init: bool = False) -> tuple[list[float], dict | None]:
    """The same under zeroplug on ``world`` ranks; rank 0 gets the consolidated state dict."""
    import torch.distributed as dist

    import zeroplug
    if use_init:
        with zeroplug.init(cfg):
            model = build(name)
            if prepare is not None:
                model = prepare(model)
    else:
        model = build(name)
        if prepare is not None:
            model = prepare(model)
    engine = zeroplug.initialize(model, cfg, model_parameters=groups(model) if groups else None)
    m = GLOBAL_BATCH // world
    losses = []
    for s in range(steps):
        loss = engine(**batch(name, s, rank * m, (rank + 1) * m)).loss
        engine.backward(loss)
        engine.step()
        d = loss.detach().clone()
        if world > 1:
            dist.all_reduce(d)
        losses.append(d.item() / world)
    sd = engine.consolidated_state_dict()
    engine.close()
    return losses, sd


def max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs(sd, ref) -> float:
    return max((sd[k].float() - ref[k].float()).abs().max().item() for k in ref if ref[k].is_floating_point())
