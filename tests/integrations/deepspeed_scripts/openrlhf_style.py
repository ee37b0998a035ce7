"""In the style of OpenRLHF's DeepSpeed strategy (openrlhf/utils/deepspeed/deepspeed.py) and a
critic trained by it: the engine assigned as a child module of the wrapper (``model.model =
engine``), the value head initialised by rank 0 under ``deepspeed.zero.GatheredParameters(...,
modifier_rank=0)`` on a model built under ``deepspeed.zero.Init``, ``save_checkpoint`` /
``load_checkpoint`` with client state, ``get_accelerator()``. Tiny GPT-2 backbone, synthetic
value targets, nothing downloaded. Ported to zeroplug by its imports only.

``--load_checkpoint`` resumes from the latest checkpoint in ``--ckpt_path`` (skipping the
samples it consumed). Run as DeepSpeed's launcher runs it (``--local_rank=<i>``).
"""
import argparse
import math
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2Model, get_scheduler

import zeroplug.deepspeed as deepspeed
from zeroplug.deepspeed.accelerator import get_accelerator
from zeroplug.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam


def get_train_ds_config(offload, adam_offload=True, stage=2, bf16=True, max_norm=1.0, zpg=8,
                        grad_accum_dtype=None, overlap_comm=False):
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": "cpu" if adam_offload else "none", "pin_memory": True},
        "sub_group_size": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
        # ZeRO++
        "zero_hpz_partition_size": zpg,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
    }
    if overlap_comm:
        zero_opt_dict["overlap_comm"] = True
        zero_opt_dict["contiguous_gradients"] = True
    return {
        "steps_per_print": 100,
        "zero_optimization": zero_opt_dict,
        "bf16": {"enabled": bf16},
        "gradient_clipping": max_norm,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "data_types": {"grad_accum_dtype": grad_accum_dtype},
    }


def get_optimizer_grouped_parameters(model, weight_decay,
                                     no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight")):
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters()
                    if (not any(nd in n for nd in no_decay_name_list) and p.requires_grad)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if (any(nd in n for nd in no_decay_name_list) and p.requires_grad)],
         "weight_decay": 0.0},
    ]
    return optimizer_grouped_parameters


class CriticModel(nn.Module):
    """A backbone and a value head (OpenRLHF's _get_critic_model, on GPT-2)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        h = self.transformer(input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(h).squeeze(-1)[:, -1]


def get_llm_for_critic(config, ds_config=None, init_value_head=True):
    # (OpenRLHF passes HfDeepSpeedConfig(ds_config) so that transformers builds under
    # deepspeed.zero.Init at stage 3; the same, said directly.)
    stage3 = ds_config is not None and ds_config["zero_optimization"]["stage"] == 3
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=stage3):
        model = CriticModel(config)
    # NOTE: For reward model training only, intialize value_head manually
    # because deepspeed.zero.Init() will not intialize them.
    if init_value_head:
        if stage3:
            with deepspeed.zero.GatheredParameters([model.value_head.weight], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    model.value_head.weight.data.normal_(mean=0.0, std=1 / (config.hidden_size + 1))
        else:
            model.value_head.weight.data.normal_(mean=0.0, std=1 / (config.hidden_size + 1))
    return model


class Critic(nn.Module):
    """The wrapper a trainer holds; after ``strategy.prepare`` its ``model`` is the engine."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask)


