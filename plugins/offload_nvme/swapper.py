"""AsyncSwapper: tensors to files on a local NVMe disk and back, at disk speed.

How a transfer runs::

    write(key, t)  caller thread: record the size, hand a coroutine to the swapper's loop
                   loop thread:   per buffer-sized chunk of t: take a free bounce buffer
                                  (round-robin queue), copy the chunk in (copy threads),
                                  split it into block_size requests, queue_depth of them
                                  in flight at once over thread_count I/O threads
                                  (aiofiles.os.wrap(os.pwritev) on an O_DIRECT descriptor),
                                  give the buffer back
    read(key, out) the same in reverse: the file is read into a bounce buffer first and
                   copied into ``out`` only when every request of that chunk succeeded

Transfers of one key run in the order they were issued; transfers of different keys
run concurrently. Files are padded to 4096 bytes (O_DIRECT's alignment) and
preallocated before the first write, so parallel direct writes into the file are
overwrites that filesystems (ext4, xfs) let run under a shared lock.

The private swap directory and its cleanup are :mod:`.swapdir`, the checks before
anything is allocated (:func:`plan`) :mod:`.swapplan`, the errors :mod:`.errors`; their
public names are importable from here too.

Note: where O_DIRECT is refused (tmpfs on older kernels, some network filesystems:
EINVAL at open or at the first aligned request), the swapper warns once and uses
buffered I/O (the page cache then holds a copy of what is swapped).

Note: a failed write leaves the source tensor untouched (it is only read) and drops
the key (its old bytes on disk may be half-overwritten); a failed read leaves the
destination untouched when the tensor fits in one buffer (which :func:`plan` checks);
a larger tensor is streamed chunk by chunk and the error then says the destination
was partially overwritten.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import re
import threading
from concurrent.futures import Future as _CFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable

import aiofiles.os
import torch

from zeroplug.errors import ConfigError

from .directio import ALIGN, O_DIRECT, align, bytes_of, clear_direct, copy_in, copy_out, has_direct
from .errors import SwapError, explain
from .swapdir import check_path, clean_stale, forget_live, make_run_dir, register_live, remove_run_dir
# Re-exported, so that everything stays importable from this module:
from .errors import SwapIOError, SwapMemoryError, SwapPathError, SwapSpaceError  # noqa: F401
from .swapdir import DIR_PREFIX, at_exit, cleanup_all  # noqa: F401
from .swapfuture import SwapFuture
from .swapplan import SwapPlan, plan  # noqa: F401

log = logging.getLogger("zeroplug")

#: threads that copy chunks between the caller's tensors and the pinned I/O buffers
COPY_THREADS = 2

PIECE = 16 << 20                      # a write starts its requests after each PIECE bytes copied


_WARNED_BUFFERED = False


@dataclass
class _Entry:
    file: str                # its name in the held directory
    valid: bool = False


# --- the swapper ---------------------------------------------------------------------------

class AsyncSwapper:
    """Asynchronous tensor <-> file swapping through aligned bounce buffers reused in turn.

    ``buffer_size`` is in elements of ``element_size`` bytes (DeepSpeed's convention:
    4 for fp32 optimizer states); each buffer holds ``buffer_size x element_size``
    bytes rounded up to 4096. A tensor larger than one buffer is streamed through the
    buffers chunk by chunk. ``direct=False`` forces buffered I/O.
    """

    def __init__(self, nvme_path: str, *, buffer_count: int = 4, buffer_size: int = int(1e8),
                 element_size: int = 4, block_size: int = 1 << 20, queue_depth: int = 32,
                 thread_count: int = 16, pin_memory: bool = True, direct: bool = True,
                 copy_threads: int = COPY_THREADS):
        for name, v in (("buffer_count", buffer_count), ("buffer_size", buffer_size),
                        ("element_size", element_size), ("queue_depth", queue_depth),
                        ("thread_count", thread_count), ("copy_threads", copy_threads)):
            if int(v) < 1:
                raise ConfigError(f"AsyncSwapper: {name} = {v} must be >= 1", key=name)
        if block_size < ALIGN or block_size % ALIGN:
            raise ConfigError(f"AsyncSwapper: block_size = {block_size} must be a multiple of {ALIGN}",
                              key="block_size")
        self._closed = True          # until fully started
        self._dir: str | None = None
        self._rundir = None          # the directory, held (see swapdir.RunDir), and its lock
        self._owner = os.getpid()
        self.base = check_path(nvme_path)
        clean_stale(self.base)
        self.buffer_count, self.block_size = int(buffer_count), int(block_size)
        self.queue_depth, self.thread_count = int(queue_depth), int(thread_count)
        self.buffer_bytes = align(int(buffer_size) * int(element_size))
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        self.direct = bool(direct) and O_DIRECT != 0
        self._direct_ok = False      # a direct request succeeded: EINVAL is then a real error
        self._lock = threading.RLock()   # _done may run inside _submit
        self._names: dict[Hashable, str] = {}      # key -> file name (caller's view, in issue order)
        self._sizes: dict[Hashable, int] = {}      # key -> bytes of the last issued write
        self._entries: dict[Hashable, _Entry] = {}  # loop's view: what is on disk
        self._last: dict[Hashable, _CFuture] = {}  # last transfer issued per key (ordering)
        self._pending: set[_CFuture] = set()
        self._errors: list[_CFuture] = []          # failed, not yet seen by wait()/wait_all()
        self._files = 0
        self.bytes_written = self.bytes_read = 0   # issued so far (benchmarks: the I/O floor)
        self._loop = None
        self._io = self._copy = None
        self._buffers: list[torch.Tensor] = []
        self._rundir = make_run_dir(self.base)
        self._held = self._rundir.held  # every file is opened relative to it (never by path)
        self._dir = self._rundir.path
        register_live(self)
        try:
            self._buffers = [self._alloc(self.buffer_bytes) for _ in range(self.buffer_count)]
            self._views = [memoryview((ctypes.c_char * self.buffer_bytes).from_address(b.data_ptr())).cast("B")
                           for b in self._buffers]
            self._io = ThreadPoolExecutor(self.thread_count, thread_name_prefix="zeroplug-aio")
            self._copy = ThreadPoolExecutor(copy_threads, thread_name_prefix="zeroplug-swapcopy")
            self._pwritev = aiofiles.os.wrap(os.pwritev)
            self._preadv = aiofiles.os.wrap(os.preadv)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run_loop, name="zeroplug-swapper", daemon=True)
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result()
        except BaseException:
            self._closed = False
            self.close(wait=False)
            raise
        self._closed = False

    # -- set-up -----------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        if t.data_ptr() % ALIGN:
            t = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
            off = (-t.data_ptr()) % ALIGN
            t = t[off:off + nbytes]
        if not self.pinned:
            t.zero_()        # fault the pages in now, not during the first transfers
        return t

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _setup(self) -> None:
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(self.buffer_count):
            self._free.put_nowait(i)
        self._slots = asyncio.Semaphore(self.queue_depth)

    # -- public API ---------------------------------------------------------------------------
    @property
    def path(self) -> str | None:
        """This run's private swap directory (None once closed)."""
        return self._dir

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, key: Hashable, tensor: torch.Tensor) -> SwapFuture:
        """Write ``tensor`` (any dtype, contiguous, CPU or CUDA) to ``key``'s file.

        Returns at once; the tensor must not change until the future is done (its
        bytes are copied into the bounce buffers in the background).
        """
        src = bytes_of(tensor)
        with self._lock:
            self._check_open()
            name = self._names.get(key)
            if name is None:
                self._files += 1
                hint = re.sub(r"[^A-Za-z0-9._-]+", "_", str(key))[:60]
                name = self._names[key] = f"{self._files:06d}-{hint}.swp"
            self._sizes[key] = src.numel()
            self.bytes_written += src.numel()
            return self._submit(key, self._write(key, name, src, self._last.get(key)), src.numel())

    def read(self, key: Hashable, out: torch.Tensor) -> SwapFuture:
        """Read ``key``'s bytes into ``out`` (same byte size; any dtype, contiguous, CPU or CUDA)."""
        dst = bytes_of(out)
        with self._lock:
            self._check_open()
            size = self._sizes.get(key)
            if size is None:
                raise SwapError(f"NVMe swap: nothing was written under key {key!r}", self._dir)
            if size != dst.numel():
                raise ValueError(f"AsyncSwapper.read({key!r}): the destination has {dst.numel()} bytes "
                                 f"but {size} were written")
            self.bytes_read += dst.numel()
            return self._submit(key, self._read(key, dst, self._last.get(key)), dst.numel())

    def wait_all(self) -> None:
        """Wait for every transfer issued so far; raises the first failure not yet seen
        through its own future's ``wait()``."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result()
            except BaseException as exc:    # noqa: BLE001 - collected below
                log.debug("NVMe swap: a transfer failed (raised below): %r", exc)
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0].exception()

    def delete(self, key: Hashable) -> None:
        """Remove ``key``'s file once the transfers of ``key`` already issued are done."""
        with self._lock:
            self._check_open()
            self._sizes.pop(key, None)
            self._names.pop(key, None)
            fut = self._submit(key, self._delete(key, self._last.get(key)), 0)
        fut.wait()
        with self._lock:
            if self._last.get(key) is fut.future:
                del self._last[key]

    def keys(self) -> list:
        with self._lock:
            return list(self._sizes)

    def close(self, wait: bool = True) -> None:
        """Finish (``wait``) or cancel the pending transfers, free the buffers, remove the
        directory. Idempotent; also run at exit, on SIGTERM and by ``with`` on an error."""
        if self._closed and self._dir is None:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and loop.is_running():
            if wait:
                for f in list(self._pending):
                    try:
                        f.result()
                    except BaseException as exc:    # noqa: BLE001 - reported to whoever waits on it
                        log.debug("NVMe swap: a transfer failed as the swapper closed: %r", exc)
            else:
                try:
                    asyncio.run_coroutine_threadsafe(self._cancel_all(), loop).result(timeout=30)
                except Exception as exc:    # noqa: BLE001 - closing goes on: the loop is stopped next
                    log.debug("NVMe swap: cancelling the transfers in flight failed: %r", exc)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=30)
        # Note: requests already inside a syscall cannot be cancelled; the pools' shutdown
        # waits for them, so no thread still reads or writes a buffer when it is freed.
        for pool in (self._io, self._copy):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        if loop is not None and not loop.is_running():
            loop.close()
        self._views, self._buffers = [], []
        self.remove_dir()

    def __enter__(self) -> "AsyncSwapper":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)

    def __repr__(self) -> str:
        return (f"AsyncSwapper({self._dir!r}, buffers={self.buffer_count}x{self.buffer_bytes}B, "
                f"block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"threads={self.thread_count}, direct={self.direct}, pinned={self.pinned})")

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SwapError("NVMe swap: the swapper is closed", self._dir)

    def remove_dir(self, fast: bool = False) -> None:
        """``fast``: the SIGTERM path, with transfers maybe still running (the directory's
        descriptor stays open, see :func:`.swapdir.remove_run_dir`)."""
        forget_live(self)
        self._dir = None
        run, self._rundir = self._rundir, None
        if run is None or os.getpid() != self._owner:
            return
        remove_run_dir(run, close=not fast)
        try:                     # and what dead runs left here (a rank killed beside this one)
            clean_stale(self.base)
        except Exception as exc:     # noqa: BLE001 - cleanup must not raise
            log.debug("NVMe swap: cleaning up stale swap directories under %s failed: %r", self.base, exc)

    def _submit(self, key, coro, nbytes: int) -> SwapFuture:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._last[key] = fut
        self._pending.add(fut)
        fut.add_done_callback(self._done)
        return SwapFuture(fut, key, nbytes, self)

    def _done(self, fut) -> None:
        with self._lock:
            self._pending.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                self._errors.append(fut)

    def error_seen(self, fut) -> None:
        """A failed transfer's error was raised to its caller: wait_all() does not raise it again."""
        with self._lock:
            if fut in self._errors:
                self._errors.remove(fut)

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=20)

    @staticmethod
    async def _after(prev) -> None:
        if prev is not None:
            try:
                await asyncio.wrap_future(prev)
            except BaseException as exc:    # noqa: BLE001 - the earlier transfer reports its own error
                log.debug("NVMe swap: the transfer this one follows failed: %r", exc)

    async def _run(self, pool, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _open(self, name: str, write: bool) -> int:
        """The file ``name`` in the held directory (no link followed, wherever the directory
        was moved since)."""
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        if self.direct:
            try:
                return self._held.open(name, flags | O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back("EINVAL on open with O_DIRECT")
        return self._held.open(name, flags, 0o600)

    def _fall_back(self, why: str) -> None:
        global _WARNED_BUFFERED
        self.direct = False
        if not _WARNED_BUFFERED:
            _WARNED_BUFFERED = True
            log.warning("NVMe swap: %s does not support O_DIRECT (%s); using buffered I/O (slower, and the "
                        "page cache holds a copy of the swapped data). Put nvme_path on a local NVMe "
                        "filesystem (ext4, xfs) for direct I/O", self.base, why)

    async def _request(self, fd: int, view: memoryview, foff: int, write: bool) -> None:
        """One block request: all of ``view`` at file offset ``foff`` (short transfers retried)."""
        async with self._slots:
            done, retried = 0, False
            while done < len(view):
                fn = self._pwritev if write else self._preadv
                try:
                    n = await fn(fd, [view[done:]], foff + done, executor=self._io)
                except OSError as exc:
                    # EINVAL before any direct request succeeded: the filesystem refuses
                    # O_DIRECT at I/O time (tmpfs, some FUSE / network filesystems)
                    if exc.errno == errno.EINVAL and not self._direct_ok and not retried:
                        retried = True
                        if has_direct(fd):
                            clear_direct(fd)
                        self._fall_back("EINVAL on the first aligned O_DIRECT request")
                        continue
                    raise
                if n == 0:
                    raise OSError(errno.EIO, "unexpected end of file" if not write else "wrote 0 bytes")
                done += n
            if not self._direct_ok and self.direct and has_direct(fd):
                self._direct_ok = True

    async def _gather(self, coros) -> None:
        results = await asyncio.gather(*coros, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _blocks(self, fd: int, view: memoryview, foff: int, write: bool) -> None:
        bs = self.block_size
        await self._gather(self._request(fd, view[o:o + bs], foff + o, write) for o in range(0, len(view), bs))

    async def _write_chunk(self, fd: int, src: torch.Tensor, off: int, n: int) -> None:
        i = await self._free.get()
        try:
            # copy in pieces and start each piece's requests as soon as it is in the buffer
            step = max(self.block_size, PIECE)
            writes = []
            for p in range(0, n, step):
                m = min(step, n - p)
                padded = align(m)
                await self._run(self._copy, copy_in, self._buffers[i][p:], src, off + p, m, padded)
                writes.append(asyncio.ensure_future(
                    self._blocks(fd, self._views[i][p:p + padded], off + p, write=True)))
            await self._gather(writes)
        finally:
            self._free.put_nowait(i)

    async def _read_chunk(self, fd: int, dst: torch.Tensor, off: int, n: int) -> None:
        i = await self._free.get()
        try:
            await self._blocks(fd, self._views[i][:align(n)], off, write=False)
            await self._run(self._copy, copy_out, self._buffers[i], dst, off, n)
        finally:
            self._free.put_nowait(i)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(o, min(self.buffer_bytes, n - o)) for o in range(0, n, self.buffer_bytes)]

    async def _write(self, key, name: str, src: torch.Tensor, prev) -> None:
        await self._after(prev)
        n = src.numel()
        self._entries[key] = entry = _Entry(name)
        fd = -1
        try:
            fd = await self._run(self._io, self._open, name, True)
            padded = align(n)
            size = os.fstat(fd).st_size
            if size < padded:       # allocate up front: ENOSPC before any data moves, and the
                # parallel direct writes are then overwrites (shared inode lock on ext4/xfs)
                await self._run(self._io, os.posix_fallocate, fd, 0, padded)
            elif size > padded:
                os.ftruncate(fd, padded)
            await self._gather(self._write_chunk(fd, src, o, c) for o, c in self._chunks(n))
            entry.valid = True
        except OSError as exc:
            try:                    # free the space: the old contents are lost anyway
                self._held.unlink(name)
            except OSError:
                pass
            raise explain(exc, self._held.join(name), f"writing {key!r} ({n} bytes)",
                          "The in-memory tensor is intact; the key's data on disk was dropped.") from None
        finally:
            if fd >= 0:
                os.close(fd)

    async def _read(self, key, dst: torch.Tensor, prev) -> None:
        await self._after(prev)
        entry = self._entries.get(key)
        if entry is None or not entry.valid:
            raise SwapError(f"NVMe swap: no valid data for key {key!r} (its last write failed or it was "
                            f"deleted); the destination is untouched", self._dir)
        n = dst.numel()
        chunks = self._chunks(n)
        fd = -1
        try:
            fd = await self._run(self._io, self._open, entry.file, False)
            await self._gather(self._read_chunk(fd, dst, o, c) for o, c in chunks)
        except OSError as exc:
            note = ("The destination is untouched." if len(chunks) <= 1 else
                    "The destination may be partially overwritten (the tensor is larger than one swap buffer).")
            raise explain(exc, self._held.join(entry.file), f"reading {key!r} ({n} bytes)", note) from None
        finally:
            if fd >= 0:
                os.close(fd)

    async def _delete(self, key, prev) -> None:
        await self._after(prev)
        entry = self._entries.pop(key, None)
        if entry is not None:
            try:
                self._held.unlink(entry.file)
            except FileNotFoundError:
                pass
