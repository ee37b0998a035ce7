"""cpu_adam's compiled kernel, built once per machine and torch version, before the first step.

What makes a second process skip the C++ build is inductor's FX graph cache: the compiled
graph (and the shared object it loads) is stored under ``TORCHINDUCTOR_CACHE_DIR``, keyed by
the graph, torch's version and the inductor options (the kernel's thread count among them).
A later process still traces the function (about a second) but loads the kernel instead of
running the C++ compiler. Before inductor builds or loads a CPU kernel it checks which
vector ISAs the machine can use, a slow check in every process; the warm-up keeps
those answers in ``vector_isa_checks.json`` beside the cache, so they too are found once
per machine (:func:`.cpu_adam_kernels.remember_isa_checks`). Inductor's default directory
is under ``/tmp``, which containers and reboots empty; zeroplug points it at
``~/.cache/zeroplug/torch-<version>/<cpu>/inductor`` (``ZEROPLUG_CACHE_DIR`` moves the
root; a ``TORCHINDUCTOR_CACHE_DIR`` already set is kept).
The ``<cpu>`` part names the CPU model and its instruction-set flags, so a home directory
shared by different machines never hands one a kernel built for another's vector unit.
A cache directory that another user could write (or that holds their files) is never
used: inductor would load their code (:func:`use_cache_dir`).

The warm-up runs on a background thread started first thing in ``initialize``: it points
inductor at the cache, takes the build lock, recalls the ISA answers and imports the
compiler's modules while the stage allocates and pins the states; the kernel variants
follow as soon as the optimizer exists. At the end of ``initialize`` a machine that built
these variants before (``cpu_adam_variants.json`` in the cache lists them) waits for them to
load, so that no training step pays for any of it: no wait, and no Python work on a
background thread competing with the training loop for the interpreter (the module, checkpoint
and gradient hooks of the first steps need it). On the first run on a machine the build is long
(docs/benchmarks.md, "Cold start and the first steps", has the figures); the steps then use
the eager kernel until it is ready (``while_building``), or wait for it. On a host with several ranks, one builds while the
others wait on a file lock in the cache directory, then load what it built; variants built
before load on every rank at once.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import torch

from zeroplug.trust import (ancestors_problem, atomic_write, code_dir_problem, existing_ancestor, make_dirs,
                            open_append, printable)
from zeroplug.locks import wait_lock

from . import cpu_adam_kernels as kernels

log = logging.getLogger("zeroplug")

CACHE_ENV = "ZEROPLUG_CACHE_DIR"
#: what the build lock's waiting line says another process is doing
BUILDING = "building the cpu_adam kernel"
LOCK_NAME = "cpu_adam.lock"
ISA_FILE = "vector_isa_checks.json"
VARIANTS_FILE = "cpu_adam_variants.json"
BUILD_LOG = "cpu_adam_build.log"
#: the longest an exiting process waits for a kernel load or build of its own to end
EXIT_WAIT_S = 120.0


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


def _cache_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    c = counters["inductor"]
    return {"hit": int(c.get("fxgraph_cache_hit", 0)), "miss": int(c.get("fxgraph_cache_miss", 0))}


class WarmUp:
    """Builds an optimizer's kernel variants on a background thread (see the module doc).

    ``start()`` begins the work that needs no optimizer; ``build(optimizer, keys, counts)``
    names the variants (or pass them to the constructor); ``finish()`` ends ``initialize``.
    ``eager_while_building``: a first build runs in a child process that outlives this one
    (the steps use the eager kernel meanwhile), and this process loads what it built.
    ``compiled``: whether the steps are expected to take the compiled kernel; where they take
    the native one instead (False), the compiler's imports and the vector-ISA checks wait until
    a variant is named (none, unless the native kernel is unavailable): on a fresh machine
    those checks run for about a minute beside the first steps, on the cores they step on."""

    def __init__(self, optimizer=None, keys=(), thread_counts=(None,), announce: bool = True,
                 eager_while_building: bool = False, compiled: bool = True):
        self.announce, self.eager_while_building, self.compiled = announce, eager_while_building, compiled
        self.done = threading.Event()
        self.stats: dict = {}
        self.error: str | None = None
        self.cache_dir: str | None = None
        self.built_before: set[str] = set()      # variants this machine's cache holds already
        self.child: subprocess.Popen | None = None   # the first build, in a process of its own
        self._located = threading.Event()        # cache_dir and built_before are known
        self._named = threading.Event()          # the variants (and the child, if any) are known
        self._thread: threading.Thread | None = None
        self._exiting = False
        self.optimizer, self.keys, self.thread_counts = None, [], ()
        if optimizer is not None:
            self.build(optimizer, keys, thread_counts)

    def build(self, optimizer, keys, thread_counts) -> None:
        """The variants to build (``keys`` x ``thread_counts``) for ``optimizer``."""
        self.optimizer, self.keys, self.thread_counts = optimizer, list(keys), tuple(thread_counts)
        if self.keys:
            kernels.COMPILED.warming = self.done      # a step waits for these, never builds beside them
            if self.eager_while_building and self._located.wait(60) and not self.cached():
                self.child = _build_in_child(self.keys, self.thread_counts, self.cache_dir)
                kernels.COMPILED.eager_while_warming = self.child is not None
        self._named.set()

    def variants(self) -> list[str]:
        return [f"{kernels.key_str(k)} threads={t}" for k in self.keys for t in self.thread_counts]

    def cached(self) -> bool:
        """Whether this machine built every variant before (they load in seconds)."""
        return set(self.variants()) <= self.built_before

    def start(self) -> "WarmUp":
        kernels.COMPILED.eager_while_warming = False
        # Note: imported here, on the caller's thread: building the optimizer imports it too
        # (torch.optim does, lazily), and two threads importing torch's compiler packages at
        # once can meet a partly initialised module.
        import torch._dynamo  # noqa: F401
        # Note: a daemon: a process that ends before the build is done (a short script, a
        # test) must not hang or fail at exit; inductor writes its cache entries atomically,
        # so an interrupted build leaves nothing half-written (and a first build with
        # eager_while_building runs in a child process that finishes it regardless).
        ref = weakref.ref(self)     # the hook must not keep the optimizer (and its states) alive

        def exit_hook() -> None:
            warm_up = ref()
            if warm_up is not None:
                warm_up._at_exit()
        self._exit_hook = exit_hook
        atexit.register(exit_hook)
        self._thread = threading.Thread(target=self._run, name="zeroplug-cpu-adam-warmup", daemon=True)
        self._thread.start()
        return self

    def _at_exit(self) -> None:
        """Let a load or build in this process end before the interpreter does.

        Note: a process that exits while the daemon thread is inside inductor's C++ loading
        aborts ("terminate called without an active exception", exit code -6) after its
        work is done: seen when a short run ended just as the child's first build finished
        and this process began loading it. A thread still waiting for the child is told to
        stop instead (the child finishes the build on its own)."""
        self._exiting = True
        t = self._thread
        if t is not None and t.is_alive() and (self.child is None or self.child.poll() is not None):
            t.join(timeout=EXIT_WAIT_S)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def finish(self) -> None:
        """The end of ``initialize``: wait for the kernels to load (seconds, mostly while the
        states were allocated), or to be built when no child process builds them."""
        if self.done.is_set() or not self.keys:
            return
        if self.child is not None:
            if self.announce:
                log.info("[zeroplug] cpu_adam: building the compiled kernel in a background process (the first "
                         "run on this machine, about a minute; log: %s); the steps use the eager kernel until "
                         "it is ready", os.path.join(self.cache_dir, BUILD_LOG))
            return
        t0 = time.perf_counter()
        cached = self.cached()
        self.done.wait()
        if self.announce and time.perf_counter() - t0 > 1.0:
            log.info("[zeroplug] cpu_adam: initialize waited %.1f s for the kernel (%s)", time.perf_counter() - t0,
                     "loaded from the cache" if cached else "built: the first run on this machine")

    def _prepare(self, lock_path: str) -> float:
        """Import the compiler's modules and answer the machine's vector-ISA checks (they need
        no variant: once per machine, under the lock, so that a rank that waited finds the
        answers); the seconds waited for the lock."""
        _import_compiler()
        lock, waited = wait_lock(lock_path, BUILDING if self.announce else "")
        try:
            kernels.remember_isa_checks(os.path.join(self.cache_dir, ISA_FILE))
            _pick_vec_isa()
        finally:
            if lock is not None:
                lock.release()
        return waited

    def _run(self) -> None:
        me = threading.get_ident()
        kernels.COMPILED.warm_up_threads.add(me)
        t0 = time.perf_counter()
        lock = None
        try:
            try:
                self.cache_dir, warning = use_cache_dir()
                self.built_before = _read_variants(os.path.join(self.cache_dir, VARIANTS_FILE))
            finally:
                self._located.set()
            if warning and self.announce:
                log.warning("[zeroplug] %s", warning)
            lock_path = os.path.join(self.cache_dir, LOCK_NAME)
            waited = self._prepare(lock_path) if self.compiled else 0.0
            self._named.wait()      # (forever if initialize fails first: an idle daemon thread)
            if not self.keys:
                return
            if not self.compiled:
                waited = self._prepare(lock_path)
            if self.child is not None:
                self.child.wait()   # the build, elsewhere; what follows loads it
                if self._exiting:
                    return
            # Note: variants this machine built before only load (seconds), and the ranks of a
            # host load them side by side: one after another, the last rank ended initialize
            # seconds after the first, which then waited in step 1's first collective. A
            # build takes the lock, so that one rank builds and the others load its result.
            if not self.cached():
                lock, more = wait_lock(lock_path, BUILDING if self.announce else "")
                waited += more
            t1 = time.perf_counter()
            before = _cache_counters()
            result = self.optimizer.warm_up(self.keys, self.thread_counts)
            after = _cache_counters()
            if all(v == "compile" for v in result.values()):
                _add_variants(os.path.join(self.cache_dir, VARIANTS_FILE), self.variants())
            self.stats = {"seconds": time.perf_counter() - t0, "build_seconds": time.perf_counter() - t1,
                          "waited_seconds": waited, "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                          "cache_hits": after.get("hit", 0) - before.get("hit", 0),
                          "cache_misses": after.get("miss", 0) - before.get("miss", 0), "result": result,
                          "child": None if self.child is None else self.child.returncode}
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
            kernels.COMPILED.warm_up_threads.discard(me)
            self.done.set()
            atexit.unregister(self._exit_hook)


def _build_in_child(keys, thread_counts, cache_dir: str) -> subprocess.Popen | None:
    """Start ``python -m zeroplug.plugins.optim.cpu_adam_warmup`` on these variants, in a
    session of its own (it finishes the build if this process ends first), writing to the
    build log in ``cache_dir``; None if it cannot be started (this process builds instead)."""
    spec = json.dumps({"keys": [[bool(k[0]), str(k[1]), None if k[2] is None else str(k[2]), *k[3:]] for k in keys],
                       "threads": list(thread_counts)})
    try:
        logf = os.fdopen(open_append(os.path.join(cache_dir, BUILD_LOG)), "a")
    except OSError:
        logf = subprocess.DEVNULL
    # Note: one compile worker, and (in main) a lower CPU priority: the training steps beside
    # it run on every core, and two small kernels gain nothing from parallel compilation.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    try:
        return subprocess.Popen([sys.executable, "-m", __name__, spec], stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    except OSError:
        return None
    finally:
        if logf is not subprocess.DEVNULL:
            logf.close()


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name.rpartition(".")[2])


def main(argv=None) -> int:
    """The child of :func:`_build_in_child`: build the variants given as JSON, then exit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    spec = json.loads((argv or sys.argv[1:])[0])
    keys = [(k[0], _dtype(k[1]), _dtype(k[2]), *k[3:]) for k in spec["keys"]]
    from .cpu_adam import CPUAdam
    opt = CPUAdam([torch.zeros(1)], lr=1e-3)     # builds any state kind: the keys name it
    w = WarmUp(opt, keys, spec["threads"]).start()
    w.wait()
    return 0 if w.error is None else 1


def _pick_vec_isa() -> None:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        pick_vec_isa()
    except Exception as exc:   # noqa: BLE001 - another torch layout: the build checks what it needs
        log.debug("cpu_adam: picking the vector ISA ahead failed: %r", exc)


def _import_compiler() -> None:
    """Import what building or loading a kernel needs (seconds of module imports), before the
    variants are known."""
    try:
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    except Exception as exc:   # noqa: BLE001 - another torch layout: the build imports what it needs
        log.debug("cpu_adam: importing inductor ahead failed: %r", exc)


def _read_variants(path: str) -> set[str]:
    try:
        with open(path) as f:
            return set(json.load(f))
    except (OSError, ValueError, TypeError):
        return set()


def _add_variants(path: str, names: list[str]) -> None:
    """Record ``names`` as built on this machine (atomic; an unwritable cache is not an error)."""
    known = _read_variants(path) | set(names)
    try:
        atomic_write(path, json.dumps(sorted(known), indent=1).encode())
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
