"""Monitors: one metrics line per ``steps_per_print`` steps (stdout), a CSV file, or
TensorBoard event files (``zeroplug report`` draws a picture from either file)."""
from __future__ import annotations

import csv
import os
import stat
import sys
from dataclasses import dataclass

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.observe.memory import GB
from zeroplug.options import opt
from zeroplug.observe.phases import PHASES
from zeroplug.slots import Monitor

from .tensorboard import TensorBoard

FIELDS = ("step", "loss", "lr", "loss_scale", "grad_norm", "samples_per_sec", "avg_samples_per_sec",
          "tokens_per_sec", "mem_allocated", "max_mem_allocated", "host_rss", "skipped_steps",
          *(f"phase_{p}" for p in PHASES), "eval_loss")


#: in place of the rates on the first step measured (zeroplug.observe.metrics says why)
NO_RATE = "(no rate on a first step: its overlapped work ends in the next)"


def format_line(m: dict) -> str:
    """DeepSpeed's fields, one line: what seed 004's users grep for (the GPU memory fields on a
    GPU run only; tokens/s where the inputs have a sequence dimension; no rate on the first
    step measured)."""
    gpu = "" if m.get("mem_allocated") is None else (
        f"MemAllocated={m['mem_allocated'] / GB:.2f}GB MaxMemAllocated={m['max_mem_allocated'] / GB:.2f}GB ")
    if m.get("samples_per_sec") is None:
        rate = f"{NO_RATE} "
    else:
        rate = (f"CurrSamplesPerSec={m['samples_per_sec']:.2f} "
                f"RunningAvgSamplesPerSec={m['avg_samples_per_sec']:.2f} "
                + (f"tokens/s={m['tokens_per_sec']:.0f} " if m.get("tokens_per_sec") is not None else ""))
    return (f"[zeroplug] step={m['step']} loss={m['loss']:.4f} lr={m['lr']:.3e} "
            f"loss_scale={m['loss_scale']:g} grad_norm={m['grad_norm']:.3f} "
            f"{rate}{gpu}RSS={m['host_rss'] / GB:.2f}GB"
            + (f" skipped={m['skipped_steps']}" if m.get("skipped_steps") else ""))


class Stdout(Monitor):
    """Rank 0 prints one line per steps_per_print steps."""
    @dataclass(frozen=True)
    class Options:
        all_ranks: bool = opt(False, "Print from every rank, not only rank 0.")

    def write(self, metrics):
        if self.run.rank == 0 or self.options.all_ranks:
            out = sys.stderr if metrics.get("to_stderr") else sys.stdout
            print(format_line(metrics), file=out, flush=True)
            if "memory_report" in metrics:      # once, after the first step
                print(metrics["memory_report"], file=out, flush=True)


class CSVMonitor(Monitor):
    """Rank 0 appends one row per step to a CSV file (and one per evaluation)."""
    every_step = True
    @dataclass(frozen=True)
    class Options:
        path: str = opt("zeroplug_metrics.csv", "The CSV file (created, or appended to).")

    def __init__(self, options, run):
        super().__init__(options, run)
        self._file = None
        if run.rank == 0:       # a path that cannot be written fails here, before any training
            self._open()

    def _open(self) -> None:
        path = self.options.path
        try:
            # Note: no blocking on a FIFO (refused below), created 0644 like other outputs
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"monitor.path {path!r} cannot be created or appended to: "
                              f"{exc.strerror or exc}: set monitor.path to a file in a directory that exists "
                              "and that this user can write", key="monitor.path") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"monitor.path {path!r} is not a regular file (a FIFO, device or directory): set "
                              "monitor.path to a CSV file", key="monitor.path")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "a+", newline="", encoding="utf-8", errors="replace")
        try:
            f.seek(0)
            header = next(csv.reader(f), None)     # appending: keep the file's columns
        except csv.Error:
            header = None
        if header is not None and "step" not in header:
            f.close()
            raise ConfigError(f"monitor.path {path!r} holds something other than zeroplug metrics (its first "
                              "line has no 'step' column): set monitor.path to a new file", key="monitor.path")
        f.seek(0, 2)
        self._file = f
        print(f"[zeroplug] csv monitor: appending to {os.path.abspath(path)}", flush=True)
        # Note: an evaluation row holds only step and eval_loss; readers skip empty cells.
        self._writer = csv.DictWriter(f, header or FIELDS, extrasaction="ignore")
        if not header:
            self._writer.writeheader()

    def write(self, metrics):
        if self.run.rank != 0:
            return
        if self._file is None:
            self._open()
        self._writer.writerow(metrics)
        self._file.flush()

    def write_eval(self, metrics):
        self.write(metrics)

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


class Quiet(Monitor):
    """Prints nothing."""
    @dataclass(frozen=True)
    class Options:
        pass


@hookimpl
def zeroplug_register_monitors(register):
    register("stdout", Stdout)
    register("csv", CSVMonitor)
    register("tensorboard", TensorBoard)
    register("none", Quiet)
