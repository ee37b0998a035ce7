"""cpu_adam: Adam / AdamW for optimizer states held in host memory, at memory-bandwidth speed.

The modules, each importing only those listed before it (no import circle; the boundary
tests check it):

- :mod:`.topology`: the CPUs a rank may use, as data, and their split among the local ranks.
- :mod:`.cores`: the default thread count of a rank (its cores divided among the local ranks).
- :mod:`.cache`: zeroplug's kernel cache directory (per torch version and CPU), trusted or not.
- :mod:`.kernels`: the eager step and the ``torch.compile`` d kernel, built and checked.
- :mod:`.native`: the fused C kernel (``native.c``) for bf16 and 8-bit moments.
- :mod:`.optimizer`: :class:`CPUAdam`, which picks among them per call.
- :mod:`.warmup`: the compiled kernel built before the first step (``python -m`` of it is
  the background build's child process).
- :mod:`.plan_cache`, :mod:`.plan`: the CPU plan of a rank (binding and a measured thread
  count), cached per machine.

The optim plugin (``optimizer.plugin = "cpu_adam"``) imports these lazily, when cpu_adam
steps a run's states.
"""
from __future__ import annotations

from .optimizer import CPUAdam

__all__ = ["CPUAdam"]
