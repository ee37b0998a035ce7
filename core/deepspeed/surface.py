"""The surface of ``zeroplug.deepspeed``: every DeepSpeed name it offers, what it maps to,
and what is refused and why. docs/deepspeed-api.md is generated from :data:`SURFACE`
(``zeroplug docs --deepspeed-api``), and a test checks each row against the code: a name
listed resolves under ``zeroplug.deepspeed``, and every public name there is listed."""
from __future__ import annotations

SUPPORTED, PARTIAL, REFUSED = "supported", "partly", "refused"

# (DeepSpeed name, zeroplug's, status, notes)
SURFACE: list[tuple[str, str, str, str]] = [
    # -- entry points
    ("deepspeed.initialize", "zeroplug.initialize", SUPPORTED,
     "returns `(engine, optimizer, training_dataloader, lr_scheduler)`. Config from `config`, `config_params` or "
     "`args.deepspeed_config` (DeepSpeed JSON or dict; a zeroplug TOML works too). `optimizer`: a torch "
     "optimizer (its class, settings and parameter groups; an lr that a scheduler already changed is read "
     "from `initial_lr`) or a callable building one from `model_parameters`. `lr_scheduler`: any torch LR "
     "scheduler (or a callable given the engine's optimizer), stepped after every applied step; a scheduler "
     "in the config wins, as in DeepSpeed (no config at all: no schedule). `training_data`: a DataLoader of micro batches over a "
     "DistributedSampler (one rank too; a new order each pass). `mpu`, `mesh_param`: refused (data parallel "
     "only). Under a launcher the process group is started (nccl on CUDA, gloo else)"),
    ("deepspeed.add_config_arguments", "argparse", SUPPORTED,
     "adds `--deepspeed`, `--deepspeed_config` (and the old `--deepscale`, `--deepscale_config`)"),
    ("deepspeed.init_distributed", "zeroplug.launch.start_process_group", SUPPORTED,
     "starts the group from torchrun's variables (`dist_backend` or the device's: nccl on CUDA, gloo "
     "else; one rank started by a launcher gets a group of one, as DeepSpeed starts it); one process "
     "without a launcher needs none: nothing happens. The default gloo group (started here or by "
     "the script) is destroyed when the process exits: torch aborts some gloo processes that exit with it alive"),
    ("deepspeed.DeepSpeedEngine", "zeroplug.deepspeed.DeepSpeedEngine", SUPPORTED,
     "an `nn.Module` holding zeroplug's Engine (`zeroplug_engine`); the model is its child `module`; "
     "attributes neither has fall through to the model"),
    # -- the engine
    ("DeepSpeedEngine.forward / __call__", "Engine.__call__", SUPPORTED, ""),
    ("DeepSpeedEngine.backward", "Engine.backward", SUPPORTED, "`retain_graph` honoured; loss divided by the "
     "accumulation steps"),
    ("DeepSpeedEngine.step", "Engine.step", SUPPORTED, "steps at the accumulation boundary; the script's "
     "scheduler steps after an applied step (`lr_kwargs` passed to it)"),
    ("DeepSpeedEngine.zero_grad", "Engine.zero_grad", SUPPORTED, "gradients are zeroed after every step anyway"),
    ("DeepSpeedEngine.train / eval", "nn.Module.train", SUPPORTED, ""),
    ("DeepSpeedEngine.module", "the model", SUPPORTED, ""),
    ("DeepSpeedEngine.optimizer", "zeroplug.deepspeed.optimizer.EngineOptimizer", SUPPORTED,
     "what `initialize` returns as the optimizer: the engine's torch optimizer over this rank's fp32 master "
     "shards (`param_groups`, `state`, `state_dict`); `zero_grad()` is the engine's, `step()` refused (the "
     "engine steps). Without a schedule in the config or passed in, the engine trains with the lr its groups "
     "hold, so a torch scheduler built on it after `initialize` and stepped by the script sets the lr"),
    ("DeepSpeedEngine.lr_scheduler", "the script's scheduler", SUPPORTED, "None when the script passed none"),
    ("DeepSpeedEngine.local_rank", "LOCAL_RANK", SUPPORTED, ""),
    ("DeepSpeedEngine.device", "Engine.run.device", SUPPORTED, ""),
    ("DeepSpeedEngine.global_rank / world_size / dp_world_size", "Engine.run", SUPPORTED, ""),
    ("DeepSpeedEngine.mp_world_size", "1", SUPPORTED, "no model parallelism"),
    ("DeepSpeedEngine.global_steps", "Engine.global_step", SUPPORTED, "optimizer steps, taken or skipped"),
    ("DeepSpeedEngine.global_samples", "global_step x train_batch_size", SUPPORTED, ""),
    ("DeepSpeedEngine.micro_steps / skipped_steps", "Engine.micro_step / skipped_steps", SUPPORTED, ""),
    ("DeepSpeedEngine.train_batch_size()", "batch.train_batch_size", SUPPORTED, ""),
    ("DeepSpeedEngine.train_micro_batch_size_per_gpu()", "batch.micro_batch_size", SUPPORTED, ""),
    ("DeepSpeedEngine.gradient_accumulation_steps()", "batch.gradient_accumulation_steps", SUPPORTED, ""),
    ("DeepSpeedEngine.gradient_clipping()", "batch.gradient_clipping", SUPPORTED, ""),
    ("DeepSpeedEngine.steps_per_print()", "batch.steps_per_print", SUPPORTED, ""),
    ("DeepSpeedEngine.zero_optimization_stage()", "the [zero] plugin's stage", SUPPORTED, ""),
    ("DeepSpeedEngine.zero_optimization()", "stage > 0", SUPPORTED, ""),
    ("DeepSpeedEngine.zero_offload_optimizer() / zero_offload_param()", "the offload tiers", SUPPORTED, ""),
    ("DeepSpeedEngine.fp16_enabled() / bfloat16_enabled() / bf16_enabled()", "the [precision] plugin", SUPPORTED,
     ""),
    ("DeepSpeedEngine.get_global_grad_norm()", "the last step's grad_norm", SUPPORTED,
     "before clipping; None before the first step"),
    ("DeepSpeedEngine.was_step_applied()", "not the last step's skipped", SUPPORTED,
     "False after an fp16 overflow"),
    ("DeepSpeedEngine.is_gradient_accumulation_boundary()", "Engine.is_gradient_accumulation_boundary", SUPPORTED,
     ""),
    ("DeepSpeedEngine.get_lr()", "Engine.get_lr", SUPPORTED, ""),
    ("DeepSpeedEngine.save_checkpoint", "Engine.save_checkpoint", SUPPORTED,
     "`client_state` kept; the script's scheduler's state travels in it; `exclude_frozen_parameters` accepted "
     "(the checkpoint holds every parameter)"),
    ("DeepSpeedEngine.load_checkpoint", "Engine.load_checkpoint", SUPPORTED,
     "returns `(path, client_state)`; `(None, None)` with a warning when the directory has no checkpoint "
     "(as DeepSpeed); `load_module_strict=False` warns (loading is strict); `custom_load_fn` refused"),
    ("DeepSpeedEngine.save_16bit_model / save_fp16_model", "Engine.save_16bit_model", SUPPORTED,
     "`save_dir/save_filename` (default pytorch_model.bin; a `.safetensors` name writes safetensors); "
     "`exclude_frozen_parameters` honoured"),
    ("DeepSpeedEngine.destroy", "Engine.close", SUPPORTED, ""),
    # -- zero
    ("deepspeed.zero.Init", "zeroplug.init (stage 3)", SUPPORTED,
     "`config_dict_or_path` / `config`: the config given to `initialize`; without one, stage 3 in `dtype` "
     "(fp32 by default); `remote_device`, `pin_memory` accepted (the shards go to the config's offload_param "
     "tier at initialize); `enabled=False`: a plain build. `module=`, process groups, `mpu` and quantized "
     "weights refused"),
    ("deepspeed.zero.MiCS_Init", "zeroplug.init (stage 3, zero.shard_group_size)", SUPPORTED,
     "as `deepspeed.zero.Init`, sharded within the groups of the config's `mics_shard_size` ranks"),
    ("deepspeed.zero.GatheredParameters", "zeroplug.gathered_parameters", SUPPORTED,
     "whole parameters inside, on every rank; with `modifier_rank` that rank's values are partitioned again "
     "to every rank on exit (before initialize, and after it into the fp32 masters too); without it a write "
     "is refused (StateError), never dropped. `fwd_module` accepted"),
    ("deepspeed.zero.register_external_parameter", "nothing to do", SUPPORTED,
     "a parameter read outside its module's forward is gathered on use"),
    ("deepspeed.runtime.zero.partition_parameters.Init / GatheredParameters", "deepspeed.zero's", SUPPORTED,
     "where DeepSpeed defines them"),
    ("deepspeed.utils.set_z3_leaf_modules / unset_z3_leaf_modules / get_z3_leaf_modules / z3_leaf_module",
     "zeroplug.set_leaf_modules / unset_leaf_modules / get_leaf_modules / is_leaf_module", SUPPORTED,
     "a leaf is gathered whole by its own forward on every rank (a mixture of experts whose experts a rank "
     "may skip); modules holding an `experts` list are found without it (`zero.stage3_auto_leaf_modules`)"),
    ("deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint / "
     "convert_zero_checkpoint_to_fp32_state_dict / convert_zero_checkpoint_to_state_dict / "
     "load_state_dict_from_zero_checkpoint", "zeroplug.checkpoint.fp32_export", SUPPORTED,
     "a zeroplug or a DeepSpeed checkpoint, streamed one tensor at a time; `python -m "
     "zeroplug.deepspeed.utils.zero_to_fp32 CKPT OUT` as DeepSpeed's script (docs/deepspeed-switch.md)"),
    ("deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live / "
     "estimate_zero2_model_states_mem_needs_all_cold", "zeroplug's estimate", SUPPORTED,
     "DeepSpeed's table, with zeroplug's bytes per parameter"),
    ("deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live / "
     "estimate_zero3_model_states_mem_needs_all_cold", "zeroplug's estimate", SUPPORTED,
     "DeepSpeed's table, with zeroplug's bytes per parameter"),
    ("the deepspeed launcher (`deepspeed --num_gpus N train.py`)", "zeroplug-deepspeed / zeroplug launch",
     SUPPORTED, "the same command line carried out by torchrun (`--num_gpus`, `--num_nodes`, `--hostfile`, "
     "`--include` / `--exclude`, `--master_addr`, `--master_port`); docs/deepspeed-switch.md"),
    ("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus", "an enum", SUPPORTED,
     "zeroplug's parameters carry no `ds_id` / `ds_status`: code that checks `hasattr(p, \"ds_id\")` takes "
     "its whole-parameter path, where a stage-3 parameter read is gathered on use"),
    # -- comm
    ("deepspeed.comm.init_distributed", "zeroplug.launch.start_process_group", SUPPORTED, ""),
    ("deepspeed.comm.get_rank / get_world_size / get_local_rank / get_global_rank", "torch.distributed",
     SUPPORTED, "0 / 1 / LOCAL_RANK without a process group"),
    ("deepspeed.comm.is_initialized / is_available / get_backend", "torch.distributed", SUPPORTED, ""),
    ("deepspeed.comm.barrier / all_reduce / reduce / broadcast", "torch.distributed", SUPPORTED,
     "no-ops without a process group"),
    ("deepspeed.comm.all_gather / all_gather_into_tensor / allgather_fn / reduce_scatter_tensor",
     "torch.distributed", SUPPORTED, "a copy without a process group"),
    ("deepspeed.comm.gather / scatter / all_gather_object / broadcast_object_list", "torch.distributed",
     SUPPORTED, ""),
    ("deepspeed.comm.new_group / destroy_process_group / ReduceOp", "torch.distributed", SUPPORTED, ""),
    # -- ops
    ("deepspeed.ops.adam.FusedAdam", "adamw (adam_w_mode) / adam", SUPPORTED,
     "torch's fused kernels; `bias_correction=False`: cpu_adam"),
    ("deepspeed.ops.adam.DeepSpeedCPUAdam", "auto (cpu_adam offloaded, else adamw) / cpu_adam", SUPPORTED,
     "`adamw_mode=False` or `bias_correction=False`: cpu_adam; `amsgrad` refused (DeepSpeed's has none)"),
    ("deepspeed.ops.lamb.FusedLamb", "", REFUSED,
     "zeroplug has no LAMB optimizer: use FusedAdam or torch.optim.AdamW, retuning the lr"),
    ("torch.optim.AdamW / Adam / SGD passed as optimizer", "adamw / adam / sgd", SUPPORTED,
     "torch's kernel flags (`fused`, `foreach`, `capturable`) are zeroplug's choice; `maximize=True` and "
     "`differentiable=True` refused"),
    ("any other optimizer class passed", "", REFUSED,
     "refused naming the classes zeroplug steps (the maths would differ)"),
    # -- accelerator
    ("deepspeed.accelerator.get_accelerator", "zeroplug.deepspeed.accelerator.Accelerator", SUPPORTED,
     "cuda when torch sees a GPU (or ZEROPLUG_DEVICE names one), else cpu"),
    ("get_accelerator().device_name / current_device_name / current_device / set_device / device_count / "
     "device", "torch.cuda", SUPPORTED, ""),
    ("get_accelerator().synchronize / empty_cache / is_available", "torch.cuda", SUPPORTED, "no-ops on the CPU"),
    ("get_accelerator().is_bf16_supported / is_fp16_supported / supported_dtypes", "torch.cuda", SUPPORTED, ""),
    ("get_accelerator().communication_backend_name", "nccl / gloo", SUPPORTED, ""),
    ("get_accelerator().manual_seed / manual_seed_all / initial_seed", "torch.cuda / torch", SUPPORTED, ""),
    ("get_accelerator().memory_allocated / max_memory_allocated / memory_reserved / max_memory_reserved / "
     "reset_peak_memory_stats / total_memory", "torch.cuda", SUPPORTED, "0 on the CPU (total_memory: the host's)"),
    ("get_accelerator().Stream / Event / current_stream / stream / pin_memory / on_accelerator", "torch.cuda",
     SUPPORTED, ""),
]

