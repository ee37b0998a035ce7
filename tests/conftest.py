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
