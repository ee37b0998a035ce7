"""Every key of a DeepSpeed config, classified: the one table behind ``zeroplug convert``,
DeepSpeed JSON configs given to ``zeroplug.initialize`` and docs/deepspeed-compat.md.

A rule says what zeroplug does with a key:

* ``same``        — the same meaning, under the zeroplug key named.
* ``translated``  — honoured under another name or shape (convert.py does the custom ones).
* ``ignored``     — accepted; a value other than the quiet ones gets a one-line warning
  saying why it changes nothing here.
* ``refused``     — a value other than the quiet ones is an error with the reason and
  what to use instead. Only what would otherwise change the training silently is refused.

``quiet`` lists the values that need no word (zeroplug already behaves so). ``ANY``: no
value needs one; ``OFF``: quiet while the section is off (``enabled`` false, or empty).
A ``*`` rule covers the keys of a section that are not listed one by one. Sources: the
DeepSpeed configuration docs (docs/_pages/config-json.md), its config classes (runtime/
config.py, constants.py, zero/config.py, zero/offload_config.py, precision_config.py)
and the Hugging Face integration's handling of "auto".
"""
from __future__ import annotations

from typing import NamedTuple

from zeroplug.errors import ConfigError

SAME, TRANSLATED, IGNORED, REFUSED = "same", "translated", "ignored", "refused"
ANY, OFF = "any", "off"


class Rule(NamedTuple):
    kind: str
    target: str          # the zeroplug key (same / translated), else "" (why says it all)
    why: str = ""
    quiet: object = ()


def same(target: str, why: str = "") -> Rule:
    return Rule(SAME, target, why)


def moved(target: str, why: str) -> Rule:
    return Rule(TRANSLATED, target, why)


def ignored(why: str, quiet: object = ANY) -> Rule:
    return Rule(IGNORED, "", why, quiet)


def refused(why: str, quiet: object = ()) -> Rule:
    return Rule(REFUSED, "", why, quiet)


_LOG = "logging and profiling only; zeroplug reports through [monitor] (stdout, csv)"
_SPEED = "a speed or memory knob of DeepSpeed's implementation; the values trained are the same"
_STAGE3_ALIAS = "DeepSpeed's field name for stage3_{}"
_NOTHING_TO_DO = "zeroplug already behaves so"
_LEAF_BY_NAME = ("leaf modules by module name: zeroplug takes their classes (zero.stage3_leaf_modules) and finds "
                 "blocks holding a ModuleList named 'experts' itself")

