"""Asynchronous checkpoint saves: one in flight per engine, written by a thread.

``save_checkpoint(..., async_save=True)`` does in the caller's thread what every rank must
agree on (the failure check, the directory lock, the free-space check, the temporary
directory) and takes the values that the forward changes; then it returns and a thread
of this engine copies the states into host buffers (:mod:`.staging`) and writes the files
under the same protocol as a synchronous save: the rank files, the exchange of sizes and
digests, the manifest, the rename, ``latest`` last. A crash at any moment leaves ``latest``
naming the last complete checkpoint.

What the engine waits for, and where:

* the copy into host memory, before the next optimizer step (``engine.step()`` at the
  accumulation boundary, and a boundary backward whose tier may step during it), before
  ``offload_states`` and a ``gathered_parameters`` block: until then the saved tensors are
  read in place (nothing else in the engine writes them);
* the whole save, before the next save, a load and ``close()``.

A failed background save is raised once, as :class:`~zeroplug.checkpoint.CheckpointError`
with one line naming the checkpoint and its directory, at the first ``step()`` boundary
by which every rank's writer has ended (the ranks agree on it: one all-reduce per step
while a save is unsettled), or at the next save, load or ``close()``, whichever comes
first; ``latest`` still names the previous checkpoint.

With several ranks the threads exchange sizes and digests over a gloo process group of
their own (created, collectively, by the first asynchronous save), so that they never
share a communicator with the training's collectives.
"""
from __future__ import annotations

import logging
import threading

import torch

from .files import CheckpointError

log = logging.getLogger("zeroplug")

#: host memory an asynchronous save leaves free (the page cache its own writes need, the
#: training's small allocations); a save that would take more is synchronous
HOST_RESERVE = 1 << 30


class BackgroundSaves:
    """An engine's asynchronous saves: at most one in flight."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: str | None = None
        self._comm = None
        self._staging = None

    # -- what the save uses --------------------------------------------------------------
    def comm(self, comm):
        """The communicator of the writer threads: a gloo group of ``comm``'s ranks (made
        on first use; every rank must call it at the same point), or ``comm`` itself with
        one rank."""
        if not comm.distributed:
            return comm
        if self._comm is None:
            import torch.distributed as dist
            from zeroplug.comm import Comm
            ranks = None if comm.group is None else dist.get_process_group_ranks(comm.group)
            self._comm = Comm(dist.new_group(ranks=ranks, backend="gloo"))
        return self._comm

    @property
    def staging(self):
        if self._staging is None:
            from .staging import Staging
            self._staging = Staging()
        return self._staging

    def room(self, nbytes: int) -> str | None:
        """None if this rank's host memory can hold the copies of an asynchronous save of
        ``nbytes`` (less the buffers kept from the last one), else why not."""
        from zeroplug.observe.memory import host_available_bytes
        from .directory import fmt_bytes
        held = self._staging.held if self._staging is not None else 0
        extra = max(0, nbytes - held)
        avail = host_available_bytes()
        if extra + HOST_RESERVE <= avail:
            return None
        return (f"the copy of the states it writes in the background needs {fmt_bytes(extra)} more host "
                f"memory, this host has {fmt_bytes(avail)} available (keeping {fmt_bytes(HOST_RESERVE)} free)")

    def launch(self, engine, job, state, failure) -> str:
        """The asynchronous half of a save: ``state`` (this rank's file, as views) with the
        values the forward changes copied now; the thread copies the rest into host memory,
        then ``job.write(state, error, comm)`` (every rank's thread takes part). ``failure``:
        what went wrong while building ``state`` (reported through the exchange). Returns
        the checkpoint's path."""
        from .staging import split
        comm = self.comm(engine.run.comm)
        places, after = [], None
        if failure is None:
            try:
                buffers = {b.data_ptr() for b in engine.module.buffers()}
                state, places = split(state, buffers)
                cuda = [t for _, _, t in places if t.is_cuda]
                if cuda:
                    after = torch.cuda.Event()
                    after.record(torch.cuda.current_stream(cuda[0].device))
            except Exception as exc:    # noqa: BLE001 - reported through the exchange
                failure, state = exc, None
        first = failure

        def copy() -> None:
            if first is not None:
                raise first
            self.staging.copy(places, after)

        def write(error) -> None:
            nonlocal state
            try:
                job.write(state, error, comm)
            finally:
                state = None
                places.clear()

        self.start(f"checkpoint {job.tag!r} in {job.save_dir}", copy, write)
        return str(job.save_dir / job.tag)

    def start(self, name: str, copy, write) -> None:
        """Run ``copy()`` then ``write(error)`` on a thread (``error``: the exception
        ``copy`` raised, or None); ``write`` raises what failed. ``name`` says which
        checkpoint, for the error."""
        self.wait()
        self._copied.clear()

        def run() -> None:
            failure = None
            try:
                copy()
            except BaseException as exc:    # noqa: BLE001 - every rank's writer must reach the exchange
                failure = exc
            finally:
                self._copied.set()
            try:
                write(failure)
            except BaseException as exc:    # noqa: BLE001 - raised in the training thread (take_error)
                text = str(exc).strip().splitlines()
                self._error = (f"the asynchronous save of {name} failed: "
                               f"{text[0] if text else type(exc).__name__}")
                log.error("[zeroplug] %s", self._error)

        # Note: not a daemon: an interpreter that exits (without close()) still finishes
        # the checkpoint rather than leave only its temporary directory.
        self._thread = threading.Thread(target=run, name="zeroplug-checkpoint", daemon=False)
        self._thread.start()

    # -- what the engine waits for -------------------------------------------------------
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_copied(self) -> None:
        """Return once the states of the save in flight are in host memory."""
        self._copied.wait()

    def before_step(self, comm) -> None:
        """The optimizer is about to change the states: the copy of a save in flight is
        waited for, and a save that failed is raised, on every rank at the same step.

        Note: each rank's writer learns the outcome from the same exchange, but not at the
        same moment; raising as soon as this rank's writer ends would let the other ranks
        go on into the step's collectives and hang. So while a save is unsettled the ranks
        agree (one all-reduce per step) on whether every writer has ended, and only then
        is a failure raised, everywhere."""
        self._copied.wait()
        t = self._thread
        if t is None:               # ended and joined already (on every rank): settled
            self.raise_error()
            return
        if comm.distributed:
            from torch.distributed import ReduceOp
            if comm.all_reduce_scalar(0.0 if t.is_alive() else 1.0, op=ReduceOp.MIN) < 1.0:
                return
        elif t.is_alive():
            return
        self.wait()

    def wait(self, raise_error: bool = True) -> None:
        """Return once no save is in flight; raise the error of a failed one."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if raise_error:
            self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(error)

    def close(self) -> str | None:
        """Wait for the save in flight and free the host buffers; returns the error of a
        failed save (for the caller to raise after its own clean-up)."""
        self.wait(raise_error=False)
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        error, self._error = self._error, None
        return error