class DeepspeedStrategy:
    """The strategy for training with Accelerator (OpenRLHF's, the parts a critic uses)."""

    def __init__(self, seed=42, max_norm=0.0, micro_train_batch_size=1, train_batch_size=1, zero_stage=2,
                 bf16=True, args=None):
        self.args = args
        self.stage = zero_stage
        self.train_batch_size = train_batch_size
        self.micro_train_batch_size = micro_train_batch_size
        self.bf16 = bf16
        self.seed = seed
        self.max_norm = max_norm
        self.adam_offload = getattr(args, "adam_offload", False)
        self.zpg = getattr(args, "zpg", 1)
        self.grad_accum_dtype = getattr(args, "grad_accum_dtype", None)
        self.overlap_comm = getattr(args, "overlap_comm", False)

    def set_seed(self, seed):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)

    def setup_distributed(self, timeout=timedelta(minutes=60)):
        self.set_seed(self.seed)
        if self.args.local_rank == -1 and "LOCAL_RANK" in os.environ:  # for slurm
            self.args.local_rank = int(os.environ["LOCAL_RANK"])
        if self.args.local_rank != -1:
            get_accelerator().set_device(self.args.local_rank)
        # Initializes the distributed backend which will take care of sychronizing nodes/GPUs
        deepspeed.init_distributed(timeout=timeout)
        self.world_size = dist.get_world_size()
        self.accumulated_gradient = self.train_batch_size // self.micro_train_batch_size // self.world_size

    def create_optimizer(self, model, **kwargs):
        if isinstance(model, Critic):
            model = model.model
        # Optimizer
        AdamOptimizer = DeepSpeedCPUAdam if self.adam_offload else FusedAdam
        optim_params = get_optimizer_grouped_parameters(model, kwargs["weight_decay"])
        return AdamOptimizer(optim_params, **kwargs)

    def backward(self, loss, model, optimizer, **kwargs):
        if isinstance(model, Critic):
            model = model.model
        model.backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        if isinstance(model, Critic):
            model = model.model
        model.step()

    def setup_dataloader(self, dataset, batch_size, shuffle=True, collate_fn=None, drop_last=True):
        sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                     shuffle=shuffle, seed=self.seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          collate_fn=collate_fn)

    def _unwrap_model(self, model) -> nn.Module:
        if isinstance(model, Critic):
            return self._unwrap_model(model.model)
        elif hasattr(model, "module"):
            return model.module
        else:
            return model

    def prepare(self, model_optim_scheduler):
        model, optim, scheduler = model_optim_scheduler
        return self._ds_init_train_model(model, optim, scheduler)

    def _ds_init_train_model(self, model, optim, scheduler):
        is_wrapped = isinstance(model, Critic)
        ds_config = self.get_ds_train_config()
        engine, optim, _, scheduler = deepspeed.initialize(
            model=model.model if is_wrapped else model, optimizer=optim, lr_scheduler=scheduler,
            config=ds_config, args={"local_rank": self.args.local_rank}, dist_init_required=True)
        if is_wrapped:
            model.model = engine
        else:
            model = engine
        return model, optim, scheduler

    def get_ds_train_config(self):
        # DS Config
        ds_config = get_train_ds_config(offload=False, adam_offload=self.adam_offload, stage=self.stage,
                                        bf16=self.bf16, max_norm=self.max_norm, zpg=self.zpg,
                                        grad_accum_dtype=self.grad_accum_dtype, overlap_comm=self.overlap_comm)
        ds_config["train_micro_batch_size_per_gpu"] = self.micro_train_batch_size
        ds_config["train_batch_size"] = self.train_batch_size
        return ds_config

    def all_reduce(self, data, op="mean"):
        assert op in ("mean", "max", "sum")
        is_tensor = isinstance(data, torch.Tensor)
        if not is_tensor:
            data = torch.Tensor([data])
        is_cpu_tensor = data.device.type == "cpu"
        data = data.to(get_accelerator().current_device_name())
        if op == "mean":
            data /= self.world_size
        dist.all_reduce(data, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if is_cpu_tensor:
            data = data.cpu()
        return data.item() if not is_tensor else data

    def is_rank_0(self) -> bool:
        return dist.get_rank() == 0

    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state={}, save_latest=True):
        assert isinstance(model, deepspeed.DeepSpeedEngine)
        if self.is_rank_0():
            os.makedirs(save_dir, exist_ok=True)
        dist.barrier()
        model.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load_ckpt(self, model, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                  load_lr_scheduler_states=True, load_module_only=False):
        assert isinstance(model, deepspeed.DeepSpeedEngine)
        load_path, states = model.load_checkpoint(load_dir, tag, load_module_strict=load_module_strict,
                                                  load_optimizer_states=load_optimizer_states,
                                                  load_lr_scheduler_states=load_lr_scheduler_states,
                                                  load_module_only=load_module_only)
        if load_path is None:
            raise Exception(f"[deepspeed] failed to resume from checkpoint {load_dir}")
        return load_path, states


class ValueDataset(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.values = torch.randn(n, generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], torch.ones_like(self.ids[i]), self.values[i]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--micro_train_batch_size", type=int, default=2)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--l2", type=float, default=0.01)
    parser.add_argument("--max_norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--ckpt_path", type=str, required=True)
    parser.add_argument("--load_checkpoint", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def main(args):
    strategy = DeepspeedStrategy(seed=args.seed, max_norm=args.max_norm,
                                 micro_train_batch_size=args.micro_train_batch_size,
                                 train_batch_size=args.train_batch_size, zero_stage=args.zero_stage, bf16=args.bf16,
                                 args=args)
    strategy.setup_distributed()
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    critic = Critic(get_llm_for_critic(config, strategy.get_ds_train_config()))
    optim = strategy.create_optimizer(critic, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.l2)
    scheduler = get_scheduler("cosine_with_min_lr", optim, num_warmup_steps=math.ceil(args.max_steps * 0.03),
                              num_training_steps=args.max_steps,
                              scheduler_specific_kwargs={"min_lr": args.learning_rate * 0.1})
    # prepare models/optimizers...
    critic, optim, scheduler = strategy.prepare((critic, optim, scheduler))
    consumed_samples = 0
    if args.load_checkpoint and os.path.exists(args.ckpt_path):
        _, states = strategy.load_ckpt(critic.model, args.ckpt_path)
        consumed_samples = states["consumed_samples"]
        if strategy.is_rank_0():
            print(f"Loaded the checkpoint: {args.ckpt_path}, consumed_samples: {consumed_samples}")
    dataset = ValueDataset(args.max_steps * args.train_batch_size, 16, 97)
    loader = strategy.setup_dataloader(dataset, args.micro_train_batch_size, shuffle=True)
    device = get_accelerator().current_device_name()
    skip = consumed_samples // strategy.world_size // args.micro_train_batch_size
    global_step = consumed_samples // args.train_batch_size
    critic.train()
    for i, (ids, mask, target) in enumerate(loader):
        if i < skip:
            continue
        values = critic(ids.to(device), mask.to(device))
        loss = ((values.float() - target.to(device)) ** 2).mean()
        strategy.backward(loss, critic, optim)
        strategy.optimizer_step(optim, critic, scheduler)
        print(f"micro_step={i} rank={dist.get_rank()} loss={loss.item()!r}")
        if (i + 1) % strategy.accumulated_gradient == 0:
            global_step += 1
            consumed_samples += args.train_batch_size
            loss_mean = strategy.all_reduce(loss.item())
            if strategy.is_rank_0():
                print(f"global_step={global_step} loss_mean={loss_mean!r} lr={scheduler.get_last_lr()[0]!r}")
            if global_step % args.save_steps == 0 and global_step < args.max_steps:
                strategy.save_ckpt(critic.model, args.ckpt_path, tag=f"global_step{global_step}",
                                   client_state={"consumed_samples": consumed_samples})


if __name__ == "__main__":
    main(parse_args())
