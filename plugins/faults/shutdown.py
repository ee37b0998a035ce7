"""The end of a process that ran engines of several ranks, in order.

One exit handler, registered when the first such engine is created (after the one of
:mod:`zeroplug.launch` that destroys the default gloo group, so it runs before it: atexit
runs handlers last-in first-out):

1. a process that ends normally (no uncaught exception) with an engine it never closed meets
   the other ranks once more (``exit``, a comparison of :mod:`.agree`). A rank whose loop
   ended early (its data ran out, it stopped) meets there another rank's next comparison: both
   learn it, and this one exits with status 1 and one line instead of 0. Its wait is not
   bounded by the watchdog (another rank may still write a model of its own for minutes);
   torch's process-group timeout bounds it;
2. every engine still alive and not closed is closed, in the order the engines were made (the
   same on every rank): a save in flight is finished, the overlapped optimizer step waited
   for, the tiers' threads and files (cpu_adam's step worker, the swapper's threads and swap
   directory) ended;
3. the watchdog thread is stopped, and the comparisons' gloo group destroyed (with an NCCL
   default group too: a gloo group alive at exit can abort the process, see
   :mod:`zeroplug.launch`);
4. then :mod:`zeroplug.launch`'s handler destroys the default gloo group.

Note: Python has joined the non-daemon threads (a background save's writer, thread pools'
workers) before atexit handlers run. A process that ends with an uncaught exception skips 1
and 2: the other ranks may be gone or blocked, and nothing may wait for them.
"""
from __future__ import annotations

import logging
import atexit
import sys

from .agree import KINDS, describe_mine, explain
from .context import first_line
from .watchdog import end_process

log = logging.getLogger("zeroplug")

_registered = False


def register(state) -> None:
    global _registered
    if not _registered:
        _registered = True
        atexit.register(at_exit, state)


def meet_at_exit(state) -> bool:
    """The ``exit`` comparison (1 above): ends the process when the ranks disagree; False when
    another rank is gone (this process is ending after a failure already, with its status)."""
    a, rec = state.agreement, state.record
    rec.activity = "exit"       # (not armed: see 1 above)
    try:
        if a.compare([KINDS["exit"], 0, rec.completed, 0, -1, 0]):
            return True
        where = f"the end of the script after step {rec.completed}"
        mine = describe_mine("exit", -1, None, "", where, state.rank, rec.completed, 0)
        message = explain(a.descriptions(mine), None)
    except Exception as exc:        # another rank is gone
        log.debug("faults: the ranks' meeting at exit failed: %r", exc)
        return False
    rec.failed = "the ranks are on different paths"
    end_process(f"error: rank {state.rank}: at exit: {message}", 1)
    return False


def end_group(group) -> None:
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except (RuntimeError, ValueError) as exc:     # already gone with the default group
        log.debug("faults: destroying the comparisons' group: %r", exc)


def at_exit(state) -> None:
    if not state.exception_seen and not state.record.failed:
        if state.agreement is not None and state.open_engines > 0 and not meet_at_exit(state):
            state.engines.clear()       # the others are gone: nothing may wait for them
        for engine in [e for e in (ref() for ref in state.engines) if e is not None]:
            if engine.run.faults.closed:
                continue
            try:
                engine.close()
            except Exception as exc:     # another rank on another path, gone, or a failed save
                end_process(f"error: rank {state.rank}: at exit, closing the engine: {first_line(exc)}", 1)
    if state.watchdog is not None:
        state.watchdog.stop()
        state.watchdog.join(timeout=2.0)
    if state.agreement is not None:         # the comparisons' gloo group (a gloo group alive at exit
        end_group(state.agreement.group)    # can abort the process: zeroplug.launch)
        state.agreement = None
    try:
        sys.stderr.flush()
    except (OSError, ValueError):   # (stderr closed)
        pass