# where each public module attribute is listed (the test's map from code to rows)
MODULES = {
    "zeroplug.deepspeed": ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine"],
    "zeroplug.deepspeed.zero": ["Init", "MiCS_Init", "GatheredParameters", "register_external_parameter"],
    "zeroplug.deepspeed.comm": "deepspeed.comm.",
    "zeroplug.deepspeed.ops.adam": ["DeepSpeedCPUAdam", "FusedAdam"],
    "zeroplug.deepspeed.ops.lamb": ["FusedLamb"],
    "zeroplug.deepspeed.accelerator": ["get_accelerator"],
    "zeroplug.deepspeed.runtime.zero.partition_parameters": ["Init", "GatheredParameters", "ZeroParamStatus"],
    "zeroplug.deepspeed.utils": "deepspeed.utils.",
    "zeroplug.deepspeed.runtime.zero.stage_1_and_2": "deepspeed.runtime.zero.stage_1_and_2.",
    "zeroplug.deepspeed.runtime.zero.stage3": "deepspeed.runtime.zero.stage3.",
}


def api_markdown() -> str:
    out = ["# DeepSpeed's API in zeroplug", "",
           "Generated by `zeroplug docs --deepspeed-api` from `core/deepspeed/surface.py`. A script written "
           "for DeepSpeed runs on zeroplug with its imports changed: `import deepspeed` -> `import "
           "zeroplug.deepspeed as deepspeed`, `from deepspeed.X import Y` -> `from zeroplug.deepspeed.X import "
           "Y`. Configs: [deepspeed-compat.md](deepspeed-compat.md) (each DeepSpeed key).", "",
           "Each name is **supported** (the same behaviour, through the zeroplug name shown) or **refused** "
           "(one line `ConfigError` naming the alternative: the maths would differ).", "",
           "| DeepSpeed name | zeroplug | status | notes |", "| --- | --- | --- | --- |"]
    for name, target, status, notes in SURFACE:
        out.append(f"| `{name}` | {f'`{target}`' if target else ''} | {status} | {notes} |")
    out += ["", "## Scripts that run by their imports", "",
            "Each runs on 1 and 2 CPU ranks as DeepSpeed's launcher starts it, and its losses equal plain "
            "torch's (tests/integrations/test_deepspeed_scripts.py; the scripts are tests/integrations/deepspeed_scripts/):", "",
            "* DeepSpeedExamples' CIFAR script (`initialize(args=, model=, model_parameters=, training_data=)`, "
            "the returned data loader, `get_accelerator()`);",
            "* DeepSpeed-Chat's supervised fine-tuning, step 1 (`FusedAdam` over grouped parameters, "
            "transformers' `get_scheduler`, `initialize(model=, optimizer=, args=, config=, lr_scheduler=, "
            "dist_init_required=True)`, `zero.Init`, the stage-3 save through `GatheredParameters`); one line "
            "differs beyond the imports: `save_hf_format` (rank 0's `state_dict()` of a stage-3 model, empty "
            "tensors under DeepSpeed) runs below stage 3 only, as zeroplug refuses a sharded state dict on one "
            "rank;",
            "* OpenRLHF's DeepSpeed strategy (the engine as a child module, `GatheredParameters(..., "
            "modifier_rank=0)` on a `zero.Init` model, `save_checkpoint` / `load_checkpoint` with client state "
            "and an exact resume);",
            "* a plain script on `deepspeed.comm`, `add_config_arguments` and `init_distributed`.", "",
            "The scripts of hosts (transformers' Trainer, accelerate, Lightning) are "
            "tests/integrations/test_deepspeed_script_hosts.py."]
    return "\n".join(out)
