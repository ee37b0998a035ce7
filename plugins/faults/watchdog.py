"""The watchdog: a rank that makes no progress for ``faults.timeout`` seconds ends the run.

A daemon thread per process. While the training thread is inside an engine call (or
waits for the other ranks) and its record shows no progress for the limit, it reads the
other ranks' records (peers.py); when none of them progressed either, it writes one line
to stderr (this rank's step, micro-step, phase and last collective; every other rank's; the
last completed step; the flight recorder's dump), runs the clean-ups registered with
:func:`zeroplug.faults.at_abort` (bounded in time) and ends the process with
``os._exit(EXIT_STALLED)``. torchrun's agent sees the rank fail and ends the others.

Note: a gloo or NCCL call that blocks cannot be interrupted from Python, and a Python
signal handler would run only once it returns; ``os._exit`` from this thread is what ends
such a process. A rank that is inside a checkpoint's I/O counts as progressing (a large save
makes no marks for a while); a hang there is left to torch's process-group timeout.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
import time

from zeroplug.faults import abort_cleanups

from .peers import Peers, peer_lines
from .record import Record

log = logging.getLogger("zeroplug")

#: the exit status of a rank the watchdog ends
EXIT_STALLED = 3


def run_aborts(budget: float = 5.0) -> None:
    """The clean-ups of :func:`zeroplug.faults.at_abort`, on another thread, for ``budget`` seconds at most."""
    def run():
        for fn in abort_cleanups():
            try:
                fn()
            except Exception as exc:        # one clean-up's failure must not stop the others
                log.debug("faults: a clean-up before the end failed: %r", exc)
    t = threading.Thread(target=run, name="zeroplug-abort-cleanup", daemon=True)
    t.start()
    t.join(budget)


def dump_flight_recorder(rank: int) -> str:
    """torch's flight recorder (the last collectives of every group, with their states) into
    the file torch would dump it to; returns the path, or "" when it recorded nothing."""
    try:
        import torch._C._distributed_c10d as c10d
        data = c10d._dump_fr_trace(True, True, False)
    except Exception as exc:        # a torch without it, or nothing recorded
        log.debug("faults: no flight recorder dump: %r", exc)
        return ""
    try:
        if not pickle.loads(data).get("entries"):
            return ""
    except (pickle.UnpicklingError, AttributeError, EOFError, TypeError) as exc:
        log.debug("faults: the flight recorder's dump does not unpickle: %r", exc)
    base = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            or "/tmp/nccl_trace_rank_")
    path = f"{base}{rank}"
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError:
        return ""
    return path


class Watchdog(threading.Thread):
    INTERVAL = 0.25     # seconds between looks (and between publications while the record changes)
    HEARTBEAT = 3.0     # seconds between publications of a record that did not change
    SIGTERM_GRACE = 1.0     # seconds the main thread has to run its SIGTERM handler itself
    NUDGE = 0.02            # seconds between nudges at most

    def __init__(self, state, limit: float):
        super().__init__(name="zeroplug-watchdog", daemon=True)
        self._state = state         # the process's fault state (plugins/faults: ProcessState)
        self.record: Record = state.record
        self.rank, self.world, self.limit = state.rank, state.world, limit
        self.peers = Peers(self.rank, self.world)
        self._halt = threading.Event()
        self._published = (-1, 0.0)
        self._cpu = (None, 0.0, 0.0)        # (thread, its CPU time, when read)
        self.wake_fd = -1                   # signals arrive here (context.install_sigterm)
        self._sigterm_at = None
        # Note: the training thread nudges the watchdog as a forward, backward or step begins, so that
        # the record the others read is that step's even when a step takes less than an interval
        # (a rank killed then is named in the step it died in); a write to a pipe, at most every
        # NUDGE seconds, costs that thread about a microsecond
        self._nudge_r, self._nudge_w = os.pipe()
        os.set_blocking(self._nudge_w, False)
        self._nudged = 0.0

    def stop(self) -> None:
        self._halt.set()
        self.nudge()

    def run(self) -> None:
        try:
            self.publish(force=True)        # a rank that dies within the first interval leaves one too
        except Exception as exc:            # (never the end of the watchdog)
            log.debug("faults: the first publication failed: %r", exc)
        while not self._halt.is_set():
            self._wait()
            if self._halt.is_set():
                return
            try:
                self._look()
            except Exception as exc:        # a watchdog that dies must not take the run with it
                log.debug("faults: the watchdog's look failed: %r", exc)

    def nudge(self) -> None:
        """Publish the record soon (called by the training thread)."""
        now = time.monotonic()
        if now - self._nudged >= self.NUDGE:
            self._nudged = now
            try:
                os.write(self._nudge_w, b"\0")
            except OSError:         # (the pipe is full: a nudge is pending already)
                pass

    def _wait(self) -> None:
        """One interval, or less when a signal arrives (the wake-up descriptor) or a nudge."""
        fds = [self._nudge_r] + ([self.wake_fd] if self.wake_fd >= 0 else [])
        try:
            ready, _, _ = select.select(fds, [], [], self.INTERVAL)
        except (OSError, ValueError):
            self.wake_fd = -1
            return
        if self._nudge_r in ready:
            os.read(self._nudge_r, 4096)
        if self.wake_fd in ready:
            try:
                if signal.SIGTERM in os.read(self.wake_fd, 64) and self._sigterm_at is None:
                    self._sigterm_at = time.monotonic()
            except OSError:
                self.wake_fd = -1

    def peer_lines(self) -> list[str]:
        return peer_lines(self.peers.read(), self.world, self.rank, time.time())

    def publish(self, force: bool = False) -> None:
        r = self.record
        now = time.monotonic()
        ticks, at = self._published
        if force or r.ticks != ticks or now - at >= self.HEARTBEAT or r.failed:
            self.peers.publish(r.snapshot(self.rank))
            self._published = (r.ticks, now)

    def _computing(self) -> bool:
        """Whether the training thread used most of a core since the last look (a CPU run's
        forward makes no marks for as long as it computes; a thread blocked in a collective
        uses none)."""
        r = self.record
        try:
            now_cpu = time.clock_gettime(time.pthread_getcpuclockid(r.thread))
        except (OSError, AttributeError, OverflowError):
            return False
        now = time.monotonic()
        thread, before, at = self._cpu
        self._cpu = (r.thread, now_cpu, now)
        return thread == r.thread and now_cpu - before > 0.5 * (now - at)

    def _look(self) -> None:
        if (self._sigterm_at is not None and not self._state.sigterm_handled
                and time.monotonic() - self._sigterm_at > self.SIGTERM_GRACE):
            # the main thread did not get to its handler: it is blocked outside Python (a
            # handler that did run decides, also to go on: a script that saves when preempted)
            from .context import sigterm_line
            self.record.failed = "ended by SIGTERM"
            end_process(sigterm_line(self._state), 128 + signal.SIGTERM)
        self.publish()
        r = self.record
        if r.cpu and r.inside and self._computing():
            r.tick()
        if self.limit <= 0 or r.inside <= 0 or r.busy or r.failed:
            return
        stalled = time.monotonic() - r.last
        if stalled < self.limit:
            return
        peers = self.peers.read()
        now = time.time()
        for p in peers.values():
            fresh = now - p.get("wall", 0) < 2 * self.HEARTBEAT
            if fresh and (p.get("busy") or p.get("idle", 1e9) < self.limit):
                return      # another rank is progressing: this one waits for it
        self.stop_run(f"no progress for {stalled:.0f} s (faults.timeout = {self.limit:g} s)", peers)

    def stop_run(self, why: str, peers: dict | None = None) -> None:
        """Write the line, clean up, end the process (any thread)."""
        r = self.record
        if peers is None:
            peers = self.peers.read()
        parts = [f"error: rank {self.rank}: {why}, in {r.where()}"]
        parts += peer_lines(peers, self.world, self.rank, time.time())
        parts.append(f"last completed step {min([r.completed] + [p.get('completed', r.completed) for p in peers.values()])}")
        dump = dump_flight_recorder(self.rank)
        if dump:
            parts.append(f"torch's flight recorder (the last collectives) dumped to {dump}")
        line = "; ".join(parts) + (". The run stops: fix the stalled rank, or raise faults.timeout if its "
                                   "work is legitimate, and resume from the last checkpoint")
        r.failed = why
        self.publish(force=True)
        end_process(line, EXIT_STALLED)


def end_process(line: str, status: int) -> None:
    """Write ``line`` to stderr, run the abort clean-ups and end this process now."""
    from .context import say_once
    say_once(line)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):   # (stdout closed)
        pass
    run_aborts()
    os._exit(status)
