"""``import zeroplug.deepspeed as deepspeed``: DeepSpeed's training API over zeroplug.

A script written for DeepSpeed runs with its import lines changed (``from deepspeed.X
import Y`` -> ``from zeroplug.deepspeed.X import Y``). docs/deepspeed-api.md lists every
name, what it maps to, and what is refused and why (generated from :data:`SURFACE`).
"""
from __future__ import annotations

from . import accelerator, comm, ops, zero
from .api import add_config_arguments, init_distributed, initialize
from .engine import DeepSpeedEngine

__version__ = "0.16.0+zeroplug"     # the DeepSpeed API this module follows
__all__ = ["initialize", "add_config_arguments", "init_distributed", "comm", "zero", "ops", "accelerator",
           "DeepSpeedEngine"]
