"""``ZeroplugTrainer``: the Hugging Face ``Trainer``, training with the zeroplug engine.

::

    from zeroplug.integrations.transformers import ZeroplugTrainer
    trainer = ZeroplugTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                              zeroplug_config="zero.toml")     # or a dict, or a DeepSpeed JSON
    trainer.train()

The Trainer keeps its loop: data, evaluation, logging, callbacks, checkpoint timing and
rotation, and the learning-rate schedule of ``TrainingArguments``. The engine does the rest:
parameters, gradients (reduced across ranks: no DDP wrapper), clipping and the optimizer
step. ``TrainingArguments`` is the one source of truth for what both can say (learning
rate, Adam's betas and epsilon, weight decay, batch size, accumulation, clipping,
precision): the zeroplug config may leave those out or ``"auto"``; a value given in both
places and different is refused with both names. An argument zeroplug cannot honour
(``deepspeed``, ``fsdp``, ``torch_compile``, ...) is refused when the Trainer is built.

A checkpoint folder holds what the plain Trainer writes (the model, ``trainer_state.json``,
``optimizer.pt`` and ``scheduler.pt`` of the schedule, RNG states) plus ``zeroplug/``: the
engine's sharded checkpoint (masters, optimizer states, counters), so
``train(resume_from_checkpoint=...)`` continues exactly and rotation removes it with its folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

try:
    import transformers
    from transformers import Trainer, TrainingArguments
except ImportError as exc:       # pragma: no cover - exercised without the extra installed
    raise ImportError("zeroplug.integrations.transformers needs transformers and accelerate: "
                      "pip install 'zeroplug[hf]'") from exc

from zeroplug.errors import ConfigError

from .host import (COMPATIBLE, Given, HostOptimizer, backward_and_step, build_engine, drop_auto_schedule,
                   load_engine_checkpoint, load_raw, reconcile, save_engine_checkpoint, scheduled_lr)

log = logging.getLogger("zeroplug")

#: where the engine's checkpoint lives inside a Trainer checkpoint folder
ZEROPLUG_DIR = "zeroplug"
#: TrainingArguments.optim values zeroplug computes, and as which of its optimizers
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}

@dataclasses.dataclass
class ZeroplugTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose ``deepspeed`` (``--deepspeed ds.json``: a DeepSpeed JSON path or
    dict) configures :class:`ZeroplugTrainer` instead of DeepSpeed, which is neither started nor
    needed. A script ported with one import line keeps its command line::

        from zeroplug.integrations.transformers import ZeroplugTrainer as Trainer, \\
            ZeroplugTrainingArguments as TrainingArguments
    """

    def __post_init__(self):
        # Note: the plain __post_init__ would start DeepSpeed's config machinery for deepspeed=.
        self.zeroplug_deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()


# Note: the Trainer methods this class overrides are its own internals; a transformers
# release that renames one would leave the loop half on DDP. Refuse to run instead.
_REQUIRED = ("_prepare_for_training", "_build_accelerator_args", "_wrap_model", "_move_model_to_device",
             "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_load_from_checkpoint",
             "_clip_grad_norm", "_get_grad_norm", "_load_best_model")
_missing = [m for m in _REQUIRED if not hasattr(Trainer, m)]
if _missing:                    # pragma: no cover - depends on the installed release
    raise ImportError(f"ZeroplugTrainer does not support transformers {transformers.__version__}: "
                      f"Trainer has no {', '.join(_missing)} (tested with 5.23)")


def _refusals(args: TrainingArguments) -> list[str]:
    """TrainingArguments options zeroplug cannot honour, each with its name and why."""
    out = []
    if args.deepspeed:
        out.append("deepspeed: ZeroplugTrainer trains with zeroplug; build the arguments with "
                   "zeroplug.integrations.transformers.ZeroplugTrainingArguments (its deepspeed= is the zeroplug "
                   "config) or pass that DeepSpeed config as zeroplug_config=")
    if args.fsdp:
        out.append(f"fsdp={args.fsdp!r}: zeroplug shards the model itself (zero.plugin = \"stage3\")")
    if getattr(args, "parallelism_config", None) is not None:
        out.append("parallelism_config: zeroplug runs data parallel only")
    if args.torch_compile:
        out.append("torch_compile=True: the engine's parameter hooks are not compiled")
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size=True: set per_device_train_batch_size")
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name, False):
            out.append(f"{name}=True: the zeroplug precision sets the model dtype for evaluation too")
    if _name(args.optim) not in OPTIMIZERS:
        out.append(f"optim={_name(args.optim)!r}: zeroplug computes {', '.join(OPTIMIZERS)}")
    if args.optim_args:
        out.append(f"optim_args={args.optim_args!r}: set optimizer options in the zeroplug config")
    if getattr(args, "optim_target_modules", None) is not None:
        out.append("optim_target_modules: not supported by zeroplug's optimizers")
    for name in ("ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph"):
        if getattr(args, name, None) is not None:
            out.append(f"{name}={getattr(args, name)!r}: zeroplug reduces gradients itself, without DDP "
                       f"(its bucket size is zero.reduce_bucket_size)")
    return out


