"""A rank that raises says where it was, and leaves it for the others' messages.

``sys.excepthook`` is chained (once per process, when an engine of several ranks is ready):
before Python prints the traceback the rank's record is marked failed and published
(peers.py), so that a rank whose collective then fails because this one is gone names it;
after the traceback one line says which rank stopped, in which step, micro-step and phase,
with which collective last, and (for a collective that failed) where the other ranks were.
"""
from __future__ import annotations

import sys
import time

from .peers import peer_lines

#: texts of torch's errors when a collective's partner is gone or silent
COLLECTIVE_FAILURES = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out",
                       "NCCL", "DistNetworkError", "DistBackendError", "gloo")

_installed = False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[-400:]}" if line else type(exc).__name__


def collective_failed(exc: BaseException) -> bool:
    import torch.distributed as dist
    return isinstance(exc, getattr(dist, "DistError", ())) or any(s in str(exc) for s in COLLECTIVE_FAILURES)


def context_line(exc: BaseException, state) -> str:
    """``error: rank 1 stopped in step 3 (micro-step 1 of 1), forward; ...: RuntimeError: ...``"""
    r = state.record
    parts = [f"error: rank {state.rank} stopped in {r.where()}: {first_line(exc)}"]
    if collective_failed(exc) and state.watchdog is not None:
        parts += peer_lines(state.watchdog.peers.read(), state.world, state.rank, time.time())
    parts.append(f"last completed step {r.completed}")
    return "; ".join(parts)


def install(state) -> None:
    """Chain ``sys.excepthook`` for this process (``state``: the process's fault state)."""
    global _installed
    if _installed:
        return
    _installed = True
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
        except Exception:
            pass
        previous(tp, value, tb)
        if line:
            print(line, file=sys.stderr, flush=True)
    sys.excepthook = hook
