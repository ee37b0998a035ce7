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
and extend. A hook with ``firstresult`` stops at the first non-None answer. A hook
implementation whose name matches no hook here is an error when its plugin registers
(pluggy's ``check_pending``), so a misspelled hook never goes silently uncalled.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("zeroplug")
hookimpl = pluggy.HookimplMarker("zeroplug")


# --- registration: one hook per slot ---------------------------------------

@hookspec
def zeroplug_register_partitioners(register):
    """Register ZeRO stages (the ``[zero]`` slot).

    Called once at plugin-manager setup. ``register(name, cls)`` with ``cls``
    following :class:`zeroplug.slots.Partitioner`. Returns nothing.
    """


@hookspec
def zeroplug_register_precisions(register):
    """Register precisions (the ``[precision]`` slot: fp32, bf16, fp16, ...).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.Precision`. Returns nothing.
    """


@hookspec
def zeroplug_register_optimizers(register):
    """Register optimizers (the ``[optimizer]`` slot).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.OptimizerFactory`: it builds a ``torch.optim.Optimizer``
    over the master tensors of one rank's shard. Returns nothing.
    """


@hookspec
def zeroplug_register_schedulers(register):
    """Register learning-rate schedules (the ``[scheduler]`` slot).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.Scheduler`. Returns nothing.
    """


@hookspec
def zeroplug_register_offload_devices(register):
    """Register offload tiers (the ``[offload.optimizer]`` and ``[offload.param]`` slots).

    Called once at setup. ``register(name, cls)`` with ``cls`` a subclass of
    :class:`zeroplug.tiers.OffloadTier`: the contract between a ZeRO stage and a tier
    (where states live, how they move), documented method by method there and in
    docs/plugins.md, "Writing an offload tier". Returns nothing.
    """


@hookspec
def zeroplug_register_monitors(register):
    """Register monitors (the ``[monitor]`` slot: stdout lines, CSV, ...).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.Monitor`. Returns nothing.
    """


@hookspec
def zeroplug_register_activations(register):
    """Register where checkpointed activations wait (the ``[activation_checkpointing]`` slot:
    none keeps them on the device, cpu in host memory).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.ActivationStore`. Returns nothing.
    """


@hookspec
def zeroplug_register_sequence(register):
    """Register how the ranks share long sequences (the ``[sequence]`` slot: none, or ulysses:
    each sequence sliced over a group of ranks, attention exchanging heads for sequence, the MLP
    and the head's loss computed in tiles).

    Called once at setup. ``register(name, cls)`` with ``cls`` following
    :class:`zeroplug.slots.SequenceStrategy`. Returns nothing.
    """


@hookspec
def zeroplug_model_presets():
    """Called by ``zeroplug estimate`` / ``zeroplug tune`` (and ``zeroplug.tools.probe.load_spec``)
    to name the models ``--model`` accepts. Returns ``{name: spec(checkpointing)}``, where
    ``spec`` returns a :class:`zeroplug.tools.probe.ModelSpec` (how to build the model at a
    given depth, its vocabulary and longest sequence), or None. The built-in ``workload``
    plugin names the reference GPT's presets.
    """


@hookspec
def zeroplug_add_commands(subparsers):
    """Called once while the ``zeroplug`` command line is built, with argparse's
    ``subparsers``: a plugin adds its own subcommands, each with ``set_defaults(fn=...)``
    (``fn(args, overrides)``, overrides the command line's ``--section.key=value`` items, returns
    the exit status; a :class:`zeroplug.ZeroplugError` it raises is
    printed as one ``error:`` line, exit 2). The built-in ``workload`` plugin adds ``train``.
    Returns nothing.
    """


# --- lifecycle ---------------------------------------------------------------

@hookspec
def zeroplug_engine_created(engine):
    """Called at the end of ``zeroplug.initialize``, once every slot is filled.

    ``engine`` is ready to train. Returns nothing.
    """


@hookspec
def zeroplug_engine_setup(engine):
    """Called during ``zeroplug.initialize`` once the engine's states, optimizer and
    schedule exist, before the ranks meet at its end: set-up work that every rank does and
    that the first step should not pay for (the built-in ``warmup`` plugin runs the CUDA
    warm-up here). Returns nothing.
    """


@hookspec
def zeroplug_phase(engine, phase):
    """Called as a step enters ``phase``: one of :data:`zeroplug.observe.phases.PHASES`
    ("forward", "backward", "wait_gradients", "optimizer", and "other" when the step has
    ended and the loop's own work begins). Called several times per micro-step, so keep
    it cheap: record, do not synchronise (the built-in ``observe`` plugin records a CUDA
    event or a clock reading and reports ``phase_*`` metrics in ``zeroplug_step_end``).
    Returns nothing.
    """


@hookspec
def zeroplug_step_begin(engine):
    """Called at the start of an optimizer step (gradient-accumulation boundary),
    after gradients are reduced and before they are unscaled, clipped and applied.
    Returns nothing.
    """


@hookspec
def zeroplug_step_end(engine, metrics):
    """Called after an optimizer step (taken or skipped) with the step's metrics
    (a dict: ``step``, ``loss``, ``lr``, ``loss_scale``, ``grad_norm``,
    ``skipped``, ...). A plugin may add keys to ``metrics``; monitors see them.
    Returns nothing.
    """


@hookspec
def zeroplug_engine_closed(engine):
    """Called by ``engine.close()`` once the last optimizer step has finished, before the
    offload tiers release their buffers and files (monitors flush here). Returns nothing.
    """


@hookspec
def zeroplug_checkpoint_state_save(engine):
    """Called while a checkpoint is written on each rank.

    Returns a dict ``{name: state}`` of extra state to store in this rank's
    shard (tensors and plain Python values only), or None.
    """


@hookspec
def zeroplug_checkpoint_state_load(engine, states):
    """Called while a checkpoint is loaded, with ``states``: every dict that
    ``zeroplug_checkpoint_state_save`` returned when it was written, merged.
    A plugin takes its own keys. Returns nothing.
    """


@hookspec
def zeroplug_offload_states(engine, include, device, pin_memory, non_blocking, nvme_path):
    """Called by ``engine.offload_states`` with the set of state names (``include``), the
    tier's name (``device``: "cpu", "nvme" or another registered tier) and the call's
    options. The built-in ``offload_states`` plugin moves the engine's own states first
    (``tryfirst``); a plugin that holds device copies of its own moves them here too.
    Returns nothing.
    """


@hookspec
def zeroplug_reload_states(engine, non_blocking):
    """Called by ``engine.reload_states``: every state offloaded comes back, bit-identical
    (the built-in ``offload_states`` plugin first). Returns nothing.
    """


@hookspec(firstresult=True)
def zeroplug_state_devices(engine, state):
    """Called by ``zeroplug.get_state_devices(engine, state)``: the set of devices where
    the state named ``state`` lives now (offloaded data counts as ``cpu``), or None when
    this plugin does not track offloaded states.
    """


@hookspec(firstresult=True)
def zeroplug_memory_report(engine):
    """Called by ``engine.memory_report()``: returns a dict of bytes held per category now
    (low-precision parameters, masters, gradients, optimizer states, communication buckets,
    prefetch window; device and host), or None. The built-in ``observe`` plugin answers.
    """


@hookspec(firstresult=True)
def zeroplug_gathered_params(params, modifier_rank):
    """Called by ``zeroplug.gathered_parameters(params, modifier_rank)`` (and
    ``deepspeed.zero.GatheredParameters``) for parameters that no engine holds: a plugin
    that partitioned some of them while the model was built (``zeroplug.init``) returns
    ``(context_manager, those_parameters)``; inside the context they hold their whole
    values on every rank, and on exit the values of rank ``modifier_rank`` are partitioned
    again (None: a parameter written inside raises StateError). Returns None when it holds
    none of them.
    """
