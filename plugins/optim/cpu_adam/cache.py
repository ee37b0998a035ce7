"""Where cpu_adam's kernels are cached, and whether that directory may be trusted with code.

One directory per machine kind and torch version: ``~/.cache/zeroplug/torch-<version>/<cpu>``
(``ZEROPLUG_CACHE_DIR`` moves the root, else ``XDG_CACHE_HOME``). The ``<cpu>`` part names
the CPU model and its instruction-set flags, so a home directory shared by different machines
never hands one a kernel built for another's vector unit. Under it: inductor's FX graph cache
(the compiled kernel, :mod:`.warmup`), the native kernel's shared objects (:mod:`.native`)
and the measured CPU plans (:mod:`.plan_cache`).

A cache directory that another user could write (or that holds their files) is never used
for code: inductor and the native loader would load what they find there
(:func:`use_cache_dir`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile

import torch

from zeroplug.trust import ancestors_problem, code_dir_problem, existing_ancestor, make_dirs, printable

log = logging.getLogger("zeroplug")

CACHE_ENV = "ZEROPLUG_CACHE_DIR"


def cpu_tag() -> str:
    """The CPU model and instruction-set flags, hashed: which kernels this machine can run."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    text = f"{model}|{flags}" if (model or flags) else platform.processor()
    return f"{platform.machine() or 'cpu'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def cache_root(env=None) -> str:
    """zeroplug's kernel cache for this torch version and CPU."""
    env = os.environ if env is None else env
    base = env.get(CACHE_ENV) or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zeroplug")
    return os.path.join(base, f"torch-{torch.__version__}", cpu_tag())


def _writable(path: str) -> None:
    make_dirs(path, 0o700)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
        pass


def _usable(path: str) -> tuple[str, str | None]:
    """(the directory to use for ``path``: resolved, created 0700 where missing; why it is not
    trusted for code, or None). Raises ``OSError`` where it cannot be created or written."""
    problem = ancestors_problem(existing_ancestor(path))
    if problem is not None:     # nothing is created below a directory others can change
        return path, problem
    _writable(path)
    real = os.path.realpath(path)
    return (path if real == os.path.abspath(path) else real), code_dir_problem(real)


def use_cache_dir(env=None) -> tuple[str, str | None]:
    """Point inductor's cache at zeroplug's directory (unless TORCHINDUCTOR_CACHE_DIR is set).

    Returns (the directory the build lock lives in, a warning or None). Note: the setting is
    process-wide (inductor reads the variable for every compile), so a model compiled with
    ``torch.compile`` in this process is cached there too. A directory that cannot be written
    gives a warning and a private temporary one: the run works, and pays the build.

    Note: inductor loads the shared objects it finds in its cache (and unpickles its entries),
    so a cache directory that another user can write would run their code in this process.
    One that is not trusted for code (:func:`zeroplug.trust.code_dir_problem`: owned by
    another user, writable by others, below such a directory, or holding files of another
    user) is not used: the default ``~/.cache/zeroplug`` (created 0700) is, or failing that
    a private temporary directory, with one warning."""
    env = os.environ if env is None else env
    given = env.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) == _inductor_default():
        given = None        # set by inductor itself (importing torch._dynamo does), not chosen
    target = given or os.path.join(cache_root(env), "inductor")
    try:
        path, problem = _usable(target)
    except OSError as e:
        tmp = tempfile.mkdtemp(prefix="zeroplug-kernels-")
        env["TORCHINDUCTOR_CACHE_DIR"] = tmp
        return tmp, (f"cpu_adam: the kernel cache {target} cannot be written ({e.strerror or e}): building the "
                     f"kernel in {tmp} for this run only; set {CACHE_ENV} (or TORCHINDUCTOR_CACHE_DIR) to a "
                     f"writable directory to build it once per machine")
    if problem is None:
        if path != given:
            env["TORCHINDUCTOR_CACHE_DIR"] = path
        return path, None
    fallback = None
    default = os.path.join(cache_root({k: v for k, v in env.items() if k != CACHE_ENV}), "inductor")
    if os.path.realpath(default) != os.path.realpath(target):
        try:
            fallback, again = _usable(default)
        except OSError:
            fallback = again = None
        if again is not None:
            fallback = None
    if fallback is None:
        fallback = tempfile.mkdtemp(prefix="zeroplug-kernels-")
    env["TORCHINDUCTOR_CACHE_DIR"] = fallback
    which = "TORCHINDUCTOR_CACHE_DIR" if given else CACHE_ENV
    return fallback, (f"cpu_adam: the kernel cache {printable(target)} is not used, because another user could "
                      f"put code there that this run would load: {printable(problem)}; using {fallback}. Fix: "
                      f"set {which} to a directory only you can write (chmod go-w), or unset it")


def _inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except Exception as exc:    # noqa: BLE001 - another torch layout
        log.debug("cpu_adam: inductor's default cache directory is unknown here: %r", exc)
        return None


