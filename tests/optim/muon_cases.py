"""Shared by the Muon tests: a reference loop (torch.optim.Muon on the hidden matrices,
torch.optim.AdamW on the rest, one process, full batch) and the same run through zeroplug."""
from __future__ import annotations

import torch

from tests.support.toy import ToyNet, batches, global_step

LR, ADAM_LR, WEIGHT_DECAY = 0.02, 1e-2, 0.01
GLOBAL_BATCH = 8


def is_muon(name: str, p) -> bool:
    """The default rule on ToyNet: its hidden Linear weights."""
    return p.ndim >= 2 and not name.startswith(("emb", "head"))


def data(steps):
    fixed = list(batches(2, GLOBAL_BATCH))
    return [fixed[i % 2] for i in range(steps)]


def newton_schulz_fp32(g, coefficients, steps, eps):
    """torch.optim.Muon's quintic iteration with fp32 arithmetic: what the reference runs
    when the comparison is to be exact to fp32 rounding (``ns_dtype = "fp32"``)."""
    a, b, c = coefficients
    x = g.float().clone()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def reference(steps, clip=0.0, ns_fp32=False):
    """``ns_fp32``: torch.optim.Muon with its Newton-Schulz iterations in fp32 (its module
    function swapped for the same iteration in fp32 while the reference runs)."""
    import torch.optim._muon as torch_muon
    saved = torch_muon._zeropower_via_newtonschulz
    if ns_fp32:
        torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        return _reference(steps, clip)
    finally:
        torch_muon._zeropower_via_newtonschulz = saved


def _reference(steps, clip):
    torch.manual_seed(0)
    model = ToyNet()
    mu = [p for n, p in model.named_parameters() if is_muon(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_muon(n, p)]
    opts = [torch.optim.Muon(mu, lr=LR, weight_decay=WEIGHT_DECAY),
            torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=WEIGHT_DECAY)]
    losses = []
    for x, y in data(steps):
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(stage, precision="fp32", offload=False, world=1, gas=1, clip=0.0, **optimizer):
    cfg = {"zero": {"plugin": f"stage{stage}"}, "precision": {"plugin": precision},
           "optimizer": {"plugin": "muon", "lr": LR, "adam_lr": ADAM_LR, "weight_decay": WEIGHT_DECAY, **optimizer},
           "batch": {"micro_batch_size": GLOBAL_BATCH // (gas * world), "gradient_accumulation_steps": gas,
                     "gradient_clipping": clip, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    return cfg


def train(rank, world, cfg, steps, engine=None):
    """Losses (global means) and, on rank 0, the consolidated state dict."""
    from tests.support.toy import build_engine
    engine = engine or build_engine(ToyNet, cfg)
    gas = engine.gradient_accumulation_steps
    losses = [global_step(engine, x, y, rank, world, gas) for x, y in data(steps)]
    return losses, engine.consolidated_state_dict(), engine


def run_cases(rank, world, cases, steps):
    """Every case (name -> config kwargs) on these ranks in turn; rank 0's results."""
    out = {}
    for name, kw in cases.items():
        losses, state, engine = train(rank, world, config(world=world, **kw), steps)
        out[name] = {"losses": losses, "state": state, "skipped": engine.skipped_steps}
        engine.close()
    return out if rank == 0 else None
