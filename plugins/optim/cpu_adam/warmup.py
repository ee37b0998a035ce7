"""cpu_adam's compiled kernel, built once per machine and torch version, before the first step.

What makes a second process skip the C++ build is inductor's FX graph cache: the compiled
graph (and the shared object it loads) is stored under ``TORCHINDUCTOR_CACHE_DIR``, keyed by
the graph, torch's version and the inductor options (the kernel's thread count among them).
A later process still traces the function (about a second) but loads the kernel instead of
running the C++ compiler. Before inductor builds or loads a CPU kernel it checks which
vector ISAs the machine can use, a slow check in every process; the warm-up keeps
those answers in ``vector_isa_checks.json`` beside the cache, so they too are found once
per machine (:func:`.kernels.remember_isa_checks`). Inductor's default directory
is under ``/tmp``, which containers and reboots empty; zeroplug points it at
``<zeroplug's cache>/inductor`` (:mod:`.cache`: per torch version and CPU, never a directory
another user could write; a ``TORCHINDUCTOR_CACHE_DIR`` already set is kept).

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
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import torch

from zeroplug.trust import atomic_write, open_append
from zeroplug.locks import wait_lock

from . import kernels
from .cache import use_cache_dir
from .optimizer import CPUAdam

log = logging.getLogger("zeroplug")

#: what the build lock's waiting line says another process is doing
BUILDING = "building the cpu_adam kernel"
LOCK_NAME = "cpu_adam.lock"
ISA_FILE = "vector_isa_checks.json"
VARIANTS_FILE = "cpu_adam_variants.json"
BUILD_LOG = "cpu_adam_build.log"
#: the longest an exiting process waits for a kernel load or build of its own to end
EXIT_WAIT_S = 120.0


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
    """Start ``python -m zeroplug.plugins.optim.cpu_adam.warmup`` on these variants, in a
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
