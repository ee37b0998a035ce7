"""Learning-rate schedules with DeepSpeed's names and semantics (the ``[scheduler]`` slot).

Every schedule gives the lr of optimizer step ``t`` (counting steps taken; an fp16
step skipped for overflow does not advance it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zeroplug import hookimpl
from zeroplug.errors import ConfigError
from zeroplug.options import AUTO, opt
from zeroplug.slots import Scheduler


class Constant(Scheduler):
    """No schedule: the optimizer's lr throughout."""
    @dataclass(frozen=True)
    class Options:
        pass


@dataclass(frozen=True)
class WarmupOptions:
    warmup_min_lr: float = opt(0.0, "lr at step 0.", min=0.0)
    warmup_max_lr: float | Literal["auto"] = opt(AUTO, "lr reached after warm-up; \"auto\" = optimizer.lr.",
                                                 min=0.0)
    warmup_num_steps: int = opt(1000, "Steps of warm-up.", min=1)
    warmup_type: Literal["log", "linear"] = opt("log", "Shape of the warm-up curve.")


class Warmup(Scheduler):
    """WarmupLR: min -> max over warmup_num_steps, then constant."""
    Options = WarmupOptions

    def __init__(self, options, run, base_lr):
        super().__init__(options, run, base_lr)
        self.max_lr = base_lr if options.warmup_max_lr == AUTO else options.warmup_max_lr

    def _gamma(self, step: int) -> float:
        o = self.options
        if step >= o.warmup_num_steps:
            return 1.0
        if o.warmup_type == "log":
            return math.log(step + 1) / math.log(o.warmup_num_steps) if o.warmup_num_steps > 1 else 1.0
        return step / o.warmup_num_steps

    def lr_at(self, step: int) -> float:
        lo = self.options.warmup_min_lr
        return lo + (self.max_lr - lo) * self._gamma(step)


@dataclass(frozen=True)
class WarmupDecayOptions(WarmupOptions):
    total_num_steps: int = opt(10000, "Step at which the lr has decayed linearly to 0.", min=1)

    def validate(self, path: str) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            raise ConfigError(f"{path}.total_num_steps = {self.total_num_steps} is smaller than "
                              f"warmup_num_steps = {self.warmup_num_steps}; raise it", key=f"{path}.total_num_steps")


class WarmupDecay(Warmup):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""
    Options = WarmupDecayOptions

    def lr_at(self, step: int) -> float:
        o = self.options
        if step < o.warmup_num_steps:
            return super().lr_at(step)
        span = max(1, o.total_num_steps - o.warmup_num_steps)
        return self.max_lr * max(0.0, (o.total_num_steps - step) / span)


@dataclass(frozen=True)
class WarmupCosineOptions:
    total_num_steps: int = opt(10000, "Step at which the cosine reaches cos_min_ratio.", min=1)
    warmup_num_steps: int = opt(1000, "Steps of warm-up.", min=0)
    warmup_min_ratio: float = opt(0.0, "lr / optimizer.lr at step 0.", min=0.0, max=1.0)
    cos_min_ratio: float = opt(1e-4, "lr / optimizer.lr at the end of the cosine.", min=0.0, max=1.0)
    warmup_type: Literal["log", "linear"] = opt("log", "Shape of the warm-up curve.")

    def validate(self, path: str) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            raise ConfigError(f"{path}.total_num_steps = {self.total_num_steps} is smaller than "
                              f"warmup_num_steps = {self.warmup_num_steps}; raise it", key=f"{path}.total_num_steps")


class WarmupCosine(Scheduler):
    """WarmupCosineLR: ratio warm-up, then cosine decay to cos_min_ratio x lr."""
    Options = WarmupCosineOptions

    def lr_at(self, step: int) -> float:
        o = self.options
        if step < o.warmup_num_steps:
            if o.warmup_type == "log":
                g = math.log(step + 1) / math.log(o.warmup_num_steps) if o.warmup_num_steps > 1 else 1.0
            else:
                g = step / o.warmup_num_steps
            ratio = o.warmup_min_ratio + (1 - o.warmup_min_ratio) * g
        else:
            span = max(1, o.total_num_steps - o.warmup_num_steps)
            progress = min(1.0, (step - o.warmup_num_steps) / span)
            ratio = o.cos_min_ratio + (1 - o.cos_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.base_lr * ratio


@hookimpl
def zeroplug_register_schedulers(register):
    register("none", Constant)
    register("warmup", Warmup)
    register("warmup_decay", WarmupDecay)
    register("warmup_cosine", WarmupCosine)