def _name(value) -> str:
    """An enum's value (OptimizerNames, SchedulerType) or the string itself."""
    return str(getattr(value, "value", value))


def _precision(args: TrainingArguments) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def trainer_config(zeroplug_config, args: TrainingArguments) -> dict:
    """The zeroplug config (raw, zeroplug layout) with what ``args`` decides filled in;
    a value set in both and different is refused with both names."""
    raw = load_raw(zeroplug_config)
    raw = drop_auto_schedule(raw, f"TrainingArguments.lr_scheduler_type = {_name(args.lr_scheduler_type)!r}")
    plugin = OPTIMIZERS[_name(args.optim)]
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    given = [
        Given("batch.micro_batch_size", mbs, "TrainingArguments.per_device_train_batch_size"),
        Given("batch.gradient_accumulation_steps", gas, "TrainingArguments.gradient_accumulation_steps"),
        Given("batch.train_batch_size", mbs * gas * args.world_size,
              "per_device_train_batch_size x gradient_accumulation_steps x world size"),
        Given("batch.gradient_clipping", float(args.max_grad_norm or 0.0), "TrainingArguments.max_grad_norm"),
        Given("precision.plugin", _precision(args), "TrainingArguments bf16/fp16"),
        Given("optimizer.plugin", plugin, f"TrainingArguments.optim = {_name(args.optim)!r}",
              accepts=COMPATIBLE[plugin]),
        Given("optimizer.lr", args.learning_rate, "TrainingArguments.learning_rate"),
        Given("optimizer.weight_decay", args.weight_decay, "TrainingArguments.weight_decay"),
    ]
    if plugin == "adamw":
        given += [Given("optimizer.betas", [args.adam_beta1, args.adam_beta2],
                        "TrainingArguments (adam_beta1, adam_beta2)"),
                  Given("optimizer.eps", args.adam_epsilon, "TrainingArguments.adam_epsilon")]
    raw = reconcile(raw, given)
    opt = raw["optimizer"]
    if opt.get("plugin") in ("cpu_adam", "auto") and opt.get("adamw_mode", True) is False:
        raise ConfigError(f"zeroplug_config optimizer.adamw_mode = false (Adam's L2 decay) but "
                          f"TrainingArguments.optim = {_name(args.optim)!r} is AdamW; remove adamw_mode",
                          key="optimizer.adamw_mode")
    return raw


