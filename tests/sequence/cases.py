"""The models, data and both sides (plain torch on one process, zeroplug with a sequence split over
ranks) of the sequence-parallel equivalence tests.

Models: the reference GPT and a Hugging Face Llama built from a tiny config (4 heads, 2
key-value heads: a group of 4 ranks repeats them), 2 layers, d = 32. Data: ``GROUPS`` samples
of ``SEQ`` = 29 tokens (not a multiple of 2 or 4: the slices are padded), the second one
right-padded from token 22 and the first one's first 3 labels ignored (a prompt), so the
samples have different counts of real tokens.

Reference: one process, plain torch, SGD (lr 0.1, so the parameters after a step show the
gradients): each step the mean over the samples of each sample's mean loss over its real tokens
(what data-parallel ranks of whole samples train), backward, step; ``STEPS`` steps.
"""
from __future__ import annotations

import torch

VOCAB, SEQ, PAD_FROM, PROMPT = 64, 29, 22, 3
STEPS, LR = 2, 0.1


def build(kind: str, checkpointing: bool = False, positions: int = 64):
    torch.manual_seed(0)
    if kind == "gpt":
        from zeroplug.plugins.workload.models import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=positions, n_layer=2, d_model=32, n_head=4,
                             activation_checkpointing=checkpointing))
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    model = T.LlamaForCausalLM(cfg)
    if checkpointing:
        checkpointing_on(model)
    return model


def checkpointing_on(model) -> None:
    """A Hugging Face model's activation checkpointing, non-reentrant (the newer name where it exists)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def samples(kind: str, n: int) -> list[dict]:
    """``n`` samples (batches of one sequence), as a data loader gives them (whole sequences)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randint(0, VOCAB, (1, SEQ), generator=g)
        if kind == "gpt":
            y = torch.randint(0, VOCAB, (1, SEQ), generator=g)
            if i == 0:
                y[:, :PROMPT] = -100
            if i % 2 == 1:
                y[:, PAD_FROM:] = -100
            out.append({"idx": x, "targets": y})
        else:
            labels = x.clone()
            mask = torch.ones_like(x)
            if i == 0:
                labels[:, :PROMPT] = -100
            if i % 2 == 1:
                mask[:, PAD_FROM:] = 0
                x = x.masked_fill(mask == 0, 0)
            out.append({"input_ids": x, "labels": labels, "attention_mask": mask})
    return out


def _loss(model, kind: str, b: dict) -> torch.Tensor:
    if kind == "gpt":
        return model(b["idx"], b["targets"])
    # right padding: causal attention never looks ahead, so the mask only drops the padding's labels
    labels = b["labels"].masked_fill(b["attention_mask"] == 0, -100)
    return model(input_ids=b["input_ids"], labels=labels).loss


def reference(kind: str, groups: int) -> tuple[list[float], dict]:
    model = build(kind)
    data = samples(kind, groups)
    losses = []
    for _ in range(STEPS):
        loss = sum(_loss(model, kind, b) for b in data) / groups
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(stage: int, degree: int, tiled: bool = False, host: bool = False, precision: str = "fp32") -> dict:
    seq = {"plugin": "ulysses", "sequence_parallel_size": degree, "tiled_mlp": tiled, "tiled_loss": tiled}
    if tiled:      # chunks smaller than a slice: really tiled
        seq.update(mlp_chunk_tokens=4, loss_chunk_tokens=5)
    elif degree == 1:
        seq.update(tiled_mlp=True, mlp_chunk_tokens=1 << 20)
    cfg = {"zero": {"plugin": f"stage{stage}"}, "precision": {"plugin": precision},
           "optimizer": {"plugin": "sgd", "lr": LR}, "scheduler": {"plugin": "none"},
           "batch": {"micro_batch_size": 1, "gradient_clipping": 0.0, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}, "sequence": seq}
    if host:
        cfg["activation_checkpointing"] = {"plugin": "cpu", "min_offload_bytes": 0}
    return cfg


def train(rank: int, world: int, kind: str, cfg, checkpointing: bool = False) -> dict:
    """zeroplug on this rank: each group trains its sample (data-parallel rank), sliced."""
    import zeroplug
    from zeroplug.plugins.sequence import for_engine
    model = build(kind, checkpointing)
    engine = zeroplug.initialize(model, cfg, device="cpu")
    sp = for_engine(engine)
    batch = samples(kind, sp.group.data_parallel_size)[sp.group.data_parallel_rank]
    losses = []
    for _ in range(STEPS):
        out = engine(**sp.shard(batch))
        loss = out if kind == "gpt" else out.loss
        engine.backward(loss)
        engine.step()
        d = loss.detach().clone()
        if world > 1:       # the data-parallel mean (each group's ranks return the group's loss)
            torch.distributed.all_reduce(d)
        losses.append(d.item() / world)
    offloaded = engine.activations.stats["offloaded"] if hasattr(engine.activations, "stats") else None
    sd = engine.consolidated_state_dict()
    engine.close()
    return {"losses": losses, "state": sd, "own_loss": loss.item(), "offloaded": offloaded}


def max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs(sd, ref) -> float:
    return max((sd[k].float() - ref[k].float()).abs().max().item() for k in ref if ref[k].is_floating_point())
