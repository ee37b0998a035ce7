"""``deepspeed.accelerator.get_accelerator()``: the device calls scripts make, over torch.

CUDA when torch sees a GPU (or ZEROPLUG_DEVICE names one), the CPU otherwise, as zeroplug's
engine picks its device.
"""
from __future__ import annotations

import os

import torch

from zeroplug.launch import default_backend

__all__ = ["get_accelerator", "set_accelerator", "Accelerator"]


class Accelerator:
    """The calls of DeepSpeed's accelerator interface that training scripts make."""

    def __init__(self, name: str):
        self._name = name

    # -- devices ---------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """"cuda" / "cuda:<i>" (or "cpu"), as ``torch.device`` takes it."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    # -- capabilities ----------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.float16, torch.bfloat16]

    def communication_backend_name(self) -> str:
        return default_backend(self._name)

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    # -- random numbers ---------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    # -- memory -------------------------------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # -- streams and events ----------------------------------------------------------------
    def Stream(self, *args, **kwargs):          # noqa: N802 (DeepSpeed's spelling)
        return torch.cuda.Stream(*args, **kwargs)

    def Event(self, *args, **kwargs):           # noqa: N802
        return torch.cuda.Event(*args, **kwargs)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"


_current: Accelerator | None = None


def _detect() -> str:
    env = os.environ.get("ZEROPLUG_DEVICE", "").strip()
    if env:
        return torch.device(env).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The accelerator of this process (detected once)."""
    global _current
    if _current is None:
        _current = Accelerator(_detect())
    return _current


def set_accelerator(accel: Accelerator) -> None:
    global _current
    _current = accel
