"""A machine shared with other users: another user can neither run code through zeroplug,
nor hang it, nor redirect its files.

Where a second user is needed, the test creates one (``useradd``; the suite runs as root, as
CI does) and runs its steps under ``runuser``; without those tools the test is skipped.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from zeroplug import trust
from zeroplug.plugins.optim.cpu_adam import warmup
from zeroplug.plugins.optim.cpu_adam.cache import cache_root, use_cache_dir

from tests.support.shared_users import other_user, shared_tmp  # noqa: F401 - fixtures

CLI = [sys.executable, "-m", "zeroplug.cli", "train", "--max-bytes", "40000", "--seq", "16",
       "--batch.micro_batch_size=2", "--batch.steps_per_print=1000", "--monitor.plugin=none"]


# --- the kernel cache --------------------------------------------------------------------------

def _plant_build(user, cache: str) -> str:
    """``user`` makes the cache tree the victim would use, with a shared object in it."""
    inductor = os.path.join(cache_root({"ZEROPLUG_CACHE_DIR": cache}), "inductor")
    os.mkdir(cache)
    os.chown(cache, user.uid, user.gid)         # the other user's directory
    user.sh(f"mkdir -p '{inductor}/xy' && echo payload > '{inductor}/xy/c.so' && chmod -R 0777 '{cache}'")
    return inductor


def test_cache_dir_another_user_can_write_is_not_used_for_code(other_user, shared_tmp):
    """Another user's world-writable directory as ZEROPLUG_CACHE_DIR, a 'build' planted in
    it: the victim points inductor elsewhere (nothing is loaded from there), with one
    warning naming the directory and the fix; it creates nothing there either."""
    cache = os.path.join(shared_tmp, "cache")
    planted = _plant_build(other_user, cache)
    before = sorted(os.walk(cache))
    env = {"ZEROPLUG_CACHE_DIR": cache, "XDG_CACHE_HOME": os.path.join(shared_tmp, "home-cache")}
    path, warning = use_cache_dir(env)
    assert warning is not None and cache in warning and "another user could put code there" in warning
    assert f"owned by {other_user.name}" in warning and "ZEROPLUG_CACHE_DIR" in warning
    assert "\n" not in warning
    assert not os.path.realpath(path).startswith(os.path.realpath(cache))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == path != planted
    assert path == os.path.join(cache_root({"XDG_CACHE_HOME": env["XDG_CACHE_HOME"]}), "inductor")
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert trust.code_dir_problem(path) is None
    assert sorted(os.walk(cache)) == before          # nothing written into the other user's tree


def test_cache_below_a_directory_others_can_write_is_not_used(shared_tmp):
    """Our own cache directory, but inside a directory every user can write (no sticky bit):
    anyone could rename it and put theirs in its place."""
    scratch = os.path.join(shared_tmp, "scratch")
    os.mkdir(scratch)
    os.chmod(scratch, 0o777)
    env = {"ZEROPLUG_CACHE_DIR": os.path.join(scratch, "mine"), "XDG_CACHE_HOME": os.path.join(shared_tmp, "hc")}
    path, warning = use_cache_dir(env)
    assert warning and "every user can write it" in warning and scratch in warning
    assert path.startswith(os.path.join(shared_tmp, "hc"))
    assert not os.path.exists(os.path.join(scratch, "mine"))     # nothing made below it


def test_cache_in_a_sticky_directory_is_ours(shared_tmp):
    """A sticky, root-owned parent (/tmp-like) is fine: others cannot touch our entries."""
    sticky = os.path.join(shared_tmp, "sticky")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    env = {"ZEROPLUG_CACHE_DIR": os.path.join(sticky, "mine")}
    path, warning = use_cache_dir(env)
    assert warning is None and path.startswith(os.path.join(sticky, "mine"))


def test_a_file_of_another_user_inside_our_cache_refuses_it(other_user, shared_tmp):
    """The directories are ours, but a cached build inside belongs to someone else (it was
    replaced while the directory was open to others): the cache is not used."""
    env = {"ZEROPLUG_CACHE_DIR": os.path.join(shared_tmp, "c"), "XDG_CACHE_HOME": os.path.join(shared_tmp, "hc")}
    path, warning = use_cache_dir(dict(env))
    assert warning is None
    os.makedirs(os.path.join(path, "ab"))
    so = os.path.join(path, "ab", "kernel.so")
    with open(so, "w") as f:
        f.write("payload")
    os.chown(so, other_user.uid, other_user.gid)
    path2, warning = use_cache_dir(dict(env))
    assert warning and so in warning and other_user.name in warning
    assert path2 != path
    os.chown(so, 0, 0)
    os.chmod(so, 0o666)                     # ours, but every user can write it
    os.chmod(path, 0o755)
    path3, warning = use_cache_dir(dict(env))
    assert warning and so in warning and "every user can write it" in warning


def test_no_predictable_temporary_names(tmp_path):
    """Links at the names the old code used for its temporary files (``<file>.<pid>.tmp``)
    are never followed: the file they point at stays as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    os.chmod(victim, 0o600)
    cache = tmp_path / "cache"
    cache.mkdir()
    variants = cache / warmup.VARIANTS_FILE
    for pid in {os.getpid(), os.getppid()}:
        os.symlink(victim, f"{variants}.{pid}.tmp")
    warmup._add_variants(str(variants), ["adamw grad=torch.bfloat16 lp=None threads=1"])
    assert victim.read_text() == "mine\n"
    assert not variants.is_symlink()
    assert json.loads(variants.read_text()) == ["adamw grad=torch.bfloat16 lp=None threads=1"]
    assert stat.S_IMODE(os.stat(variants).st_mode) == 0o600


