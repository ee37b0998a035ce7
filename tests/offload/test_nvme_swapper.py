"""The NVMe tier's AsyncSwapper on CPU: exact round trips (O_DIRECT and buffered),
ordering and concurrency, buffer reuse, private files, cleanup (close, exceptions,
exit, SIGTERM, stale directories of killed runs), clear errors (ENOSPC, EIO,
read-only / missing paths) that leave tensors intact, and plan()'s checks."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import zeroplug.plugins.offload_nvme.swapdir as swdir
import zeroplug.plugins.offload_nvme.swapper as swmod
import zeroplug.plugins.offload_nvme.swapplan as planmod
from zeroplug.errors import ConfigError, ZeroplugError
from zeroplug.plugins.offload_nvme import NVMeOffload, NVMeOptions
from zeroplug.plugins.offload_nvme.swapper import (AsyncSwapper, SwapError, SwapIOError, SwapMemoryError,
                                                   SwapPathError, SwapSpaceError, clean_stale, plan)

KiB = 1024


def small(path, **kw) -> AsyncSwapper:
    kw = {"buffer_count": 3, "buffer_size": 64 * KiB, "block_size": 64 * KiB, "queue_depth": 4,
          "thread_count": 2, **kw}
    return AsyncSwapper(str(path), **kw)


def round_trip(sw: AsyncSwapper, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Write each tensor under its index, read all back into fresh tensors, wait."""
    for i, t in enumerate(ts):
        sw.write(i, t)
    outs = [torch.empty_like(t) for t in ts]
    for i, o in enumerate(outs):
        sw.read(i, o)
    sw.wait_all()
    return outs


def rand(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype) if not dtype.is_complex else \
            torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)


def swap_dirs(path) -> list[str]:
    return [n for n in os.listdir(path) if n.startswith("zeroplug-swap-")]


# --- round trips ------------------------------------------------------------------------

@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "buffered"])
def test_round_trip_sizes_and_dtypes(tmp_path, direct):
    gen = torch.Generator().manual_seed(0)
    shapes = [(0,), (1,), (3,), (1023,), (4096,), (7, 13), (65 * KiB + 5,), (3, 100_003)]
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
              torch.uint8, torch.bool, torch.complex64]
    with small(tmp_path, direct=direct) as sw:
        src = {(i, j): rand(s, d, gen) for i, s in enumerate(shapes) for j, d in enumerate(dtypes)}
        for k, t in src.items():
            sw.write(k, t)
        outs = {k: torch.full_like(t, 0) if t.numel() else torch.empty_like(t) for k, t in src.items()}
        futs = [sw.read(k, outs[k]) for k in src]
        for f in futs:
            f.wait()
        sw.wait_all()
        for k, t in src.items():
            assert outs[k].dtype == t.dtype and torch.equal(outs[k].view(torch.uint8) if t.numel() else outs[k],
                                                           t.view(torch.uint8) if t.numel() else t), k
        assert sw.direct is direct
        # files are padded to 4096 bytes
        for name in os.listdir(sw.path):
            if name.endswith(".swp"):
                assert os.path.getsize(os.path.join(sw.path, name)) % 4096 == 0


def test_same_key_in_order_and_concurrent_threads(tmp_path):
    with small(tmp_path) as sw:
        a, b = torch.arange(100_000, dtype=torch.float32), -torch.arange(100_000, dtype=torch.float32)
        out = torch.empty_like(a)
        sw.write("k", a)
        sw.write("k", b)                  # issued after: must win
        sw.read("k", out).wait()
        assert torch.equal(out, b)
        sw.write("k", torch.ones(10))     # a different size on the same key
        small_out = torch.empty(10)
        sw.read("k", small_out).wait()
        assert torch.equal(small_out, torch.ones(10))

        errors = []

        def worker(w):
            try:
                g = torch.Generator().manual_seed(w)
                for i in range(6):
                    t = torch.randn(int(torch.randint(1, 200_000, (1,), generator=g)), generator=g)
                    sw.write((w, i), t)
                    o = torch.empty_like(t)
                    sw.read((w, i), o).wait()
                    assert torch.equal(o, t)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_buffer_reuse_two_buffers_many_transfers(tmp_path, monkeypatch):
    used = []
    real = swmod.copy_in

    def spy(buf, src, off, n, padded):
        used.append(buf.untyped_storage().data_ptr())
        real(buf, src, off, n, padded)
    monkeypatch.setattr(swmod, "copy_in", spy)
    with small(tmp_path, buffer_count=2, buffer_size=32 * KiB) as sw:
        ts = [torch.randn(20_000 + 1000 * i) for i in range(12)]   # 12 transfers, 2 buffers
        outs = round_trip(sw, ts)
        assert all(torch.equal(a, b) for a, b in zip(ts, outs))
        assert len(set(used)) == 2 and len(used) >= 12
        assert all(b.data_ptr() % 4096 == 0 for b in sw._buffers)


