"""cpu_adam's kernel is built once per machine: the on-disk cache, the build lock, the
warm-up before the first step, and the fallbacks (no compiler, unwritable cache)."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from zeroplug.plugins.optim.cpu_adam import kernels as ck
from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam.cache import cache_root, use_cache_dir

N = (1 << 17) + 7

# One process: warm up a variant in the background, then step with it. Prints what the
# warm-up found in inductor's cache and whether the step compiled anything.
SCRIPT = r"""
import json, sys, time
import torch
from torch._dynamo.utils import counters
from torch._inductor import cpu_vec_isa
checks = []
real_check = cpu_vec_isa.VecISA.check_build
def counted(isa, code):
    checks.append(type(isa).__name__)
    return real_check(isa, code)
cpu_vec_isa.VecISA.check_build = counted       # inductor's vector-ISA checks, counted
from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam.warmup import WarmUp
n = (1 << 17) + 7
p = torch.zeros(n)
opt = CPUAdam([p], lr=1e-3, threads=1)
keys = opt.kernel_variants([torch.bfloat16], torch.bfloat16)
w = WarmUp(opt, keys, (1,), announce=False).start()
w.wait()
compiled = sum(counters["inductor"].values())
lp = torch.empty(n, dtype=torch.bfloat16)
opt.step_param(p, torch.ones(n, dtype=torch.bfloat16), lp_out=lp, grad_multiplier=0.5)
print(json.dumps({**{k: v for k, v in w.stats.items() if k != "result"}, "error": w.error,
                  "result": list(w.stats.get("result", {}).values()),
                  "step_compiled": sum(counters["inductor"].values()) - compiled, "isa_checks": len(checks),
                  "lp_ok": bool(torch.equal(lp, p.to(torch.bfloat16)))}))
