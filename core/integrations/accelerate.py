"""``Accelerator`` for accelerate scripts written for DeepSpeed, training with zeroplug.

The one-line change::

    from accelerate import Accelerator                       # before
    from zeroplug.integrations.accelerate import Accelerator # after

and the script runs as it did: ``accelerator.prepare(model, optimizer, dataloaders...,
scheduler)``, ``accelerator.backward(loss)``, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()``, ``accelerator.accumulate(model)``, ``unwrap_model``,
``get_state_dict``, ``save_state`` / ``load_state``. ``prepare`` wraps the model and its
optimizer in a zeroplug engine: the model it returns calls the engine, the optimizer's
``step()`` is ``engine.step()``. Launch it with torchrun (or ``zeroplug launch``).

The config: ``Accelerator(zeroplug_config=...)`` (a TOML or DeepSpeed JSON path, or a dict),
or else the DeepSpeed config that ``accelerate launch --use_deepspeed`` passes
(``ACCELERATE_DEEPSPEED_CONFIG_FILE``, or ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` and the offload
devices), or a ``deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)``: DeepSpeed itself is not
needed. The optimizer: a torch ``AdamW`` / ``Adam`` / ``SGD`` (mapped to zeroplug's, groups
and hyper-parameters kept) or accelerate's ``DummyOptim`` (the config's optimizer); the
schedule: any torch LR scheduler (it keeps writing the optimizer's lr and the engine reads
it) or ``DummyScheduler`` (the config's). ``mixed_precision``, ``gradient_accumulation_steps``
and the dataloader's batch size fill the config where it says "auto" or nothing; a value
set in both places and different is refused naming both.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from contextlib import contextmanager, nullcontext

import torch

try:
    import accelerate
    import accelerate.utils
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
except ImportError as exc:      # pragma: no cover - exercised without the extra installed
    raise ImportError("zeroplug.integrations.accelerate needs accelerate: pip install 'zeroplug[hf]'") from exc

# Note: accelerate.utils exports its DeepSpeed placeholders only where DeepSpeed is installed;
# scripts written for DeepSpeed import them from there (``from accelerate.utils import DummyOptim``).
for _name, _cls in (("DummyOptim", DummyOptim), ("DummyScheduler", DummyScheduler)):
    if not hasattr(accelerate.utils, _name):
        setattr(accelerate.utils, _name, _cls)

from zeroplug.errors import ConfigError

from .host import (Given, HostOptimizer, build_engine, drop_auto_schedule, load_raw, load_engine_checkpoint,
                   optimizer_givens, reconcile, save_engine_checkpoint, scheduled_lr, torch_optimizer_spec)

log = logging.getLogger("zeroplug")

PRECISIONS = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
ENGINE_TAG = "zeroplug"
_ENV_FLAG = "ACCELERATE_USE_DEEPSPEED"


def _config_from_env() -> dict | str | None:
    """The DeepSpeed config ``accelerate launch --use_deepspeed`` describes in the environment."""
    if os.environ.get(_ENV_FLAG, "false").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "").strip()
    if path and path.lower() != "none":
        return path
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    ds = {"zero_optimization": {"stage": int(stage) if stage else 2}}
    for key, env in (("offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                     ("offload_param", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
        device = os.environ.get(env, "none").lower()
        if device not in ("", "none"):
            ds["zero_optimization"][key] = {"device": device}
    return ds


class PreparedModel(torch.nn.Module):
    """What ``prepare`` returns for the model: calls go through the engine (stage 3 gathers
    and prefetches), attributes come from the model (``config``, ``generate``...)."""

    def __init__(self, engine):
        super().__init__()
        self.__dict__["engine"] = engine        # not a submodule: the engine owns the model

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True):
        self.engine.train(mode)
        return self

    def no_sync(self):
        """The engine reduces gradients at its own boundaries (``gradient_accumulation_steps``)."""
        return nullcontext()

    def __getattr__(self, name):
        if name == "engine":
            return self.__dict__["engine"]
        return getattr(self.__dict__["engine"].module, name)


class PreparedOptimizer(HostOptimizer):
    """What ``prepare`` returns for the optimizer: ``step()`` is ``engine.step()`` (an optimizer
    step at the end of each accumulation window); ``zero_grad()`` does nothing (the engine
    zeroes its gradients); ``param_groups`` carry the scheduled learning rates."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.engine.step()
        return loss


