"""The hook contract: every hook zeroplug calls, one docstring each.

Two kinds of hooks:

* ``zeroplug_register_<slot>(register)`` — called once when the plugin manager
  is set up. A plugin calls ``register(name, implementation)`` for each named
  implementation it offers for that slot. The TOML table of the slot picks one
  by name (``[zero] plugin = "stage2"``). An implementation is a class with an
  ``Options`` frozen dataclass (its TOML options, validated by core) and the
  methods of the slot's protocol in :mod:`zeroplug.slots`.
* Lifecycle hooks — called by the engine at fixed points of a run, on every
  registered plugin, so a plugin can add behaviour or state without the engine
  knowing it.

Note: the slot implementations do the work of a step; lifecycle hooks observe
and extend. A lifecycle hook that changes what the engine knows (which states are
offloaded) returns it, and the engine records it: a plugin never writes the engine's
attributes. A hook with ``firstresult`` stops at the first non-None answer. A hook
implementation whose name matches no hook here is an error when its plugin registers
(pluggy's ``check_pending``), so a misspelled hook never goes silently uncalled.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

import pluggy

if TYPE_CHECKING:
    import torch

    from .engine import Engine

#: what a registration hook is called with: ``register(name, cls)``
Register = Callable[[str, type], None]

hookspec = pluggy.HookspecMarker("zeroplug")
hookimpl = pluggy.HookimplMarker("zeroplug")


# --- registration: one hook per slot ---------------------------------------

@hookspec
def zeroplug_register_partitioners(register: Register) -> None:
    """Register ZeRO stages (the ``[zero]`` slot).

    Called once at plugin-manager setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.Partitioner`.
    """


@hookspec
def zeroplug_register_precisions(register: Register) -> None:
    """Register precisions (the ``[precision]`` slot: fp32, bf16, fp16, ...).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.Precision`.
    """


@hookspec
def zeroplug_register_optimizers(register: Register) -> None:
    """Register optimizers (the ``[optimizer]`` slot).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.OptimizerFactory`: it builds a ``torch.optim.Optimizer``
        over the master tensors of one rank's shard.
    """


@hookspec
def zeroplug_register_schedulers(register: Register) -> None:
    """Register learning-rate schedules (the ``[scheduler]`` slot).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.Scheduler`.
    """


@hookspec
def zeroplug_register_offload_devices(register: Register) -> None:
    """Register offload tiers (the ``[offload.optimizer]`` and ``[offload.param]`` slots).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` a subclass of
        :class:`zeroplug.tiers.OffloadTier`: the contract between a ZeRO stage and a tier
        (where states live, how they move), documented method by method there and in
        docs/plugins.md, "Writing an offload tier".
    """


@hookspec
def zeroplug_register_monitors(register: Register) -> None:
    """Register monitors (the ``[monitor]`` slot: stdout lines, CSV, ...).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.Monitor`.
    """


@hookspec
def zeroplug_register_activations(register: Register) -> None:
    """Register where checkpointed activations wait (the ``[activation_checkpointing]`` slot:
    none keeps them on the device, cpu in host memory).

    Called once at setup.

    :param register: ``register(name, cls)``, ``cls`` following
        :class:`zeroplug.slots.ActivationStore`.
    """


@hookspec
def zeroplug_register_sequence(register: Callable[[str, type], None]) -> None:
    """Register how the ranks share long sequences (the ``[sequence]`` slot: none, or ulysses:
    each sequence sliced over a group of ranks, attention exchanging heads for sequence, the MLP
    and the head's loss computed in tiles).

    Called once at setup.

    :param register: ``register(name, cls)`` with ``cls`` following
        :class:`zeroplug.slots.SequenceStrategy`.
    """


@hookspec
def zeroplug_model_presets() -> dict[str, Callable[[bool], Any]] | None:
    """Name the models ``--model`` accepts. Called by ``zeroplug estimate`` /
    ``zeroplug tune`` (and ``zeroplug.tools.probe.load_spec``). The built-in ``workload``
    plugin names the reference GPT's presets.

    :returns: ``{name: spec}``, where ``spec(checkpointing)`` returns a
        :class:`zeroplug.tools.probe.ModelSpec` (how to build the model at a given depth,
        its vocabulary and longest sequence; ``checkpointing``: with activation
        checkpointing), or None.
    """


@hookspec
def zeroplug_add_commands(subparsers: Any) -> None:
    """Add subcommands to the ``zeroplug`` command line; called once while it is built. The
    built-in ``workload`` plugin adds ``train``.

    :param subparsers: what argparse's ``add_subparsers()`` returned. Each subcommand
        calls ``set_defaults(fn=...)``: ``fn(args, overrides)``, ``overrides`` the command
        line's ``--section.key=value`` items, returns the exit status; a
        :class:`zeroplug.ZeroplugError` it raises is printed as one ``error:`` line, exit 2.
    """


# --- lifecycle ---------------------------------------------------------------

@hookspec
def zeroplug_engine_created(engine: Engine) -> None:
    """Called at the end of ``zeroplug.initialize``, once every slot is filled.

    :param engine: the engine, ready to train.
    """


@hookspec
def zeroplug_engine_setup(engine: Engine) -> None:
    """Called during ``zeroplug.initialize`` once the engine's states, optimizer and
    schedule exist, before the ranks meet at its end: set-up work that every rank does and
    that the first step should not pay for (the built-in ``warmup`` plugin runs the CUDA
    warm-up here).

    :param engine: the engine being initialised (its states, optimizer and schedule exist).
    """


@hookspec(firstresult=True)
def zeroplug_sequence_strategy(engine: Engine) -> Any:
    """Name the ``[sequence]`` strategy ``engine`` trains with. Called by
    :meth:`zeroplug.engine.Engine.sequence` (a training loop asks it how to slice its batches).

    :param engine: the engine asked about.
    :returns: the strategy (following :class:`zeroplug.slots.SequenceStrategy`: ``.group``,
        ``.shard(batch)``, ``.loader(loader)``), or None where this plugin did not attach one.
    """


@hookspec
def zeroplug_phase(engine: Engine, phase: str) -> None:
    """Called as a step enters a phase. Called several times per micro-step, so keep it
    cheap: record, do not synchronise (the built-in ``observe`` plugin records a CUDA event
    or a clock reading and reports ``phase_*`` metrics in ``zeroplug_step_end``).

    :param engine: the engine whose step it is.
    :param phase: one of :data:`zeroplug.observe.phases.PHASES`: "forward", "backward",
        "wait_gradients", "optimizer", and "other" when the step has ended and the loop's
        own work begins.
    """


@hookspec
def zeroplug_step_begin(engine: Engine) -> None:
    """Called at the start of an optimizer step (gradient-accumulation boundary),
    after gradients are reduced and before they are unscaled, clipped and applied.

    :param engine: the engine about to step (``global_step`` counts the steps before it).
    """


@hookspec
def zeroplug_step_end(engine: Engine, metrics: dict[str, Any]) -> None:
    """Called after an optimizer step, taken or skipped.

    :param engine: the engine that stepped.
    :param metrics: the step's metrics (``step``, ``loss``, ``lr``, ``loss_scale``,
        ``grad_norm``, ``skipped``, ...). A plugin may add keys; monitors see them.
    """


@hookspec
def zeroplug_engine_closed(engine: Engine) -> None:
    """Called by ``engine.close()`` once the last optimizer step has finished, before the
    offload tiers release their buffers and files (monitors flush here).

    :param engine: the engine being closed.
    """


@hookspec
def zeroplug_checkpoint_state_save(engine: Engine) -> dict[str, Any] | None:
    """Called while a checkpoint is written on each rank.

    :param engine: the engine being saved.
    :returns: ``{name: state}``, extra state to store in this rank's shard (tensors and
        plain Python values only), or None.
    """


@hookspec
def zeroplug_checkpoint_state_load(engine: Engine, states: dict[str, Any]) -> None:
    """Called while a checkpoint is loaded. A plugin takes its own keys.

    :param engine: the engine being loaded.
    :param states: every dict that ``zeroplug_checkpoint_state_save`` returned when the
        checkpoint was written, merged.
    """


@hookspec
def zeroplug_offload_states(engine: Engine, include: frozenset[str], device: str, pin_memory: bool,
                            non_blocking: bool, nvme_path: str | None) -> set[str] | None:
    """Called by ``engine.offload_states``. The built-in ``offload_states`` plugin moves the
    engine's own states first (``tryfirst``); a plugin that holds device copies of its own
    moves them here too. Should an implementation raise, ``zeroplug_reload_states`` is
    called before the error reaches the caller.

    :param engine: the engine whose states move.
    :param include: the names of the states to move (:data:`zeroplug.offload_states.ALL_STATES`).
    :param device: the name of the offload tier to move them into: "cpu", "nvme" or another
        registered tier.
    :param pin_memory: the call's option, for a tier that stages in host memory.
    :param non_blocking: the call's option: copies may still run when the hook returns.
    :param nvme_path: the call's option, for a tier that writes files (None: the temporary
        directory).
    :returns: the names of the engine's states it moved: the engine records them
        (``engine.states_offloaded``) and refuses to step until ``engine.reload_states()``.
        None when it moved none of them (copies of its own only).
    """


@hookspec
def zeroplug_reload_states(engine: Engine, non_blocking: bool) -> None:
    """Called by ``engine.reload_states``: every state offloaded comes back, bit-identical
    (the built-in ``offload_states`` plugin first). Also called when there is nothing to
    bring back: harmless then.

    :param engine: the engine whose states come back.
    :param non_blocking: the call's option: copies may still run when the hook returns.
    """


@hookspec(firstresult=True)
def zeroplug_state_devices(engine: Engine, state: str) -> set[torch.device] | None:
    """Called by ``zeroplug.get_state_devices(engine, state)``.

    :param engine: the engine holding the state.
    :param state: a state name (:data:`zeroplug.offload_states.ALL_STATES`).
    :returns: the set of devices where that state lives now (offloaded data counts as
        ``cpu``), or None when this plugin does not track offloaded states.
    """


@hookspec(firstresult=True)
def zeroplug_memory_report(engine: Engine) -> dict[str, dict[str, int]] | None:
    """Called by ``engine.memory_report()``. The built-in ``observe`` plugin answers.

    :param engine: the engine to report on.
    :returns: bytes held now per category (low-precision parameters, masters, gradients,
        optimizer states, communication buckets, prefetch window), under ``"device"`` and
        ``"host"``; or None.
    """


@hookspec(firstresult=True)
def zeroplug_gathered_params(params: list[torch.nn.Parameter], modifier_rank: int | None
                             ) -> tuple[ContextManager[Any], list[torch.nn.Parameter]] | None:
    """Called by ``zeroplug.gathered_parameters(params, modifier_rank)`` (and
    ``deepspeed.zero.GatheredParameters``) for parameters that no engine holds: a plugin
    that partitioned some of them while the model was built (``zeroplug.init``) answers.

    :param params: the parameters no engine holds.
    :param modifier_rank: the rank whose values are partitioned again on exit; None: a
        parameter written inside raises StateError.
    :returns: ``(context_manager, those_parameters)``: inside the context they hold their
        whole values on every rank. None when it holds none of them.
    """
