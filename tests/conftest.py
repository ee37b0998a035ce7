import os

import torch

# Note: the tests use tiny models; with torch's default threads on a busy 2-core
# machine a small op can take 1000x longer than on one thread.
torch.set_num_threads(1)

# Note: the CPU suite builds engines without a device; on a machine with a GPU they would
# land on CUDA and meet CPU batches. GPU tests pass device="cuda" explicitly. Spawned
# ranks inherit the variable.
os.environ.setdefault("ZEROPLUG_DEVICE", "cpu")

# Note: cpu_adam gives torch the cores of the rank by default; the tests keep one thread
# (see above), and spawned ranks inherit it. tests/offload/test_cpu_adam_threads.py clears it.
os.environ.setdefault("ZEROPLUG_CPU_ADAM_THREADS", "1")

# Note: `zeroplug train` writes a run directory (runs/<time>-<model>/) by default; the suite's
# runs write none unless a test names one (--run-dir), so the checkout stays clean.
# tests/engine/test_train_run_dir.py clears it.
os.environ.setdefault("ZEROPLUG_NO_SAVE", "1")


#: node ids of the default run's longest cases (tests/slow_cases.txt): marked slow at collection
_SLOW_CASES = frozenset(
    line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_cases.txt"))
    if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        if item.nodeid in _SLOW_CASES:
            item.add_marker(pytest.mark.slow)