class EngineModel:
    """What the Trainer's loop calls ``model``: calls go through the engine (so stage 3
    gathers and prefetches), attributes come from the module (``config``, ``_get_name``,
    ``parameters``...)."""

    def __init__(self, engine):
        self.__dict__["engine"] = engine

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True):
        self.engine.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes its gradients after each optimizer step."""

    def __getattr__(self, name):
        return getattr(self.engine.module, name)


class ZeroplugTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with zeroplug. ``zeroplug_config``: a TOML or
    DeepSpeed JSON path, a dict in either layout, a :class:`zeroplug.Config`, or None
    (zeroplug's defaults: stage 0, fp32 unless ``bf16``/``fp16``). Everything else is the
    Trainer's. ``trainer.engine`` is the engine once training or evaluation has started."""

    def __init__(self, *args, zeroplug_config=None, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is None:
            raise ConfigError("ZeroplugTrainer needs args=TrainingArguments(...) (its learning rate, "
                              "batch size and schedule configure the engine)")
        refused = _refusals(targs)
        if refused:
            raise ConfigError("TrainingArguments options zeroplug cannot honour: " + "; ".join(refused),
                              key=refused[0].split("=")[0].split(":")[0])
        if any(o is not None for o in kwargs.get("optimizers", (None, None))) \
                or kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ConfigError("ZeroplugTrainer(optimizers=/optimizer_cls_and_kwargs=): zeroplug builds the "
                              "optimizer over its own shards; set TrainingArguments.optim, learning_rate, "
                              "weight_decay and lr_scheduler_type instead", key="optimizers")
        if zeroplug_config is None:
            zeroplug_config = getattr(targs, "zeroplug_deepspeed", None)
        self.engine = None
        self._engine_model = None
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise ConfigError(f"{self.args.n_gpu} GPUs in one process (torch.nn.DataParallel): launch one "
                              "process per GPU with torchrun instead", key="n_gpu")
        self.zeroplug_raw = trainer_config(zeroplug_config, self.args)
        from zeroplug.config import load as load_config
        load_config(self.zeroplug_raw, world_size=self.args.world_size)    # every key checked now

    # -- the engine ------------------------------------------------------------------------
    def _parameter_groups(self) -> list[dict]:
        """The plain Trainer's groups: weight decay except on biases and norms."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]

    def _scheduled_lr(self):
        if not isinstance(self.optimizer, HostOptimizer):
            return None
        return scheduled_lr(self.optimizer, self.args.learning_rate)

    def _ensure_engine(self):
        if self.engine is not None and self.engine.module is not self.model:    # model_init: a new model
            self.engine.close()
            self.engine = None
        if self.engine is None:
            self.engine = build_engine(self.model, self.zeroplug_raw, self._parameter_groups(),
                                       self._scheduled_lr, device=self.args.device)
            self._engine_model = EngineModel(self.engine)
        return self.engine

    # -- construction: no DDP, no autocast, no device move ------------------------------------
    def _build_accelerator_args(self, **kwargs):
        # Note: the zeroplug precision holds the model in bf16/fp16 itself; accelerate's
        # autocast on top would change the arithmetic and cost casts.
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"
        return out

    def _move_model_to_device(self, model, device):
        """Nothing: the engine places the parameters (stage 3: only each rank's shard)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        self._ensure_engine()
        return self._engine_model

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self._ensure_engine()
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": self.args.learning_rate}
                      for g in self._parameter_groups() if g["params"]]
            self.optimizer = HostOptimizer(self.engine, groups)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:         # a later train() builds its schedule again
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        # Note: accelerate asks its optimizers whether an fp16 step was skipped before the
        # Trainer advances the schedule; the engine's answer goes through HostOptimizer.
        if self.optimizer not in self.accelerator._optimizers:
            self.accelerator._optimizers.append(self.optimizer)
        model = self._wrap_model(self.model_wrapped)
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    # -- the step -----------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self._ensure_engine()
        engine = self.engine

        def backward(loss, **kwargs):
            backward_and_step(engine, loss, window=getattr(self, "current_gradient_accumulation_steps", None))

        # Note: the Trainer's own training_step (loss, its scaling for accumulation, context
        # parallel, cache emptying) stays as it is; only its last call, the backward, goes
        # to the engine, which also steps at the window's last micro-batch.
        with _replaced(self.accelerator, "backward", backward):
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return None                     # the engine clips (batch.gradient_clipping)

    def _get_grad_norm(self, model, grad_norm=None):
        metrics = getattr(self.engine, "last_metrics", None) or {}
        return metrics.get("grad_norm")

    # -- saving and resuming --------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a folder that ``from_pretrained`` loads (every rank must call it: stage 3
        gathers the weights). Stage 3 with ``stage3_gather_16bit_weights_on_model_save =
        false`` writes no weights into checkpoints (the engine's checkpoint has them)."""
        engine = self._ensure_engine()
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zero = engine.config.slot("zero").options
        if getattr(zero, "stage3_gather_16bit_weights_on_model_save", True) is False \
                and engine.partitioner.shard_params:
            if _internal_call:
                return
            raise ConfigError("save_model: zero.stage3_gather_16bit_weights_on_model_save = false, so the "
                              "weights stay sharded; set it to true, or export a checkpoint with "
                              "`zeroplug export`", key="zero.stage3_gather_16bit_weights_on_model_save")
        state_dict = engine.consolidated_state_dict()
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)    # the schedule's optimizer.pt, scheduler.pt
        save_engine_checkpoint(self.engine, os.path.join(output_dir, ZEROPLUG_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        super()._load_optimizer_and_scheduler(checkpoint)    # the scheduled lr first: the engine reads it
        load_engine_checkpoint(self.engine, os.path.join(checkpoint, ZEROPLUG_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the engine's checkpoint (in _prepare_for_training)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZEROPLUG_DIR)):
            raise ConfigError(f"{resume_from_checkpoint} has no {ZEROPLUG_DIR}/ folder, so it was not written "
                              f"by ZeroplugTrainer and cannot be resumed exactly; load its weights with "
                              f"from_pretrained and start a new run", key="resume_from_checkpoint")

    def _load_best_model(self) -> None:
        best = os.path.join(self.state.best_model_checkpoint, ZEROPLUG_DIR)
        log.info("[zeroplug] loading the best model from %s (score: %s)", best, self.state.best_metric)
        load_engine_checkpoint(self.engine, best, load_optimizer_states=False, load_lr_scheduler_states=False,
                               load_module_only=True)


@contextlib.contextmanager
def _replaced(obj, name: str, value):
    """``obj.name`` is ``value`` inside the block (an instance attribute, then removed)."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


__all__ = ["ZeroplugTrainer", "ZeroplugTrainingArguments", "trainer_config"]
