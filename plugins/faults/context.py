"""A rank that raises, or that torchrun's agent ends, says where it was.

``sys.excepthook`` is chained (once per process, when an engine of several ranks is ready):
before Python prints the traceback the rank's record is marked failed and published
(peers.py), so that a rank whose collective then fails because this one is gone names it;
after the traceback one line says which rank stopped, in which step, micro-step and phase,
with which collective last, and (for a collective that failed) where the other ranks were.

SIGTERM (what torchrun's agent sends every rank once one has failed) gets a handler that
writes the same line, naming the other ranks' last records, then hands over to the handler
before it (the nvme tier's removes its swap directory) or to the default action. A Python
handler runs only once the main thread is back in Python, which a rank blocked in a gloo or
NCCL call is not: the signal also wakes the watchdog thread (``signal.set_wakeup_fd``), which
ends such a process itself after a grace second (the line, the clean-ups of
:func:`zeroplug.faults.at_abort`, exit status 143), instead of leaving it to torchrun's
SIGKILL 30 seconds later.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("zeroplug")


#: texts of torch's errors when a collective's partner is gone or silent
COLLECTIVE_FAILURES = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out",
                       "NCCL", "DistNetworkError", "DistBackendError", "gloo")

_installed = False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:1500]}" if line else type(exc).__name__


def collective_failed(exc: BaseException) -> bool:
    import torch.distributed as dist
    return isinstance(exc, getattr(dist, "DistError", ())) or any(s in str(exc) for s in COLLECTIVE_FAILURES)


def context_line(exc: BaseException, state) -> str:
    """``error: rank 1 stopped in step 3 (micro-step 1 of 1), forward; ...: RuntimeError: ...``"""
    r = state.record
    parts = [f"error: rank {state.rank} stopped in {r.where_raised(exc)}: {first_line(exc)}"]
    if collective_failed(exc) and state.watchdog is not None:
        parts += state.watchdog.peer_lines()
    parts.append(f"last completed step {r.completed}")
    return "; ".join(parts)


def sigterm_line(state) -> str:
    r = state.record
    parts = [f"error: rank {state.rank}: ended by SIGTERM (torchrun's agent ends every rank once one has "
             f"failed) in {r.where()}"]
    if state.watchdog is not None:
        parts += state.watchdog.peer_lines()
    parts.append(f"last completed step {r.completed}")
    return "; ".join(parts)


_said = threading.Lock()


def say_once(line: str) -> None:
    """Write ``line`` to stderr unless another thread of this process is writing its own last line."""
    if _said.acquire(blocking=False):
        try:
            os.write(2, (line + "\n").encode(errors="replace"))
        except OSError:
            pass


def install_sigterm(state) -> None:
    """The SIGTERM handler (main thread only; a process that ignores SIGTERM keeps ignoring
    it) and the wake-up of the watchdog thread (unless a wake-up descriptor is taken:
    asyncio's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return

    def on_sigterm(signum, frame):
        state.sigterm_handled = True        # the watchdog thread leaves it to this handler
        try:
            say_once(sigterm_line(state))
        except Exception as exc:        # the handler must hand over, whatever the line
            log.debug("faults: the SIGTERM line failed: %r", exc)
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_sigterm)
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_blocking(r, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        return
    if old != -1:           # someone else's (asyncio): theirs stays
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    if state.watchdog is not None:
        state.watchdog.wake_fd = r


def install(state) -> None:
    """Chain ``sys.excepthook`` for this process (``state``: the process's fault state), and
    the SIGTERM handler."""
    global _installed
    if _installed:
        return
    _installed = True
    install_sigterm(state)
    previous = sys.excepthook

    def hook(tp, value, tb):
        state.exception_seen = True
        line = None
        try:
            line = context_line(value, state)
            if not state.record.failed:
                state.record.failed = first_line(value)
            if state.watchdog is not None:
                state.watchdog.publish(force=True)
        except Exception as exc:        # the traceback must be printed, whatever the line
            log.debug("faults: the context line failed: %r", exc)
        previous(tp, value, tb)
        if line:
            say_once(line)
    sys.excepthook = hook
