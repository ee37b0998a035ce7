"""Shared by the element-wise optimizer tests: one process of a torch.optim class (or of a
formula written out) on ToyNet, and the same run through zeroplug's stages."""
from __future__ import annotations

import torch

from tests.support.toy import ToyNet, batches

GLOBAL_BATCH = 8


def data(steps):
    fixed = list(batches(2, GLOBAL_BATCH))
    return [fixed[i % 2] for i in range(steps)]


def reference(make_optimizer, steps):
    torch.manual_seed(0)
    model = ToyNet()
    opt = make_optimizer(list(model.parameters()))
    losses = []
    for x, y in data(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(stage, optimizer: dict, offload=False, world=1):
    cfg = {"zero": {"plugin": f"stage{stage}"}, "optimizer": optimizer,
           "batch": {"micro_batch_size": GLOBAL_BATCH // world, "steps_per_print": 10_000},
           "monitor": {"plugin": "none"}}
    if offload:
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    return cfg


def run_cases(rank, world, cases, steps):
    """case name -> (stage, optimizer table, offload): rank 0's losses and final state."""
    from tests.support.toy import build_engine
    out = {}
    m = GLOBAL_BATCH // world
    for name, (stage, table, offload) in cases.items():
        engine = build_engine(ToyNet, config(stage, table, offload, world))
        losses = []
        for x, y in data(steps):
            loss = engine(x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m])
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            engine.run.comm.all_reduce(t)
            losses.append(t.item() / world)
        out[name] = (losses, engine.consolidated_state_dict())
        engine.close()
    return out if rank == 0 else None