RULES: dict[str, Rule] = {
    # --- batch and logging ------------------------------------------------------------
    "train_batch_size": same("batch.train_batch_size"),
    "train_micro_batch_size_per_gpu": same("batch.micro_batch_size"),
    "gradient_accumulation_steps": same("batch.gradient_accumulation_steps"),
    "gradient_clipping": same("batch.gradient_clipping"),
    "steps_per_print": same("batch.steps_per_print"),
    "managed_gradient_accumulation": refused(
        "zeroplug counts micro steps itself: call engine.step() after every backward (DeepSpeed's true)",
        quiet=(True,)),
    "wall_clock_breakdown": ignored("zeroplug's metrics line always has the step time", quiet=(False,)),
    "memory_breakdown": ignored("zeroplug's metrics line always has device and host memory", quiet=(False,)),
    "dump_state": ignored("it prints DeepSpeed's state at start; logging only", quiet=(False,)),
    "log_level": ignored("logging only; zeroplug logs through the Python logger \"zeroplug\""),
    "vocabulary_size": ignored("DeepSpeed only warns when it is not a multiple of 8"),
    "dataloader_drop_last": ignored("it configures DeepSpeed's data loader (deepspeed_io); zeroplug builds "
                                    "none: drop the last batch in your own loader", quiet=(False,)),
    "disable_python_gc": ignored("Python garbage-collection tuning; the values trained are the same",
                                 quiet=(False,)),
    # --- optimizer and schedule (convert.py: the type picks the plugin) -----------------
    "optimizer": moved("optimizer.plugin", "type Adam/AdamW: adamw (adam with adam_w_mode = false); with "
                       "offload_optimizer: auto (cpu_adam, as DeepSpeed picks DeepSpeedCPUAdam, torch_adam "
                       "or not); SGD: sgd; bias_correction = false: cpu_adam"),
    "optimizer.type": moved("optimizer.plugin", "see optimizer"),
    "optimizer.params": moved("[optimizer]", "the keys below"),
    "optimizer.legacy_fusion": ignored("an old fp16 fusion switch; zeroplug's step is fused already",
                                       quiet=(False,)),
    "optimizer.params.lr": same("optimizer.lr"),
    "optimizer.params.betas": same("optimizer.betas"),
    "optimizer.params.eps": same("optimizer.eps"),
    "optimizer.params.weight_decay": same("optimizer.weight_decay"),
    "optimizer.params.amsgrad": same("optimizer.amsgrad"),
    "optimizer.params.momentum": same("optimizer.momentum", "SGD"),
    "optimizer.params.dampening": same("optimizer.dampening", "SGD"),
    "optimizer.params.nesterov": same("optimizer.nesterov", "SGD"),
    "optimizer.params.muon_lr": same("optimizer.muon_lr", "Muon"),
    "optimizer.params.adam_lr": same("optimizer.adam_lr", "Muon"),
    "optimizer.params.ns_method": same("optimizer.ns_method", "Muon"),
    "optimizer.params.max_coeff": same("optimizer.max_coeff", "Lamb"),
    "optimizer.params.min_coeff": same("optimizer.min_coeff", "Lamb"),
    "optimizer.params.eps_inside_sqrt": same("optimizer.eps_inside_sqrt", "Lamb"),
    "optimizer.params.alpha": same("optimizer.alpha", "torch.optim RMSprop, ASGD"),
    "optimizer.params.centered": same("optimizer.centered", "torch.optim RMSprop"),
    "optimizer.params.lr_decay": same("optimizer.lr_decay", "torch.optim Adagrad"),
    "optimizer.params.initial_accumulator_value": same("optimizer.initial_accumulator_value",
                                                       "torch.optim Adagrad"),
    "optimizer.params.rho": same("optimizer.rho", "torch.optim Adadelta"),
    "optimizer.params.momentum_decay": same("optimizer.momentum_decay", "torch.optim NAdam"),
    "optimizer.params.decoupled_weight_decay": same("optimizer.decoupled_weight_decay", "torch.optim NAdam, RAdam"),
    "optimizer.params.lambd": same("optimizer.lambd", "torch.optim ASGD"),
    "optimizer.params.t0": same("optimizer.t0", "torch.optim ASGD"),
    "optimizer.params.etas": same("optimizer.etas", "torch.optim Rprop"),
    "optimizer.params.step_sizes": same("optimizer.step_sizes", "torch.optim Rprop"),
    "optimizer.params.adam_w_mode": moved("optimizer.plugin", "true (DeepSpeed's default, also for type "
                                          "Adam): adamw; false: adam (L2), or cpu_adam adamw_mode = false"),
    "optimizer.params.bias_correction": moved("optimizer.bias_correction",
                                              "false: cpu_adam, the optimizer with that switch (it steps "
                                              "states held in CPU memory: a CPU run or offload_optimizer)"),
    "optimizer.params.torch_adam": ignored("DeepSpeed's way around building its own Adam kernels; zeroplug "
                                           "builds none: torch's fused Adam/AdamW on the GPU, cpu_adam for "
                                           "offloaded states, the same update (optimizer.plugin = \"adamw\" runs "
                                           "torch's on the CPU too)"),
    "optimizer.params.adamw_mode": moved("optimizer.adamw_mode", "DeepSpeedCPUAdam's spelling of adam_w_mode"),
    "optimizer.params.max_grad_norm": ignored(
        "DeepSpeed does not clip with it either (it warns, newer versions refuse): set gradient_clipping",
        quiet=(0, 0.0)),
    "optimizer.params.set_grad_none": ignored("zeroplug frees gradients after the step anyway"),
    "optimizer.params.fp32_optimizer_states": moved(
        "optimizer.state_dtype", "false (DeepSpeedCPUAdam's bf16 moments): \"bf16\" with offload_optimizer; "
        "without it ignored (torch's kernels on the GPU step fp32 states); true: \"fp32\", the default"),
    "optimizer.params.foreach": ignored("torch's kernel choice; zeroplug picks fused where it exists "
                                        "(optimizer.implementation)"),
    "optimizer.params.fused": ignored("torch's kernel choice; zeroplug picks fused where it exists "
                                      "(optimizer.implementation)"),
    "optimizer.params.capturable": ignored("CUDA-graph capture of torch's optimizer; the same update"),
    "optimizer.params.differentiable": ignored("autograd through the step; not used in training",
                                               quiet=(False,)),
    "optimizer.params.maximize": refused("zeroplug minimizes the loss: negate the loss instead",
                                         quiet=(False,)),
    "scheduler": moved("scheduler.plugin", "WarmupLR: warmup, WarmupDecayLR: warmup_decay, WarmupCosineLR: "
                       "warmup_cosine"),
    "scheduler.type": moved("scheduler.plugin", "see scheduler"),
    "scheduler.params": moved("[scheduler]", "the keys below"),
    "scheduler.params.warmup_min_lr": same("scheduler.warmup_min_lr"),
    "scheduler.params.warmup_max_lr": same("scheduler.warmup_max_lr"),
    "scheduler.params.warmup_num_steps": same("scheduler.warmup_num_steps"),
    "scheduler.params.warmup_type": same("scheduler.warmup_type"),
    "scheduler.params.total_num_steps": same("scheduler.total_num_steps"),
    "scheduler.params.warmup_min_ratio": same("scheduler.warmup_min_ratio"),
    "scheduler.params.cos_min_ratio": same("scheduler.cos_min_ratio"),
    "scheduler.params.last_batch_iteration": refused(
        "a schedule that starts mid-way; resume with engine.load_checkpoint, which restores the schedule's "
        "step", quiet=(-1,)),
    # --- precision ----------------------------------------------------------------------
    "fp16": moved("precision.plugin", "enabled: plugin = \"fp16\"; the loss-scaling keys below"),
    "fp16.enabled": moved("precision.plugin", "true: \"fp16\" (with bf16.enabled also true: refused, as "
                          "DeepSpeed does)"),
    "fp16.loss_scale": same("precision.loss_scale"),
    "fp16.initial_scale_power": same("precision.initial_scale_power"),
    "fp16.loss_scale_window": same("precision.loss_scale_window"),
    "fp16.hysteresis": same("precision.hysteresis"),
    "fp16.consecutive_hysteresis": same("precision.consecutive_hysteresis"),
    "fp16.min_loss_scale": same("precision.min_loss_scale"),
    "fp16.auto_cast": ignored("zeroplug does not cast the inputs: pass fp16 tensors where the model takes "
                              "floats (token ids need nothing)", quiet=(False,)),
    "fp16.fp16_master_weights_and_grads": ignored(
        "zeroplug keeps fp32 master weights and gradients: more exact, 4 more bytes per parameter",
        quiet=(False,)),
    "fp16.fused_mode": ignored("zeroplug's fp16 step is always fused"),
    "bf16": moved("precision.plugin", "enabled: plugin = \"bf16\""),
    "bf16.enabled": moved("precision.plugin", "true: \"bf16\""),
    "bf16.immediate_grad_update": ignored(_SPEED),
    "bf16.check_grad_overflow": ignored("zeroplug always skips a step whose gradients are not finite"),
    "bf16.bf16_master_weights_and_grads": ignored(
        "zeroplug keeps fp32 master weights and gradients: more exact, 4 more bytes per parameter",
        quiet=(False,)),
    "bf16.bf16_optimizer_states": moved(
        "optimizer.state_dtype", "true with offload_optimizer: \"bf16\" (Adam's moments in bf16 on the host, "
        "stepped by cpu_adam; the masters stay fp32: bf16_master_weights_and_grads is ignored); without "
        "offload_optimizer ignored with a warning (torch's kernels on the GPU step fp32 states)"),
    "bfloat16": moved("precision.plugin", "DeepSpeed's old name of bf16 (used when bf16 is absent)"),
    "communication_data_type": moved("precision.reduce_dtype", "fp32 / fp16 / bf16 where the precision "
                                     "plugin offers it; another dtype is ignored with a warning"),
    "amp": refused("Apex AMP is not available: use fp16 or bf16", quiet=OFF),
    "torch_autocast": refused("zeroplug trains with bf16/fp16 parameters and fp32 masters, not under "
                              "autocast: set bf16.enabled or fp16.enabled instead, or remove it (fp32)",
                              quiet=OFF),
    "data_types": moved("", "the keys below"),
    "data_types.grad_accum_dtype": ignored(
        "zeroplug has no switch for it: micro-batch gradients add up in the dtype each stage keeps them in",
        quiet=(None,)),
    "data_types.*": ignored("zeroplug keeps parameters and buffers in the model's dtype of its precision",
                            quiet=(None,)),
    # --- gradient reduction ---------------------------------------------------------------
    "prescale_gradients": ignored("zeroplug always divides by the world size before reducing; the mean is "
                                  "the same either way"),
    "gradient_predivide_factor": ignored("zeroplug divides by the world size before reducing; another "
                                         "pre-division changes rounding only", quiet=(1, 1.0)),
    "gradient_allreduce_op": refused("zeroplug averages gradients over ranks; a sum scales every update by "
                                     "the world size: use \"mean\" and scale the learning rate",
                                     quiet=("mean",)),
    "sparse_gradients": ignored("zeroplug reduces dense gradients: the same values", quiet=(False,)),
    "disable_allgather": ignored("zeroplug all-gathers updated parameters (DeepSpeed's alternative "
                                 "broadcasts them): the same values", quiet=(False,)),
    "fp32_allreduce": ignored("an old switch; zeroplug's reduction dtype is precision.reduce_dtype",
                              quiet=(False,)),
    "zero_allow_untested_optimizer": ignored("every zeroplug optimizer works with every stage"),
    "zero_force_ds_cpu_optimizer": ignored("zeroplug picks the CPU optimizer for offloaded states itself "
                                           "(optimizer.plugin = \"auto\")"),
    # --- ZeRO -----------------------------------------------------------------------------
    "zero_optimization": moved("[zero]", "the keys below (true alone, DeepSpeed's old form: stage 1)"),
    "zero_optimization.stage": moved("zero.plugin", "0-3: \"stage0\" ... \"stage3\""),
    "zero_optimization.contiguous_gradients": same("zero.contiguous_gradients"),
    "zero_optimization.reduce_scatter": same("zero.reduce_scatter"),
    "zero_optimization.reduce_bucket_size": same("zero.reduce_bucket_size", "\"auto\": hidden_size^2; 0 "
                                                 "(one gradient at a time): 1"),
    "zero_optimization.allgather_bucket_size": same("zero.allgather_bucket_size"),
    "zero_optimization.overlap_comm": same("zero.overlap_comm"),
    "zero_optimization.sub_group_size": same("zero.sub_group_size", "0 (one parameter per sub-group): "
                                             "zeroplug's default; sub-groups change memory, not values"),
    "zero_optimization.stage3_prefetch_bucket_size": same("zero.stage3_prefetch_bucket_size",
                                                          "\"auto\": 0.9 x hidden_size^2"),
    "zero_optimization.stage3_param_persistence_threshold": same("zero.stage3_param_persistence_threshold",
                                                                 "\"auto\": 10 x hidden_size"),
    "zero_optimization.stage3_max_live_parameters": same("zero.stage3_max_live_parameters"),
    "zero_optimization.stage3_max_reuse_distance": same("zero.stage3_max_reuse_distance"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": same(
        "zero.stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.prefetch_bucket_size": moved("zero.stage3_prefetch_bucket_size",
                                                    _STAGE3_ALIAS.format("prefetch_bucket_size")),
    "zero_optimization.param_persistence_threshold": moved(
        "zero.stage3_param_persistence_threshold", _STAGE3_ALIAS.format("param_persistence_threshold")),
    "zero_optimization.max_live_parameters": moved("zero.stage3_max_live_parameters",
                                                   _STAGE3_ALIAS.format("max_live_parameters")),
    "zero_optimization.max_reuse_distance": moved("zero.stage3_max_reuse_distance",
                                                  _STAGE3_ALIAS.format("max_reuse_distance")),
    "zero_optimization.gather_16bit_weights_on_model_save": moved(
        "zero.stage3_gather_16bit_weights_on_model_save",
        _STAGE3_ALIAS.format("gather_16bit_weights_on_model_save")),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": moved(
        "zero.stage3_gather_16bit_weights_on_model_save", "DeepSpeed's old name of it"),
    "zero_optimization.offload_optimizer": moved("[offload.optimizer]", "device cpu / nvme: plugin = "
                                                 "\"cpu\" / \"nvme\"; none: no offload"),
    "zero_optimization.offload_param": moved("[offload.param]", "device cpu / nvme: plugin = \"cpu\" / "
                                             "\"nvme\" (stage 3 only: ignored below it with a warning, as DeepSpeed does); without "
                                             "offload_optimizer the optimizer is offloaded to the CPU too"),
    "zero_optimization.cpu_offload": moved("offload.optimizer.plugin", "DeepSpeed's old switch: true = "
                                           "offload_optimizer on the CPU"),
    "zero_optimization.cpu_offload_param": moved("offload.param.plugin", "DeepSpeed's old switch: true = "
                                                 "offload_param on the CPU"),
    "zero_optimization.cpu_offload_use_pin_memory": moved("offload.*.pin_memory", "DeepSpeed's old switch"),
    "zero_optimization.allgather_partitions": ignored("zeroplug all-gathers updated partitions (false: a "
                                                      "series of broadcasts, the same values)", quiet=(True,)),
    "zero_optimization.use_multi_rank_bucket_allreduce": ignored(_SPEED),
    "zero_optimization.load_from_fp32_weights": ignored("zeroplug's checkpoints always restore the fp32 "
                                                        "master weights", quiet=(True,)),
    "zero_optimization.elastic_checkpoint": ignored("zeroplug's checkpoints load at any world size"),
    "zero_optimization.ignore_unused_parameters": ignored("zeroplug never fails on parameters that get no "
                                                          "gradient", quiet=(True,)),
    "zero_optimization.legacy_stage1": ignored("an old implementation of stage 1; the same values",
                                               quiet=(False,)),
    "zero_optimization.round_robin_gradients": ignored(_SPEED, quiet=(False,)),
    "zero_optimization.parameter_alignment": ignored("padding for grouped matrix products; zeroplug's flat "
                                                     "buffers need none", quiet=(False,)),
    "zero_optimization.compute_grad_norm": ignored("zeroplug always computes the gradient norm (its overflow "
                                                   "check needs it)", quiet=(True,)),
    "zero_optimization.zero_hpz_partition_size": same(
        "zero.zero_hpz_partition_size", "ZeRO++ hpZ (stage 3): a second copy of the parameters sharded within "
        "groups of this size, so the gathers after the first one of a step stay in the group; 1: off; below stage 3 "
        "ignored, as DeepSpeed does"),
    "zero_optimization.zero_quantized_weights": ignored(
        "ZeRO++ quantized communication; zeroplug communicates in full precision (exact, more bytes)",
        quiet=(False,)),
    "zero_optimization.zero_quantized_nontrainable_weights": ignored(
        "zeroplug keeps frozen weights in the model's dtype (exact, more memory)", quiet=(False,)),
    "zero_optimization.zero_quantized_gradients": ignored(
        "ZeRO++ quantized communication; zeroplug communicates in full precision (exact, more bytes)",
        quiet=(False,)),
    "zero_optimization.zeropp_loco_param": ignored("LoCo error feedback for quantized gradients, which "
                                                   "zeroplug does not quantize", quiet=(None,)),
    "zero_optimization.mics_shard_size": same("zero.shard_group_size", "MiCS (stage 3): parameters, gradients and "
                                              "optimizer states sharded within groups of this size, replicated "
                                              "across them; -1: off; below stage 3 ignored, as DeepSpeed does"),
    "zero_optimization.mics_hierarchical_params_gather": ignored(
        "MiCS's two-hop all-gather for groups that span hosts; zeroplug gathers within a group in one collective "
        "(NCCL picks its algorithm across hosts): the same values", quiet=(False,)),
    "zero_optimization.stage3_model_persistence_threshold": ignored("caps the elements kept whole; memory "
                                                                    "only"),
    "zero_optimization.model_persistence_threshold": ignored("caps the elements kept whole; memory only"),
    "zero_optimization.stage3_module_granularity_threshold": ignored(_SPEED),
    "zero_optimization.module_granularity_threshold": ignored(_SPEED),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": ignored(_SPEED),
    "zero_optimization.use_all_reduce_for_fetch_params": ignored(_SPEED),
    "zero_optimization.stage3_allgather_sequential": ignored(_SPEED),
    "zero_optimization.allgather_sequential": ignored(_SPEED),
    "zero_optimization.stage3_partition_stream_chunk_size": ignored(_SPEED),
    "zero_optimization.partition_stream_chunk_size": ignored(_SPEED),
    "zero_optimization.memory_efficient_linear": ignored(_SPEED),
    "zero_optimization.override_module_apply": ignored(_SPEED),
    "zero_optimization.pipeline_loading_checkpoint": ignored("pipeline parallelism only", quiet=(False,)),
    "zero_optimization.log_trace_cache_warnings": ignored("logging only"),
    "zero_optimization.enable_sanity_checks": ignored("debugging only"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": ignored("Muon only (not a zeroplug optimizer)"),
    "zero_optimization.leaf_module": moved("[zero]", "leaf modules, gathered whole at stage 3"),
    "zero_optimization.leaf_module.classes": moved(
        "zero.stage3_leaf_modules", "class names, or dotted module.Class paths; blocks holding a ModuleList "
                                    "named 'experts' are leaves without it"),
    "zero_optimization.leaf_module.names": ignored(_LEAF_BY_NAME, quiet=OFF),
    "zero_optimization.leaf_module.name_suffixes": ignored(_LEAF_BY_NAME, quiet=OFF),
    "zero_optimization.zenflow": refused("ZenFlow applies unimportant gradients late (stale updates); "
                                         "zeroplug updates every parameter every step: remove it",
                                         quiet=(None,)),
    # offload tables: the same rules for offload_optimizer and offload_param
    "zero_optimization.offload_*.device": moved("offload.*.plugin", "cpu / nvme / none"),
    "zero_optimization.offload_*.nvme_path": same("offload.*.nvme_path", "nvme only (required there)"),
    "zero_optimization.offload_*.pin_memory": same("offload.*.pin_memory"),
    "zero_optimization.offload_*.buffer_count": same("offload.*.buffer_count", "nvme only"),
    "zero_optimization.offload_*.buffer_size": same("offload.*.buffer_size", "nvme, offload_param only"),
    "zero_optimization.offload_*.max_in_cpu": same("offload.*.max_in_cpu", "nvme, offload_param only"),
    "zero_optimization.offload_*.pipeline_read": same("offload.*.pipeline_read", "nvme only"),
    "zero_optimization.offload_*.pipeline_write": same("offload.*.pipeline_write", "nvme only"),
    "zero_optimization.offload_*.fast_init": same("offload.*.fast_init", "nvme only"),
    "zero_optimization.offload_*.ratio": moved("offload.optimizer.gpu_resident_ratio",
                                               "1 - ratio: the share whose states stay on the GPU (cpu tier)"),
    "zero_optimization.offload_*.super_offload": ignored("Superchip tuning: " + _SPEED, quiet=(False,)),
    "zero_optimization.offload_*.convert_grad_on_cpu": ignored(_SPEED),
    "zero_optimization.offload_*.cpuadam_cores_perc": ignored(_SPEED),
    "aio": same("[aio]", "the nvme tier's I/O defaults"),
    "aio.block_size": same("aio.block_size"),
    "aio.queue_depth": same("aio.queue_depth"),
    "aio.thread_count": same("aio.thread_count"),
    "aio.intra_op_parallelism": same("aio.intra_op_parallelism"),
    "aio.single_submit": same("aio.single_submit"),
    "aio.overlap_events": same("aio.overlap_events"),
    "aio.use_gds": ignored("GPUDirect Storage; zeroplug reads through host memory: the same values",
                           quiet=(False,)),
    # --- parallelism zeroplug does not have ------------------------------------------------
    "tensor_parallel": moved("", "the keys below"),
    "tensor_parallel.autotp_size": refused(
        "zeroplug has no tensor parallelism: every rank is data-parallel, so the batch arithmetic and the "
        "memory per GPU differ; remove it (stage 3 shards the parameters instead)", quiet=(0, 1)),
    "tensor_parallel.*": ignored("tensor parallelism only"),
    "expert_parallel": refused("zeroplug has no expert parallelism: every rank holds every expert; remove "
                               "it", quiet=OFF),
    "sequence_parallel_size": moved(
        "sequence.sequence_parallel_size", "above 1: [sequence] plugin = \"ulysses\" with that many consecutive "
        "ranks per sequence (Ulysses attention; the MLP and the head's loss in tiles where a sequence needs them); "
        "the batch sizes count world size / sequence_parallel_size data-parallel ranks, as DeepSpeed counts them. "
        "The script slices its batches (engine.sequence().shard / .loader, in place "
        "of UlyssesSPDataLoaderAdapter) and needs no UlyssesSPAttentionHF.register_with_transformers; 1: nothing"),
    "seq_parallel_communication_data_type": ignored(
        "the dtype of sequence parallelism's all-to-alls; zeroplug exchanges the model's dtype (exact)"),
    "seq_parallel_comm_data_type": ignored(
        "the dtype of sequence parallelism's all-to-alls; zeroplug exchanges the model's dtype (exact)"),
    "use_data_before_expert_parallelism": ignored("expert parallelism only"),
    "pipeline": ignored("it configures DeepSpeed's PipelineModule, which a model must be built as; "
                        "zeroplug has no pipeline parallelism"),
    "hybrid_engine": ignored("DeepSpeed's inference kernels for generation inside RLHF loops; training is "
                             "the same", quiet=OFF),
    # --- features that change what is trained ---------------------------------------------
    "progressive_layer_drop": refused("the engine feeds a layer-drop schedule to the model's forward; "
                                      "zeroplug has none: remove it (every layer trains every step)",
                                      quiet=OFF),
    "curriculum_learning": refused("it changes the sequence lengths the model sees; zeroplug does not: "
                                   "remove it, or shorten sequences in your data loader", quiet=OFF),
    "data_efficiency": refused("curriculum sampling and random-LTD change the data the model sees: remove "
                               "it, or do it in your data loader", quiet=OFF),
    "quantize_training": refused("MoQ quantizes the weights while training; zeroplug trains full-precision "
                                 "weights: remove it", quiet=OFF),
    "elasticity": refused("elastic training picks the batch sizes from the GPU count; zeroplug uses the "
                          "batch sizes given: set train_batch_size and train_micro_batch_size_per_gpu",
                          quiet=OFF),
    # --- sections that do not change the training step -------------------------------------
    "activation_checkpointing": moved("", "the keys below; the model turns checkpointing on itself "
                                          "(model.gradient_checkpointing_enable() or torch.utils.checkpoint)"),
    "activation_checkpointing.cpu_checkpointing": moved(
        "activation_checkpointing.plugin", "true: \"cpu\", the checkpointed blocks' inputs wait in pinned host memory "
        "for their recompute, as DeepSpeed's CPU checkpointing keeps them (without needing partition_activations); "
        "false: \"none\""),
    "activation_checkpointing.partition_activations": ignored(
        "it splits each checkpointed activation across the model-parallel ranks; zeroplug has no model "
        "parallelism, so each rank holds its own micro batch's whole activations", quiet=(False,)),
    "activation_checkpointing.contiguous_memory_optimization": ignored(
        "it copies the checkpoints into one preallocated buffer against fragmentation: " + _SPEED, quiet=(False,)),
    "activation_checkpointing.number_checkpoints": ignored(
        "the number of checkpoints contiguous_memory_optimization's buffer holds"),
    "activation_checkpointing.synchronize_checkpoint_boundary": ignored(
        "a device synchronisation at each checkpoint boundary, for profiling; the values trained are the same",
        quiet=(False,)),
    "activation_checkpointing.profile": ignored(_LOG, quiet=(False,)),
    "sparse_attention": ignored("it configures DeepSpeed's SparseSelfAttention modules, which a model must "
                                "be built with; the engine does not change attention"),
    "compression_training": ignored("applied by deepspeed.compression.init_compression in the training "
                                    "script, not by the engine", quiet=OFF),
    "weight_quantization": ignored("inference-time quantization (init_inference); training is the same"),
    "eigenvalue": ignored("used by MoQ only", quiet=OFF),
    "compile": ignored("zeroplug does not compile the model: call torch.compile(model) before initialize",
                       quiet=OFF),
    "graph_harvesting": ignored("CUDA-graph capture of small kernels: " + _SPEED, quiet=(False,)),
    "checkpoint": moved("[checkpoint]", "writer.decoupled: checkpoint.async_save; the rest does not apply"),
    "checkpoint.*": ignored("zeroplug's checkpoints are universal (any world size), atomic and verified; "
                            "DeepSpeed's tag checks and serialization do not apply", quiet=OFF),
    "checkpoint.writer": moved("checkpoint.async_save", "decoupled: the keys below"),
    "checkpoint.writer.decoupled": same("checkpoint.async_save", "written in the background while training "
                                        "goes on (a thread, not a process)"),
    "checkpoint.writer.*": ignored("DeepSpeed's writer implementation and its I/O buffers; zeroplug writes its own "
                                   "files"),
    "nebula": ignored("a checkpoint engine; zeroplug writes its own checkpoints", quiet=OFF),
    "datastates": ignored("a checkpoint engine; zeroplug writes its own checkpoints", quiet=OFF),
    "autotuning": ignored("zeroplug has no autotuner; `zeroplug estimate` prints the memory per stage",
                          quiet=OFF),
    "flops_profiler": ignored(_LOG, quiet=OFF),
    "tensorboard": ignored(_LOG, quiet=OFF),
    "wandb": ignored(_LOG, quiet=OFF),
    "comet": ignored(_LOG, quiet=OFF),
    "csv_monitor": ignored(_LOG, quiet=OFF),
    "comms_logger": ignored(_LOG, quiet=OFF),
    "timers": ignored(_LOG, quiet=OFF),
}

#: DeepSpeed sections whose unknown keys DeepSpeed refuses (pydantic models with extra="forbid",
#: or constructor keyword arguments): zeroplug refuses them too, with a did-you-mean.
STRICT_SECTIONS = ("zero_optimization", "zero_optimization.offload_*", "fp16", "bf16", "optimizer",
                   "optimizer.params", "scheduler", "scheduler.params", "aio")

OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd", "muon": "muon", "lion": "lion", "lamb": "lamb",
              "adagrad": "ds_adagrad"}
