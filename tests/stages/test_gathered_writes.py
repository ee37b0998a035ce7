"""Writes to gathered parameters (issue 32): DeepSpeed's weight-loading pattern
``with GatheredParameters(params, modifier_rank=0): if rank == 0: p.data.copy_(loaded)``.

With a modifier rank, that rank's values reach every rank: before ``initialize`` (a model
built under ``zeroplug.init``) and after it, into the fp32 masters too, with the optimizer's
moments kept; the training that follows equals plain torch's (AdamW, full batch) from the
same weights. Without a modifier rank a write is refused on every rank, never dropped.
Rank 1 writes other values on purpose: only the modifier rank's may survive."""
from __future__ import annotations

import pytest
import torch

import zeroplug
from tests.support.distributed import run_ranks
from zeroplug.deepspeed.zero import GatheredParameters
from zeroplug.errors import StateError
from tests.support.toy import ToyNet, batches

STEPS, BATCH, LR = 3, 4, 1e-2


def cfg(stage: int, precision: str = "fp32") -> dict:
    return {"zero": {"plugin": f"stage{stage}", "stage3_param_persistence_threshold": 0},
            "precision": {"plugin": precision}, "batch": {"micro_batch_size": 2},
            "optimizer": {"plugin": "adamw", "lr": LR, "weight_decay": 0.01}, "scheduler": {"plugin": "none"},
            "monitor": {"plugin": "none"}}


def loaded() -> dict:
    torch.manual_seed(5)
    return ToyNet().state_dict()


def write(model, rank: int, values: dict) -> None:
    """Rank 0 loads ``values``; any other rank writes something else."""
    for n, p in model.named_parameters():
        if rank == 0:
            p.data.copy_(values[n])
        else:
            p.data.fill_(7.0)


def train(engine, rank, world, steps, start=0):
    out = []
    for x, y in list(batches(start + steps, BATCH))[start:]:
        n = BATCH // world
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        out.append(engine.run.comm.all_reduce_scalar(loss.item()) / world)
    return out


def reference(write_after: int) -> list[float]:
    """Plain torch: ToyNet(seed 0), ``write_after`` steps, then the loaded weights (moments kept)."""
    torch.manual_seed(0)
    model = ToyNet()
    if write_after == 0:
        model.load_state_dict(loaded())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    out = []
    for i, (x, y) in enumerate(batches(STEPS, BATCH)):
        if i == write_after and write_after:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(loaded()[n])
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def before_initialize(rank, world):
    """zeroplug.init at stage 3, then rank 0 loads the weights; then initialize and train."""
    values = loaded()
    torch.manual_seed(0)
    with zeroplug.init(cfg(3)):
        model = ToyNet()
    refused = None
    try:
        with GatheredParameters(list(model.parameters())):
            if rank == 0:
                model.head.weight.data.add_(1.0)
    except StateError as e:
        refused = str(e)
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        write(model, rank, values)
    engine = zeroplug.initialize(model, cfg(3))
    sd = engine.consolidated_state_dict()
    same = None if sd is None else all(torch.equal(sd[k], values[k]) for k in values)
    plain = ToyNet()                       # not partitioned: whole on every rank, broadcast on exit
    with GatheredParameters(list(plain.parameters()), modifier_rank=0):
        write(plain, rank, values)
    plain_same = all(torch.equal(v, values[k]) for k, v in plain.state_dict().items())
    return refused, same and plain_same if sd is not None else plain_same, train(engine, rank, world, STEPS)


def after_initialize(rank, world, stage, precision, through_shim):
    """One step, then rank 0 loads the weights (the moments stay), then two more steps."""
    torch.manual_seed(0)
    model = ToyNet()
    engine = zeroplug.initialize(model, cfg(stage, precision))
    losses = train(engine, rank, world, 1)
    refused = None
    try:
        with engine.gathered_parameters():
            if rank == 0:
                model.norm.weight.data.mul_(2.0)
    except StateError as e:
        refused = str(e)
    params = list(model.parameters())
    ctx = GatheredParameters(params, modifier_rank=0) if through_shim else engine.gathered_parameters(params, 0)
    with ctx:
        write(model, rank, {k: v.to(p.dtype) for (k, v), p in zip(loaded().items(), params)})
    losses += train(engine, rank, world, STEPS - 1, start=1)
    return refused, losses


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_modifier_rank_writes_before_initialize_reach_every_rank(world):
    results = run_ranks(before_initialize, world)
    want = reference(write_after=0)
    for refused, same, losses in results:
        assert refused and "without a modifier rank" in refused and "modifier_rank=" in refused
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-5)
        assert same is True


CASES = [(0, "fp32", False), (2, "fp32", True), (3, "fp32", False), (3, "bf16", True)]


def after_all(rank, world):
    return [after_initialize(rank, world, *case) for case in CASES]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_modifier_rank_writes_after_initialize_reach_the_masters(world):
    results = run_ranks(after_all, world)
    want = reference(write_after=1)
    for per_rank in results:
        for (stage, precision, _), (refused, losses) in zip(CASES, per_rank):
            assert refused and "without a modifier rank" in refused, (stage, precision)
            tol = 1e-5 if precision == "fp32" else 3e-2
            torch.testing.assert_close(losses, want, rtol=tol, atol=tol, msg=f"stage {stage} {precision}")