def test_read_errors_before_io(tmp_path):
    with small(tmp_path) as sw:
        with pytest.raises(SwapError, match="nothing was written"):
            sw.read("missing", torch.empty(3))
        sw.write("x", torch.ones(8)).wait()
        with pytest.raises(ValueError, match="32 were written"):
            sw.read("x", torch.empty(9))
        with pytest.raises(ValueError, match="contiguous"):
            sw.write("y", torch.ones(4, 4).t())
        sw.delete("x")
        assert [n for n in os.listdir(sw.path) if n.endswith(".swp")] == []
        with pytest.raises(SwapError):
            sw.read("x", torch.empty(8))


# --- files: private, cleaned up -----------------------------------------------------------

def test_private_modes_even_with_open_umask(tmp_path):
    old = os.umask(0)
    try:
        with small(tmp_path) as sw:
            sw.write("a", torch.ones(5000)).wait()
            assert stat.S_IMODE(os.stat(sw.path).st_mode) == 0o700
            files = os.listdir(sw.path)
            assert any(f.endswith(".swp") for f in files)
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(sw.path, f)).st_mode) == 0o600
            assert os.path.basename(sw.path).startswith(f"zeroplug-swap-{os.getpid()}-")
    finally:
        os.umask(old)


def test_removed_after_close_and_after_exception(tmp_path):
    sw = small(tmp_path)
    sw.write("a", torch.ones(1000)).wait()
    d = sw.path
    sw.close()
    sw.close()                               # idempotent
    assert not os.path.exists(d) and swap_dirs(tmp_path) == []
    with pytest.raises(SwapError, match="closed"):
        sw.write("b", torch.ones(3))

    with pytest.raises(RuntimeError, match="boom"):
        with small(tmp_path) as sw:
            d = sw.path
            for i in range(8):
                sw.write(i, torch.randn(100_000))   # still in flight when the error hits
            raise RuntimeError("boom")
    assert not os.path.exists(d) and swap_dirs(tmp_path) == []


CHILD = textwrap.dedent("""
    import signal, sys, time, torch
    from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper
    base, mode = sys.argv[1], sys.argv[2]
    if mode == "chain":
        def prev(signum, frame):
            open(sys.argv[3], "w").write("called")
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, prev)
    sw = AsyncSwapper(base, buffer_count=2, buffer_size=1 << 16)
    sw.write("a", torch.randn(1 << 18)).wait()
    print(sw.path, flush=True)
    if mode == "exit":
        sys.exit(0)               # no close(): atexit cleans up
    time.sleep(60)
""")


@pytest.mark.parametrize("mode", ["sigterm", "chain", "exit"])
def test_child_process_cleanup(tmp_path, mode):
    flag = tmp_path / "prev-called"
    base = tmp_path / "swap"
    base.mkdir()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(base), mode, str(flag)], stdout=subprocess.PIPE,
                         text=True)
    try:
        d = p.stdout.readline().strip()
        assert d and os.path.isdir(d) or mode == "exit"
        if mode != "exit":
            p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(d) and swap_dirs(base) == []
    if mode == "sigterm":
        assert rc == -signal.SIGTERM          # the default action still happens
    elif mode == "chain":
        assert rc == 3 and flag.read_text() == "called"
    else:
        assert rc == 0


