"""Writes checkpoints in DeepSpeed's on-disk layout (ZeRO stages 1-3) without DeepSpeed.

From a model (its parameters are the fp32 masters) and a stepped ``torch.optim.AdamW``
over its parameters, :func:`write_deepspeed_checkpoint` writes what DeepSpeed's
``engine.save_checkpoint`` writes for ``world`` ranks (the layout of
``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` ``state_dict()``, the model
states of ``engine._save_checkpoint``): flat fp32 partitions with DeepSpeed's alignment
padding (``2 * world`` elements at stages 1-2, per-parameter ``ceil(numel / world)`` parts at
stage 3), the torch optimizer's state over them, ``param_shapes``, the 16-bit module, the
counters, and the DeepSpeed objects DeepSpeed pickles (the stage enum, a loss scaler,
fragment addresses), pickled under DeepSpeed's module paths by stand-in classes that exist
only while the files are written.
"""
from __future__ import annotations

import enum
import math
import sys
import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler:
    def __init__(self, scale=1.0):
        self.cur_scale = scale
        self.dynamic = False
        self.dtype = torch.bfloat16


class DynamicLossScaler:
    def __init__(self, scale=2.0 ** 16):
        self.cur_scale = scale
        self.cur_iter = 7
        self.last_overflow_iter = 2
        self.scale_factor = 2.0
        self.scale_window = 1000
        self.min_scale = 1
        self.delayed_shift = 2
        self.cur_hysteresis = 2
        self.consecutive_hysteresis = False
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = torch.float16


@dataclass
class fragment_address:      # noqa: N801 - DeepSpeed's name
    numel: int
    start: int


_CLASSES = {"deepspeed.runtime.zero.config": [ZeroStageEnum],
            "deepspeed.runtime.fp16.loss_scaler": [LossScaler, DynamicLossScaler],
            "deepspeed.utils.tensor_fragment": [fragment_address]}


@contextmanager
def deepspeed_names():
    """The stand-in classes importable under DeepSpeed's module paths, for pickling only."""
    added = []
    try:
        for mod, classes in _CLASSES.items():
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    sys.modules[name] = types.ModuleType(name)
                    added.append(name)
            for cls in classes:
                cls.__module__ = mod
                setattr(sys.modules[mod], cls.__name__, cls)
        yield
    finally:
        for name in added:
            del sys.modules[name]
        for classes in _CLASSES.values():
            for cls in classes:
                cls.__module__ = __name__


def _groups(opt):
    out = []
    for g in opt.param_groups:
        out.append({k: v for k, v in g.items() if k != "params"})
    return out


