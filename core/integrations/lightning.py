"""``ZeroplugStrategy``: Lightning's ``Trainer`` training with the zeroplug engine.

::

    from zeroplug.integrations.lightning import ZeroplugStrategy
    trainer = L.Trainer(strategy=ZeroplugStrategy("zero.toml"), devices=2, ...)
    trainer.fit(lit_module)

    import zeroplug.integrations.lightning      # registers the strategy names
    trainer = L.Trainer(strategy="zeroplug_stage_3", ...)   # was "deepspeed_stage_3"

Lightning's ``deepspeed``, ``deepspeed_stage_1`` ... ``deepspeed_stage_3_offload`` names have
``zeroplug`` counterparts (:data:`STRATEGY_NAMES`), registered when this module is imported.

The LightningModule stays as users write it: ``training_step`` returns the loss,
``configure_optimizers`` returns a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` (with its
parameter groups) and optionally a scheduler. The engine computes that optimizer's update
over its own shards (``adamw``, ``adam``, ``sgd``); the scheduler keeps writing the
optimizer's learning rate and the engine reads it each step. Gradient accumulation
(``accumulate_grad_batches``), clipping (``gradient_clip_val``) and precision
(``precision="bf16-mixed"`` ...) map to the engine's; a value given both there and in the
zeroplug config and different is refused with both names. Stage 3 builds the layers of
``configure_model`` already sharded (``zeroplug.init``).

A Lightning checkpoint (``ModelCheckpoint``, ``trainer.save_checkpoint``) is a folder:
``zeroplug/`` holds the engine's sharded checkpoint, ``lightning.ckpt`` the loops, callbacks,
optimizer hyper-parameters and schedulers; ``fit(ckpt_path=...)`` continues exactly.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as exc:      # pragma: no cover - exercised without the extra installed
    raise ImportError("zeroplug.integrations.lightning needs Lightning: pip install 'zeroplug[lightning]'") from exc

import zeroplug
from zeroplug.errors import ConfigError

from .host import (Given, backward_and_step, build_engine, load_raw, optimizer_givens, reconcile,
                   load_engine_checkpoint, save_engine_checkpoint, scheduled_lr, torch_optimizer_spec)

#: inside a checkpoint folder: the engine's checkpoint (a tag) and Lightning's own state
ENGINE_TAG = "zeroplug"
LIGHTNING_FILE = "lightning.ckpt"
#: Lightning precision -> zeroplug precision plugin ("32-true" is Lightning's default)
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16",
              "16-mixed": "fp16", "16-true": "fp16"}
SOURCE = "ZeroplugStrategy config"


class ZeroplugPrecision(Precision):
    """Lightning's precision slot when zeroplug trains: the engine holds the parameters in
    the configured dtype and scales the loss; backward and the optimizer step go to it."""

    def __init__(self, requested: str = "32-true"):
        if requested not in PRECISIONS:
            raise ConfigError(f"Trainer(precision={requested!r}): ZeroplugStrategy trains in "
                              f"{', '.join(PRECISIONS)}", key="precision")
        self.precision = requested
        self.param_dtype = torch.float32        # set once the engine exists

    def convert_input(self, data):
        if self.param_dtype == torch.float32:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def cast(t):
            return t.to(self.param_dtype) if torch.is_floating_point(t) else t
        return apply_to_collection(data, torch.Tensor, cast)

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Note: in automatic optimization Lightning already divided the loss by
        # accumulate_grad_batches; the engine steps at the window's last micro-batch.
        engine = model.trainer.strategy.engine
        backward_and_step(engine, tensor)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Run the closure (training_step and backward, which steps the engine); the
        optimizer of configure_optimizers is never stepped itself."""
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ConfigError("training_step returned None: ZeroplugStrategy needs a loss on every step "
                              "(each rank runs the same collectives)")
        # Note: torch's schedulers warn once when their optimizer's step() never ran; the
        # engine took that step.
        optimizer._opt_called = True
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        """Nothing: the engine clips by the global norm (batch.gradient_clipping)."""