def test_printable_escapes_control_characters():
    assert trust.printable("a\x1b[31mb\x07\u202ec\n") == "a\\x1b[31mb\\x07\\u202ec\\x0a"
    assert trust.printable("x" * 400, limit=10) == "x" * 10 + "..."


# --- lock files: never followed, never waited on, printed escaped --------------------------------

# Each lock step runs in a child with a timeout: on a FIFO the old code blocked forever.
CLEAN = "import sys, logging; logging.basicConfig(level=logging.WARNING, format='%(message)s'); " \
        "from zeroplug.plugins.offload_nvme.swapdir import clean_stale; print(clean_stale(sys.argv[1]))"
HOLD_CKPT = "import sys; from zeroplug.checkpoint import directory; directory.hold(sys.argv[1], object())"


def _child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def test_fifo_lock_in_a_swap_dir_of_ours_does_not_hang(tmp_path):
    d = tmp_path / f"zeroplug-swap-{os.getpid()}-0123abcd"
    d.mkdir(mode=0o700)
    os.mkfifo(d / ".lock")
    (d / "000001-x.swp").write_bytes(b"x" * 4096)
    r = _child(CLEAN, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]" and d.exists()          # not a lock: left alone ...
    warnings = [line for line in r.stderr.splitlines() if ".lock" in line]
    assert len(warnings) == 1 and "a FIFO" in warnings[0] and "left alone" in warnings[0], r.stderr


def test_another_users_swap_dirs_are_not_ours_to_clean(other_user, shared_tmp):
    """A shared nvme_path (sticky, like /tmp): another user's directory with a FIFO at its
    lock path, and one with a free lock (a dead run of theirs). A run of ours (root here)
    neither hangs on the first nor removes the second."""
    base = os.path.join(shared_tmp, "nvme")
    os.mkdir(base)
    os.chmod(base, 0o1777)
    fifo_dir = os.path.join(base, "zeroplug-swap-4242-0badf00d")
    dead_dir = os.path.join(base, "zeroplug-swap-4243-deadbeef")
    other_user.sh(f"mkdir -m 700 {fifo_dir} {dead_dir} && mkfifo {fifo_dir}/.lock && "
                  f"echo '{{\"pid\": 4243}}' > {dead_dir}/.lock && echo data > {dead_dir}/000001-x.swp")
    r = _child(CLEAN, base)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    assert os.path.exists(os.path.join(dead_dir, "000001-x.swp")) and os.path.exists(fifo_dir)
    # and a swapper starting there works beside them, and cleans up only its own directory
    from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper
    with AsyncSwapper(base, buffer_count=2, buffer_size=1 << 14, pin_memory=False) as sw:
        sw.write("k", torch.arange(10.0)).wait()
        mine = sw.path
    assert not os.path.exists(mine)
    assert sorted(os.listdir(base)) == sorted([os.path.basename(fifo_dir), os.path.basename(dead_dir)])


def test_fifo_lock_in_a_checkpoint_dir_is_one_error(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / ".zeroplug.lock")
    r = _child(HOLD_CKPT, str(ck))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in last and ".zeroplug.lock is a FIFO" in last and "remove" in last, r.stderr


def test_a_symlinked_checkpoint_lock_is_not_followed(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, ck / ".zeroplug.lock")
    from zeroplug.checkpoint import CheckpointError
    from zeroplug.checkpoint import directory
    with pytest.raises(CheckpointError, match="symbolic link"):
        directory.hold(ck, object())
    assert victim.read_text() == "mine\n"


