"""Whether a directory (and what is in it) can be changed by another user; files written
so that no link or predictable name can redirect them."""
from __future__ import annotations

import os
import stat
import tempfile

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: entries a tree check looks at before it gives up (and trusts the rest of the tree)
TREE_LIMIT = 200_000


def user_name(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp
        return grp.getgrgid(gid).gr_name
    except (ImportError, KeyError):
        return f"gid {gid}"


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is the user-private group of ``uid`` (its name, no other member)."""
    try:
        import grp
        import pwd
        name = pwd.getpwuid(uid).pw_name
        g = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return g.gr_name == name and set(g.gr_mem) <= {name}


def others_can_write(st: os.stat_result, uid: int | None = None, sticky_ok: bool = False) -> str | None:
    """Who, besides ``uid`` (this user) and root, can change the entry with this stat (for a
    directory: add, rename or remove its entries), in words; None if no one.
    ``sticky_ok``: a sticky directory owned by ``uid`` or root is not counted as writable by
    others (they may add entries of their own, never touch this user's)."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid not in (uid, 0):
        return f"it is owned by {user_name(st.st_uid)}"
    mode = st.st_mode
    if sticky_ok and stat.S_ISDIR(mode) and mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return f"every user can write it (mode {stat.S_IMODE(mode):04o})"
    if mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        return f"group {_group(st.st_gid)} can write it (mode {stat.S_IMODE(mode):04o})"
    return None


def code_dir_problem(path, uid: int | None = None, tree: bool = True) -> str | None:
    """Why the directory ``path`` is not trusted for code, or None (see the module doc).
    The path is resolved first (the resolved path is what must be used). A missing
    directory is a problem: create it first (:func:`make_dirs`). ``tree=False`` checks the
    directory and its ancestors, not what is inside."""
    real = os.path.realpath(path)
    try:
        st = os.lstat(real)
    except OSError as exc:
        return f"it cannot be read ({os.strerror(exc.errno) if exc.errno else exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    why = others_can_write(st, uid)
    if why:
        return why
    why = ancestors_problem(os.path.dirname(real), uid)
    if why:
        return why
    return tree_problem(real, uid) if tree else None


def ancestors_problem(path, uid: int | None = None) -> str | None:
    """Why a directory made in ``path`` could be renamed or replaced by another user: ``path``
    or one of its ancestors is writable by others (a sticky one owned by root or this user
    is not), or owned by another user; None if none is."""
    parent = os.path.realpath(path)
    while True:
        try:
            st = os.lstat(parent)
        except OSError as exc:
            return f"{parent} cannot be read ({os.strerror(exc.errno) if exc.errno else exc})"
        why = others_can_write(st, uid, sticky_ok=True)
        if why:
            return f"in {parent}, {why}"
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


def data_dir_problem(path, uid: int | None = None) -> str | None:
    """Why files written into the existing directory ``path`` could be replaced or added to
    by another user (its owner, where that is someone else; every user, where every user
    can write it, sticky bit or not), or None. A group that can write it is a grant its
    owner made, and is trusted."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"it cannot be read ({os.strerror(exc.errno) if exc.errno else exc})"
    why = []
    if st.st_uid not in (uid, 0):
        why.append(f"it is owned by {user_name(st.st_uid)}")
    if st.st_mode & stat.S_IWOTH:
        why.append(f"every user can write it (mode {stat.S_IMODE(st.st_mode):04o})")
    return " and ".join(why) or None


def tree_problem(path, uid: int | None = None, limit: int = TREE_LIMIT) -> str | None:
    """Why the tree under the trusted directory ``path`` holds something this user did not
    make, or None: every entry must be owned by this user or root and, where others can
    reach it (``path`` has group or other execute permission), not writable by them."""
    uid = os.geteuid() if uid is None else uid
    try:
        top = os.lstat(path)
    except OSError:
        return None
    reachable = bool(stat.S_IMODE(top.st_mode) & 0o011)
    seen = 0
    stack = [path]
    while stack and seen < limit:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for entry in it:
                seen += 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid not in (uid, 0):
                    return f"{entry.path} is owned by {user_name(st.st_uid)}"
                if reachable and not stat.S_ISLNK(st.st_mode):
                    why = others_can_write(st, uid)
                    if why:
                        return f"{entry.path}: {why}"
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
    return None


def existing_ancestor(path) -> str:
    """The longest prefix of ``path`` (absolute) that exists as a directory."""
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    return p


def make_dirs(path, mode: int = 0o700) -> None:
    """``mkdir -p`` where every directory created gets ``mode`` (``os.makedirs`` gives the
    intermediate ones the umask's default instead)."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.lexists(p):     # (a file in the way: the mkdir below it says ENOTDIR)
        missing.append(p)
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            if not os.path.isdir(p):
                raise


def atomic_write(path, data: bytes, mode: int = 0o600) -> None:
    """Replace the file ``path`` with ``data``: written to an exclusively created temporary
    file with a random name beside it, then renamed over ``path``."""
    d, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_append(path, mode: int = 0o600) -> int:
    """A descriptor appending to ``path`` (created with ``mode``), never through a link."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC, mode)
