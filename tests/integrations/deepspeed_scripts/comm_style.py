"""A plain DeepSpeed script on ``deepspeed.comm``: its own argument parser with DeepSpeed's
arguments (``add_config_arguments``: the config comes as ``--deepspeed_config ds.json``),
``init_distributed``, the collectives a training script calls, and ``initialize`` on a small
MLP whose loss it averages over the ranks itself. Ported to zeroplug by its imports only.
"""
import argparse

import torch
import torch.nn as nn

import zeroplug.deepspeed as deepspeed
import zeroplug.deepspeed.comm as dist
from zeroplug.deepspeed.accelerator import get_accelerator


def parse_args():
    parser = argparse.ArgumentParser(description="deepspeed.comm")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global_batch", type=int, default=8)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def check_collectives(rank, world, device):
    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t
    b = torch.tensor([10.0 * (rank + 1)], device=device)
    dist.broadcast(b, src=0)
    assert b.item() == 10.0, b
    parts = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)], device=device))
    assert [p.item() for p in parts] == list(range(world)), parts
    flat = torch.zeros(world, device=device)
    dist.all_gather_into_tensor(flat, torch.tensor([float(rank)], device=device))
    assert flat.tolist() == list(range(world)), flat
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    m = torch.tensor([float(rank)], device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert m.item() == world - 1
    dist.barrier()


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(get_accelerator().device_name(dist.get_local_rank()))
    check_collectives(rank, world, device)
    if rank == 0:
        print(f"collectives ok on {world} ranks ({dist.get_backend()})")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(3)
    per_rank = args.global_batch // world
    for step in range(args.steps):
        x = torch.randn(args.global_batch, 16, generator=g)
        y = torch.randint(0, 4, (args.global_batch,), generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.cross_entropy(engine(x[mine].to(device)), y[mine].to(device))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            print(f"step {step} loss {mean.item()!r}")


if __name__ == "__main__":
    main()