"""


@pytest.mark.slow
def test_second_process_loads_the_kernel(tmp_path):
    """Two processes start at once (two local ranks): one builds under the lock while the
    other waits, then loads the kernel from the cache instead of compiling it."""
    if ck.compiler_missing():
        pytest.skip("no C++ compiler")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["ZEROPLUG_CACHE_DIR"] = str(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for r in outs:
        assert r["error"] is None and r["result"] == ["compile"] and r["lp_ok"]
        assert r["cache_dir"].startswith(str(tmp_path)) and os.path.isdir(r["cache_dir"])
        assert r["step_compiled"] == 0          # the step found the kernel ready
    builder, loader = sorted(outs, key=lambda r: r["waited_seconds"])
    assert builder["cache_misses"] >= 1
    assert loader["cache_misses"] == 0 and loader["cache_hits"] >= 1
    assert loader["build_seconds"] < builder["build_seconds"]
    assert loader["waited_seconds"] > 0.1     # it waited for the builder's lock
    # inductor's vector-ISA checks (a compile and a child process each) ran once, in the builder
    assert loader["isa_checks"] == 0
    with open(os.path.join(builder["cache_dir"], "vector_isa_checks.json")) as f:
        assert len(json.load(f)) >= 1


def test_unwritable_cache_dir_falls_back(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {"ZEROPLUG_CACHE_DIR": str(blocker / "cache")}
    path, warning = use_cache_dir(env)
    assert "cannot be written" in warning and "ZEROPLUG_CACHE_DIR" in warning
    assert env["TORCHINDUCTOR_CACHE_DIR"] == path and os.path.isdir(path) and os.access(path, os.W_OK)
    os.rmdir(path)


def test_cache_dir_names_torch_and_cpu(tmp_path):
    env = {"ZEROPLUG_CACHE_DIR": str(tmp_path)}
    root = cache_root(env)
    assert root.startswith(str(tmp_path)) and f"torch-{torch.__version__}" in root
    path, warning = use_cache_dir(env)
    assert warning is None and path == os.path.join(root, "inductor") == env["TORCHINDUCTOR_CACHE_DIR"]
    given = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine"), "ZEROPLUG_CACHE_DIR": str(tmp_path)}
    assert use_cache_dir(given) == (str(tmp_path / "mine"), None)       # the user's choice is kept


def test_missing_compiler_said_once_and_eager(monkeypatch, caplog):
    """No C++ compiler: one warning for the run, every variant steps eagerly (right values)."""
    from torch._inductor import config
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())
    monkeypatch.setattr(config.cpp, "cxx", ("/nonexistent/zeroplug-test-g++",))
    assert "no C++ compiler" in ck.compiler_missing()
    a = torch.nn.Parameter(torch.randn(N))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.0)
    opt = CPUAdam([b], lr=1e-2, threads=1)
    caplog.set_level(logging.WARNING, "zeroplug")
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        res = opt.warm_up(opt.kernel_variants([torch.bfloat16, torch.float16], torch.bfloat16))
    assert set(res.values()) == {"eager"} and len(res) == 2
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 1
    g = torch.randn(N).to(torch.bfloat16)
    a.grad = g.float()
    lp = torch.empty(N, dtype=torch.bfloat16)
    opt.step_param(b, g, lp_out=lp)
    ref.step()
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(lp, b.detach().to(torch.bfloat16))
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 1


def test_a_glitch_inside_the_compiler_search_is_not_a_missing_compiler(monkeypatch):
    """Only inductor's own "no compiler" verdict counts: another error while a compiler is on
    the PATH (an import race inside inductor) leaves the compiled kernel in play, so whether
    the kernel is tested does not depend on which test ran before."""
    import shutil

    from torch._inductor import config, cpp_builder
    if not shutil.which("g++"):
        pytest.skip("no g++ on the PATH")

    def glitch():
        raise AttributeError("partially initialized module 'torch._inductor.codecache'")
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", glitch)
    monkeypatch.setattr(config.cpp, "cxx", (None, "g++"))
    assert ck.compiler_missing() is None
    monkeypatch.setattr(config.cpp, "cxx", ("/nonexistent/zeroplug-test-g++",))
    assert "no C++ compiler" in ck.compiler_missing()      # nothing on the PATH: missing, whatever the error


def test_step_waits_for_the_warm_up(monkeypatch):
    """A step never builds the kernel beside the warm-up: it waits for it to finish."""
    import threading
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())
    gate = threading.Event()
    ck.COMPILED.warming = gate
    p = torch.zeros(N)
    opt = CPUAdam([p], lr=1e-3, impl="eager")
    done = threading.Event()
    t = threading.Thread(target=lambda: (ck.COMPILED.get((True, torch.bfloat16, torch.bfloat16), False, 1),
                                         done.set()), daemon=True)
    monkeypatch.setattr(ck.COMPILED, "_build", lambda key, strict, threads: ck.COMPILED.ok.__setitem__(key, False))
    t.start()
    assert not done.wait(0.3)           # blocked on the warm-up
    gate.set()
    assert done.wait(10)
    assert opt.kernel_variants([torch.bfloat16], torch.bfloat16) == []     # eager: nothing to build


def test_eager_while_a_first_build_runs(monkeypatch):
    """``while_building = "eager"``: a step neither waits nor builds while the warm-up builds;
    once it is done, the compiled kernel is used."""
    import threading
    monkeypatch.setattr(ck, "COMPILED", ck.CompiledKernels())
    gate = threading.Event()
    ck.COMPILED.warming = gate
    ck.COMPILED.eager_while_warming = True
    built = []
    monkeypatch.setattr(ck.COMPILED, "_build",
                        lambda key, strict, threads: (built.append(key), ck.COMPILED.ok.__setitem__(key, False)))
    key = (True, torch.bfloat16, torch.bfloat16)
    assert ck.COMPILED.get(key, False, 1) is None and built == []      # eager now, nothing built
    gate.set()
    ck.COMPILED.get(key, False, 1)
    assert built == [key]           # the warm-up is over: the kernel is taken (here: built)


# The end of initialize in a fresh process: finish() on a cache that has (or has not) built
# the variant; prints whether the warm-up was done when finish() returned.
FINISH = r"""
import json, torch
from zeroplug.plugins.optim.cpu_adam import kernels as ck
from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam.warmup import WarmUp
w = WarmUp(announce=False, eager_while_building=True).start()   # before the optimizer, as in initialize
p = torch.zeros((1 << 17) + 7)
opt = CPUAdam([p], lr=1e-3, threads=1)
w.build(opt, opt.kernel_variants([torch.bfloat16], torch.bfloat16), (1,))
w.finish()
print(json.dumps({"done": w.done.is_set(), "eager": ck.COMPILED.eager_while_warming,
                  "child": w.child is not None}))
