"""The end of a process that ran engines of several ranks, in order.

One exit handler, registered when the first such engine is ready (after the one of
:mod:`zeroplug.launch` that destroys the default gloo group, so it runs before it: atexit
runs handlers last-in first-out):

1. a process that ends normally (no uncaught exception) meets the other ranks once more
   (``exit``: the comparison of :mod:`.agree`). A rank whose loop ended early (its data ran
   out, it stopped) meets there another rank's next comparison: both learn it, and this one
   exits non-zero with one line instead of 0;
2. every engine not closed is closed, in the order the engines were made (the same on every
   rank): a save in flight is finished, the overlapped optimizer step waited for, the tiers'
   threads and files (cpu_adam's step worker, the swapper's threads and swap directory) ended;
3. the watchdog thread is stopped;
4. then :mod:`zeroplug.launch`'s handler destroys the default gloo group.

Note: Python has joined the non-daemon threads (a background save's writer, thread pools'
workers) before atexit handlers run. A process that ends with an uncaught exception skips 1
and 2: the other ranks may be gone or blocked, and nothing may wait for them.
"""
from __future__ import annotations

import atexit
import sys

from .watchdog import end_process

_registered = False


def register(state) -> None:
    global _registered
    if not _registered:
        _registered = True
        atexit.register(at_exit, state)


def at_exit(state) -> None:
    engines = [e for e in (ref() for ref in state.engines) if e is not None and not e.run.faults.closed]
    if not state.exception_seen and not state.record.failed:
        for engine in engines:
            try:
                engine.run.faults.agree("exit")
                engine.close()
            except Exception as exc:     # another rank on another path, gone, or a failed save
                from .context import first_line
                end_process(f"error: rank {state.rank}: at exit: {first_line(exc)}", 1)
    if state.watchdog is not None:
        state.watchdog.stop()
        state.watchdog.join(timeout=2.0)
    try:
        sys.stderr.flush()
    except Exception:
        pass