class PreparedScheduler:
    """The user's torch scheduler, stepping the original optimizer's learning rates (which
    the engine reads); its warning that the original optimizer never stepped is silenced."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` trains the model with zeroplug (see the
    module docstring). ``zeroplug_config``: a TOML or DeepSpeed JSON path, or a dict."""

    def __init__(self, *args, zeroplug_config=None, deepspeed_plugin=None, deepspeed_plugins=None, **kwargs):
        plugin = deepspeed_plugin or deepspeed_plugins
        if isinstance(plugin, dict):
            plugin = next(iter(plugin.values()), None)
        if zeroplug_config is None and plugin is not None:
            zeroplug_config = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
        if zeroplug_config is None:
            zeroplug_config = _config_from_env()
        # Note: accelerate would ask for DeepSpeed when the launcher set this; zeroplug trains instead.
        os.environ.pop(_ENV_FLAG, None)
        super().__init__(*args, **kwargs)
        self.zeroplug_config = zeroplug_config
        self.engine = None
        self._model = None
        self._warned_clip = False

    # -- prepare ----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        models = [a for a in args if isinstance(a, torch.nn.Module) and not isinstance(a, PreparedModel)]
        if not models:
            return super().prepare(*args, device_placement=device_placement)
        if len(models) > 1 or self.engine is not None:
            raise ConfigError("zeroplug's Accelerator prepares one model (with its optimizer), once")
        optimizers = [a for a in args if isinstance(a, (torch.optim.Optimizer, DummyOptim))]
        schedulers = [a for a in args if isinstance(a, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))]
        rest = [a for a in args if not any(a is x for x in models + optimizers + schedulers)]
        prepared_rest = super().prepare(*rest, device_placement=device_placement) if rest else ()
        if len(rest) == 1:
            prepared_rest = (prepared_rest,)
        loaders = [a for a in prepared_rest if isinstance(a, torch.utils.data.DataLoader)]
        model, opt = self._build(models[0], optimizers[0] if optimizers else None,
                                 schedulers[0] if schedulers else None, loaders)
        out, it = [], iter(prepared_rest)
        for a in args:
            if a is models[0]:
                out.append(model)
            elif optimizers and a is optimizers[0]:
                out.append(opt)
            elif schedulers and a is schedulers[0]:
                out.append(PreparedScheduler(a) if isinstance(a, torch.optim.lr_scheduler.LRScheduler) else a)
            else:
                out.append(next(it))
        return out[0] if len(out) == 1 else tuple(out)

    def _build(self, module, optimizer, scheduler, loaders):
        raw = load_raw(self.zeroplug_config)
        if str(self.mixed_precision) not in PRECISIONS:
            raise ConfigError(f"Accelerator(mixed_precision={str(self.mixed_precision)!r}): zeroplug trains in "
                              f"{', '.join(sorted(PRECISIONS))}", key="mixed_precision")
        given = [Given("precision.plugin", PRECISIONS[str(self.mixed_precision)],
                       f"Accelerator(mixed_precision={str(self.mixed_precision)!r})"),
                 Given("batch.gradient_accumulation_steps", self.gradient_accumulation_steps,
                       "Accelerator(gradient_accumulation_steps)")]
        if loaders and loaders[0].batch_size:
            given.append(Given("batch.micro_batch_size", loaders[0].batch_size, "the prepared DataLoader's batch_size"))
        groups, lr_source = None, None
        if isinstance(optimizer, torch.optim.Optimizer):
            plugin, options, groups = torch_optimizer_spec(optimizer, "the optimizer passed to prepare()")
            given += optimizer_givens(plugin, options, type(optimizer).__name__)
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                raw = drop_auto_schedule(raw, f"the scheduler passed to prepare() ({type(scheduler).__name__})")
                base = float(options["lr"])
                lr_source = lambda: scheduled_lr(optimizer, base)       # noqa: E731
        elif isinstance(optimizer, DummyOptim):
            params = list(optimizer.params)
            groups = params if params and isinstance(params[0], dict) else [{"params": params}]
            given += [Given("optimizer.lr", optimizer.lr, "DummyOptim(lr)"),
                      Given("optimizer.weight_decay", optimizer.weight_decay, "DummyOptim(weight_decay)")]
        if isinstance(scheduler, DummyScheduler):
            table = raw.get("scheduler") or {}
            for key, value in (("total_num_steps", scheduler.total_num_steps),
                               ("warmup_num_steps", scheduler.warmup_num_steps)):
                if value is not None and key in table:
                    given.append(Given(f"scheduler.{key}", value, f"DummyScheduler({key})"))
        raw = reconcile(raw, given, "the zeroplug / DeepSpeed config")
        self.engine = build_engine(module, raw, groups, lr_source, device=self.device)
        self._model = PreparedModel(self.engine)
        host_groups = groups if groups is not None else [{"params": list(module.parameters())}]
        lr = float(raw.get("optimizer", {}).get("lr", 1e-3)) if not isinstance(optimizer, torch.optim.Optimizer) \
            else float(options["lr"])
        opt = PreparedOptimizer(self.engine, [dict(g, lr=g.get("lr", lr)) for g in host_groups])
        return self._model, opt

    # -- the loop ---------------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        if self.engine is None:
            return super().backward(loss, **kwargs)
        self.engine.backward(loss)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clips at its step by ``batch.gradient_clipping`` (as DeepSpeed does by
        its config); a different ``max_norm`` is reported once. Returns None, as under DeepSpeed."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        clip = float(self.engine.config.batch.gradient_clipping)
        if clip != float(max_norm) and not self._warned_clip:
            self._warned_clip = True
            log.warning("[zeroplug] clip_grad_norm_(max_norm=%s): the engine clips by batch.gradient_clipping = "
                        "%s at each step; set that in the config to change it", max_norm, clip)
        return None

    @contextmanager
    def accumulate(self, *models):
        with super().accumulate(*[m for m in models if not isinstance(m, PreparedModel)]):
            yield

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, PreparedModel):
            return model.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        """The whole model-dtype state dict on rank 0 (None elsewhere); every rank calls it."""
        if isinstance(model, PreparedModel) or (self.engine is not None and model is self.engine.module):
            return self.engine.consolidated_state_dict()
        return super().get_state_dict(model, unwrap)

    def save_state(self, output_dir: str | None = None, **kwargs):
        if self.engine is None:
            return super().save_state(output_dir, **kwargs)
        out = output_dir or os.path.join(self.project_dir or ".", "checkpoint")
        save_engine_checkpoint(self.engine, out, tag=ENGINE_TAG)
        if self.is_main_process:
            with open(os.path.join(out, "accelerate_state.json"), "w") as f:
                json.dump({"step": self.step}, f)
        return out

    def load_state(self, input_dir: str | None = None, **kwargs):
        if self.engine is None:
            return super().load_state(input_dir, **kwargs)
        load_engine_checkpoint(self.engine, input_dir, tag=ENGINE_TAG)
        meta = os.path.join(input_dir, "accelerate_state.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                self.step = int(json.load(f).get("step", 0))


__all__ = ["Accelerator", "PreparedModel", "PreparedOptimizer"]
