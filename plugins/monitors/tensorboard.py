"""The "tensorboard" monitor: scalars in TensorBoard event files (optional extra).

Tags: ``Train/*`` (loss, lr, loss scale, grad norm, samples/s, tokens/s), ``Memory/*`` (GiB:
device allocated and its peak, host RSS), ``Phases/*`` (seconds of the reported step:
forward, backward, wait for gradients, optimizer, other) and ``Eval/loss``; the step axis is
the optimizer step. ``zeroplug report DIR`` draws them.
"""
from __future__ import annotations

from dataclasses import dataclass

from zeroplug.errors import ConfigError
from zeroplug.observe.memory import GB
from zeroplug.options import opt
from zeroplug.slots import Monitor

#: metrics key -> (tag, scale)
SCALARS = {
    "loss": ("Train/loss", 1.0), "lr": ("Train/lr", 1.0), "loss_scale": ("Train/loss_scale", 1.0),
    "grad_norm": ("Train/grad_norm", 1.0), "samples_per_sec": ("Train/samples_per_sec", 1.0),
    "tokens_per_sec": ("Train/tokens_per_sec", 1.0),
    "mem_allocated": ("Memory/allocated_GiB", 1 / GB), "max_mem_allocated": ("Memory/max_allocated_GiB", 1 / GB),
    "host_rss": ("Memory/host_rss_GiB", 1 / GB), "eval_loss": ("Eval/loss", 1.0),
}


class TensorBoard(Monitor):
    """Rank 0 writes TensorBoard scalars to output_path/job_name (needs the tensorboard package)."""
    @dataclass(frozen=True)
    class Options:
        output_path: str = opt("runs", "Directory of the runs (DeepSpeed: tensorboard.output_path).")
        job_name: str = opt("zeroplug", "This run's subdirectory (DeepSpeed: tensorboard.job_name).")

    def __init__(self, options, run):
        super().__init__(options, run)
        self._writer = None
        if run.rank != 0:
            return
        try:   # Note: an optional extra, imported only when this monitor is chosen
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError('monitor.plugin = "tensorboard" needs the tensorboard package: '
                              'pip install "zeroplug[tensorboard]" (or pick "csv")',
                              key="monitor.plugin") from None
        import os
        self.log_dir = os.path.join(options.output_path, options.job_name)
        self._writer = SummaryWriter(log_dir=self.log_dir)
        print(f"[zeroplug] tensorboard monitor: writing to {os.path.abspath(self.log_dir)} "
              f"(tensorboard --logdir {options.output_path})", flush=True)

    def write(self, metrics):
        if self._writer is None:
            return
        step = int(metrics["step"])
        for key, value in metrics.items():
            if key in SCALARS and value is not None:
                tag, scale = SCALARS[key]
                self._writer.add_scalar(tag, float(value) * scale, step)
            elif key.startswith("phase_"):
                self._writer.add_scalar(f"Phases/{key[len('phase_'):]}", float(value), step)
        self._writer.flush()

    def write_eval(self, metrics):
        self.write(metrics)

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
