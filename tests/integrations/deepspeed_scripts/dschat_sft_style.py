"""In the style of DeepSpeed-Chat's step 1, supervised fine-tuning (training/step1_supervised_finetuning/
main.py with its dschat/utils helpers): its DeepSpeed calls as they are, on a tiny GPT-2 saved
to a local directory and synthetic token data (no tokenizer, nothing downloaded). Ported to
zeroplug by its imports only, with one exception marked below.

Run as DeepSpeed's launcher runs it: ``--local_rank=<i>`` and torchrun's variables per rank.
"""
import argparse
import math
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, SchedulerType, default_data_collator, get_scheduler

import zeroplug.deepspeed as deepspeed
from zeroplug.deepspeed.accelerator import get_accelerator
from zeroplug.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zeroplug.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


# --- dschat/utils/ds_utils.py -------------------------------------------------------------------
def get_train_ds_config(offload, dtype, stage=2, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512, enable_tensorboard=False, enable_mixed_precision_lora=False,
                        tb_path="", tb_name=""):
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type = "fp16"
        dtype_config = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        data_type = "bfloat16"
        dtype_config = {"enabled": True}
    else:
        data_type = "fp16"
        dtype_config = {"enabled": False}
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        data_type: dtype_config,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": enable_hybrid_engine, "max_out_tokens": max_out_tokens,
                          "inference_tp_size": inference_tp_size, "release_inference_cache": release_inference_cache,
                          "pin_parameters": pin_parameters, "tp_gather_partition_size": tp_gather_partition_size},
        "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                        "job_name": f"{tb_name}_tensorboard"},
    }


# --- dschat/utils/utils.py ------------------------------------------------------------------------
def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)


def to_device(batch, device):
    output = {}
    for k, v in batch.items():
        try:
            output[k] = v.to(device)
        except Exception:
            output[k] = v
    return output


def set_random_seed(seed):
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    tensor = tensor / torch.distributed.get_world_size()
    return tensor


def get_optimizer_grouped_parameters(model, weight_decay, lora_lr=5e-4,
                                     no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight"),
                                     lora_name_list=("lora_right_weight", "lora_left_weight")):
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters()
                    if (not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                        and not any(nd in n.lower() for nd in lora_name_list))],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if (not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
                        and any(nd in n.lower() for nd in lora_name_list))],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in model.named_parameters()
                    if (any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad)],
         "weight_decay": 0.0},
    ]
    non_empty_groups = []
    for group in optimizer_grouped_parameters:
        if group["params"]:
            non_empty_groups.append(group)
    return non_empty_groups


def save_hf_format(model, tokenizer, args, sub_folder=""):
    # used to save huggingface format, so we can use it for hf.from_pretrained
    model_to_save = model.module if hasattr(model, "module") else model
    CONFIG_NAME = "config.json"
    WEIGHTS_NAME = "pytorch_model.bin"
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    output_model_file = os.path.join(output_dir, WEIGHTS_NAME)
    output_config_file = os.path.join(output_dir, CONFIG_NAME)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, output_model_file)
    model_to_save.config.to_json_file(output_config_file)


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = (zero_stage == 3)
    os.makedirs(save_dir, exist_ok=True)
    WEIGHTS_NAME = "pytorch_model.bin"
    output_model_file = os.path.join(save_dir, WEIGHTS_NAME)
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


# --- the data: synthetic token sequences (dschat's PromptDataset of input_ids / attention_mask / labels)
class PromptDataset(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        return {"input_ids": self.ids[idx], "attention_mask": torch.ones_like(self.ids[idx]),
                "labels": self.ids[idx]}


def create_hf_model(model_class, model_name_or_path, ds_config=None):
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    # (DeepSpeed-Chat passes HfDeepSpeedConfig(ds_config) to transformers at stage 3 so that
    # from_pretrained builds under deepspeed.zero.Init; here the same, said directly.)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=ds_config["zero_optimization"]["stage"] == 3):
        model = model_class.from_pretrained(model_name_or_path, config=model_config)
    model.config.pad_token_id = model.config.eos_token_id
    return model


def evaluation(model, eval_dataloader, device):
    model.eval()
    losses = 0
    for step, batch in enumerate(eval_dataloader):
        batch = to_device(batch, device)
        with torch.no_grad():
            outputs = model(**batch)
        losses += outputs.loss.float()
    losses = losses / (step + 1)
    try:
        losses = get_all_reduce_mean(losses)
    except Exception:
        pass
    try:
        perplexity = torch.exp(losses).item()
    except OverflowError:
        perplexity = float("inf")
    return perplexity, losses.item()


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=MICRO_BATCH_SIZE)
    parser.add_argument("--max_seq_len", type=int, default=16)
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine",
                        choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                 "constant_with_warmup"])
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(args.local_rank))
        # Initializes the distributed backend which will take care of sychronizing nodes/GPUs
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    # If passed along, set the training seed now.
    set_random_seed(args.seed)
    torch.distributed.barrier()
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, ds_config)
    train_dataset = PromptDataset(args.num_samples, args.max_seq_len, model.config.vocab_size)
    eval_dataset = PromptDataset(8, args.max_seq_len, model.config.vocab_size)
    # DataLoaders creation:
    if args.local_rank == -1:
        train_sampler = RandomSampler(train_dataset)
        eval_sampler = torch.utils.data.SequentialSampler(eval_dataset)
    else:
        train_sampler = DistributedSampler(train_dataset)
        eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=eval_sampler,
                                 batch_size=args.per_device_train_batch_size)
    # Split weights in two groups, one with weight decay and the other not.
    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    # Train!
    print_rank_0("***** Running training *****", args.global_rank)
    for epoch in range(args.num_train_epochs):
        print_rank_0(f"Beginning of Epoch {epoch+1}/{args.num_train_epochs}, Total Micro Batches "
                     f"{len(train_dataloader)}", args.global_rank)
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = {loss.item()}")
            model.backward(loss)
            model.step()
        # Evaluate perplexity on the validation set.
        perplexity, eval_loss = evaluation(model, eval_dataloader, device)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
    if args.output_dir is not None:
        print_rank_0("saving the final model ...", args.global_rank)
        # Note: the one line that differs beyond the imports: DeepSpeed's state_dict() of a stage-3
        # model on one rank hands out empty tensors (save_zero_three_model then overwrites the
        # file); zeroplug refuses it (StateError), so save_hf_format runs below stage 3 only.
        if args.global_rank == 0 and args.zero_stage != 3:
            save_hf_format(model, None, args)
        if args.zero_stage == 3:
            # For zero stage 3, each gpu only has a part of the model, so we need a special save function
            save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)


if __name__ == "__main__":
    main()