def write_deepspeed_checkpoint(save_dir, model: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: int,
                               world: int, *, dtype=torch.bfloat16, global_steps: int = 3, skipped_steps: int = 0,
                               tag: str | None = None, lr_scheduler: dict | None = None, client_state=None,
                               sub_group_size: int | None = None, fused_adam_step: bool = False,
                               elastic: bool = False, bf16_optimizer: bool = False, fp16_scaler: bool = False,
                               ds_version: str = "0.19.8") -> Path:
    """Write ``model`` (its fp32 values are the masters) and ``optimizer``'s AdamW state as
    DeepSpeed ZeRO ``stage`` on ``world`` ranks; returns the tag directory."""
    tag = tag or f"global_step{global_steps}"
    d = Path(save_dir) / tag
    d.mkdir(parents=True, exist_ok=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    first = {}
    shared = {}                 # DeepSpeed's shared_params: {alias: the name param_shapes uses}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[n] = first[id(p)]
        else:
            first[id(p)] = n
    state = optimizer.state
    hp = _groups(optimizer)[0]

    def opt_state(p):
        st = state[p]
        return st["exp_avg"].detach().float().reshape(-1), st["exp_avg_sq"].detach().float().reshape(-1), \
            float(st["step"])

    scaler = DynamicLossScaler() if fp16_scaler else LossScaler()
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                 "bf16": {"enabled": dtype == torch.bfloat16}}
    module = OrderedDict()
    for k, v in model.state_dict().items():
        is_param = any(k == n for n, _ in named) or k in shared
        if is_param and stage == 3:
            module[k] = torch.empty(0, dtype=dtype)
        else:
            module[k] = v.detach().to(dtype) if v.is_floating_point() else v.detach().clone()
    buffer_names = [n for n, _ in model.named_buffers()]

    with deepspeed_names():
        if stage in (1, 2):
            names = [n for n, _ in named]
            shapes = [OrderedDict((n, p.shape) for n, p in named)]
            total = sum(p.numel() for _, p in named)
            align = 2 * world
            padded = -(-total // align) * align
            part = padded // world

            def flat(tensors):
                f = torch.zeros(padded, dtype=torch.float32)
                f[:total] = torch.cat(tensors)
                return f

            masters = flat([p.detach().float().reshape(-1) for _, p in named])
            m = flat([opt_state(p)[0] for _, p in named])
            v = flat([opt_state(p)[1] for _, p in named])
            step = opt_state(named[0][1])[2]
            mapping = OrderedDict()
            o = 0
            for n, p in named:
                mapping[n] = fragment_address(numel=p.numel(), start=o)
                o += p.numel()
            for r in range(world):
                sl = slice(r * part, (r + 1) * part)
                left = r * part
                pad = part if total <= left else max(0, left + part - total)
                fp32 = masters[sl].clone()
                st = {"exp_avg": m[sl].clone(), "exp_avg_sq": v[sl].clone()}
                if fused_adam_step:
                    st["step"] = int(step)
                else:
                    st["step"] = torch.tensor(step)
                group = dict(hp, params=[0])
                if fused_adam_step:
                    group["step"] = int(step)
                if bf16_optimizer:
                    osd = {"clip_grad": 1.0, "base_optimizer_state": {"state": {0: st}, "param_groups": [group]},
                           "single_partition_of_fp32_groups": [fp32], "group_paddings": [pad],
                           "partition_count": [world], "ds_version": ds_version,
                           "param_slice_mappings": [mapping]}
                else:
                    if elastic:
                        base = [{k: (t[:part - pad] if torch.is_tensor(t) and t.dim() else t) for k, t in st.items()
                                 if k != "step"}]
                    else:
                        base = {"state": {0: st}, "param_groups": [group]}
                    osd = {"loss_scaler": scaler, "dynamic_loss_scale": fp16_scaler, "overflow": False,
                           "clip_grad": 1.0, "base_optimizer_state": base,
                           "single_partition_of_fp32_groups": [fp32[:part - pad]],
                           "zero_stage": ZeroStageEnum.gradients if stage == 2 else ZeroStageEnum.optimizer_states,
                           "group_paddings": [pad], "partition_count": [world], "ds_version": ds_version,
                           "param_slice_mappings": [mapping]}
                    if elastic:
                        osd["base_optimizer_state_step"] = int(step)
                prefix = "bf16_" if bf16_optimizer else ""
                torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version},
                           d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            model_files = [d / "mp_rank_00_model_states.pt"]
            assert names
        else:
            # sub-groups: consecutive parameters up to sub_group_size elements (DeepSpeed's rule)
            limit = sub_group_size or 10**12
            subs, cur, size = [], [], 0
            for n, p in named:
                if cur and size + p.numel() > limit:
                    subs.append(cur)
                    cur, size = [], 0
                cur.append((n, p))
                size += p.numel()
            subs.append(cur)
            shapes = [OrderedDict((n, p.shape) for n, p in s) for s in subs]

            def part_of(t, r):
                n = t.numel()
                ps = -(-n // world)
                f = torch.zeros(ps * world, dtype=torch.float32)
                f[:n] = t
                return f[r * ps:(r + 1) * ps]

            for r in range(world):
                flats, st = [], {}
                for k, s in enumerate(subs):
                    flats.append(torch.cat([part_of(p.detach().float().reshape(-1), r) for _, p in s]))
                    e = {"exp_avg": torch.cat([part_of(opt_state(p)[0], r) for _, p in s]),
                         "exp_avg_sq": torch.cat([part_of(opt_state(p)[1], r) for _, p in s])}
                    step = opt_state(s[0][1])[2]
                    e["step"] = int(step) if fused_adam_step else torch.tensor(step)
                    st[k] = e
                osd = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler,
                       "dynamic_loss_scale": fp16_scaler, "overflow": False, "partition_count": world,
                       "optimizer_state_dict": {"state": st,
                                                "param_groups": [dict(hp, params=list(range(len(subs))))]},
                       "fp32_flat_groups": flats}
                torch.save({"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version},
                           d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            model_files = [d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]

        ms = {"module": module, "buffer_names": buffer_names, "optimizer": None, "param_shapes": shapes,
              "frozen_param_shapes": None, "shared_params": shared, "frozen_param_fragments": None,
              "lr_scheduler": lr_scheduler, "data_sampler": None, "random_ltd": None,
              "sparse_tensor_module_names": set(), "skipped_steps": skipped_steps, "global_steps": global_steps,
              "global_samples": global_steps * 2 * world, "dp_world_size": world, "mp_world_size": 1,
              "ds_config": ds_config, "ds_version": ds_version}
        ms.update(client_state or {})
        for f in model_files:
            torch.save(ms, f)
    (Path(save_dir) / "latest").write_text(tag)
    return d


def padded_numel(total: int, world: int) -> int:
    align = 2 * world
    return math.ceil(total / align) * align
