"""pytest plugin: benchmark your own model's training step under zeroplug.

Loaded with ``pytest -p zeroplug.benchmarking`` (installed zeroplug also registers it as a
``pytest11`` entry point, so it loads by itself unless plugin autoloading is off). It adds
one fixture, ``zeroplug_step``, built on pytest-benchmark's ``benchmark``::

    import pytest, torch

    def build_model():
        return MyModel()                     # forward(x, y) -> loss, or a Hugging Face model

    def make_batch(device):                  # one micro-batch, made outside the timing
        x = torch.randint(0, 1000, (8, 256), device=device)
        return x, x                          # a tuple (model(*batch)) or a dict (model(**batch))

    @pytest.mark.parametrize("stage", ["stage2", "stage3"])
    def test_mine(zeroplug_step, stage):
        result = zeroplug_step(build_model, make_batch, steps=5,
                               config={"zero": {"plugin": stage}, "optimizer": {"lr": 1e-4}})
        assert result.losses[-1] < 10

Run with ``pytest --benchmark-enable`` (``--benchmark-json``, ``--benchmark-compare`` as
usual). Each result's ``extra_info`` holds ``tokens_per_s``, ``step_s``, ``peak_gpu_bytes``,
``peak_host_bytes``, the engine's step ``phases`` and, when a baseline is asked for
(``baseline="torch"``: the same model in plain PyTorch, measured once per session),
``baseline_tokens_per_s`` and ``ratio_to_baseline``. Under ``--benchmark-disable`` one step
runs (a quick check that the configuration trains) and nothing is timed.

The device is CUDA when present, else the CPU (``device=`` to choose).
"""
from __future__ import annotations

import time

import pytest

_BASELINES = pytest.StashKey[dict]() if hasattr(pytest, "StashKey") else None


def _baselines(config) -> dict:
    if _BASELINES is None:
        return config.__dict__.setdefault("_zeroplug_baselines", {})
    return config.stash.setdefault(_BASELINES, {})


class ZeroplugStep:
    """The ``zeroplug_step`` fixture's callable (one benchmark per test, as pytest-benchmark allows)."""

    def __init__(self, request):
        self.request = request
        try:
            self.benchmark = request.getfixturevalue("benchmark")
        except pytest.FixtureLookupError:
            raise pytest.UsageError("zeroplug_step needs pytest-benchmark: pip install pytest-benchmark "
                                    "(or zeroplug[test])") from None

    def __call__(self, build_model, make_batch, config=None, steps: int = 5, warmup: int = 2,
                 device=None, baseline: str | None = None, label: str | None = None):
        """Benchmark one configuration; returns a :class:`zeroplug.benchmarking.measure.StepRun`.

        ``config``: what ``zeroplug.initialize`` takes (dict, TOML path, Config), or "torch"
        for plain PyTorch; ``steps`` timed rounds after ``warmup`` ones; ``baseline="torch"``
        adds the ratio to plain PyTorch measured in this run."""
        from .measure import StepRun, batch_tokens, default_device, make_runner, read_peaks, release, run_steps, start_peaks
        import torch

        bench = self.benchmark
        dev = torch.device(device) if device is not None else default_device()
        cfg = {} if config is None else config
        name = label or ("torch" if cfg == "torch" else self.request.node.name)
        result = StepRun(name)
        start_peaks(dev)
        runner = make_runner(build_model, make_batch, cfg, dev, name)
        seen: list = []

        def setup():
            batches = runner.batches()
            seen[:] = [batches]
            return (batches,), {}

        def step(batches):
            t0 = time.perf_counter()
            loss = runner.step(batches)
            result.step_times.append(time.perf_counter() - t0)
            result.losses.append(loss)

        try:
            bench.pedantic(step, setup=setup, rounds=steps, warmup_rounds=warmup, iterations=1)
            result.tokens_per_step = sum(batch_tokens(b) for b in seen[0])
            result.phases = runner.phases()
            read_peaks(result, dev)
        finally:
            runner.close()
            del runner
            release(dev)
        if bench.disabled:
            return result
        if len(result.step_times) > steps:          # pedantic's warm-up rounds went through step()
            result.step_times = result.step_times[-steps:]
        stats = getattr(getattr(bench, "stats", None), "stats", None)
        if stats is not None:                       # pytest-benchmark's median, the one it compares
            result.step_times = [stats.median]
        info = bench.extra_info
        info.update(result.extra_info())
        info["device"] = str(dev)
        store = _baselines(self.request.config)
        key = (getattr(build_model, "__qualname__", repr(build_model)),
               getattr(make_batch, "__qualname__", repr(make_batch)), str(dev))
        if cfg == "torch":
            store[key] = result.tokens_per_s
        if baseline is not None:
            if baseline != "torch":
                raise pytest.UsageError(f"zeroplug_step(baseline={baseline!r}): the baseline is \"torch\"")
            if key not in store:
                store[key] = run_steps(build_model, make_batch, "torch", steps, warmup, dev).tokens_per_s
            info["baseline"] = "torch"
            info["baseline_tokens_per_s"] = round(store[key], 1)
            info["ratio_to_baseline"] = round(result.tokens_per_s / store[key], 4)
        return result


@pytest.fixture
def zeroplug_step(request):
    """Benchmark a training step: ``zeroplug_step(build_model, make_batch, config=..., steps=...)``."""
    return ZeroplugStep(request)
