"""Options of the ``[zero]`` table, shared by the stage plugins (DeepSpeed's names)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug.options import AUTO, opt

STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
               "stage3_param_persistence_threshold", "stage3_low_precision_shards",
               "stage3_gather_16bit_weights_on_model_save", "stage3_leaf_modules", "stage3_auto_leaf_modules",
               "stage3_block_units", "stage3_params_from_masters")


@dataclass(frozen=True)
class ZeroOptions:
    reduce_bucket_size: int | Literal["auto"] = opt(
        AUTO, "Elements per gradient bucket reduced at a time during backward (stages 0-2: "
              "parameters are laid out, reduced and their fp32 gradients allocated in buckets of "
              "this size, or smaller where the optimizer's offload tier takes less at a time: 1e8 for "
              "cpu); \"auto\" = hidden_size^2.", min=1)
    allgather_bucket_size: int = opt(5e8, "Elements all-gathered at a time when publishing updated "
                                          "parameters (stages 1-2).", min=1)
    overlap_comm: bool = opt(True, "Launch each bucket's reduction as soon as it fills, overlapping "
                                   "backward; false waits for each reduction before going on.")
    reduce_scatter: bool = opt(True, "Stage 2-3: reduce-scatter gradients into shards; false "
                                     "all-reduces them and keeps this rank's part.")
    contiguous_gradients: bool = opt(True, "Copy gradients into a contiguous bucket as they are "
                                           "produced (always on: kept for DeepSpeed configs).")
    sub_group_size: int = opt(1e9, "Elements of a rank's shard stepped (and offloaded) at a time, or fewer "
                                   "where the offload tier takes less at a time (1e8 for cpu).", min=1)
    shard_group_size: int = opt(
        0, "Stages 1-3: shard the states within groups of this many consecutive ranks and replicate "
           "them across the groups (HSDP; DeepSpeed's mics_shard_size): parameter all-gathers stay "
           "within a group, gradients are reduce-scattered within it and all-reduced across groups; "
           "set it to the GPUs per host (torchrun's --nproc-per-node) on several hosts. 0 = one group "
           "of every rank; it must divide the world size.", min=0)
    zero_hpz_partition_size: int = opt(
        1, "Stage 3: ZeRO++ hpZ (DeepSpeed's name and meaning): optimizer states, masters and gradients "
           "stay sharded across every rank, and each group of this many consecutive ranks also keeps a "
           "model-dtype copy of the parameters sharded among its ranks (1 / size of them per rank), filled "
           "by the first all-gather after each step (across every rank): every later gather until the next "
           "step (the backward's) stays within the group. 1 = off; it must divide the world size; not "
           "with shard_group_size or offloading.", min=1)
    stage3_prefetch_bucket_size: int | Literal["auto"] = opt(
        AUTO, "Stage 3: elements gathered ahead of use, following the recorded order; "
              "\"auto\" = 0.9 x hidden_size^2.", min=0)
    stage3_max_live_parameters: int = opt(1e9, "Stage 3: most gathered elements kept live before "
                                               "prefetching stops.", min=0)
    stage3_max_reuse_distance: int = opt(1e8, "Stage 3: keep a gathered module if it is used again "
                                              "within this many elements of execution, the backward "
                                              "included (the tail of the forward stays gathered for "
                                              "the backward that starts with it). DeepSpeed's default "
                                              "is 1e9; 1e8 measured as fast at less memory "
                                              "(docs/benchmarks.md).", min=0)
    stage3_param_persistence_threshold: int | Literal["auto"] = opt(
        AUTO, "Stage 3: modules with fewer parameter elements stay whole on every rank; "
              "\"auto\" = 10 x hidden_size.", min=0)
    stage3_low_precision_shards: bool = opt(
        False, "Stage 3: keep a model-dtype copy of each parameter shard beside its fp32 master "
               "(2 bytes per element / world; on one rank, the whole model kept gathered, no hooks), "
               "gathered without a cast; false gathers the fp32 master, cast into the gather buffer "
               "(on one rank a cast on the compute stream: nothing prefetched or kept for reuse).")
    stage3_params_from_masters: bool = opt(
        False, "Stage 3 with offload.param and offload.optimizer in host memory (\"cpu\", without "
               "delayed_update): keep no model-dtype copy of the trainable parameters on the host; a gather "
               "uploads the unit's fp32 master (4 bytes per element instead of 2) and casts it on the GPU, and "
               "the CPU step writes no model-dtype copy. 2 bytes less host memory per parameter; the same values "
               "(the cast rounds as the step's copy does) where cpu_adam runs one kernel (its eager or its compiled "
               "one: with both, units under 64K elements that the param tier's path steps eagerly are stepped by "
               "the compiled kernel here, which rounds the last bits differently). The GPU lane (gpu_step_ratio) "
               "is not used. false: model-dtype shards in the param tier.")
    stage3_leaf_modules: tuple[str, ...] = opt(
        (), "Stage 3: class names (or dotted package.module.Class paths) of leaf modules, gathered as "
            "one unit with every module inside them in the leaf's own forward, on every rank (a "
            "mixture-of-experts block whose experts run only when tokens route to them); as "
            "zeroplug.set_leaf_modules(model, [cls]) and DeepSpeed's set_z3_leaf_modules.")
    stage3_auto_leaf_modules: bool = opt(
        True, "Stage 3: a module holding a ModuleList or ModuleDict named like 'experts' is a leaf "
              "module (see stage3_leaf_modules), and such a list held by the model itself is gathered "
              "whole with the model's own forward; false gathers each expert on its own, and ranks that "
              "route tokens to different experts then stop with an error that names them "
              "([faults] check_paths).")
    stage3_block_units: bool = opt(
        True, "Stage 3: each repeated block of the model (an entry of a ModuleList or Sequential of "
              "modules of one class, as transformer layers are; the innermost where they nest) is one "
              "unit, gathered with one all-gather before its forward and reduced with one reduce-scatter, "
              "as FSDP2 wraps each block; false gathers each module on its own (DeepSpeed's granularity). "
              "A block's parameters are then used only inside its forward (see stage3_leaf_modules).")
    stage3_gather_16bit_weights_on_model_save: bool = opt(
        True, "Stage 3: save_16bit_model() gathers the full weights; false refuses (weights are sharded).")


def hidden_size(module: torch.nn.Module) -> int:
    """The model's hidden size as DeepSpeed's "auto" values mean it: the largest input width."""
    h = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            h = max(h, min(m.in_features, m.out_features))
        elif isinstance(m, torch.nn.Embedding):
            h = max(h, m.embedding_dim)
    return h or 1024


def bucket_elements(options: ZeroOptions, hidden: int, granularity: int | None) -> int:
    """Elements per gradient bucket (stages 0-2): ``reduce_bucket_size`` ("auto" = hidden^2),
    at most the optimizer tier's granularity, since a bucket is what the tier receives
    gradients in (see ``TierCapabilities``)."""
    size = hidden * hidden if options.reduce_bucket_size == "auto" else int(options.reduce_bucket_size)
    if granularity and granularity < size:
        logging.getLogger("zeroplug").info(
            "zero: gradient buckets of %d elements (reduce_bucket_size %d; the optimizer's tier takes "
            "at most %d at a time)", granularity, size, granularity)
        return granularity
    return size


def check_stage_config(cls, config, choice) -> None:
    """The rules of a stage class (``cls.stage``, ``cls.shard_params``) on the whole config."""

    from zeroplug.config import SLOT_TABLES
    from zeroplug.errors import ConfigError
    # Note: these are rules of the partitioner, whichever tier holds the parameters
    param = config.slot("offload.param").name
    nothing = SLOT_TABLES["offload.param"][1]       # the slot's default: nothing offloaded
    if param != nothing and not cls.shard_params:
        raise ConfigError(f"offload.param.plugin = \"{param}\" needs zero.plugin = \"stage3\" (only stage 3 "
                          "shards parameters); offload the optimizer with [offload.optimizer] instead",
                          key="offload.param.plugin")
    if param != nothing and config.slot("offload.optimizer").name == nothing:
        raise ConfigError(f"offload.param.plugin = \"{param}\" needs the optimizer offloaded too: add "
                          f"[offload.optimizer] plugin = \"{param}\" (the fp32 masters update the "
                          "offloaded shards)", key="offload.param.plugin")
    if cls.stage < 3 and config.raw.get("zero", {}).get("zero_hpz_partition_size", 1) != 1:
        logging.getLogger("zeroplug").warning(
            "[zeroplug] zero.zero_hpz_partition_size applies to stage 3 only; %s ignores it", choice.name)
    if cls.stage == 0 and config.raw.get("zero", {}).get("shard_group_size"):
        logging.getLogger("zeroplug").warning(
            "[zeroplug] zero.shard_group_size applies to stages 1-3; stage0 shards nothing and ignores it")
    if cls.stage < 3:
        given = [k for k in config.raw.get("zero", {}) if k.startswith("stage3_")]
        if given:
            logging.getLogger("zeroplug").warning(
                "[zeroplug] zero.%s applies to stage 3 only; %s ignores it", given[0], choice.name)
