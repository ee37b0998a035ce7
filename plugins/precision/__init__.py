"""Precisions: fp32, bf16 (fp32 masters) and fp16 (fp32 masters, loss scaling)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug import hookimpl
from zeroplug.options import opt
from zeroplug.slots import Precision

from .scaler import LossScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FP32(Precision):
    """Everything in fp32: parameters, gradients, reductions, optimizer."""
    @dataclass(frozen=True)
    class Options:
        pass


class BF16(Precision):
    """bf16 model parameters and gradients, fp32 master weights; no loss scaling."""
    @dataclass(frozen=True)
    class Options:
        reduce_dtype: Literal["fp32", "bf16"] = opt(
            "fp32", "Dtype in which gradients are summed across ranks (DeepSpeed: "
                    "communication_data_type); fp32 is exact-er, bf16 moves half the bytes.")

    param_dtype = torch.bfloat16

    def __init__(self, options, run):
        super().__init__(options, run)
        self.reduce_dtype = DTYPES[options.reduce_dtype]


class FP16(Precision):
    """fp16 model parameters and gradients, fp32 masters, dynamic (or static) loss scaling."""
    @dataclass(frozen=True)
    class Options:
        loss_scale: float = opt(0.0, "0 = dynamic loss scaling; any other value is a static scale.", min=0.0)
        initial_scale_power: int = opt(16, "Dynamic scaling starts at 2**initial_scale_power.", min=0, max=64)
        loss_scale_window: int = opt(1000, "Clean steps in a row before the scale doubles.", min=1)
        hysteresis: int = opt(2, "Overflows tolerated before the scale is halved.", min=1)
        consecutive_hysteresis: bool = opt(False, "Refill the hysteresis after every clean step "
                                                  "(otherwise only when the scale grows).")
        min_loss_scale: float = opt(1.0, "The scale never drops below this.", above=0.0)
        reduce_dtype: Literal["fp32", "fp16"] = opt(
            "fp16", "Dtype in which gradients are summed across ranks (pre-divided by world size).")

    param_dtype = torch.float16

    def __init__(self, options, run):
        super().__init__(options, run)
        self.reduce_dtype = DTYPES[options.reduce_dtype]
        o = options
        self.scaler = LossScaler(o.loss_scale, o.initial_scale_power, o.loss_scale_window,
                                 o.hysteresis, o.consecutive_hysteresis, o.min_loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss):
        return loss.float() * self.scaler.scale

    def update(self, overflow: bool) -> None:
        self.scaler.update(overflow)

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state)


@hookimpl
def zeroplug_register_precisions(register):
    register("fp32", FP32)
    register("bf16", BF16)
    register("fp16", FP16)
