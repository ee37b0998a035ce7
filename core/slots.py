"""What an implementation registered for each slot must provide.

These are base classes with the methods the engine calls; a plugin subclasses the
one of its slot (or provides the same methods). Each has a nested ``Options``
frozen dataclass: its TOML table, validated by core (see :mod:`zeroplug.options`).
Optional ``check_config(config, choice)`` classmethods apply rules across slots.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Iterable

import torch

from .comm import Comm
from .faults import NO_FAULTS
from .hookspecs import hookimpl
# the offload tier's slot: the stage <-> tier contract (documented there)
from .tiers import (Layout, OffloadDevice, OffloadTier, SubGroup, SubGroupOptimizer,  # noqa: F401
                    TierCapabilities, UnitShard, step_group)

if TYPE_CHECKING:
    from .engine import Engine


def takes_grad_scale(optimizer) -> bool:
    """Whether ``optimizer`` applies the step's gradient multiplier inside its own pass:
    torch's fused kernels (they divide by their ``grad_scale``, which
    :func:`zeroplug.tiers.step_all` sets for them) and every :class:`SubGroupOptimizer`
    (cpu_adam). The engine then passes the unscale x clip factor to the step instead of
    multiplying every gradient before it."""
    return bool(getattr(optimizer, "defaults", {}).get("fused")) or isinstance(optimizer, SubGroupOptimizer)


@dataclass
class RunContext:
    """What every slot implementation may know about the run: the one place where state
    is shared between plugins (besides the records of a slot's own contract, e.g. the
    offload tier's in :mod:`zeroplug.tiers`). A plugin never reads another plugin's
    objects or options; what they must agree on is a field here, set by the engine."""
    device: torch.device
    comm: Comm
    config: Any                      # zeroplug.config.Config: every slot's choice and options
    hook: Any = None                 # the plugin manager's hook relay
    # why the training state is no longer consistent (an optimizer step failed part-way;
    # set by the engine, or by a tier whose step finishes after engine.step() returns);
    # None while it is. Cleared by loading a checkpoint.
    failed: str | None = None
    # host bytes the offload tiers planned on this host (initialize's host-memory check), which
    # memory that grows with the batch must leave them (zeroplug.host_budget.host_room)
    host_planned: int = 0
    # the engine's part in fault handling (zeroplug.faults.Faults, set when the engine is ready):
    # a stage calls faults.agree(...) before a collective whose partners depend on its rank's path
    faults: Any = NO_FAULTS

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


class Precision:
    """Dtypes and loss scaling. ``param_dtype`` is the model's; masters are fp32."""
    @dataclass(frozen=True)
    class Options:
        pass

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    @property
    def loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def update(self, overflow: bool) -> None:
        """After each optimizer step: ``overflow`` says whether gradients were non-finite."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class OptimizerFactory:
    """Builds the ``torch.optim.Optimizer`` over one rank's master tensors."""
    @dataclass(frozen=True)
    class Options:
        lr: float = 1e-3

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    @property
    def lr(self) -> float:
        return self.options.lr

    def param_groups(self, module: torch.nn.Module, groups):
        """The parameter groups the stage lays out (``groups``: a
        :class:`zeroplug.param_groups.ParamGroups`, the user's): an optimizer that treats
        parameters differently (Muon's matrices and AdamW's rest) splits them here, with each
        part's settings; every master tensor then belongs to one group. Default: as given."""
        return groups

    def begin(self, state_device: torch.device) -> None:
        """Called first in ``initialize``, before the stage allocates anything: start one-time
        work that needs no parameters (cpu_adam: its kernel's toolchain and cache, on a
        background thread), so that it overlaps the stage's setup."""

    def build(self, params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (tensors or param-group dicts). With offloaded states
        there is one param group per sub-group, stepped one at a time through
        :func:`zeroplug.tiers.step_group`; an optimizer may declare ``step_group`` for it."""
        raise NotImplementedError

    def ready(self) -> None:
        """Called last in ``initialize``: finish what the first step would otherwise wait
        for (cpu_adam: loading its kernel), so that no training step pays for it."""

    @classmethod
    def grad_dtypes(cls, options, run: RunContext, state_device: torch.device) -> tuple[torch.dtype, ...]:
        """Gradient dtypes the built optimizer reads for fp32 masters on ``state_device``
        (a tier may hold gradients in the model dtype only if it is one of them)."""
        return (torch.float32,)

    @classmethod
    def state_bytes(cls, options, run: RunContext, state_device: torch.device) -> float:
        """Bytes per master element of the optimizer's states on ``state_device`` (what an
        offload tier reserves beside the master and the gradient; Adam's two fp32 moments: 8)."""
        return 8.0


class Scheduler:
    """A learning-rate schedule: the lr to use for a given optimizer step."""
    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options, run: RunContext, base_lr: float):
        self.options, self.run, self.base_lr = options, run, base_lr

    def lr_at(self, step: int) -> float:
        return self.base_lr


class Monitor:
    """Receives each reported step's metrics.

    A monitor is a lifecycle plugin of its engine: the engine registers it with the plugin
    manager for its life, and the hook implementations below call ``write`` on the steps
    that are reported (``steps_per_print``), after every other plugin's
    ``zeroplug_step_end`` has added its keys, and ``close`` when the engine closes."""
    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    #: write every step's readings (``metrics["record"]``), not only the printed steps'
    every_step = False

    @hookimpl(trylast=True)
    def zeroplug_step_end(self, engine: Engine, metrics: dict[str, Any]) -> None:
        if engine.run is self.run and (metrics.get("print") or self.every_step and metrics.get("record")):
            self.write(metrics)

    @hookimpl
    def zeroplug_engine_closed(self, engine: Engine) -> None:
        if engine.run is self.run:
            self.close()

    def write(self, metrics: dict) -> None:
        pass

    def write_eval(self, metrics: dict) -> None:
        """Held-out metrics (``step``, ``eval_loss``) from a training loop that evaluates."""

    def close(self) -> None:
        pass


class ActivationStore:
    """Where the tensors that activation checkpointing saves for the backward (each checkpointed
    block's inputs) wait for the block's recompute.

    The model turns checkpointing on (``model.gradient_checkpointing_enable()``,
    ``torch.utils.checkpoint``); the engine enters ``forward_context()`` around each training
    forward (``torch.autograd.graph.saved_tensors_hooks`` fit there), so a store sees what the
    forward saves and gives it back when the backward asks for it. Its values must be given back
    bit for bit: the gradients are the same whichever store is chosen."""
    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    def forward_context(self):
        """A context manager entered around one training forward (grad mode on)."""
        return contextlib.nullcontext()

    def host_bytes(self) -> int:
        """Host memory it holds now (bytes)."""
        return 0

    def close(self) -> None:
        """Called by ``engine.close()``."""


class SequenceStrategy:
    """How the ranks share the tokens of long sequences (the ``[sequence]`` slot).

    It acts on the model, not on the step: at the end of ``initialize`` (on
    ``zeroplug_engine_setup``) its plugin builds it and calls :meth:`attach`, which may split
    each sequence over groups of ranks (their attention exchanging heads for sequence) and
    compute parts of the model in tiles along the sequence. The ZeRO stage still shards the
    states over every rank; the batch arithmetic counts each group once (``ranks_per_sample``).
    """
    @dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    @classmethod
    def ranks_per_sample(cls, options) -> int:
        """Ranks that share one sample's sequence (DeepSpeed's sequence_parallel_size): the
        batch sizes count world size / this many data-parallel ranks."""
        return 1

    def attach(self, engine) -> None:
        """Called once by its plugin while ``initialize`` ends (every rank)."""

    def close(self) -> None:
        """Undo :meth:`attach` (called when the engine closes)."""


class Partitioner:
    """A ZeRO stage: owns the parameters' layout, the gradient reduction and the masters.

    The engine calls, per optimizer step::

        setup(module, precision, offload_optimizer, offload_param, groups)   # once
        ... forward / backward (the partitioner's hooks do the reductions) ...
        finish_gradients()          # wait for reductions; master .grad ready
        grad_norm_sq()              # global squared norm of the master grads
        step_optimizer(optimizer, grad_multiplier)   # step masters, publish model parameters
                                    # (+ all-gather); may return with the step still running
                                    # (see wait_optimizer)
        zero_grad()

    Every method and attribute the engine, the checkpoint code and the integrations use is
    declared here; those with nothing to do in a simple stage have that default, so callers
    call them directly.
    """
    @dataclass(frozen=True)
    class Options:
        pass

    #: the ZeRO stage it implements (what DeepSpeed's ``zero_optimization_stage()`` answers)
    stage: int = 0
    #: each rank holds only its shard of the masters and optimizer states (False: every rank
    #: holds them whole, and rank 0 alone writes them into a checkpoint)
    shard_optimizer: bool = False
    #: each rank holds only its shard of the model's parameters (stage 3)
    shard_params: bool = False

    def __init__(self, options, run: RunContext):
        self.options, self.run = options, run

    def tier_elements(self, module: torch.nn.Module) -> dict[str, int]:
        """Elements of this rank's shard that the offload tiers will hold, by kind
        ("optimizer": fp32 masters of the trainable parameters; "param": model-dtype
        parameter shards), counted before :meth:`setup` allocates anything: ``initialize``
        asks the tiers for the host memory they need for them (:mod:`zeroplug.host_budget`).
        The default: every trainable element on every rank (no sharding), no parameter shards."""
        return {"optimizer": sum(p.numel() for p in module.parameters() if p.requires_grad), "param": 0}

    @classmethod
    def construction_context(cls, options, run: RunContext, precision: Precision) -> ContextManager:
        """What ``zeroplug.init`` enters while the model is built (stage 3 shards each
        module's parameters as its constructor returns). Default: nothing."""
        return contextlib.nullcontext()

    def setup(self, module: torch.nn.Module, precision: Precision,
              offload_optimizer: OffloadTier, offload_param: OffloadTier, groups=None) -> None:
        """Lay out ``module``'s parameters. ``groups`` (:class:`zeroplug.param_groups.ParamGroups`)
        says which parameter group each trainable parameter is in; ``optimizer_params`` returns
        one torch param group per group with its settings. Parameters with
        ``requires_grad=False`` are never stepped, and integer ones keep their dtype."""
        raise NotImplementedError

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters (possibly mid-step: call wait_optimizer() before reading them)."""
        raise NotImplementedError

    def before_forward(self) -> None:
        """Called by ``engine(...)`` before each forward."""

    def before_backward(self, at_boundary: bool = True, first_micro_step: bool = True) -> None:
        """Called by ``engine.backward`` before each backward.

        :param at_boundary: this micro-step ends the gradient-accumulation window (stages 0-1
            reduce their gradients then).
        :param first_micro_step: this micro-step opens the window (its reductions overwrite)."""

    def finish_gradients(self) -> None:
        raise NotImplementedError

    def grad_norm_sq(self) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_params(self):
        """What the optimizer is built over (tensors or param-group dicts)."""
        return self.master_params()

    def optimizer_built(self, optimizer) -> None:
        """The optimizer over :meth:`optimizer_params` exists (once, inside ``initialize``):
        whatever the first step would otherwise allocate can be allocated now."""

    def step_optimizer(self, optimizer, grad_multiplier: float = 1.0) -> None:
        """Step the masters, their gradients multiplied by ``grad_multiplier`` inside the
        optimizer's pass (the engine's unscale x clip factor when the optimizer
        ``takes_grad_scale``; else 1, the engine having multiplied the gradients), through
        :func:`zeroplug.tiers.step_all` / :func:`~zeroplug.tiers.step_group` or the tier's
        ``step(optimizer, grad_multiplier)``; then publish the model parameters."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def release_all(self) -> None:
        """Drop every gathered or prefetched copy (stage 3); a no-op elsewhere."""

    def wait_optimizer(self) -> None:
        """Block until a step that ``step_optimizer`` left running is finished (raising its
        error). The partitioner calls it before anything reads its states; the engine calls
        it before close and checkpoints. A no-op when steps finish inside step_optimizer."""

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict | None:
        """The full model state dict on rank 0 (None on other ranks)."""
        raise NotImplementedError

    def close(self) -> None:
        """Detach from the module (remove every hook ``setup`` placed): called by
        ``engine.close()``, after which the engine's states can be freed."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds, by kind: ``lp_params``, ``lp_grads``, ``hp_params``,
        ``hp_grads`` (for memory accounting and offload_states)."""
        return {}

    def writes_states(self) -> bool:
        """Whether this rank writes its masters and optimizer states into a checkpoint: one
        copy of each shard is written (ranks that hold the same shard as a lower rank write
        none). Default: every rank."""
        return True

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors behind each memory category of ``engine.memory_report()``
        (``lp_params``, ``master``, ``gradients``, ``buckets``, ``prefetch``); sizes only, so
        no wait for a step in flight. Default: none (the report counts the optimizer's states)."""
        return {}

    def gathered_params(self, params=None, modifier_rank: int | None = None,
                        check_writes: bool = False) -> ContextManager:
        """Context in which every parameter (or each of ``params``) holds its whole value
        (``engine.gathered_parameters``; every rank enters it). On exit, with
        ``modifier_rank``, that rank's values become every rank's (shards and masters);
        without it and with ``check_writes``, a write inside raises StateError on every rank."""
        raise NotImplementedError

    def checkpoint_state(self, optimizer=None, parts=None) -> dict:
        """This rank's part of a checkpoint (world-size independent; see
        :mod:`zeroplug.checkpoint`): tensors and plain values. ``parts``: the
        :class:`zeroplug.checkpoint.PartWriter` that large pieces may be streamed through.
        Default: checkpoints are not supported (a CheckpointError that says so)."""
        from .checkpoint.files import CheckpointError
        raise CheckpointError(f"the ZeRO plugin {type(self).__name__} does not support checkpoints "
                              "(it does not implement checkpoint_state)")

    def load_checkpoint_state(self, states, optimizer=None, *, load_master: bool = True,
                              load_optimizer_states: bool = True) -> None:
        """Load this rank's states from ``states`` (a :class:`zeroplug.checkpoint.ShardSet` or
        a DeepSpeed checkpoint presented the same way): check every file against the layout,
        then ``states.commit()`` (every rank agrees), then copy. Default: not supported."""
        from .checkpoint.files import CheckpointError
        raise CheckpointError(f"the ZeRO plugin {type(self).__name__} does not support checkpoints "
                              "(it does not implement load_checkpoint_state)")

    def iter_grads(self) -> Iterable[torch.Tensor]:
        return (p.grad for p in self.master_params() if p.grad is not None)
