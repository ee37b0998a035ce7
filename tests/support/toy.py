"""Small models and a reference loop shared by the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ToyNet(torch.nn.Module):
    """Embedding -> 2 residual MLP blocks -> LayerNorm -> head; odd sizes on purpose (padding)."""

    def __init__(self, vocab=37, d=24, hidden=50):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))
            for _ in range(2))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, y=None):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        logits = self.head(self.norm(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


class ExpertsOnTheModel(torch.nn.Module):
    """An ``experts`` ModuleList held by the model itself, top-1 routed by token id (with
    ``experts`` = 2 x ranks, rank r's tokens of a batch split by id go to experts 2r, 2r+1),
    experts without tokens skipped, a learned sigmoid gate."""

    def __init__(self, vocab=37, d=24, hidden=40, experts=4, head_bias=False):
        super().__init__()
        self.vocab, self.n = vocab, experts
        self.emb = torch.nn.Embedding(vocab, d)
        self.gate = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))
            for _ in range(experts))
        self.head = torch.nn.Linear(d, vocab, bias=head_bias)

    def forward(self, x, y):
        h = self.emb(x)
        flat, route = h.reshape(-1, h.size(-1)), (x * self.n // self.vocab).reshape(-1)
        g = torch.sigmoid(self.gate(flat)).gather(1, route[:, None])
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            mask = route == i
            if mask.any():
                out[mask] = g[mask] * expert(flat[mask])
        h = h + out.view_as(h)
        return F.cross_entropy(self.head(h).view(-1, self.vocab), y.view(-1))


def batches(steps, global_batch, seq=8, vocab=37, seed=1234):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, (global_batch, seq), generator=g)
        y = torch.randint(0, vocab, (global_batch, seq), generator=g)
        yield x, y


def reference_losses(model_fn, steps, global_batch, lr=1e-2, clip=0.0, weight_decay=0.01, device="cpu"):
    """Single-process torch.optim.AdamW on the full batch: the ground truth."""
    torch.manual_seed(0)
    model = model_fn().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for x, y in batches(steps, global_batch):
        loss = model(x.to(device), y.to(device))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_step(engine, x, y, rank=0, world=1, gas=1, comm=None) -> float:
    """One optimizer step over the global batch ``x, y``: this rank's ``gas`` micro-batches
    (micro-batch k of rank r is slice ``k * world + r``), step() after each as DeepSpeed's loop
    does; the mean loss over every rank (``comm``: the engine's when None)."""
    m = x.shape[0] // (gas * world)
    total = torch.zeros(())
    for k in range(gas):
        lo = (k * world + rank) * m
        loss = engine(x[lo:lo + m], y[lo:lo + m])
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    (comm or engine.run.comm).all_reduce(total)
    return total.item() / (gas * world)


def build_engine(model_fn, config, use_init=False, device=None):
    """``zeroplug.initialize`` of ``model_fn()`` built from seed 0, inside ``zeroplug.init``
    (each parameter built straight into its shards) when ``use_init``."""
    import zeroplug
    torch.manual_seed(0)
    if use_init:
        with zeroplug.init(config, device=device):
            model = model_fn()
    else:
        model = model_fn()
    return zeroplug.initialize(model, config, device=device)


def engine_losses(model_fn, steps, global_batch, config, rank=0, world=1, use_init=False, device=None,
                  after_init=None):
    """The same run through zeroplug; each rank takes its slice of the global batch
    (``after_init(engine)`` runs before the first step)."""
    engine = build_engine(model_fn, config, use_init, device)
    if after_init is not None:
        after_init(engine)
    dev = engine.run.device
    per = global_batch // world
    losses = []
    for x, y in batches(steps, global_batch):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = engine(xs.to(dev), ys.to(dev))
        engine.backward(loss)
        engine.step()
        # the global loss: mean over ranks of the per-rank mean
        t = loss.detach().float().clone()
        engine.run.comm.all_reduce(t)
        losses.append(t.item() / world)
    return losses, engine


def train_steps(engine, data, n):
    """``n`` optimizer steps on batches from ``data``; the losses."""
    out = []
    for _ in range(n):
        x, y = next(data)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def peak_bytes(fn):
    """(result, peak live tensor bytes above the start) of ``fn()``, from the allocator's
    events as torch's profiler records them (RSS and tracemalloc do not see torch's CPU
    allocations precisely)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return out, peak


class Wide(torch.nn.Module):
    """``layers`` Linear(width, width): with sub_group_size = width^2 + width, one unit and
    one sub-group per layer (the checkpoint / swap memory tests)."""

    def __init__(self, width=512, layers=6):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x).float().pow(2).mean()


def wide_steps(engine, width, seed, n):
    """``n`` steps of a model whose forward takes a (4, width) float batch and returns a loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        loss = engine(torch.randn(4, width, generator=g))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out
