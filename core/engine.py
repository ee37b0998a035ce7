"""The engine: one training step as a pipeline of calls into the selected plugins.

It holds no strategy of its own. Per optimizer step:

1. ``engine(*inputs)``   forward (the partitioner's module hooks gather parameters)
2. ``engine.backward(loss)``  loss / accumulation steps x loss scale, backward
   (the partitioner's gradient hooks reduce buckets as they fill)
3. ``engine.step()``     at the accumulation boundary: finish reductions, global
   grad norm (also the overflow check), unscale + clip in one multiply, lr from the
   schedule, optimizer over the master shards, publish parameters, zero grads.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import weakref
from contextlib import contextmanager

import torch

from . import config as config_mod
from .comm import Comm
from .errors import PluginError, StateError, StepFailedError
from .faults import watched
from zeroplug.gathering import forget_engine, register_engine
from zeroplug.launch import start_process_group
from zeroplug.observe.metrics import StepMetrics, sequence_length
from .registry import get_plugin_manager
from .slots import RunContext, takes_grad_scale
from .tiers import fp32_multiplier

log = logging.getLogger("zeroplug")


def _default_device() -> torch.device:
    """The device when none is given: ZEROPLUG_DEVICE (e.g. "cpu", "cuda:1") if set, else
    the current CUDA device, else the CPU."""
    env = os.environ.get("ZEROPLUG_DEVICE", "").strip()
    if env:
        try:
            return _indexed(torch.device(env))
        except RuntimeError as e:
            raise ValueError(f"ZEROPLUG_DEVICE={env!r} is not a device ({e}); use e.g. cpu, cuda "
                             f"or cuda:1, or unset it") from None
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _indexed(dev: torch.device) -> torch.device:
    """``dev`` with its index: "cuda" names the current CUDA device.

    Note: tensors made on ``torch.device("cuda")`` report ``cuda:0`` (the current index), and
    ``torch.device("cuda") != torch.device("cuda:0")``: a run's device always carries its
    index, so that ``t.device == run.device`` holds for the tensors made on it."""
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def make_run(config=None, overrides=None, device=None, plugin_manager=None, model=None):
    """The validated config and run context for this process (``model``: for "auto" sizes)."""
    pm = plugin_manager or get_plugin_manager()
    # under a launcher, the process group (nccl for CUDA, gloo else) before anything counts ranks
    start_process_group(torch.device(device).type if device is not None else _default_device().type)
    comm = Comm()
    cfg = config_mod.load(config, overrides, pm=pm, world_size=comm.world_size, model=model)
    dev = _indexed(torch.device(device)) if device is not None else _default_device()
    return cfg, RunContext(device=dev, comm=comm, config=cfg, hook=pm.hook), pm


class Engine:
    def __init__(self, model: torch.nn.Module, config=None, overrides=None, device=None,
                 plugin_manager=None, model_parameters=None):
        from .param_groups import param_groups
        groups = param_groups(model, model_parameters)
        cfg, run, pm = make_run(config, overrides, device, plugin_manager, model=model)
        self.config, self.run, self.plugin_manager = cfg, run, pm
        self.hook = pm.hook
        self.module = model
        self._param_ids = {id(p) for p in model.parameters()}

        def build(path, *extra):
            choice = cfg.slot(path)
            return choice.impl(choice.options, run, *extra)

        self.precision = build("precision")
        self.offload_optimizer = build("offload.optimizer", "optimizer")
        self.offload_param = build("offload.param", "param")
        self.partitioner = build("zero")
        from .host_budget import check_host_budget
        elements = self.partitioner.tier_elements(model)
        check_host_budget(run, model, [
            (f"offload.{tier.kind}", tier.host_bytes(elements.get(tier.kind, 0), self.precision.param_dtype))
            for tier in (self.offload_optimizer, self.offload_param) if tier.capabilities.offloaded])
        factory = build("optimizer")
        groups = factory.param_groups(model, groups)
        factory.begin(self.offload_optimizer.device)
        self.partitioner.setup(model, self.precision, self.offload_optimizer, self.offload_param,
                               groups=groups)
        self.optimizer = factory.build(self.partitioner.optimizer_params(), self.offload_optimizer.device)
        self.partitioner.optimizer_built(self.optimizer)
        # a group's own lr follows the schedule in proportion (as torch's LR schedulers do)
        base = factory.lr or 1.0
        self._lr_scale = [g["lr"] / base for g in self.optimizer.param_groups]
        self.scheduler = build("scheduler", factory.lr)
        self.activations = build("activation_checkpointing")
        self.monitors = [build("monitor")]
        for m in self.monitors:     # lifecycle plugins of this engine (slots.Monitor)
            name = f"zeroplug-monitor-{id(m):x}"
            pm.attach(m, name)
            weakref.finalize(self, pm.detach, name)

        b = cfg.batch
        self.micro_batch_size = b.micro_batch_size
        self.gradient_accumulation_steps = b.gradient_accumulation_steps
        self.train_batch_size = b.train_batch_size
        self.global_step = 0          # optimizer steps, taken or skipped (DeepSpeed's global_steps)
        self.micro_step = 0           # backward calls
        self.micro_steps_in_window = 0              # backward calls since the last optimizer step
        self._stepped_since_backward = True
        self.skipped_steps = 0
        self.lr_step = 0              # steps taken: what the schedule counts
        self.tokens_per_sample: int | None = None
        self.states_offloaded: set[str] = set()
        from .checkpoint.background import BackgroundSaves
        self.background_saves = BackgroundSaves()     # save_checkpoint(async_save=True)
        self.metrics = StepMetrics(self.run.device)
        self.set_lr(self.scheduler.lr_at(0))
        self.hook.zeroplug_engine_setup(engine=self)        # the CUDA warm-up (plugins/warmup)
        factory.ready()
        # Note: a full pass of the cyclic collector walks every tracked object (hundreds of
        # thousands once torch, a model and its libraries are loaded) and lands in whichever
        # step allocates past its threshold. What is alive now lives for the run.
        self._froze_gc = b.freeze_gc is True or b.freeze_gc == "auto" and run.device.type == "cuda"
        if self._froze_gc:
            gc.collect()
            gc.freeze()
        # Note: ranks end their set-up at different times (kernel loads, pinning); meeting
        # here keeps that wait in initialize instead of in the first step's first collective
        run.comm.barrier()
        register_engine(self)
        # (the faults plugin fills self.run.faults here: zeroplug.faults; the calls below are @watched)
        self.hook.zeroplug_engine_created(engine=self)

    # -- the training step -------------------------------------------------------
    @watched("forward")
    def __call__(self, *inputs, **kwargs):
        self.require_states("forward")
        if self.tokens_per_sample is None:
            self.tokens_per_sample = sequence_length(kwargs.get("input_ids", inputs[0] if inputs else None))
        training = torch.is_grad_enabled()     # else an evaluation: nothing is saved for a backward
        if training:
            self.metrics.forward()
            self.hook.zeroplug_phase(engine=self, phase="forward")
        self.partitioner.before_forward()
        if not training:
            return self.module(*inputs, **kwargs)
        with self.activations.forward_context():
            return self.module(*inputs, **kwargs)

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the backward of this micro-step closes the accumulation window (asked
        after ``backward`` and before ``step``: whether the one just taken did)."""
        return self.micro_steps_in_window + self._stepped_since_backward >= self.gradient_accumulation_steps

    @watched("backward")
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, window: int | None = None) -> None:
        """Backward of ``loss`` divided by the accumulation steps. ``window``: how many
        micro-batches this backward's accumulation window has, where a host loop's differs
        from ``gradient_accumulation_steps`` (the shorter last window of an epoch); it holds
        from then on (``gradient_accumulation_steps`` becomes it).

        Note: the accumulation window counts backward calls, so ``step()`` may be called
        after every micro-batch (DeepSpeed's loop; it steps at the boundary) or only at the
        boundary (the plain PyTorch loop); either way one optimizer step per window."""
        self.require_states("backward")
        if window is not None:
            self.gradient_accumulation_steps = window
        self.hook.zeroplug_phase(engine=self, phase="backward")
        at_boundary = self.micro_steps_in_window + 1 >= self.gradient_accumulation_steps
        scaled = loss.float() / self.gradient_accumulation_steps if self.gradient_accumulation_steps > 1 else loss
        self.metrics.backward(loss)
        if at_boundary:        # the tier may step during this backward
            self.background_saves.wait_copied()
        self.partitioner.before_backward(at_boundary=at_boundary,
                                         first_micro_step=self.micro_steps_in_window == 0)
        self._lr_kept = self.get_lr()       # the lr a skipped step keeps (a speculation sets the next)
        if at_boundary and self.offload_optimizer.speculate(self.optimizer, self.precision.loss_scale):
            self.set_lr(self.scheduler.lr_at(self.lr_step))     # the step's: its tier may start it now
        self.precision.scale_loss(scaled).backward(retain_graph=retain_graph)
        self.micro_step += 1
        self.micro_steps_in_window += 1
        self._stepped_since_backward = False

    @watched("step")
    def step(self) -> None:
        """Steps the optimizer once the accumulation window is complete; a no-op before."""
        self.require_states("step")
        self._stepped_since_backward = True
        if self.micro_steps_in_window < self.gradient_accumulation_steps:
            return
        # Note: an asynchronous save reads the states in place until its copy is taken; a
        # failed one is raised here, before the step changes anything
        self.background_saves.before_step(self.run.comm)
        self.micro_steps_in_window = 0
        self.hook.zeroplug_step_begin(engine=self)
        try:
            self._boundary_step()
        except BaseException as exc:
            # Note: the sub-groups stepped before the error are updated and the rest are not;
            # such a state must never be trained on or saved as if it were whole.
            self.run.failed = self.run.failed or (
                f"optimizer step {self.global_step + 1} failed ({type(exc).__name__}: {exc})")
            raise

    def _boundary_step(self) -> None:
        part = self.partitioner
        self.hook.zeroplug_phase(engine=self, phase="wait_gradients")
        part.finish_gradients()
        self.hook.zeroplug_phase(engine=self, phase="optimizer")
        scale = self.precision.loss_scale
        norm = math.sqrt(part.grad_norm_sq().item()) / scale   # one host sync per step
        overflow = not math.isfinite(norm)
        self.precision.update(overflow)
        lr = self.scheduler.lr_at(self.lr_step)
        if overflow:
            self.skipped_steps += 1
            for g, kept in zip(self.optimizer.param_groups, self._lr_kept):
                g["lr"] = kept
            if self.run.rank == 0:
                log.warning("[zeroplug] OVERFLOW! Rank 0 Skipping step %d. Attempted loss scale: %g, "
                            "reducing to %g", self.global_step + 1, scale, self.precision.loss_scale)
        else:
            factor = 1.0 / scale
            clip = self.config.batch.gradient_clipping
            if clip > 0 and norm > clip:
                factor *= clip / (norm + 1e-6)
            self.set_lr(lr)
            multiplier = 1.0
            if factor != 1.0 and takes_grad_scale(self.optimizer):
                # Note: torch's fused Adam/AdamW/SGD (and cpu_adam) multiply each gradient
                # inside their one pass; that saves a read and a write of every gradient.
                multiplier = fp32_multiplier(factor)
            elif factor != 1.0:
                torch._foreach_mul_(list(part.iter_grads()), factor)
            part.step_optimizer(self.optimizer, multiplier)
            self.lr_step += 1
        part.zero_grad()
        self.global_step += 1
        self._report(norm, lr, overflow)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate to ``lr`` now: a parameter group built with an lr of its own
        (``model_parameters``) gets ``lr`` in proportion, as torch's LR schedulers do. The
        schedule sets it again at the next step."""
        for g, scale in zip(self.optimizer.param_groups, self._lr_scale):
            g["lr"] = lr * scale

    def use_schedule(self, schedule) -> None:
        """Drive the lr with ``schedule`` (an object with ``lr_at(step)``, as
        :class:`zeroplug.slots.Scheduler`) from now on; the lr is set at once."""
        self.scheduler = schedule
        self.set_lr(schedule.lr_at(self.lr_step))

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def memory_report(self) -> dict:
        """Bytes held per category now (low-precision parameters, master, gradients, optimizer
        states, communication buckets, prefetch window; on CUDA the rest), device and host."""
        report = self.hook.zeroplug_memory_report(engine=self)
        if report is None:
            raise PluginError("engine.memory_report(): no plugin reports memory (the built-in \"observe\" "
                              "plugin is blocked?): allow it in ZEROPLUG_PLUGINS_ALLOW / drop it from "
                              "ZEROPLUG_PLUGINS_BLOCK")
        return report

    def _report(self, norm: float, lr: float, skipped: bool) -> None:
        self.hook.zeroplug_phase(engine=self, phase="other")     # the loop's own work until the next forward
        self.last_metrics = self.metrics.step_end(self, norm, lr, skipped)
        self.hook.zeroplug_step_end(engine=self, metrics=self.last_metrics)    # monitors write on "print" steps

    # -- modes and views -----------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def zero_grad(self) -> None:
        """Harmless: gradients are zeroed after every optimizer step already."""
        if self.micro_steps_in_window == 0:
            self.partitioner.zero_grad()

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Context in which every parameter (or each of ``params``) holds its whole value
        (stage 3 gathers them; every rank must enter it). ``module.state_dict()`` works inside.

        Writes: with ``modifier_rank``, the values that rank holds at the end of the block
        become every rank's (shards and fp32 master weights; the optimizer's moments stay);
        without it, a parameter written inside raises StateError on every rank at the end of
        the block (the write would otherwise be lost at the next step)."""
        self.background_saves.wait_copied()
        return self.partitioner.gathered_params(params, modifier_rank=modifier_rank, check_writes=True)

    def owns(self, param) -> bool:
        """Whether ``param`` is a parameter of the model this engine trains."""
        return id(param) in self._param_ids

    def consolidated_state_dict(self) -> dict | None:
        """The full model state dict (model dtype) on rank 0; None on the other ranks."""
        self.partitioner.release_all()
        return self.partitioner.consolidated_state_dict(self.module)

    def save_pretrained(self, save_directory, **kwargs) -> bool:
        """``module.save_pretrained(save_directory, state_dict=<whole weights>)`` on rank 0, for
        Hugging Face (and peft) models: a folder ``from_pretrained`` loads. Every rank calls it."""
        from .checkpoint.exporting import save_pretrained
        return save_pretrained(self, save_directory, **kwargs)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The consolidated model-dtype state dict to ``save_dir/save_filename`` from rank 0
        (every rank calls it): ``torch.save``, or safetensors for a ``.safetensors`` name; a file
        path as ``save_dir``: see checkpoint/weights.py. True on the rank that wrote."""
        from .checkpoint.exporting import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # -- offload_states / reload_states ---------------------------------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False, nvme_path: str | None = None) -> None:
        """Move training states off the device (``include``: names or OffloadStateTypeEnum;
        default all) into the offload tier ``device`` names: "cpu" (host memory), "nvme" (files
        under ``nvme_path``) or another registered tier. Harmless to repeat. The step refuses
        to run until ``reload_states()`` while any is offloaded; a call that fails brings every
        state back (``reload_states()``) before raising."""
        self.background_saves.wait_copied()
        from .offload_states import ALL_STATES, state_name
        names = {state_name(s) for s in include} if include is not None else set(ALL_STATES)
        tier = device.value if hasattr(device, "value") else str(device)
        try:
            moved = self.hook.zeroplug_offload_states(engine=self, include=frozenset(names), device=tier,
                                                      pin_memory=pin_memory, non_blocking=non_blocking,
                                                      nvme_path=nvme_path)
        except BaseException:
            # Note: a state moved before the error would be missing from the next step; the
            # plugins bring back what they moved (should that fail too, the step refuses)
            self.states_offloaded |= names
            self.reload_states()
            raise
        for names_moved in moved:       # each plugin's answer: the engine's states it moved
            self.states_offloaded |= set(names_moved)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back, bit-identical. Harmless when nothing is offloaded."""
        self.hook.zeroplug_reload_states(engine=self, non_blocking=non_blocking)
        self.states_offloaded.clear()

    def sequence(self):
        """The ``[sequence]`` strategy this engine trains with (:class:`zeroplug.slots.SequenceStrategy`:
        ``.group``, ``.shard(batch)``, ``.loader(loader)``), as the plugin that attached it says."""
        strategy = self.hook.zeroplug_sequence_strategy(engine=self)
        if strategy is None:
            raise PluginError("no [sequence] strategy is attached to this engine: the built-in \"sequence\" "
                              "plugin is blocked (ZEROPLUG_PLUGINS_BLOCK / ZEROPLUG_PLUGINS_ALLOW): allow it")
        return strategy

    def require_states(self, what: str) -> None:
        """Raise unless the training state is whole and in place for ``engine.<what>()``:
        StepFailedError after a step that failed part-way (until a checkpoint is loaded),
        StateError while states are offloaded (until reload_states). The step's methods and
        the checkpoint package call it first."""
        if self.run.failed is not None:
            raise StepFailedError(what, self.run.failed)
        if self.states_offloaded:
            raise StateError(f"engine.{what}() called while states {sorted(self.states_offloaded)} are "
                             f"offloaded; call engine.reload_states() first")

    @watched("close")
    def close(self) -> None:
        """Release offload files and buffers; monitors flush. A save in flight is finished
        first; if it failed, its error is raised after the clean-up."""
        save_error = self.background_saves.close()
        forget_engine(self)
        from .checkpoint.directory import release
        release(self)                   # the locks of the checkpoint directories it saved to
        self.partitioner.wait_optimizer()
        self.hook.zeroplug_engine_closed(engine=self)
        for m in self.monitors:
            self.plugin_manager.detach(f"zeroplug-monitor-{id(m):x}")
        if self._froze_gc:
            gc.unfreeze()
        self.offload_optimizer.close()
        self.offload_param.close()
        self.activations.close()
        self.partitioner.close()      # its hooks on the model's parameters held every state alive
        if save_error is not None:
            from .checkpoint import CheckpointError
            raise CheckpointError(save_error)

    # -- checkpoints (zeroplug.checkpoint) -------------------------------------------------
    @watched("save_checkpoint")
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        async_save: bool | None = None) -> str:
        """Save the complete training state under ``save_dir/tag`` (default ``global_step<N>``),
        one file per rank, atomically; every rank must call it. Returns the checkpoint's path.
        ``async_save`` (None: the config's ``checkpoint.async_save``): write it in the
        background; the path then names it before it is complete (zeroplug.checkpoint.background)."""
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, async_save)

    @watched("load_checkpoint")
    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Restore a checkpoint saved on any world size (``tag`` None: the ``latest`` one);
        every rank must call it. Returns ``(path, client_state)``. Reads DeepSpeed's too."""
        self.background_saves.wait()
        from .checkpoint.deepspeed_format import load_any
        return load_any(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def initialize(model: torch.nn.Module, config=None, overrides=None, device=None,
               plugin_manager=None, model_parameters=None) -> Engine:
    """Wrap ``model`` for training. ``config``: a path (TOML, or DeepSpeed JSON), a dict,
    a :class:`zeroplug.config.Config` or None (defaults); ``overrides``: ``["zero.plugin=stage2"]``;
    ``model_parameters``: torch-style parameter groups (or parameters), as for torch.optim.AdamW."""
    return Engine(model, config, overrides, device, plugin_manager, model_parameters)


@contextmanager
def init(config=None, overrides=None, device=None, plugin_manager=None):
    """Build a model already partitioned: ``with zeroplug.init(cfg): model = build()``.

    The selected ZeRO stage decides what that means (stage 3 keeps only each rank's
    shard of every parameter; lower stages only place parameters on the device).
    """
    cfg, run, pm = make_run(config, overrides, device, plugin_manager)
    choice = cfg.slot("zero")
    precision = cfg.slot("precision")
    ctx = choice.impl.construction_context(choice.options, run,
                                           precision.impl(precision.options, run))
    with ctx:
        yield
