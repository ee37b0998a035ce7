"""Every stage x precision on N GPUs (NCCL) against single-GPU torch.optim.AdamW.

Run: torchrun --nproc-per-node N -m tests.gpu.gpu_equivalence   (prints a table; exit 1 on a miss)
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.support.toy import ToyNet, engine_losses, reference_losses

TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}   # relative loss; bf16/fp16 round the parameters


def main() -> int:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    steps, batch = 20, 8
    ref, _ = reference_losses(ToyNet, steps, batch, clip=0.5, device="cuda")
    bad = 0
    for stage in ("stage0", "stage1", "stage2", "stage3"):
        for prec in ("fp32", "bf16", "fp16"):
            cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500,
                            "stage3_param_persistence_threshold": 0},
                   "precision": {"plugin": prec},
                   "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
                   "batch": {"micro_batch_size": batch // world, "gradient_clipping": 0.5},
                   "monitor": {"plugin": "none"}}
            losses, _ = engine_losses(ToyNet, steps, batch, cfg, rank, world,
                                      use_init=stage == "stage3", device="cuda")
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            ok = rel <= TOL[prec]
            bad += not ok
            if rank == 0:
                print(f"world={world} {stage} {prec}: max rel loss diff {rel:.2e} "
                      f"(tol {TOL[prec]:.0e}) {'OK' if ok else 'MISS'}", flush=True)
    # hierarchical sharding (zero.shard_group_size): groups of 2 GPUs, replicated across the groups
    # (the cross-group all-reduce launched from a side stream after the group's reduce-scatter)
    # and ZeRO++ hpZ (zero_hpz_partition_size = 2: states over every GPU, a secondary parameter shard
    # per group of 2 gathered from in the backward, nothing kept from forward to backward)
    for stage, prec, key in (() if world < 4 or world % 2 else
                             (("stage1", "fp32", "shard_group_size"), ("stage2", "bf16", "shard_group_size"),
                              ("stage3", "fp32", "shard_group_size"), ("stage3", "bf16", "shard_group_size"),
                              ("stage3", "bf16", "zero_hpz_partition_size"))):
        cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0,
                        key: 2, **({"stage3_max_reuse_distance": 0} if key.startswith("zero_hpz") else {})},
               "precision": {"plugin": prec},
               "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
               "batch": {"micro_batch_size": batch // world, "gradient_clipping": 0.5},
               "monitor": {"plugin": "none"}}
        losses, eng = engine_losses(ToyNet, steps, batch, cfg, rank, world, use_init=stage == "stage3",
                                    device="cuda")
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        ok = rel <= TOL[prec] and eng.partitioner.layout_world == (2 if key == "shard_group_size" else world)
        bad += not ok
        if rank == 0:
            print(f"world={world} {stage} {prec} {key} 2: max rel loss diff {rel:.2e} "
                  f"(tol {TOL[prec]:.0e}) {'OK' if ok else 'MISS'}", flush=True)
        eng.close()
    # the cpu offload tier on N GPUs: cpu_adam, the GPU lane, bf16 host gradients (bf16 reduction);
    # gpu_step_ratio "auto" leaves the lane off with several ranks on the host (they share its cores)
    for stage, params, ratio, reduce in (("stage2", "none", 0.5, "bf16"), ("stage3", "cpu", "auto", "bf16"),
                                         ("stage3", "cpu", 0.5, "fp32")):
        cfg = {"zero": {"plugin": stage, "reduce_bucket_size": 500, "sub_group_size": 300,
                        "stage3_param_persistence_threshold": 0},
               "precision": {"plugin": "bf16", "reduce_dtype": reduce},
               "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
               "batch": {"micro_batch_size": batch // world, "gradient_clipping": 0.5},
               "offload": {"optimizer": {"plugin": "cpu", "gpu_step_ratio": ratio}, "param": {"plugin": params}},
               "monitor": {"plugin": "none"}}
        losses, eng = engine_losses(ToyNet, steps, batch, cfg, rank, world, use_init=stage == "stage3",
                                    device="cuda")
        off = eng.offload_optimizer
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        lane = off.lane is not None and off.lane.elements > 0
        ok = rel <= TOL["bf16"] and lane == (ratio != "auto")
        bad += not ok
        if rank == 0:
            print(f"world={world} {stage} offload cpu (params {params}, gpu_step_ratio {ratio}, reduce {reduce}, "
                  f"host grads {eng.partitioner.master_params()[0].grad.dtype}): max rel loss diff {rel:.2e} "
                  f"(tol {TOL['bf16']:.0e}) {'OK' if ok else 'MISS'}", flush=True)
        eng.close()
    # stage 3 with the trainable units gathered from their host masters (stage3_params_from_masters):
    # each rank uploads its master shard in chunks, casts it and all-gathers the bf16 shards
    cfg = {"zero": {"plugin": "stage3", "reduce_bucket_size": 500, "sub_group_size": 300,
                    "stage3_param_persistence_threshold": 0, "stage3_params_from_masters": True},
           "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "cpu_adam", "lr": 1e-2, "weight_decay": 0.01},
           "batch": {"micro_batch_size": batch // world, "gradient_clipping": 0.5},
           "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}},
           "monitor": {"plugin": "none"}}
    losses, eng = engine_losses(ToyNet, steps, batch, cfg, rank, world, use_init=True, device="cuda")
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    ok = rel <= TOL["bf16"] and all(u.shard.untyped_storage().size() == 0 for u in eng.partitioner.units)
    bad += not ok
    if rank == 0:
        print(f"world={world} stage3 offload cpu, stage3_params_from_masters: max rel loss diff {rel:.2e} "
              f"(tol {TOL['bf16']:.0e}) {'OK' if ok else 'MISS'}", flush=True)
    eng.close()
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK" if not bad else f"{bad} MISSES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
