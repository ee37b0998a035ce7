"""The contract between a ZeRO stage and an offload tier.

The stage owns the layout (units, shards, sub-groups), the reductions, the gathers and
their order. The tier owns where states live between uses and how they move. They meet
only through the records and methods below, each documented where it is defined (and as
a table in docs/plugins.md, "Writing an offload tier"); a tier never reads the stage's
objects and the stage never reads a tier's options.

An :class:`OffloadTier` fills ``[offload.optimizer]`` (kind ``"optimizer"``: fp32 masters,
their gradients and the optimizer's states) or ``[offload.param]`` (kind ``"param"``,
stage 3: the model-dtype parameter shards). The base class implements every method the
simple way (every state in the tier's memory, every copy synchronous), so a tier overrides
only what it does differently; the built-in "cpu" and "nvme" tiers pipeline the step.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol, runtime_checkable

import torch

from .errors import ConfigError
from .flat import set_grad


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier tells the stage about itself (fixed for the tier's life)."""
    #: states live apart from the model's parameters: the stage goes through this contract
    #: (False: they stay on the training device with the model, and the stage keeps them)
    offloaded: bool = True
    #: every state (or shard) stays in memory between uses; False: ``export(k)`` / ``fetch(u)``
    #: bring one in, and checkpoints stream one sub-group at a time
    in_memory: bool = True
    #: elements the tier moves and steps best at a time (None: no preference). The stage cuts
    #: its sub-groups, and below stage 3 its gradient buckets, at most this large; smaller
    #: sizes from the config still win
    granularity: int | None = None
    #: the tier can run with ``Layout.publish`` False: its masters stay in memory between
    #: steps, where the stage reads them, and it writes no model-dtype shard
    publish_optional: bool = False


@dataclass(frozen=True)
class UnitShard:
    """One unit's shard of this rank as the tier sees it."""
    index: int              # the stage's name for the unit (grad_ready, fetch, update, ...)
    start: int              # offset of its first element in the rank's master numbering
    shard: torch.Tensor     # its model-dtype shard: initial master values, published values

    @property
    def numel(self) -> int:
        return self.shard.numel()


@dataclass(frozen=True)
class SubGroup:
    """The unit of stepping and moving: whole unit shards, consecutive in the numbering."""
    start: int              # [start, end) of the rank's master numbering
    end: int
    units: tuple[int, ...]  # positions in Layout.units
    group: int              # the parameter group (its settings are optimizer param group k's)

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    """What the stage hands the tier in ``plan``."""
    units: tuple[UnitShard, ...]
    sub_groups: tuple[SubGroup, ...]      # empty for kind "param"
    param_dtype: torch.dtype
    device: torch.device                  # the training device
    #: reduced gradients are exact in this dtype (the model's with one rank or a model-dtype
    #: reduction and no accumulation; else fp32): a tier may hold gradients in it
    exact_grad_dtype: torch.dtype = torch.float32
    #: the stage calls wait(k) before it gathers a unit of sub-group k (stage 3), so step()
    #: may return while sub-groups are still stepping
    gathers_per_unit: bool = False
    #: every parameter shard stays in memory (False: publish only through write_shard)
    shards_in_memory: bool = True
    #: ``with write_shard(unit) as shard:`` new values for a unit's shard (persisted after)
    write_shard: Callable[[int], ContextManager[torch.Tensor]] | None = None
    #: False (only where ``capabilities.publish_optional``): stage 3 gathers the trainable units
    #: from the fp32 masters themselves (``zero.stage3_params_from_masters``): the units' shards
    #: hold no values after ``plan``, and the step writes none (no ``lp_out``, no ``publish``)
    publish: bool = True


@dataclass(frozen=True)
class HostBytes:
    """Host memory a tier will hold: page-locked (``pinned``) and ordinary (``pageable``)
    bytes, and what they are (for messages)."""
    pinned: int = 0
    pageable: int = 0
    what: str = ""

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


@runtime_checkable
class SubGroupOptimizer(Protocol):
    """An optimizer that steps one param group (an offloaded sub-group) in one pass and may
    allocate a group's states ahead of its first step (cpu_adam is one).

    A stage or tier never calls these directly: :func:`step_group` and
    :func:`init_group_states` call them on such an optimizer and do the plain-torch thing on
    any other ``torch.optim.Optimizer``."""

    def step_group(self, k: int, lp_out=None, grad_multiplier: float = 1.0, threads: int | None = None) -> None:
        """Step param group ``k`` alone: gradients multiplied by ``grad_multiplier`` inside
        the pass (the call may run on a worker thread after ``engine.step()`` returned), the
        updated values rounded into ``lp_out`` (a tensor, or a list of tensors holding the
        group's elements in order) when given, with ``threads`` threads (None: its own)."""

    def init_group_states(self, k: int) -> None:
        """Allocate param group ``k``'s states now (else its first step does)."""


def fp32_multiplier(factor: float) -> float:
    """The gradient multiplier of a step whose unscale x clip factor is ``factor``: the
    multiplier an fp32 ``grad_scale`` of ``1 / factor`` stands for in torch's fused
    kernels, so that an optimizer handed the multiplier and one handed that ``grad_scale``
    compute the same values."""
    return 1.0 if factor == 1.0 else 1.0 / float(torch.tensor(1.0 / factor, dtype=torch.float32))


def init_group_states(optimizer, k: int) -> None:
    """Allocate the states of optimizer param group ``k`` now on a
    :class:`SubGroupOptimizer` (others create theirs in their first step)."""
    if isinstance(optimizer, SubGroupOptimizer):
        optimizer.init_group_states(k)


def _torch_step(optimizer, grad_multiplier: float) -> None:
    """``optimizer.step()``, gradients multiplied by ``grad_multiplier``: a multiplier other
    than 1 reaches only optimizers that apply it in their own pass (``takes_grad_scale``),
    torch's fused ones through their own ``grad_scale`` attribute, set around the call."""
    if grad_multiplier == 1.0:
        optimizer.step()
        return
    device = next(p.device for g in optimizer.param_groups for p in g["params"])
    optimizer.grad_scale = torch.tensor(1.0 / grad_multiplier, dtype=torch.float32, device=device)
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None


def step_all(optimizer, grad_multiplier: float = 1.0) -> None:
    """Step every param group of ``optimizer`` (those of its parameters that have a
    gradient), gradients multiplied by ``grad_multiplier`` inside the optimizer's pass."""
    if isinstance(optimizer, SubGroupOptimizer):
        for k in range(len(optimizer.param_groups)):
            optimizer.step_group(k, grad_multiplier=grad_multiplier)
        return
    _torch_step(optimizer, grad_multiplier)


def step_group(optimizer, k: int, lp_out=None, grad_multiplier: float = 1.0, threads=None) -> bool:
    """Step optimizer param group ``k`` (sub-group k) alone, gradients multiplied by
    ``grad_multiplier``; True if ``lp_out`` was written.

    A :class:`SubGroupOptimizer` steps group k in one pass and writes ``lp_out``. Any other
    ``torch.optim.Optimizer`` steps with its param groups narrowed to group k (``lp_out``
    and ``threads`` unused)."""
    if isinstance(optimizer, SubGroupOptimizer):
        optimizer.step_group(k, lp_out=lp_out, grad_multiplier=grad_multiplier, threads=threads)
        return lp_out is not None
    groups = optimizer.param_groups
    optimizer.param_groups = [groups[k]]
    try:
        _torch_step(optimizer, grad_multiplier)
    finally:
        optimizer.param_groups = groups
    return False


def reads_grad_dtype(run, dtype: torch.dtype, state_device: torch.device) -> bool:
    """Whether the selected optimizer reads gradients of ``dtype`` for fp32 masters on
    ``state_device`` (its factory's declared ``grad_dtypes``)."""
    choice = run.config.slot("optimizer")
    return dtype in choice.impl.grad_dtypes(choice.options, run, state_device)


def optimizer_state_bytes(run, state_device: torch.device) -> float:
    """Bytes per master element of the selected optimizer's states on ``state_device`` (its
    factory's declared ``state_bytes``)."""
    choice = run.config.slot("optimizer")
    return float(choice.impl.state_bytes(choice.options, run, state_device))


def full_precision_states(optimizer) -> bool:
    """Whether ``optimizer`` holds its element-wise states in fp32: an optimizer may declare
    ``state_dtype`` ("fp32", "bf16", "int8": cpu_adam does); one that declares none does.
    A tier that steps states with another kernel (torch's fused AdamW on the GPU) needs them."""
    return getattr(optimizer, "state_dtype", "fp32") == "fp32"


class OffloadTier:
    """Where a kind of state ("optimizer" or "param") lives between uses, and its movement."""
    @dataclass(frozen=True)
    class Options:
        pass

    #: the slots it can fill
    kinds: tuple[str, ...] = ("optimizer", "param")

    def __init__(self, options, run, kind: str):
        self.options, self.run, self.kind = options, run, kind
        self.layout: Layout | None = None
        self.masters: list[torch.Tensor] = []      # kind "optimizer", after plan()
        self.unit_masters: dict[int, torch.Tensor] = {}   # unit -> its view of its sub-group's master
        self._at: dict[int, tuple[int, int, int]] = {}   # unit -> (sub-group, offset in it, numel)
        self._stash: dict = {}

    @classmethod
    def check_config(cls, config, choice) -> None:
        kind = choice.path.split(".")[-1]
        if kind not in cls.kinds:
            raise ConfigError(f"{choice.path}.plugin = \"{choice.name}\" holds only "
                              f"{' and '.join(cls.kinds)} states; choose another tier for [{choice.path}]",
                              key=f"{choice.path}.plugin")

    @classmethod
    def cpu_workers(cls, options, run, kind: str) -> dict[str, int]:
        """Threads of its own that run beside the optimizer's step and each want a core, by
        kind (``{"copy": 2}``; threads that mostly wait for the disk or the device are not
        counted): cpu_adam's CPU plan leaves them cores. Default: none."""
        return {}

    @property
    def device(self) -> torch.device:
        """Where the optimizer finds masters, gradients and states (it is built for it)."""
        return self.run.device

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(offloaded=self.device != self.run.device)

    def host_bytes(self, numel: int, param_dtype: torch.dtype) -> HostBytes:
        """The host memory this tier will hold for ``numel`` elements of this rank's shard
        (kind "optimizer": fp32 masters with their gradients and the optimizer's states,
        :func:`optimizer_state_bytes`; kind "param": model-dtype shards). ``initialize`` asks
        before anything is allocated and refuses a run whose tiers do not fit the host
        (:mod:`zeroplug.host_budget`). The default: nothing when the states stay with the
        model; else master, fp32 gradient and states, pageable, in a host tier."""
        if not self.capabilities.offloaded or self.device.type != "cpu" or numel <= 0:
            return HostBytes()
        if self.kind == "param":
            size = torch.empty((), dtype=param_dtype).element_size()
            return HostBytes(pageable=size * numel, what=f"{numel:,} parameter elements x {size} bytes")
        states = optimizer_state_bytes(self.run, self.device)
        return HostBytes(pageable=int((8 + states) * numel),
                         what=f"{numel:,} master elements x {8 + states:g} bytes: master 4 + gradient 4 + "
                              f"optimizer states {states:g}")

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer in this tier (stage 3 allocates parameter shards with it)."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    # -- kind "optimizer" --------------------------------------------------------------
    def plan(self, layout: Layout) -> None:
        """Called once: check that the states fit (raise a clear error now if not), allocate
        ``masters`` (one fp32 tensor per sub-group, filled from the units' shards, each with a
        ``.grad``), ``unit_masters`` (each unit's view of its elements in its sub-group's master,
        made before any storage leaves memory) and whatever else the tier keeps. A master is
        the same tensor object for the tier's life: a tier that moves it out of memory frees
        its storage in place (``zeroplug.flat.free_storage``) and refills it, so views and the
        optimizer's state keys stay valid. Kind "param": the shards the tier holds (already allocated with
        ``empty`` and filled), which it may move out of memory until ``fetch``."""
        self.layout = layout
        self.masters = []
        for k, sg in enumerate(layout.sub_groups):
            m = self.empty(sg.numel, torch.float32)
            set_grad(m, self.empty(sg.numel, torch.float32).zero_())
            for i in sg.units:
                u = layout.units[i]
                view = m[u.start - sg.start:u.start - sg.start + u.numel]
                view.copy_(u.shard)
                self.unit_masters[u.index] = view
                self._at[u.index] = (k, u.start - sg.start, u.numel)
            self.masters.append(m)

    def grad_ready(self, unit: int, src: torch.Tensor | None, accumulate: bool) -> None:
        """Backward: ``src`` is this rank's reduced gradient shard of ``unit`` on the training
        device (valid until the current stream's later work); ``accumulate`` adds it to what
        the window already holds. ``src`` None: no gradient reached the unit in this window."""
        k, off, n = self._at[unit]
        dst = self.masters[k].grad[off:off + n]
        if src is None:
            dst.zero_()
        elif accumulate:
            dst.add_(src.to(dst.device, dst.dtype))
        else:
            dst.copy_(src)

    def prepare(self, optimizer) -> None:
        """The optimizer exists (called once, inside ``initialize``, after :meth:`plan`):
        allocate its states and the step's buffers here rather than in the first step."""

    def grads_landed(self) -> None:
        """Return once every gradient handed to grad_ready is in place (before the norm)."""

    def step(self, optimizer, grad_multiplier: float = 1.0) -> None:
        """Step every sub-group (the engine has set the lr), gradients multiplied by
        ``grad_multiplier`` (the engine's unscale x clip factor, or 1 when the engine
        multiplied them already), and publish the new values into the units' shards. The
        default is serial::

            for k: acquire(k); step_group(optimizer, k, grad_multiplier=...); publish(k); release(k)

        A tier may order, overlap or pipeline this as it likes; with
        ``layout.gathers_per_unit`` it may return before every sub-group is done, as long as
        wait(k), ready(k) and wait_all() tell the truth."""
        for k in range(len(self.masters)):
            self.acquire(k, optimizer)
            step_group(optimizer, k, grad_multiplier=grad_multiplier)
            self.publish(k, optimizer)
            self.release(k, optimizer, changed=True)

    def speculate(self, optimizer, loss_scale: float | None) -> bool:
        """True: steps during this boundary backward; None: undo that unless a step() validated it."""
        return False

    def acquire(self, k: int, optimizer) -> None:
        """Sub-group k's master, gradient and optimizer states (``optimizer.state[masters[k]]``,
        created by the optimizer at its first step) in memory on ``device``."""

    def publish(self, k: int, optimizer) -> None:
        """Sub-group k's updated masters, rounded to the model dtype, into its units' shards."""
        if not self.layout.publish:
            return
        sg = self.layout.sub_groups[k]
        for i in sg.units:
            u = self.layout.units[i]
            a = u.start - sg.start
            with self.layout.write_shard(u.index) as shard:
                shard.copy_(self.masters[k][a:a + u.numel])

    def release(self, k: int, optimizer, changed: bool) -> None:
        """The step (or checkpoint) is done with sub-group k: keep it, or move it out
        (``changed``: its values are new and must be written back)."""

    def wait(self, k: int) -> None:
        """Return once sub-group k is stepped and published, with the current stream's later
        work ordered after its upload (stage 3 calls it before gathering a unit of k)."""

    def ready(self, k: int) -> bool:
        """Whether wait(k) would return at once (the stage prefetches only such units)."""
        return True

    def wait_all(self) -> None:
        """Return once the last step is finished, raising its error if it failed."""

    def in_flight(self) -> bool:
        """Whether a step is still running after step() returned."""
        return False

    @contextmanager
    def export(self, k: int, optimizer):
        """Sub-group k's master and states in memory, to be read, for the block."""
        self.acquire(k, optimizer)
        try:
            yield self.masters[k]
        finally:
            self.release(k, optimizer, changed=False)

    @contextmanager
    def import_(self, k: int, optimizer):
        """Sub-group k in memory for the block, which writes new values (and may give the
        optimizer new state tensors for it); written back after."""
        self.acquire(k, optimizer)
        try:
            yield self.masters[k]
        finally:
            self.release(k, optimizer, changed=True)

    # -- kind "param" ------------------------------------------------------------------
    def fetch(self, unit: int) -> None:
        """Return once ``unit``'s shard holds its values in memory (before it is uploaded)."""

    def prefetch(self, unit: int) -> bool:
        """Start bringing ``unit``'s shard in; True if it lives out of memory (the stage then
        gathers it at its use), False if it is in memory already."""
        return False

    def evict(self, unit: int, after=None) -> None:
        """``unit`` was released: its shard may leave memory once ``after`` (a CUDA event of
        the upload that read it, or None) is done."""

    @contextmanager
    def update(self, unit: int):
        """``with update(u) as shard:`` new values for the shard, persisted after the block."""
        yield self._shard(unit)

    def absent(self, unit: int) -> bool:
        """Whether ``unit``'s shard lives out of memory between uses."""
        return False

    def all_in(self) -> ContextManager:
        """Every shard in memory for the block, read-only."""
        return nullcontext()

    def _shard(self, unit: int) -> torch.Tensor:
        return next(u.shard for u in self.layout.units if u.index == unit)

    # -- both ----------------------------------------------------------------------------
    def stash(self, key, data: torch.Tensor, non_blocking: bool = False) -> bool:
        """``engine.offload_states``: keep a copy of ``data`` (one storage's bytes) under
        ``key``; the engine then frees the storage. False: the bytes are already where this
        tier would put them (nothing is moved)."""
        if data.device == self.device:
            return False
        self._stash[key] = data.to(self.device, copy=True, non_blocking=non_blocking)
        return True

    def unstash(self, key, out: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy ``key``'s bytes back into ``out`` and forget them."""
        out.copy_(self._stash.pop(key), non_blocking=non_blocking)

    def close(self) -> None:
        """Release files and buffers (called at exit and on errors)."""
        self._stash.clear()


@contextmanager
def all_exported(tier: OffloadTier, optimizer):
    """Every sub-group of ``tier`` in memory for the block (read-only)."""
    with ExitStack() as stack:
        for k in range(len(tier.masters)):
            stack.enter_context(tier.export(k, optimizer))
        yield


#: the same class under the name of its registration hook (zeroplug_register_offload_devices)
OffloadDevice = OffloadTier
