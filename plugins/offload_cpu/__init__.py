"""Offload tiers "none" (state stays on the training device) and "cpu" (pinned host memory)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.memory import GB, host_available_bytes
from zeroplug.options import opt
from zeroplug.slots import OffloadDevice

log = logging.getLogger("zeroplug")


class NoOffload(OffloadDevice):
    """States live on the training device."""
    @dataclass(frozen=True)
    class Options:
        pass


@dataclass(frozen=True)
class CPUOptions:
    pin_memory: bool = opt(True, "Page-locked host buffers: faster copies, memory others cannot use.")
    ratio: float = opt(1.0, "Fraction of the optimizer state to offload (only 1.0 is supported).",
                       min=1.0, max=1.0)


class CPUOffload(OffloadDevice):
    """States in (pinned) CPU memory; the optimizer steps there (cpu_adam with optimizer.plugin = "auto")."""
    Options = CPUOptions

    def __init__(self, options, run, kind):
        super().__init__(options, run, kind)
        self.allocated = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty(self, numel, dtype):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        avail = host_available_bytes()
        if nbytes > avail:
            raise MemoryError(
                f"offload.{self.kind} = \"cpu\" needs {nbytes / GB:.2f} GiB of host memory for this buffer "
                f"({self.allocated / GB:.2f} GiB already taken) but only {avail / GB:.2f} GiB is available; "
                f"use more ranks (stage 3 shards it), offload to nvme, or free host memory")
        pin = self.options.pin_memory and torch.cuda.is_available()
        self.allocated += nbytes
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)

    @classmethod
    def check_config(cls, config, choice):
        if choice.path == "offload.param" and config.slot("zero").name != "stage3":
            raise ConfigError("offload.param.plugin = \"cpu\" needs zero.plugin = \"stage3\" (only stage 3 "
                              "shards parameters); offload the optimizer with [offload.optimizer] instead",
                              key="offload.param.plugin")
        if choice.path == "offload.param":
            raise ConfigError("offload.param.plugin = \"cpu\" is not implemented yet in this version; "
                              "offload the optimizer with [offload.optimizer] plugin = \"cpu\"",
                              key="offload.param.plugin")


@hookimpl
def zeroplug_register_offload_devices(register):
    register("none", NoOffload)
    register("cpu", CPUOffload)
