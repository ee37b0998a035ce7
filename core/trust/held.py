"""A directory held by a descriptor: made private, checked, and used only relative to it."""
from __future__ import annotations

import errno
import os
import secrets
import stat

from .dirs import CLOEXEC, NOFOLLOW, user_name

DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UntrustedDirError(OSError):
    """A directory is not what this process made (another owner, a mode others can write,
    a link or a non-directory in its place)."""


def _plain_name(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a plain file name: {name!r}")
    return name


class HeldDir:
    """A directory held by a descriptor: its files are opened, listed, renamed and removed
    relative to it, never through a link, so that renaming the directory (or replacing it
    by a link) afterwards redirects nothing. ``path`` is where it was: for messages only."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    # -- making and opening ------------------------------------------------------------------
    @classmethod
    def open_dir(cls, path, follow: bool = False) -> "HeldDir":
        """Hold the existing directory ``path`` (its last component must not be a link,
        unless ``follow``: a configured path such as ``nvme_path`` may be one)."""
        path = os.fspath(path)
        fd = os.open(path, os.O_RDONLY | DIRECTORY | (0 if follow else NOFOLLOW) | CLOEXEC)
        return cls(fd, path)

    def make_private(self, name: str) -> "HeldDir":
        """Create the subdirectory ``name`` (0700) and hold it, checked: a directory owned by
        this user that no one else can enter. Raises ``FileExistsError`` when ``name`` is
        taken, :class:`UntrustedDirError` when what was made is no longer what is found."""
        os.mkdir(_plain_name(name), 0o700, dir_fd=self.fd)
        return self.open_private(name, created=True)

    def open_owned(self, name: str) -> "HeldDir":
        """Hold the subdirectory ``name`` if this user owns it (not a link to one); raises
        :class:`UntrustedDirError` if another user does."""
        fd = os.open(_plain_name(name), os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=self.fd)
        st = os.fstat(fd)
        sub = os.path.join(self.path, name)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise UntrustedDirError(errno.EPERM, f"owned by {user_name(st.st_uid)}, not by this user", sub)
        return HeldDir(fd, sub)

    def open_private(self, name: str, created: bool = False) -> "HeldDir":
        """Hold the subdirectory ``name`` if it is a private directory of this user (0700)."""
        held = self.open_owned(name)
        fd, sub = held.fd, held.path
        st = os.fstat(fd)
        if created and stat.S_IMODE(st.st_mode) & 0o077:
            try:        # a default ACL of the parent can give a new directory more than mkdir's mode
                os.fchmod(fd, 0o700)
            except OSError:
                pass
            st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise UntrustedDirError(errno.EPERM, f"others may use it (mode {stat.S_IMODE(st.st_mode):04o})", sub)
        return HeldDir(fd, sub)

    def make_private_unique(self, prefix: str, suffix: str = "", attempts: int = 100) -> tuple[str, "HeldDir"]:
        """A new private subdirectory ``<prefix><random hex><suffix>``: (its name, held)."""
        for _ in range(attempts):
            name = f"{prefix}{secrets.token_hex(4)}{suffix}"
            try:
                return name, self.make_private(name)
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, f"no free name {prefix}*{suffix}", self.path)

    # -- files inside ------------------------------------------------------------------------
    def join(self, name: str) -> str:
        """A path for messages (never for opening: the directory may have moved)."""
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` inside, never through a link."""
        return os.open(_plain_name(name), flags | NOFOLLOW | CLOEXEC, mode, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        os.unlink(_plain_name(name), dir_fd=self.fd)

    def rmdir(self, name: str) -> None:
        os.rmdir(_plain_name(name), dir_fd=self.fd)

    def rename(self, src: str, dst: str, dst_dir: "HeldDir | None" = None) -> None:
        os.rename(_plain_name(src), _plain_name(dst), src_dir_fd=self.fd,
                  dst_dir_fd=(dst_dir or self).fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(_plain_name(name), dir_fd=self.fd, follow_symlinks=False)

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def fstat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def is_entry(self, name: str, held: "HeldDir") -> bool:
        """Whether ``name`` here is (still) the directory ``held``."""
        try:
            st = self.lstat(name)
        except OSError:
            return False
        own = held.fstat()
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def empty(self) -> None:
        """Remove everything inside (never following links; subdirectories through their
        own descriptors)."""
        for name in self.listdir():
            try:
                st = self.lstat(name)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = HeldDir(os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=self.fd),
                                  self.join(name))
                except OSError:
                    continue
                try:
                    sub.empty()
                finally:
                    sub.close()
                try:
                    self.rmdir(name)
                except OSError:
                    pass
            else:
                try:
                    self.unlink(name)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __repr__(self) -> str:
        return f"HeldDir({self.path!r}, fd={self.fd})"