#: DeepSpeed's optimizer types that zeroplug refuses, and why
REFUSED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam compresses the gradient all-reduce to 1 bit per element with error feedback, "
                  "another training than exact reductions; zeroplug's reductions are exact: use type Adam",
    "zerooneadam": "0/1 Adam compresses the gradient all-reduce and skips variance updates, another training "
                   "than exact reductions; zeroplug's reductions are exact: use type Adam",
    "onebitlamb": "1-bit Lamb compresses the gradient all-reduce to 1 bit per element with error feedback, "
                  "another training than exact reductions; zeroplug's reductions are exact: use type Lamb",
    "muadam": "mup's MuAdam scales each parameter's lr by the width multipliers mup.set_base_shapes attached to "
              "it; give the groups their lrs in model_parameters with type Adam / AdamW",
    "muadamw": "mup's MuAdamW scales each parameter's lr by the width multipliers mup.set_base_shapes attached "
               "to it; give the groups their lrs in model_parameters with type AdamW",
    "musgd": "mup's MuSGD scales each parameter's lr by the width multipliers mup.set_base_shapes attached to "
             "it; give the groups their lrs in model_parameters with type SGD",
}
SCHEDULERS = {"warmuplr": "warmup", "warmupdecaylr": "warmup_decay", "warmupcosinelr": "warmup_cosine"}
OTHER_SCHEDULERS = ("OneCycle", "LRRangeTest", "and torch.optim.lr_scheduler classes")