def test_forked_child_keeps_parents_files(tmp_path):
    with small(tmp_path) as sw:
        sw.write("a", torch.ones(100)).wait()
        pid = os.fork()
        if pid == 0:                           # the child "exits": its cleanup must not touch ours
            try:
                swmod.at_exit()
                swmod.cleanup_all(fast=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.isdir(sw.path)
        out = torch.empty(100)
        sw.read("a", out).wait()
        assert torch.equal(out, torch.ones(100))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_dir(base, pid, nbytes=3 * 4096, lock=True, name=None):
    """A swap directory as a run leaves it: files and a lock file naming its holder."""
    d = base / (name or f"zeroplug-swap-{pid}-abcd1234")
    d.mkdir()
    (d / "000001-x.swp").write_bytes(b"\1" * nbytes)
    if lock:
        (d / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    return d


HOLD = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); " \
       "print('held', flush=True); sys.stdin.read()"


def test_stale_directory_removed_at_next_start(tmp_path, caplog):
    """The lock decides, never the pid: a free lock is a dead run whatever its pid says; a
    held one is alive even when its pid names no process here (another pid namespace)."""
    dead = _dead_pid()
    stale = _fake_dir(tmp_path, dead, nbytes=5 * 2**20)
    alive = _fake_dir(tmp_path, dead, name="zeroplug-swap-1-0123abcd")    # pid 1: ours is init
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(alive / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        unlocked = _fake_dir(tmp_path, dead, lock=False, name="zeroplug-swap-7-00000000")   # an older zeroplug's
        killed_early = _fake_dir(tmp_path, dead, lock=False, name=f".zeroplug-swap-{dead}-11111111.new")
        os.utime(killed_early, (0, 0))                       # a creation killed long ago
        young = _fake_dir(tmp_path, dead, lock=False, name=f".zeroplug-swap-{dead}-22222222.new")
        with caplog.at_level(logging.WARNING, logger="zeroplug"):
            with small(tmp_path) as sw:
                assert not stale.exists() and not killed_early.exists()
                assert alive.exists() and unlocked.exists() and young.exists()
                assert sorted(swap_dirs(tmp_path)) == sorted([os.path.basename(sw.path), alive.name, unlocked.name])
                assert os.path.isfile(os.path.join(sw.path, ".lock"))
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert str(stale) in msg and "5.0 MiB" in msg and f"pid {dead}" in msg and "lock was free" in msg
        assert f"{unlocked} has no lock file" in msg
        assert clean_stale(str(tmp_path)) == [] and alive.exists()
    finally:
        holder.communicate("")
    assert [d for d, _ in clean_stale(str(tmp_path))] == [str(alive)]        # its holder has exited


def test_removal_racing_a_writer_leaves_nothing(tmp_path):
    """A transfer still creating files while the directory is removed (the SIGTERM path
    cannot wait for them) must not leave a directory behind, least of all one whose lock
    file is already gone (no later run could tell it from a live one's)."""
    run = swdir.make_run_dir(str(tmp_path))
    d, lock = run.path, run.lock
    stop, created = threading.Event(), []

    def writer():
        i = 0
        while not stop.is_set():
            try:
                with open(os.path.join(d, f"{i:06d}.swp"), "wb") as f:
                    f.write(b"x" * 4096)
                created.append(i)
            except OSError:
                pass
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 10
    while len(created) < 50 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert created, "the writer never wrote"
    swdir.remove_run_dir(run)
    stop.set()
    t.join()
    assert not lock.held
    leftovers = os.listdir(tmp_path)
    assert all(n.endswith(".del") for n in leftovers), leftovers     # never the live name
    clean_stale(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_directory_left_while_being_removed_is_garbage(tmp_path, caplog):
    left = _fake_dir(tmp_path, _dead_pid(), lock=False, name=".zeroplug-swap-9-0000abcd.del")
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        assert [d for d, _ in clean_stale(str(tmp_path))] == [str(left)]
    assert not left.exists() and "being removed" in caplog.text


def test_a_directory_its_owner_is_removing_is_left_to_it(tmp_path):
    """Ranks ending together: one empties its ``.del`` directory, still holding its lock,
    while the other cleans up; the other leaves it alone (no warning of a stale directory)."""
    busy = _fake_dir(tmp_path, os.getpid(), name=".zeroplug-swap-9-0000beef.del")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(busy / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clean_stale(str(tmp_path)) == [] and busy.exists()
    finally:
        holder.communicate("")
    assert [d for d, _ in clean_stale(str(tmp_path))] == [str(busy)]       # its owner is gone


def test_a_cleaner_cut_short_leaves_garbage_the_next_one_removes(tmp_path, monkeypatch):
    """A cleaner killed mid-removal (SIGTERM's default action during atexit's cleanup) must
    not leave the dead run's directory under its live name without its lock file."""
    stale = _fake_dir(tmp_path, _dead_pid())

    class Killed(BaseException):
        pass

    def cut_short(held):
        os.unlink(".lock", dir_fd=held.fd)             # the lock file went first, then the kill
        raise Killed

    monkeypatch.setattr(swdir.HeldDir, "empty", cut_short)
    with pytest.raises(Killed):
        clean_stale(str(tmp_path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [f".{stale.name}.del"]
    clean_stale(str(tmp_path))
    assert os.listdir(tmp_path) == []


# --- errors: clear messages, tensors intact -------------------------------------------------

def _fail_with(code):
    async def failing(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return failing


def test_enospc_injected_message_and_source_intact(tmp_path):
    with small(tmp_path) as sw:
        sw.write("old", torch.ones(1000)).wait()
        sw._pwritev = _fail_with(errno.ENOSPC)
        src = torch.randn(200_000)
        keep = src.clone()
        f = sw.write("w", src)
        with pytest.raises(SwapSpaceError) as ei:
            f.wait()
        m = str(ei.value)
        assert "ENOSPC" in m and "No space left" in m and sw.path in m and "Fix:" in m and "intact" in m
        assert torch.equal(src, keep)
        assert isinstance(ei.value, ZeroplugError) and ei.value.errno == errno.ENOSPC
        sw.wait_all()                            # already seen through the future: not raised again
        with pytest.raises(SwapError, match="no valid data"):
            sw.read("w", torch.empty(200_000)).wait()
        assert not any("-w.swp" in n for n in os.listdir(sw.path))    # the space was given back
        sw.write("w2", torch.ones(10))
        with pytest.raises(SwapSpaceError):
            sw.wait_all()                        # unseen failures surface here
        out = torch.empty(1000)
        sw.read("old", out).wait()               # other keys unaffected
        assert torch.equal(out, torch.ones(1000))


def test_eio_on_read_leaves_destination_untouched(tmp_path):
    with small(tmp_path, buffer_size=256 * KiB) as sw:
        sw.write("a", torch.randn(100_000)).wait()
        sw._preadv = _fail_with(errno.EIO)
        out = torch.full((100_000,), 7.0)
        with pytest.raises(SwapIOError, match=r"EIO.*dmesg.*untouched"):
            sw.read("a", out).wait()
        assert torch.equal(out, torch.full((100_000,), 7.0))


def test_enospc_on_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    try:
        with small(mnt) as sw:
            src = torch.randn(2**19)                 # 2 MiB > 1 MiB
            keep = src.clone()
            with pytest.raises(SwapSpaceError) as ei:
                sw.write("big", src).wait()
            assert str(mnt) in str(ei.value) and "ENOSPC" in str(ei.value)
            assert torch.equal(src, keep)
            assert [n for n in os.listdir(sw.path) if n.endswith(".swp")] == []
            t = torch.randn(1000)
            sw.write("fits", t).wait()               # space was given back
            out = torch.empty_like(t)
            sw.read("fits", out).wait()
            assert torch.equal(out, t)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_path_errors(tmp_path, monkeypatch):
    with pytest.raises(SwapPathError, match=r"ENOENT.*mkdir -p"):
        small(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SwapPathError, match="ENOTDIR"):
        small(f)
    # as root, permission checks pass: inject what a user / a read-only mount would see
    with monkeypatch.context() as m:
        m.setattr(swmod.os, "mkdir", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
        with pytest.raises(SwapPathError, match=r"EROFS.*read-only.*remount") as ei:
            small(tmp_path)
        assert str(tmp_path) in str(ei.value)
    with monkeypatch.context() as m:
        m.setattr(swmod.os, "access", lambda *a, **k: False)
        with pytest.raises(SwapPathError, match=r"EACCES.*chmod/chown"):
            small(tmp_path)
    assert swap_dirs(tmp_path) == []


@pytest.mark.parametrize("where", ["open", "io"])
def test_odirect_refused_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, where):
    monkeypatch.setattr(swmod, "_WARNED_BUFFERED", False)
    if where == "open":
        real_open = os.open

        def no_direct(path, flags, *a, **k):
            if flags & swmod.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *a, **k)
        monkeypatch.setattr(swmod.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        with small(tmp_path) as sw:
            if where == "io":
                real = sw._pwritev

                async def einval_when_direct(fd, *a, **k):
                    if swmod.has_direct(fd):
                        raise OSError(errno.EINVAL, "Invalid argument")
                    return await real(fd, *a, **k)
                sw._pwritev = einval_when_direct
            ts = [torch.randn(150_000) for _ in range(3)]
            outs = round_trip(sw, ts)
            assert all(torch.equal(a, b) for a, b in zip(ts, outs))
            assert sw.direct is False
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and "buffered" in warnings[0].getMessage()


# --- plan: before anything is allocated -------------------------------------------------------

def _opts(path, **kw):
    return SimpleNamespace(**{"nvme_path": str(path), "buffer_count": 4, "buffer_size": None,
                              "pin_memory": True, **kw})


def test_plan_checks(tmp_path, monkeypatch):
    p = plan(10 * 2**20, 1000, _opts(tmp_path), where="offload.optimizer")
    assert p.buffer_numel == 1000 and p.pinned_bytes == 4 * 4096 and p.swap_bytes >= 10 * 2**20

    with pytest.raises(ConfigError, match=r"buffer_size = 1000 .*\(5000 elements\).*buffer_size >= 5000") as ei:
        plan(0, 5000, _opts(tmp_path, buffer_size=1000), where="offload.param")
    assert ei.value.key == "offload.param.buffer_size"

    monkeypatch.setattr(planmod, "host_available_bytes", lambda: 10 * 2**20)
    with pytest.raises(SwapMemoryError, match=r"buffer_count = 5 x buffer_size = 1000000 .*10485760 bytes"):
        plan(0, 10, _opts(tmp_path, buffer_count=5, buffer_size=10**6))
    monkeypatch.undo()

    fake = SimpleNamespace(f_bavail=100, f_frsize=4096, f_flag=0)
    monkeypatch.setattr(swmod.os, "statvfs", lambda path: fake)
    with pytest.raises(SwapSpaceError) as ei:
        plan(2**30, 10, _opts(tmp_path))
    m = str(ei.value)
    assert "1073741824 bytes" in m and "409600 bytes" in m and str(tmp_path) in m
    with pytest.raises(SwapPathError, match="ENOENT"):
        plan(1, 1, _opts(tmp_path / "missing"))


# --- the tier and its options ------------------------------------------------------------------

def test_tier_options_and_lifecycle(tmp_path, caplog):
    from zeroplug.config import load
    from zeroplug.options import build_options
    cfg = load({"zero": {"plugin": "stage3"},
                "offload": {"optimizer": {"plugin": "nvme", "nvme_path": str(tmp_path), "intra_op_parallelism": 2,
                                          "block_size": 65536}}})
    o = cfg.slot("offload.optimizer").options
    # the [offload.param] table validates, though training does not use it yet (the tier rejects it)
    p = build_options(NVMeOptions, {"nvme_path": str(tmp_path)}, "offload.param").resolved("param")
    with pytest.raises(ConfigError, match="needs the optimizer offloaded too"):
        load({"zero": {"plugin": "stage3"}, "offload": {"param": {"plugin": "nvme", "nvme_path": str(tmp_path)}}})
    assert (o.buffer_count, o.pipeline_read, o.fast_init, o.thread_count) == (4, True, True, 2)
    assert (p.buffer_count, p.buffer_size, p.max_in_cpu) == (5, 10**8, 10**9)
    for raw, pattern in [
        ({"offload": {"optimizer": {"plugin": "nvme"}}}, "nvme_path is required"),
        ({"offload": {"param": {"plugin": "nvme", "nvme_path": "/x"}}}, "needs zero.plugin = \"stage3\""),
        ({"zero": {"plugin": "stage3"}, "offload": {"param": {"plugin": "nvme", "nvme_path": "/x",
                                                              "pipeline_read": True}}}, "applies to"),
        ({"offload": {"optimizer": {"plugin": "nvme", "nvme_path": "/x", "block_size": 5000}}}, "multiple of 4096"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load(raw)
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        load({"offload": {"optimizer": {"plugin": "nvme", "nvme_path": "/x", "single_submit": True}}})
    assert any("single_submit = true changes nothing" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="zeroplug"):
        load({"offload": {"optimizer": {"plugin": "nvme", "nvme_path": "/x", "fast_init": False}}})
    assert any("fast_init = false changes nothing" in r.getMessage() for r in caplog.records)

    tier = NVMeOffload(NVMeOptions(nvme_path=str(tmp_path), block_size=65536), SimpleNamespace(device=None),
                       "optimizer")
    assert tier.device == torch.device("cpu") and tier.options.buffer_count == 4
    assert tier.empty(10, torch.float32).device.type == "cpu"
    tier.plan_swap(total_bytes=3 * 40_000, largest_numel=10_000)
    sw = tier.swapper
    assert tier.swapper is sw and sw.buffer_bytes == 40_960
    t = torch.randn(10_000)
    sw.write("m", t).wait()
    d = sw.path
    tier.close()
    assert not os.path.exists(d)
