"""A run started on DeepSpeed continues under zeroplug: the same losses as DeepSpeed's own continuation.

On a CUDA host where ``import deepspeed`` works, from the repository root::

    torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_resume.py --stage 2 --out /tmp/ds_resume
    torchrun --nproc-per-node 2 tests/benchmarks/deepspeed_resume.py --stage 3 --out /tmp/ds_resume

1. DeepSpeed (ZeRO ``--stage``, bf16, AdamW) trains a small GPT (zeroplug.plugins.workload) for
   ``--steps`` steps and saves a checkpoint (``<out>/ds_stage<S>/global_step<N>``);
2. DeepSpeed continues ``--more`` steps: the reference losses;
3. a fresh model (other initial values) is wrapped by zeroplug (``--zp-stage``, default the
   same stage; bf16), ``engine.load_checkpoint`` reads DeepSpeed's checkpoint, and zeroplug
   takes the same ``--more`` steps on the same batches.

It prints both loss sequences, the largest difference and ``PASS`` when it is within
``--tol`` (bf16 rounding), and writes ``<out>/ds_stage<S>_result.json``. Every rank
gets its slice of one global batch, so the batches do not depend on the world size.
The zeroplug half and the argument parsing run on CPU too (tests/integrations/test_deepspeed_resume_script.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="DeepSpeed's ZeRO stage")
    p.add_argument("--zp-stage", type=int, choices=[0, 1, 2, 3], help="zeroplug's stage (default: --stage)")
    p.add_argument("--steps", type=int, default=20, help="DeepSpeed steps before the checkpoint")
    p.add_argument("--more", type=int, default=10, help="steps after it, on each side")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--tol", type=float, default=2e-2, help="largest |loss difference| that passes")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--out", default="/tmp/ds_resume", help="checkpoints and the result JSON go here")
    a = p.parse_args(argv)
    if a.zp_stage is None:
        a.zp_stage = a.stage
    if a.steps < 1 or a.more < 1:
        p.error("--steps and --more must be at least 1")
    return a


def model_config(a):
    from zeroplug.plugins.workload.models import get_preset
    return get_preset("char-tiny", seq_len=a.seq, n_layer=a.layers, d_model=a.width, n_head=max(1, a.width // 64))


def build_model(a, seed: int):
    from zeroplug.plugins.workload.models import GPT
    torch.manual_seed(seed)
    return GPT(model_config(a))


def global_batches(a, n: int) -> list:
    """``n`` global batches (the same on every rank and for both runs)."""
    from zeroplug.plugins.workload.data import ByteBatches, stdlib_corpus
    src = ByteBatches(stdlib_corpus(2_000_000), a.global_batch, a.seq, seed=1234)
    return [next(src) for _ in range(n)]


def rank_slice(batch, rank: int, world: int, device):
    x, y = batch
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def ds_config(a, world: int) -> dict:
    return {
        "train_batch_size": a.global_batch,
        "train_micro_batch_size_per_gpu": a.global_batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": a.weight_decay, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": a.precision == "bf16"},
        "fp16": {"enabled": a.precision == "fp16", "initial_scale_power": 12},
        "zero_optimization": {"stage": a.stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def zeroplug_config(a, world: int) -> dict:
    return {"zero": {"plugin": f"stage{a.zp_stage}"},
            "batch": {"micro_batch_size": a.global_batch // world, "gradient_accumulation_steps": 1,
                      "gradient_clipping": 0.0},
            "optimizer": {"plugin": "adamw", "lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                          "weight_decay": a.weight_decay},
            "scheduler": {"plugin": "none"}, "precision": {"plugin": a.precision},
            "monitor": {"plugin": "none"}}


def _mean_over_ranks(loss, comm_all_reduce, world: int) -> float:
    t = loss.detach().float().clone()
    comm_all_reduce(t)
    return t.item() / world


def run_deepspeed(a, ckpt_dir, batches, rank: int, world: int, device):
    """N steps, save, M more steps under DeepSpeed; returns (losses before, losses after)."""
    import deepspeed
    import torch.distributed as dist
    model = build_model(a, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(a, world))
    before, after = [], []
    for i, b in enumerate(batches):
        if i == a.steps:
            engine.save_checkpoint(str(ckpt_dir))
        x, y = rank_slice(b, rank, world, device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        (before if i < a.steps else after).append(_mean_over_ranks(loss, dist.all_reduce, world))
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    torch.cuda.empty_cache()
    return before, after


def run_zeroplug(a, ckpt_dir, batches, rank: int, world: int, device=None):
    """A fresh model, DeepSpeed's checkpoint loaded, the last M steps; returns the losses."""
    import zeroplug
    engine = zeroplug.initialize(build_model(a, seed=99), zeroplug_config(a, world), device=device)
    engine.load_checkpoint(str(ckpt_dir))
    if engine.global_step != a.steps:
        raise SystemExit(f"error: the checkpoint loaded at step {engine.global_step}, expected {a.steps}")
    dev = engine.run.device
    losses = []
    for b in batches[a.steps:]:
        x, y = rank_slice(b, rank, world, dev)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss, engine.run.comm.all_reduce, world))
    return losses


def compare(ds_after, zp_after, tol: float) -> dict:
    diffs = [abs(p - q) for p, q in zip(ds_after, zp_after)]
    worst = max(diffs) if diffs else math.inf
    return {"deepspeed": ds_after, "zeroplug": zp_after, "max_abs_diff": worst,
            "pass": len(ds_after) == len(zp_after) and worst <= tol}


def main(argv=None) -> int:
    a = parse_args(argv)
    import deepspeed
    deepspeed.init_distributed()
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if a.global_batch % world:
        raise SystemExit(f"error: --global-batch {a.global_batch} is not divisible by {world} ranks")
    out = Path(a.out)
    ckpt = out / f"ds_stage{a.stage}"
    batches = global_batches(a, a.steps + a.more)
    before, ds_after = run_deepspeed(a, ckpt, batches, rank, world, device)
    dist.barrier()
    zp_after = run_zeroplug(a, ckpt, batches, rank, world, device)
    result = compare(ds_after, zp_after, a.tol)
    result.update(stage=a.stage, zp_stage=a.zp_stage, world=world, steps=a.steps, more=a.more,
                  precision=a.precision, deepspeed_version=deepspeed.__version__, torch=torch.__version__,
                  device=torch.cuda.get_device_name(local), deepspeed_before=before)
    if rank == 0:
        print(f"DeepSpeed {deepspeed.__version__} ZeRO-{a.stage} -> zeroplug stage {a.zp_stage}, {world} ranks, "
              f"{a.precision}; checkpoint at step {a.steps}")
        print(f"{'step':>5} {'deepspeed':>12} {'zeroplug':>12} {'|diff|':>10}")
        for i, (p, q) in enumerate(zip(ds_after, zp_after)):
            print(f"{a.steps + i + 1:>5} {p:>12.6f} {q:>12.6f} {abs(p - q):>10.2e}")
        print(f"max |diff| {result['max_abs_diff']:.3e} (tolerance {a.tol}): {'PASS' if result['pass'] else 'FAIL'}")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ds_stage{a.stage}_result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