#: "auto": what fills it when no launcher has (zeroplug key -> (value, where it comes from)).
#: Note: the values are the Hugging Face TrainingArguments defaults, the values the Trainer
#: and accelerate put there for a run started without arguments; KEEP leaves "auto" to
#: zeroplug's own resolution (batch arithmetic, the optimizer's lr); HIDDEN is filled from the
#: model's hidden size as the Hugging Face integration does (or by the ZeRO stage at setup).
KEEP, HIDDEN = "keep", "hidden"
AUTO: dict[str, tuple[object, str]] = {
    "batch.micro_batch_size": (8, "the launcher's per-device batch size (HF default 8)"),
    "batch.gradient_accumulation_steps": (1, "the launcher's accumulation steps (HF default 1)"),
    "batch.train_batch_size": (KEEP, "micro batch x accumulation x world size"),
    "batch.gradient_clipping": (1.0, "the launcher's max_grad_norm (HF default 1.0)"),
    "optimizer.lr": (5e-5, "the launcher's learning_rate (HF default 5e-5)"),
    "optimizer.betas": ((0.9, 0.999), "the launcher's adam_beta1, adam_beta2 (HF defaults)"),
    "optimizer.eps": (1e-8, "the launcher's adam_epsilon (HF default 1e-8)"),
    "optimizer.weight_decay": (0.0, "the launcher's weight_decay (HF default 0)"),
    "scheduler.warmup_min_lr": (0.0, "0, as the HF launcher fills it"),
    "scheduler.warmup_max_lr": (KEEP, "the optimizer's lr"),
    "scheduler.warmup_num_steps": (1, "the launcher's warm-up steps (HF: max(1, warmup_steps = 0))"),
    "scheduler.total_num_steps": (10000, "the run's total steps, which only a launcher knows: zeroplug's "
                                         "default 10000 (set it)"),
    "precision.plugin": (KEEP, "the launcher's --fp16 / --bf16 (HF default: neither); zeroplug's default "
                               "precision (fp32; `zeroplug train --device cuda`: bf16)"),
    "zero.reduce_bucket_size": (HIDDEN, "hidden_size^2 of the model"),
    "zero.stage3_prefetch_bucket_size": (HIDDEN, "0.9 x hidden_size^2 of the model"),
    "zero.stage3_param_persistence_threshold": (HIDDEN, "10 x hidden_size of the model"),
    "zero.stage3_gather_16bit_weights_on_model_save": (
        True, "the launcher's choice (accelerate: zero3_save_16bit_model); zeroplug's default: gather"),
}


