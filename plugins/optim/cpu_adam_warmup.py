"""cpu_adam's compiled kernel, built once per machine and torch version, before the first step.

What makes a second process skip the C++ build is inductor's FX graph cache: the compiled
graph (and the shared object it loads) is stored under ``TORCHINDUCTOR_CACHE_DIR``, keyed by
the graph, torch's version and the inductor options (the kernel's thread count among them).
A later process still traces the function (about a second) but loads the kernel instead of
running the C++ compiler. Before inductor builds or loads a CPU kernel it checks which
vector ISAs the machine can use, 10-20 s per check in every process; the warm-up keeps
those answers in ``vector_isa_checks.json`` beside the cache, so they too are found once
per machine (:func:`.cpu_adam_kernels.remember_isa_checks`). Inductor's default directory
is under ``/tmp``, which containers and reboots empty; zeroplug points it at
``~/.cache/zeroplug/torch-<version>/<cpu>/inductor`` (``ZEROPLUG_CACHE_DIR`` moves the
root; a ``TORCHINDUCTOR_CACHE_DIR`` already set is kept).
The ``<cpu>`` part names the CPU model and its instruction-set flags, so a home directory
shared by different machines never hands one a kernel built for another's vector unit.

The warm-up runs on a background thread started when the optimizer is built (inside
``initialize``): the model's setup goes on meanwhile, and the first step waits for it
rather than compiling. On a host with several ranks, one builds while the others wait on
a file lock in the cache directory, then load what it built.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
import threading
import time

import torch

from zeroplug.locks import try_lock

from . import cpu_adam_kernels as kernels

log = logging.getLogger("zeroplug")

CACHE_ENV = "ZEROPLUG_CACHE_DIR"
LOCK_NAME = "cpu_adam.lock"
ISA_FILE = "vector_isa_checks.json"


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
    os.makedirs(path, mode=0o700, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
        pass


def use_cache_dir(env=None) -> tuple[str, str | None]:
    """Point inductor's cache at zeroplug's directory (unless TORCHINDUCTOR_CACHE_DIR is set).

    Returns (the directory the build lock lives in, a warning or None). Note: the setting is
    process-wide (inductor reads the variable for every compile), so a model compiled with
    ``torch.compile`` in this process is cached there too. A directory that cannot be written
    gives a warning and a private temporary one: the run works, and pays the build."""
    env = os.environ if env is None else env
    given = env.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) == _inductor_default():
        given = None        # set by inductor itself (importing torch._dynamo does), not chosen
    target = given or os.path.join(cache_root(env), "inductor")
    try:
        _writable(target)
    except OSError as e:
        tmp = tempfile.mkdtemp(prefix="zeroplug-kernels-")
        env["TORCHINDUCTOR_CACHE_DIR"] = tmp
        return tmp, (f"cpu_adam: the kernel cache {target} cannot be written ({e.strerror or e}): building the "
                     f"kernel in {tmp} for this run only; set {CACHE_ENV} (or TORCHINDUCTOR_CACHE_DIR) to a "
                     f"writable directory to build it once per machine")
    if not given:
        env["TORCHINDUCTOR_CACHE_DIR"] = target
    return target, None


def _inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except Exception:       # another torch layout
        return None


def _cache_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    c = counters["inductor"]
    return {"hit": int(c.get("fxgraph_cache_hit", 0)), "miss": int(c.get("fxgraph_cache_miss", 0))}


class WarmUp:
    """Builds an optimizer's kernel variants on a background thread (see the module doc)."""

    def __init__(self, optimizer, keys, thread_counts, announce: bool = True):
        self.optimizer, self.keys, self.thread_counts = optimizer, list(keys), tuple(thread_counts)
        self.announce = announce
        self.done = threading.Event()
        self.stats: dict = {}
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "WarmUp":
        if not self.keys:
            self.done.set()
            return self
        kernels._COMPILED.warming = self.done
        # Note: a daemon: a process that ends before the build is done (a short script, a
        # test) must not hang or fail at exit; inductor writes its cache entries atomically,
        # so an interrupted build leaves nothing half-written.
        self._thread = threading.Thread(target=self._run, name="zeroplug-cpu-adam-warmup", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _run(self) -> None:
        me = threading.get_ident()
        kernels._COMPILED.warm_up_threads.add(me)
        t0 = time.perf_counter()
        before = _cache_counters()
        lock = None
        try:
            lock_dir, warning = use_cache_dir()
            if warning and self.announce:
                log.warning("[zeroplug] %s", warning)
            lock, waited = _lock(os.path.join(lock_dir, LOCK_NAME), self.announce)
            t1 = time.perf_counter()
            kernels.remember_isa_checks(os.path.join(lock_dir, ISA_FILE))
            result = self.optimizer.warm_up(self.keys, self.thread_counts)
            after = _cache_counters()
            self.stats = {"seconds": time.perf_counter() - t0, "build_seconds": time.perf_counter() - t1,
                          "waited_seconds": waited, "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          "cache_hits": after.get("hit", 0) - before.get("hit", 0),
                          "cache_misses": after.get("miss", 0) - before.get("miss", 0), "result": result}
            if self.announce:
                built = sorted({v for v in result.values()})
                log.info("[zeroplug] cpu_adam: %d kernel variant(s) ready in %.1f s (%s; inductor cache: %d "
                         "loaded, %d built, %s)", len(self.keys) * len(self.thread_counts), self.stats["seconds"],
                         "/".join(built), self.stats["cache_hits"], self.stats["cache_misses"],
                         self.stats["cache_dir"])
        except Exception as e:      # never fatal: a step builds (or falls back to eager) itself
            self.error = f"{type(e).__name__}: {e}"
            log.warning("[zeroplug] cpu_adam: the kernel warm-up failed (%s); the first step builds it", self.error)
        finally:
            if lock is not None:
                lock.release()
            kernels._COMPILED.warm_up_threads.discard(me)
            self.done.set()


def _lock(path: str, announce: bool):
    """The build lock (None where the filesystem keeps no locks), and seconds waited for it."""
    t0 = time.perf_counter()
    said = False
    while True:
        try:
            lock = try_lock(path, mode=0o600)
        except OSError:
            return None, time.perf_counter() - t0
        if lock is not None:
            return lock, time.perf_counter() - t0
        if announce and not said:
            log.info("[zeroplug] cpu_adam: another process on this machine is building the kernel "
                     "(%s); waiting for it", path)
            said = True
        time.sleep(0.1)