HOSTILE = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": "1\\x1b[2J", "host": "gpu\\x1b]0;owned\\x07", "started": 1e300,
                             "command": "train \\x1b[31mred\\u202e"}).encode())
    print("held", flush=True)
    sys.stdin.read()
""")


def test_a_lock_holders_record_is_printed_escaped(tmp_path):
    from zeroplug.checkpoint import CheckpointError
    from zeroplug.checkpoint import directory
    ck = tmp_path / "ck"
    ck.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOSTILE, str(ck / ".zeroplug.lock")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError) as info:
            directory.hold(ck, object())
    finally:
        p.communicate("")
    msg = str(info.value)
    assert "\x1b" not in msg and "\x07" not in msg and "\u202e" not in msg
    assert "pid 1\\x1b[2J on host gpu\\x1b]0;owned\\x07" in msg and "train \\x1b[31mred\\u202e" in msg


def test_an_oversized_lock_record_is_not_read(tmp_path):
    from zeroplug.locks import RECORD_LIMIT, read_holder
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"pid": 1, "command": "x" * (RECORD_LIMIT + 10)}))
    assert read_holder(path) is None
    path.write_text(json.dumps({"pid": 1}))
    assert read_holder(path) == {"pid": 1}


# --- the swap directory: held, never redirected ---------------------------------------------------

def test_renaming_the_swap_dir_and_planting_a_link_redirects_nothing(tmp_path):
    """nvme_path writable by others (no sticky bit): after the run made its directory, its
    directory is renamed and a link to the other user's directory put in its place. The
    run's writes, reads and deletes go on in its own directory; nothing lands in theirs."""
    from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper
    base = tmp_path / "scratch"
    base.mkdir()
    os.chmod(base, 0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    ts = [torch.randn(3000) for _ in range(4)]
    sw = AsyncSwapper(str(base), buffer_count=2, buffer_size=1 << 14, pin_memory=False)
    try:
        sw.write("a", ts[0]).wait()
        path = sw.path
        moved = tmp_path / "moved"
        os.rename(path, moved)
        os.symlink(theirs, path)
        sw.write("a", ts[1]).wait()              # an existing key ...
        sw.write("b", ts[2]).wait()              # ... and new files
        sw.write("c", ts[3]).wait()
        out = [torch.empty(3000) for _ in range(3)]
        for k, o in zip("abc", out):
            sw.read(k, o).wait()
        assert all(torch.equal(a, b) for a, b in zip(out, ts[1:]))
        sw.delete("c")
        assert os.listdir(theirs) == []
        assert sorted(n for n in os.listdir(moved) if n.endswith(".swp")) == \
            ["000001-a.swp", "000002-b.swp"]
    finally:
        sw.close()
    assert os.listdir(theirs) == [] and os.listdir(moved) == []     # emptied where it went
    assert os.path.islink(path)                                    # their link is not ours to remove


def test_training_on_a_renamed_and_linked_swap_dir_writes_nothing_through_the_link(tmp_path):
    """The same during training: stage 2 with the optimizer states on NVMe under a
    directory every user can write. After the first steps the run's directory is renamed
    and a link to another user's directory put in its place; the next steps swap every
    state in and out, their losses equal an untouched run's, and the other directory
    stays empty."""
    import zeroplug
    from tests.support.toy import ToyNet, batches, train_steps

    def build(path):
        torch.manual_seed(0)
        return zeroplug.initialize(ToyNet(), {
            "zero": {"plugin": "stage2", "sub_group_size": 900}, "optimizer": {"plugin": "adamw", "lr": 1e-2},
            "batch": {"micro_batch_size": 8}, "monitor": {"plugin": "none"},
            "offload": {"optimizer": {"plugin": "nvme", "nvme_path": str(path), "buffer_count": 2}}})

    clean = tmp_path / "clean"
    clean.mkdir()
    e = build(clean)
    want = train_steps(e, batches(6, 8), 6)
    e.close()
    base, theirs = tmp_path / "scratch", tmp_path / "theirs"
    base.mkdir()
    theirs.mkdir()
    os.chmod(base, 0o777)
    os.chmod(theirs, 0o777)
    e = build(base)
    data = batches(6, 8)
    got = train_steps(e, data, 2)
    swap_path = e.offload_optimizer.swap.swapper.path
    assert os.path.dirname(swap_path) == str(base)
    moved = tmp_path / "moved"
    os.rename(swap_path, moved)
    os.symlink(theirs, swap_path)
    got += train_steps(e, data, 4)
    assert os.listdir(theirs) == [] and any(n.endswith(".swp") for n in os.listdir(moved))
    e.close()
    assert got == want
    assert os.listdir(theirs) == []


def test_a_swap_dir_replaced_right_after_mkdir_is_refused(tmp_path, monkeypatch):
    """The window between mkdir and holding it: what is found must be ours and private."""
    from zeroplug.trust import HeldDir
    from zeroplug.plugins.offload_nvme.swapper import AsyncSwapper, SwapPathError
    real = HeldDir.make_private

    def swapped(self, name):
        os.mkdir(name, 0o777, dir_fd=self.fd)
        os.chmod(name, 0o777, dir_fd=self.fd)          # "theirs": open to everyone
        return self.open_private(name)
    monkeypatch.setattr(HeldDir, "make_private", swapped)
    with pytest.raises(SwapPathError, match="replaced just after this run made it"):
        AsyncSwapper(str(tmp_path), buffer_count=1, buffer_size=1 << 12, pin_memory=False)
    monkeypatch.setattr(HeldDir, "make_private", real)


# --- checkpoint directories ----------------------------------------------------------------------

def test_a_checkpoint_dir_of_another_user_open_to_all_is_refused(other_user, shared_tmp):
    ck = os.path.join(shared_tmp, "ck")
    os.mkdir(ck)
    os.chown(ck, other_user.uid, other_user.gid)
    other_user.run("chmod", "0777", ck)
    r = subprocess.run([*CLI, "--steps", "1", f"--checkpoint.dir={ck}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.dir '{ck}' is not used: "), r.stderr
    assert f"owned by {other_user.name}" in lines[0] and "every user can write it (mode 0777)" in lines[0]
    assert "Fix: chmod o-w" in lines[0] and "training" not in r.stdout
    assert os.listdir(ck) == []


def test_a_sticky_world_writable_checkpoint_dir_is_refused(tmp_path):
    from zeroplug.checkpoint import CheckpointError
    from zeroplug.checkpoint import directory
    ck = tmp_path / "ck"
    ck.mkdir()
    os.chmod(ck, 0o1777)
    with pytest.raises(CheckpointError, match="every user can write it"):
        directory.prepare(ck)
    os.chmod(ck, 0o775)             # a group the owner granted: trusted
    assert directory.prepare(ck) == ck


# --- plugin filters ------------------------------------------------------------------------------

def test_block_and_allow_lists_ignore_case(monkeypatch):
    from zeroplug import registry
    monkeypatch.delenv("ZEROPLUG_PLUGINS_ALLOW", raising=False)
    monkeypatch.setenv("ZEROPLUG_PLUGINS_BLOCK", "Offload_NVMe, MONITORS")
    registry.reset_plugin_manager()
    try:
        pm = registry.get_plugin_manager()
        assert not pm.pm.has_plugin("offload_nvme") and not pm.pm.has_plugin("monitors")
        assert pm.pm.has_plugin("optim")
        monkeypatch.delenv("ZEROPLUG_PLUGINS_BLOCK")
        monkeypatch.setenv("ZEROPLUG_PLUGINS_ALLOW", "OPTIM")
        registry.reset_plugin_manager()
        assert [n for n, _ in registry.get_plugin_manager().pm.list_name_plugin()] == ["optim"]
    finally:
        registry.reset_plugin_manager()


def test_an_empty_allow_list_says_so(monkeypatch):
    import zeroplug
    from zeroplug import registry
    from zeroplug.errors import ConfigError
    monkeypatch.setenv("ZEROPLUG_PLUGINS_ALLOW", "")
    registry.reset_plugin_manager()
    try:
        with pytest.raises(ConfigError) as info:
            zeroplug.load_config({})
    finally:
        registry.reset_plugin_manager()
    msg = str(info.value)
    assert "Choose one of" not in msg
    assert "ZEROPLUG_PLUGINS_ALLOW=''" in msg and "excludes every plugin" in msg and "unset it" in msg


# --- loading: torch's advice is not repeated -----------------------------------------------------

class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_the_load_reason_drops_torchs_weights_only_advice(tmp_path):
    from zeroplug.trust import torch_load_reason
    path = tmp_path / "x.pt"
    torch.save({"a": _Payload()}, path)
    with pytest.raises(Exception) as info:
        torch.load(path, weights_only=True)
    assert "weights_only" in str(info.value)            # torch's own text has the advice
    reason = torch_load_reason(info.value)
    assert "weights_only" not in reason and "\n" not in reason
    assert "objects other than tensors" in reason and "posix.system" in reason