class _EngineModule(torch.nn.Module):
    """Lightning's ``trainer.model``: the LightningModule, called through the engine."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)      # not a submodule

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)


class ZeroplugStrategy(DDPStrategy):
    """Train with zeroplug on one or several devices (one process each: Lightning's
    launcher or torchrun). ``config``: a TOML or DeepSpeed JSON path, a dict in either
    layout, a :class:`zeroplug.Config`, or None (zeroplug's defaults). After ``fit`` the
    engine stays alive for validate/test/predict and saving (``strategy.engine``)."""

    strategy_name = "zeroplug"

    def __init__(self, config=None, *, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend=None, timeout=None,
                 start_method="popen"):
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **kwargs)
        self._forward_redirection = _ForwardRedirection()
        self.zeroplug_config = config
        self.engine = None

    # -- precision: Lightning's choice, carried out by the engine ----------------------------
    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroplugPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None and not isinstance(plugin, ZeroplugPrecision):
            plugin = ZeroplugPrecision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    # -- the config -------------------------------------------------------------------------
    def _config(self, trainer, optimizer_spec=None) -> dict:
        requested = self.precision_plugin.precision
        host_precision = PRECISIONS[requested]
        raw = load_raw(self.zeroplug_config)
        given = [Given("batch.gradient_accumulation_steps", trainer.accumulate_grad_batches,
                       "Trainer(accumulate_grad_batches)")]
        if requested not in ("32-true", "32"):
            given.append(Given("precision.plugin", host_precision, f"Trainer(precision={requested!r})"))
        if trainer.gradient_clip_val is not None:
            if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
                raise ConfigError("Trainer(gradient_clip_algorithm=\"value\"): zeroplug clips by the global "
                                  "norm only; use \"norm\"", key="gradient_clip_algorithm")
            given.append(Given("batch.gradient_clipping", float(trainer.gradient_clip_val),
                               "Trainer(gradient_clip_val)"))
        if optimizer_spec is not None:
            plugin, options, _ = optimizer_spec
            given += optimizer_givens(plugin, options, "configure_optimizers")
        return reconcile(raw, given, SOURCE)

    @contextmanager
    def model_sharded_context(self):
        """``configure_model`` runs here: stage 3 builds each layer already sharded."""
        with zeroplug.init(self._config(self.lightning_module.trainer), device=self.root_device):
            yield

    # -- setup --------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        # Note: outside fit too, so that an engine built for validate() steps what fit() will
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ConfigError(f"configure_optimizers returned {len(optimizers)} optimizers; "
                              f"ZeroplugStrategy steps exactly one", key="configure_optimizers")
        optimizer = None if isinstance(optimizers[0], _MockOptimizer) else optimizers[0]   # None: the config's
        if trainer.state.fn == TrainerFn.FITTING:
            self.optimizers, self.lr_scheduler_configs = optimizers, schedulers
        if self.engine is None or self.engine.module is not module:
            spec = torch_optimizer_spec(optimizer, "configure_optimizers") if optimizer is not None else None
            raw = self._config(trainer, spec)
            if schedulers and "scheduler" in raw:
                raise ConfigError(f"{SOURCE} [scheduler] and the scheduler from configure_optimizers both "
                                  f"set the learning-rate schedule; keep one", key="scheduler.plugin")
            # Note: the optimizer's scheduler drives the lr; without one, the config's [scheduler]
            lr_source = None
            if spec is not None and "scheduler" not in raw:
                base_lr = raw["optimizer"]["lr"]
                lr_source = lambda: scheduled_lr(self._live_optimizer(optimizer), base_lr)  # noqa: E731
            self.engine = build_engine(module, raw, spec[2] if spec else None, lr_source, device=self.root_device)
            self.precision_plugin.param_dtype = self.engine.precision.param_dtype
        self.model = _EngineModule(self.engine)

    def _live_optimizer(self, fallback):
        """The optimizer that fit's scheduler writes (a later fit builds a new one)."""
        live = self.optimizers[0] if self.optimizers else None
        return fallback if live is None or isinstance(live, _MockOptimizer) else live

    def model_to_device(self) -> None:
        """Nothing: the engine places the parameters."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    def teardown(self) -> None:
        # Note: the engine's parameters stay where they are (no .cpu(): at stage 3 a
        # parameter is a placeholder, and below it is a view of the engine's buffers).
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints: a folder per checkpoint -------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict:
        return {}               # the weights are in the engine's checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroplugStrategy.save_checkpoint(storage_options=...) is not supported")
        path = self.broadcast(str(filepath))
        save_engine_checkpoint(self.engine, path, tag=ENGINE_TAG)
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
            self.checkpoint_io.save_checkpoint(rest, os.path.join(path, LIGHTNING_FILE))
        self.barrier("ZeroplugStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = self.broadcast(str(checkpoint_path))
        if not os.path.isdir(os.path.join(path, ENGINE_TAG)):
            raise ConfigError(f"{path} is not a ZeroplugStrategy checkpoint (no {ENGINE_TAG}/ folder in it)",
                              key="ckpt_path")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        load_engine_checkpoint(self.engine, path, tag=ENGINE_TAG, load_optimizer_states=fitting,
                               load_lr_scheduler_states=fitting, load_module_only=not fitting)
        return self.checkpoint_io.load_checkpoint(os.path.join(path, LIGHTNING_FILE), weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Nothing: load_checkpoint restored the weights into the engine."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``Trainer(strategy="zeroplug_stage_3")`` and the rest of :data:`STRATEGY_NAMES`."""
        for name, (description, config) in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=description, override=True, config=config)


def _named(stage: int, optimizer: bool = False, param: bool = False) -> dict:
    config = {"zero": {"plugin": f"stage{stage}"}}
    offload = {k: {"plugin": "cpu"} for k, on in (("optimizer", optimizer), ("param", param)) if on}
    return dict(config, offload=offload) if offload else config


#: Lightning's ``deepspeed_*`` strategy names with ``zeroplug`` in their place: name -> (description, config)
STRATEGY_NAMES = {
    "zeroplug": ("zeroplug with its default config (zero.toml)", None),
    "zeroplug_stage_1": ("zeroplug ZeRO stage 1", _named(1)),
    "zeroplug_stage_1_offload": ("zeroplug ZeRO stage 1, optimizer states on the CPU", _named(1, True)),
    "zeroplug_stage_2": ("zeroplug ZeRO stage 2", _named(2)),
    "zeroplug_stage_2_offload": ("zeroplug ZeRO stage 2, optimizer states on the CPU", _named(2, True)),
    "zeroplug_stage_3": ("zeroplug ZeRO stage 3", _named(3)),
    "zeroplug_stage_3_offload": ("zeroplug ZeRO stage 3, optimizer states and parameters on the CPU",
                                 _named(3, True, True)),
}

# Note: Lightning finds the strategies of its own modules only; importing this module registers ours.
ZeroplugStrategy.register_strategies(StrategyRegistry)


__all__ = ["ZeroplugStrategy", "ZeroplugPrecision", "STRATEGY_NAMES"]
