"""The contract of fault handling: the ``[faults]`` options, what the engine's calls and a
stage tell it (``RunContext.faults``), and the clean-ups a rank runs before it is ended.

The built-in ``faults`` plugin (plugins/faults) fills ``engine.run.faults`` when an engine of
several ranks is created (``zeroplug_engine_created``): its watchdog, the ranks' comparisons
before the collectives that depend on a rank's path, the line a failing rank writes, the
ordered exit. Until then, and for one rank, it is :data:`NO_FAULTS`. docs/reliability.md,
section 11.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .options import opt


@dataclass(frozen=True)
class FaultOptions:
    """What a run of several ranks does when one fails, stalls or takes another path than the others."""
    timeout: float = opt(
        60.0, "Seconds without progress after which the run stops: while a rank is inside an engine call "
              "(forward, backward, step, close) or waits for the other ranks, and no rank makes progress "
              "(an engine call, a gather or reduction, CPU work of the training thread on a CPU run) for this "
              "long, the rank that sees it writes one line (every rank's step, micro-step, phase and last "
              "collective, the last completed step, the flight recorder's dump) and exits with status 3, so "
              "that torchrun's agent ends the others. Work a rank does outside the engine while the others "
              "wait (its data loader, an evaluation of its own) counts against it; checkpoint I/O does not. "
              "0 turns this watchdog off; torch's process-group timeout (zeroplug train's "
              "--collective-timeout, init_distributed(timeout=...)) still ends a collective that waits "
              "longer than it.", min=0.0)
    check_paths: bool = opt(
        True, "With several ranks: before each collective that depends on the path a rank takes (each "
              "stage-3 gather of a forward, every backward, checkpoint saves and loads, close, the end of the "
              "script) and once at initialize (the settings), the ranks compare what they are about to do in "
              "one small all-reduce on a gloo group of their own; ranks on different "
              "paths (an expert that runs on some ranks only, a branch, a loop that ends early, different "
              "checkpoint directories or settings) all stop with one error naming the module or argument "
              "and the fix, instead of blocking each other. false leaves the comparisons out (a hang is "
              "then ended by the timeout).")


class NoFaults:
    """``RunContext.faults`` of a run of one rank, and of any run until its engine is
    created: nothing to compare, no one to wait for. The faults plugin's object has the
    same methods."""
    closed = False      # engine.close() has run (the exit then leaves the engine alone)

    def enter(self, activity: str, engine=None) -> None:
        """An engine call (``activity``: forward, backward, step, save_checkpoint, ...) begins."""

    def leave(self) -> None:
        """... and ends."""

    def raised(self, exc: BaseException) -> None:
        """The engine call in progress raises ``exc`` (called before :meth:`leave`)."""

    def io(self, on: bool) -> None:
        """Checkpoint I/O begins (True) or ends on this rank: progress that makes no marks."""

    def forward_path(self, key: int, path=None, describe=None) -> None:
        """The forward in progress has run the units whose order ``key`` hashes (``path()``:
        their indices, ``describe(index)`` a unit's module, asked only for a message); the next
        backward's comparison includes it, so ranks whose forwards ran different modules stop
        before their backwards part."""

    def issued(self, kind: str, index: int, describe=None) -> None:
        """A collective that needs no comparison (it follows from what the ranks compared before
        it) is about to start: ``kind`` as for :meth:`agree`; named in messages."""

    def agree(self, kind: str, index: int = -1, describe=None, detail: str = "", path=None) -> None:
        """Every rank is about to do ``kind`` ("all_gather" or "refill" of unit ``index``,
        whose module ``describe(index)`` names for messages; "backward", "save_checkpoint", "load_checkpoint", "close", "exit") with the same
        ``detail`` (an argument every rank must share, or a key of the path its forward took):
        else every rank raises :class:`zeroplug.errors.RanksDisagree` here, before any of them
        blocks in what follows. ``path()``: the units this forward ran so far, in order (asked
        only for the message). Called right before the collective it is about."""


NO_FAULTS = NoFaults()

_aborts: list = []


def at_abort(fn) -> None:
    """Run ``fn()`` before zeroplug ends this process itself (its watchdog, a rank on another
    path at exit): a fast clean-up that must not wait for the training thread, which may be
    blocked in a collective (the nvme tier's swap directories). Each runs within a bounded
    time, on another thread; an error in one is ignored."""
    _aborts.append(fn)


def abort_cleanups() -> list:
    """The clean-ups :func:`at_abort` registered, in order."""
    return list(_aborts)


def _dir_tag(save_dir, tag=None, *args, **kwargs) -> str:
    where = os.path.abspath(os.fspath(save_dir)) if save_dir is not None else "(no directory)"
    return f"{where!r}, tag {tag!r}"


# Note: not the optimizer step: a reduction may legitimately straddle it (a unit whose
# gradients one rank's backward did not reach is reduced in the step on that rank, during the
# backward on another), and what it runs follows from the backward the ranks compared.
_AGREE = {
    "backward": lambda f, e, *a, **k: f.agree("backward"),
    "save_checkpoint": lambda f, e, *a, **k: f.agree("save_checkpoint", detail=_dir_tag(*a, **k)),
    "load_checkpoint": lambda f, e, *a, **k: f.agree("load_checkpoint", detail=_dir_tag(*a, **k)),
    "close": lambda f, e, *a, **k: f.agree("close"),
}


def watched(activity: str):
    """Decorator of an :class:`zeroplug.Engine` method: while it runs the rank counts as inside
    the engine (its watchdog is armed) in ``activity``; where ``activity`` is a call every rank
    makes together (backward, checkpoint saves and loads, close) the ranks first compare it."""
    agree = _AGREE.get(activity)
    io = activity in ("save_checkpoint", "load_checkpoint")

    def wrap(fn):
        @functools.wraps(fn)
        def call(engine, *args, **kwargs):
            faults = engine.run.faults
            faults.enter(activity, engine)
            try:
                if agree is not None:
                    agree(faults, engine, *args, **kwargs)
                if not io:
                    return fn(engine, *args, **kwargs)
                faults.io(True)
                try:
                    return fn(engine, *args, **kwargs)
                finally:
                    faults.io(False)
            except BaseException as exc:
                faults.raised(exc)
                raise
            finally:
                faults.leave()
        return call
    return wrap