def _silent(rule: Rule) -> str:
    if rule.kind not in (IGNORED, REFUSED):
        return ""
    if rule.quiet == ANY:
        return "any value"
    if rule.quiet == OFF:
        return "off or absent"
    import json
    return " / ".join(json.dumps(q) for q in rule.quiet) or "-"


def compat_markdown() -> str:
    """docs/deepspeed-compat.md: the rule table, the "auto" table and the refused combinations."""
    import json
    out = ["# DeepSpeed configs in zeroplug", "",
           "Generated by `zeroplug docs --deepspeed` from `core/convert/keys.py`, the table that "
           "`zeroplug.initialize` (given a DeepSpeed JSON file or dict) and `zeroplug convert ds_config.json` "
           "apply. Every key of DeepSpeed's configuration is one of:", "",
           "* **same** — the same meaning, under the zeroplug key named;",
           "* **translated** — honoured under another name or shape;",
           "* **ignored** — accepted; a value other than the silent ones prints one warning at start saying "
           "why it changes nothing here;",
           "* **refused** — a value other than the silent ones stops with `error:` naming the key, the reason "
           "and what to use instead. Only what would change the training silently is refused.", "",
           "Keys DeepSpeed does not know are ignored with a warning at the top level (as DeepSpeed ignores "
           "them) and refused inside `zero_optimization`, its offload tables, `fp16`, `bf16`, `optimizer`, "
           "`scheduler` and `aio` (DeepSpeed refuses those too), with a did-you-mean. `\"true\"` / `\"false\"` "
           "strings are read as booleans, with a warning, as DeepSpeed reads them.", "",
           "## Keys", "",
           "| DeepSpeed key | class | zeroplug key | what happens | silent when |",
           "| --- | --- | --- | --- | --- |"]
    for key, rule in RULES.items():
        target = f"`{rule.target}`" if rule.target else ""
        out.append(f"| `{key}` | {rule.kind} | {target} | {rule.why} | {_silent(rule)} |")
    out += ["", "`optimizer.type`: Adam and AdamW (DeepSpeed's Adam is AdamW unless `adam_w_mode` is false) "
            "and SGD are translated; Muon becomes `optimizer.plugin = \"muon\"` with `rule = \"deepspeed\"` "
            "(DeepSpeed's Newton-Schulz and `ns_method`, `muon_lr` / `adam_lr`, its Adam's defaults betas "
            "(0.9, 0.95) and eps 1e-10), Lion `lion`, Lamb `lamb`, Adagrad `ds_adagrad` (DeepSpeed's update "
            "rules); any other torch.optim class name (DeepSpeed builds `getattr(torch.optim, type)`) becomes "
            "`plugin = \"torch\"` with that `name`, when its update is element-wise. Refused, each with its "
            "reason: " + "; ".join(f"{k}: {v}" for k, v in REFUSED_OPTIMIZERS.items()) + "; torch.optim LBFGS, "
            "SparseAdam and Muon (the step needs a closure, sparse gradients or whole matrices: "
            "`plugin = \"muon\"` steps Muon).", "",
            "With `offload_optimizer`, Adam and AdamW become `optimizer.plugin = \"auto\"`: cpu_adam steps the "
            "offloaded states on the CPU with the config's `lr`, `betas`, `eps` and `weight_decay`, as "
            "DeepSpeed runs DeepSpeedCPUAdam there (`adam_w_mode = false` gives cpu_adam with "
            "`adamw_mode = false`). A choice on the command line or in TOML still wins, e.g. "
            "`--optimizer.plugin=adamw` for torch's AdamW on the CPU; cpu_adam's threads are "
            "`--optimizer.threads` (default: the rank's share of the cores).", "",
            "`scheduler.type`: WarmupLR, WarmupDecayLR and WarmupCosineLR are translated; refused, as "
            "another schedule would train with other learning rates: " + ", ".join(OTHER_SCHEDULERS) + ".", "",
            "## \"auto\"", "",
            "Launchers (the Hugging Face Trainer, accelerate) replace `\"auto\"` before DeepSpeed sees the "
            "config. zeroplug fills what no launcher filled as below and prints every value it resolved, "
            "one line each, at start (rank 0). `zeroplug convert` writes the filled values and says in a "
            "comment which ones stay `\"auto\"` and who fills them. Any other `\"auto\"` means zeroplug's "
            "default for that key.", "",
            "| zeroplug key | filled with | from |", "| --- | --- | --- |"]
    for target, (value, source) in AUTO.items():
        shown = {KEEP: "`\"auto\"` (zeroplug resolves it)", HIDDEN: "a number from the model"}.get(
            value) if isinstance(value, str) else f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"
        out.append(f"| `{target}` | {shown} | {source} |")
    out += ["", "The hidden size is the model's `config.hidden_size` (or the largest of `hidden_sizes`; "
            "the text config's for multimodal models), as the Hugging Face integration reads it; for a "
            "model without such a config the ZeRO stage uses its widest layer at setup. The stage-3 sizes "
            "are filled at stage 3 only.", "",
            "## Combinations refused", "",
            "Each names both keys and the fix:", "",
            "* `fp16.enabled` and `bf16.enabled` both true (DeepSpeed refuses it too);",
            "* `offload_*.device = \"nvme\"` without `offload_*.nvme_path`;",
            "* `train_batch_size` that is not `train_micro_batch_size_per_gpu` x "
            "`gradient_accumulation_steps` x world size (or not a multiple of the one given);",
            "* `zero_optimization.cpu_offload` together with `offload_optimizer` (and the same for "
            "`cpu_offload_param` / `offload_param`).", ""]
    return "\n".join(out)


#: Where DeepSpeed picks a strategy with a key of the table (zero_optimization.stage, offload's
#: device, optimizer's type), a zeroplug slot picks its plugin by name: the key, and the
#: plugin name its value becomes.
SELECTOR_KEYS = {"zero": ("stage", "stage{}"), "offload.optimizer": ("device", "{}"),
                 "offload.param": ("device", "{}"), "optimizer": ("type", "{}")}


def selector_key_error(path: str, slot: str, table: dict) -> None:
    """A ConfigError naming the plugin to pick when a zeroplug slot table holds DeepSpeed's
    selector key (``[zero] stage = 2``), instead of a bare "unknown key"."""
    if path in SELECTOR_KEYS and SELECTOR_KEYS[path][0] in table:
        key, plugin = SELECTOR_KEYS[path]
        value = plugin.format(str(table[key]).lower())
        raise ConfigError(f"unknown key {path}.{key}: zeroplug picks the {slot} plugin by name, "
                          f"[{path}] plugin = \"{value}\" (DeepSpeed's \"{key}\"); a DeepSpeed JSON "
                          f"config is also accepted as it is", key=f"{path}.{key}")
