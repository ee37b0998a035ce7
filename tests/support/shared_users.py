"""A second local user for the shared-machine tests: created with ``useradd`` (the tests run
as root, as CI does), removed afterwards; its steps run under ``runuser``."""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile

import pytest


def _need_root_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user (useradd)")
    for tool in ("useradd", "userdel", "runuser"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing: cannot act as a second user")


class OtherUser:
    """Another local user (``name``, ``uid``, ``gid``); :meth:`run` runs a command as it."""

    def __init__(self, name: str):
        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, pw.pw_uid, pw.pw_gid

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(["runuser", "-u", self.name, "--", *cmd], capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"as {self.name}: {cmd} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sh(self, script: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("sh", "-c", script, check=check)


@pytest.fixture
def other_user():
    _need_root_tools()
    name = "zpt" + secrets.token_hex(4)
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        yield OtherUser(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_tmp():
    """A directory under /tmp that every user can reach (not write): root 0755."""
    d = tempfile.mkdtemp(prefix="zeroplug-shared-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
