"""The engine ``deepspeed.initialize`` returns: an ``nn.Module`` around zeroplug's Engine with
DeepSpeedEngine's attributes and methods (docs/deepspeed-api.md lists them)."""
from __future__ import annotations

import logging
import os
import warnings

import torch

from zeroplug.checkpoint.deepspeed_files import SCHEDULER_KEY
from zeroplug.engine import Engine
from zeroplug.launch import local_rank

from .optimizer import EngineOptimizer

log = logging.getLogger("zeroplug")


class DeepSpeedEngine(torch.nn.Module):
    """The model as a child module (``module``); training through zeroplug's :class:`Engine`
    (``zeroplug_engine``). An attribute neither has falls through to the model, as with
    DeepSpeed (``engine.config`` of a Hugging Face model is the model's config)."""

    def __init__(self, engine: Engine, client_scheduler=None):
        super().__init__()
        self.module = engine.module
        self.__dict__["zeroplug_engine"] = engine
        self.__dict__["client_lr_scheduler"] = client_scheduler
        self.__dict__["engine_optimizer"] = EngineOptimizer(engine)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        module = modules.get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__} (and its module {type(module).__name__}) has no "
                             f"attribute {name!r}")

    # -- the step -----------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self.zeroplug_engine(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """``loss`` / accumulation steps, backward (``retain_graph``: keep the graph)."""
        self.zeroplug_engine.backward(loss, retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs=None) -> None:
        """The optimizer step at the accumulation boundary (a no-op before it); the script's LR
        scheduler steps after a step that was applied (not skipped for overflow)."""
        e = self.zeroplug_engine
        taken = e.lr_step
        e.step()
        if e.lr_step > taken:
            self.optimizer.stepped()
        if self.client_lr_scheduler is not None and e.lr_step > taken:
            with warnings.catch_warnings():
                # Note: the script's optimizer is never stepped itself (the engine's is), which
                # torch's schedulers would take for a step() called in the wrong order
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step",
                                        category=UserWarning)
                self.client_lr_scheduler.step(**(lr_kwargs or {}))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zeroplug_engine.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.zeroplug_engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the weights (False after an fp16 overflow)."""
        m = getattr(self.zeroplug_engine, "last_metrics", None)
        return bool(m) and not m.get("skipped", False)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping)."""
        m = getattr(self.zeroplug_engine, "last_metrics", None)
        return None if not m else m.get("grad_norm")

    def get_lr(self) -> list[float]:
        return self.zeroplug_engine.get_lr()

    # -- what DeepSpeed's engine reports ------------------------------------------------------
    @property
    def optimizer(self) -> EngineOptimizer:
        return self.__dict__["engine_optimizer"]

    @property
    def lr_scheduler(self):
        return self.client_lr_scheduler

    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def device(self) -> torch.device:
        return self.zeroplug_engine.run.device

    @property
    def global_rank(self) -> int:
        return self.zeroplug_engine.run.rank

    @property
    def world_size(self) -> int:
        return self.zeroplug_engine.run.world_size

    dp_world_size = world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def global_steps(self) -> int:
        return self.zeroplug_engine.global_step

    @property
    def global_samples(self) -> int:
        return self.zeroplug_engine.global_step * self.zeroplug_engine.train_batch_size

    @property
    def micro_steps(self) -> int:
        return self.zeroplug_engine.micro_step

    @property
    def skipped_steps(self) -> int:
        return self.zeroplug_engine.skipped_steps

    def train_batch_size(self) -> int:
        return self.zeroplug_engine.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.zeroplug_engine.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.zeroplug_engine.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.zeroplug_engine.config.batch.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.zeroplug_engine.partitioner.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_offload_optimizer(self) -> bool:
        return self.zeroplug_engine.offload_optimizer.capabilities.offloaded

    def zero_offload_param(self) -> bool:
        return self.zeroplug_engine.offload_param.capabilities.offloaded

    def fp16_enabled(self) -> bool:
        return self.zeroplug_engine.config.slot("precision").name == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.zeroplug_engine.config.slot("precision").name == "bf16"

    bf16_enabled = bfloat16_enabled

    def steps_per_print(self) -> int:
        return self.zeroplug_engine.config.batch.steps_per_print

    # -- weights and checkpoints ------------------------------------------------------------
    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        return self.zeroplug_engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Every rank calls it; the script's LR scheduler's state travels in the checkpoint."""
        state = dict(client_state or {})
        if self.client_lr_scheduler is not None and hasattr(self.client_lr_scheduler, "state_dict"):
            state[SCHEDULER_KEY] = _plain(self.client_lr_scheduler.state_dict())
        self.zeroplug_engine.save_checkpoint(save_dir, tag, state, save_latest)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """``(path, client_state)``; ``(None, None)`` with a warning when ``load_dir`` holds no
        checkpoint (no ``latest`` file and no ``tag``), as DeepSpeed returns."""
        if custom_load_fn is not None:
            from zeroplug.errors import ConfigError
            raise ConfigError("load_checkpoint(custom_load_fn=...) is not supported: zeroplug loads its own "
                              "checkpoint format; leave it out", key="custom_load_fn")
        if not load_module_strict:
            log.warning("[zeroplug] load_checkpoint(load_module_strict=False): zeroplug checkpoints hold "
                        "every parameter of the model they were saved from; loading is strict")
        if not _has_checkpoint(load_dir, tag):
            log.warning("[zeroplug] load_checkpoint: no checkpoint in %s%s; nothing loaded", load_dir,
                        f" (tag {tag!r})" if tag is not None else " (no 'latest' file)")
            return None, None
        path, client_state = self.zeroplug_engine.load_checkpoint(
            load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
        client_state = dict(client_state or {})
        saved = client_state.pop(SCHEDULER_KEY, None)
        if (saved is not None and self.client_lr_scheduler is not None and load_lr_scheduler_states
                and not load_module_only):
            sched = self.client_lr_scheduler
            sched.load_state_dict(saved)
            # Note: torch's schedulers write the optimizer's lr in step() only; the restored one
            # is their last lr
            if hasattr(sched, "get_last_lr") and getattr(sched, "optimizer", None) is not None:
                for g, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                    g["lr"] = lr
            self.zeroplug_engine.use_schedule(self.zeroplug_engine.scheduler)
        return path, client_state

    def gathered_parameters(self, params=None, modifier_rank=None):
        return self.zeroplug_engine.gathered_parameters(params, modifier_rank)

    def consolidated_state_dict(self):
        return self.zeroplug_engine.consolidated_state_dict()

    def destroy(self) -> None:
        self.zeroplug_engine.close()

    def close(self) -> None:
        self.zeroplug_engine.close()


def _has_checkpoint(load_dir, tag) -> bool:
    if tag is not None:
        return os.path.isdir(os.path.join(load_dir, str(tag)))
    return os.path.isfile(os.path.join(load_dir, "latest"))


def _plain(obj):
    """A scheduler's state_dict as plain values (tensors to lists: the checkpoint's
    client_state holds plain Python values)."""
    if torch.is_tensor(obj):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj
