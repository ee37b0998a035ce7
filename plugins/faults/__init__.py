"""What a run of several ranks does when one fails, stalls or takes another path than the
others (docs/reliability.md, section 11; the ``[faults]`` table; the contract in
:mod:`zeroplug.faults`). A built-in plugin on ``zeroplug_engine_created``.

torch's own mechanisms come first: torchrun's elastic agent ends every rank when one exits
with an error or is killed; the process group's timeout ends a collective that waits longer
than it (NCCL, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, aborts its communicator); torch's
flight recorder keeps the last collectives of every group. This plugin adds what those
cannot do, for ranks that are alive:

* comparisons (:mod:`.agree`): ranks about to run different collectives (an expert that runs
  on some ranks only, a branch, a loop that ends early, different checkpoint directories,
  different settings) learn it before they block, and all stop with one error naming the
  module or argument and the fix;
* the watchdog (:mod:`.watchdog`): a rank that makes no progress inside the engine for
  ``faults.timeout`` seconds, while no other rank does either, writes one line (every rank's
  step, micro-step, phase and last collective; the flight recorder's dump) and exits, so
  that torchrun's agent ends the others;
* the context line (:mod:`.context`): a rank that raises says where it was;
* the exit (:mod:`.shutdown`): the ranks meet once more, then what zeroplug started ends in
  order.

The state of the process (its record, the watchdog, the comparisons' gloo group) is shared
by its engines; each engine's :class:`Faults` is its ``engine.run.faults``.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import weakref

from zeroplug import hookimpl
from zeroplug.errors import RanksDisagree
from zeroplug.faults import NoFaults

from .agree import KINDS, UNIT_KINDS, Agreement, describe_mine, explain, text_hash
from .record import Record
from .watchdog import Watchdog


class ProcessState:
    """What the engines of this process share."""

    def __init__(self):
        self.record = Record()
        self.watchdog: Watchdog | None = None
        self.agreement: Agreement | None = None
        self.rank, self.world = 0, 1
        self.engines: list = []         # weakrefs, in the order the engines were made
        self.open_engines = 0           # engines made and not closed (alive or not)
        self.exception_seen = False
        self.sigterm_handled = False    # the main thread ran its SIGTERM handler (context.py)


STATE = ProcessState()
_ordinal = itertools.count(1)


@hookimpl(tryfirst=True)
def zeroplug_engine_created(engine):
    if engine.run.world_size > 1:
        engine.run.faults = Faults(engine)
        engine.run.faults.agree_config(engine.config)


@hookimpl
def zeroplug_phase(engine, phase):
    faults = engine.run.faults
    if isinstance(faults, Faults):
        faults.record.phase(phase)


class Faults(NoFaults):
    """An engine's part: its calls tracked in the process's record, its comparisons."""

    def __init__(self, engine):
        run = engine.run
        self.options = engine.config.faults
        self.rank, self.world = run.rank, run.world_size
        self.ordinal = next(_ordinal)       # engines are made in the same order on every rank
        self.engine_ref = weakref.ref(engine)
        self.closed = False
        self._path = (0, None, None)    # the forward's units (forward_path): compared with each backward
        st = STATE
        self.record = st.record
        st.rank, st.world = self.rank, self.world
        st.record.track(engine, cpu=run.device.type == "cpu")
        st.engines.append(weakref.ref(engine))
        st.open_engines += 1
        self._state = st
        # Note: torch's flight recorder reads this at the first collective it records
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        if self.options.check_paths and st.agreement is None:
            import torch.distributed as dist
            st.agreement = Agreement(dist.new_group(backend="gloo"), self.rank, self.world)
        self.agreement = st.agreement if self.options.check_paths else None
        if self.options.timeout > 0:
            if st.watchdog is None:
                st.watchdog = Watchdog(st, self.options.timeout)
                st.watchdog.start()
            st.watchdog.limit = self.options.timeout
        from .context import install
        from .shutdown import register
        install(st)
        register(st)

    # -- the engine's calls --------------------------------------------------------------
    def enter(self, activity, engine=None) -> None:
        if engine is not None and self.record.engine_ref() is not engine:
            self.record.track(engine)
        self.record.enter(activity)
        if activity in ("forward", "backward", "step") and self._state.watchdog is not None:
            self._state.watchdog.nudge()
        if activity == "close" and not self.closed:
            self.closed = True
            self._state.open_engines -= 1

    def leave(self) -> None:
        self.record.leave()

    def raised(self, exc: BaseException) -> None:
        self.record.raised(exc)

    def io(self, on: bool) -> None:
        self.record.busy += 1 if on else -1

    # -- comparisons ---------------------------------------------------------------------
    def forward_path(self, key: int, path=None, describe=None) -> None:
        self._path = (key, path, describe)

    def issued(self, kind: str, index: int, describe=None) -> None:
        self.record.issued(kind, index, describe)

    def agree(self, kind: str, index: int = -1, describe=None, detail: str = "", path=None) -> None:
        a = self.agreement
        if a is None:
            return
        engine = self.engine_ref()
        step = engine.global_step if engine is not None else 0
        micro = engine.micro_step if engine is not None else 0
        rec = self.record
        if kind in UNIT_KINDS:
            rec.issued(kind, index, describe)
        if kind == "backward":      # with the units its forward ran
            key, path, describe = self._path
            detail = str(key) if key else ""
        # Note: a unit's collective pairs with the same unit's on the other ranks wherever they
        # are within the step: a reduction that one rank's backward reaches is in the optimizer
        # step on a rank whose backward did not (after its micro-step ended)
        within = 0 if kind in UNIT_KINDS else micro
        rec.inside += 1         # waiting for the others arms the watchdog, wherever it happens
        try:
            same = a.compare([KINDS[kind], self.ordinal, step, within, index, text_hash(detail) if detail else 0])
        finally:
            rec.inside -= 1
            rec.tick()
        if same:
            return
        mine = describe_mine(kind, index, describe, detail, rec.where(collective=False), self.rank, step, micro,
                             path)
        message = explain(a.descriptions(mine), engine.module if engine is not None else None)
        rec.failed = "the ranks are on different paths"
        raise RanksDisagree(message)

    def agree_config(self, config) -> None:
        """Every rank runs the same settings (batch sizes, accumulation, stage, precision,
        optimizer): else each raises, naming the keys that differ and each rank's value."""
        if self.agreement is None:
            return
        flat = config_items(config)
        self.record.enter("initialize")
        try:
            same = self.agreement.compare([KINDS["config"], self.ordinal, 0, 0, -1,
                                           text_hash(repr(sorted(flat.items())))])
            if same:
                return
            every = self.agreement.descriptions(flat)
        finally:
            self.record.leave()
        keys = sorted({k for d in every for k in d if len({repr(e.get(k)) for e in every}) > 1})
        diff = "; ".join(f"{k} = " + ", ".join(f"{e.get(k)!r} on rank {r}" for r, e in enumerate(every))
                         for k in keys[:6])
        exc = RanksDisagree(f"the ranks run different settings: {diff}. Every rank must run the same "
                            f"configuration (the same file, overrides and DeepSpeed JSON)")
        self.record.raised_in = (exc, "zeroplug.initialize")
        self.record.failed = "the ranks run different settings"
        raise exc


def config_items(config) -> dict:
    """The settings every rank must share, flattened to ``table.key``: the batch, and each
    slot's plugin and options but the offload tiers' and the monitor's (paths, which may
    differ per host or rank)."""
    out = {f"batch.{f.name}": getattr(config.batch, f.name) for f in dataclasses.fields(config.batch)}
    for path, choice in config.slots.items():
        out[f"{path}.plugin"] = choice.name
        if path.startswith("offload.") or path == "monitor":
            continue
        if dataclasses.is_dataclass(choice.options):
            for f in dataclasses.fields(choice.options):
                out[f"{path}.{f.name}"] = repr(getattr(choice.options, f.name))
    return out