"""     # (and exits at once: a child process, if any, builds on)


@pytest.mark.slow
def test_initialize_waits_only_for_a_kernel_built_before(tmp_path):
    """First run on a machine: finish() returns while a child process builds the kernel
    (eager meanwhile); the child finishes the build after this process has ended; the next
    process finds the variant recorded and waits for it to load."""
    if ck.compiler_missing():
        pytest.skip("no C++ compiler")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["ZEROPLUG_CACHE_DIR"] = str(tmp_path)
    import time
    variants = os.path.join(cache_root(env), "inductor", "cpu_adam_variants.json")
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", FINISH], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        deadline = time.time() + 300
        while not os.path.exists(variants) and time.time() < deadline:   # the child builds on
            time.sleep(0.5)
    first, second = runs
    assert first == {"done": False, "eager": True, "child": True}
    assert second == {"done": True, "eager": False, "child": False}
    with open(variants) as f:
        assert json.load(f) == ["adamw grad=torch.bfloat16 lp=torch.bfloat16 threads=1"]
    with open(os.path.join(os.path.dirname(variants), "cpu_adam_build.log")) as f:
        assert "kernel variant(s) ready" in f.read()


def test_engine_starts_the_warm_up_before_the_stage_allocates(monkeypatch):
    """initialize begins the warm-up before the offload tier plans (allocates, pins), and on a
    CPU-only run ("auto" = wait) returns with it done: no step waits."""
    import zeroplug
    from zeroplug.plugins.offload_cpu.host import HostTier
    from zeroplug.plugins.optim.cpu_adam import warmup as cw
    order = []
    real_start, real_plan = cw.WarmUp.start, HostTier.plan
    monkeypatch.setattr(cw.WarmUp, "start", lambda self: (order.append("warm-up"), real_start(self))[1])
    monkeypatch.setattr(HostTier, "plan", lambda self, layout: (order.append("plan"), real_plan(self, layout))[1])
    engine = zeroplug.initialize(torch.nn.Linear(64, 64), {
        "zero": {"plugin": "stage2"}, "optimizer": {"plugin": "cpu_adam"},
        "offload": {"optimizer": {"plugin": "cpu"}}, "monitor": {"plugin": "none"}})
    assert order[:2] == ["warm-up", "plan"]
    assert ck.COMPILED.warming is None or ck.COMPILED.warming.is_set()
    assert not ck.COMPILED.eager_while_warming
    engine.close()


# A process that ends while its own warm-up thread loads the kernel: the exit waits for the
# load (a daemon thread cut off inside inductor's C++ code aborted the process).
EXIT_DURING_LOAD = r"""
import sys, time
from pathlib import Path
import torch
from zeroplug.plugins.optim.cpu_adam import warmup as cpu_adam_warmup
from zeroplug.plugins.optim.cpu_adam import CPUAdam
from zeroplug.plugins.optim.cpu_adam.warmup import WarmUp
cpu_adam_warmup._import_compiler = cpu_adam_warmup._pick_vec_isa = lambda: None   # not what this is about

class SlowLoad(CPUAdam):
    def warm_up(self, keys, counts):
        Path(sys.argv[1]).write_text("started")
        time.sleep(1.5)
        Path(sys.argv[1]).write_text("finished")
        return {}

opt = SlowLoad([torch.zeros(8)], lr=1e-3, threads=1)
w = WarmUp(opt, [(True, torch.bfloat16, torch.bfloat16)], (1,), announce=False).start()
while not Path(sys.argv[1]).exists():
    time.sleep(0.01)
"""     # ... and the script ends while the "load" sleeps


def test_exit_waits_for_a_load_in_progress(tmp_path):
    marker = tmp_path / "marker"
    env = dict(os.environ, ZEROPLUG_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", EXIT_DURING_LOAD, str(marker)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert marker.read_text() == "finished"


def test_compiler_found_when_one_is_on_the_path():
    """With g++ on the PATH the kernel's compiler is found (the other order's partner of
    test_missing_compiler_said_once_and_eager: see the next test)."""
    import shutil
    if not shutil.which("g++"):
        pytest.skip("no g++ on the PATH")
    assert ck.compiler_missing() is None


@pytest.mark.slow
@pytest.mark.parametrize("order", ["missing_first", "found_first"])
def test_compiler_detection_does_not_depend_on_test_order(order):
    """Both cases in one pytest process, in either order: each passes, none skips."""
    import shutil
    if not shutil.which("g++"):
        pytest.skip("no g++ on the PATH")
    ids = [f"{__file__}::test_missing_compiler_said_once_and_eager",
           f"{__file__}::test_compiler_found_when_one_is_on_the_path"]
    if order == "found_first":
        ids.reverse()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", "-rs", *ids],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and "2 passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
