"""Learning-rate schedules with DeepSpeed's names and semantics (the ``[scheduler]`` slot).

Every schedule gives the lr of optimizer step ``t`` (counting steps taken; an fp16
step skipped for overflow does not advance it): ``lr_at(t)`` is DeepSpeed's
``get_lr()`` with ``last_batch_iteration = t``. As in DeepSpeed, a warm-up is at
least 2 steps long (``max(2, warmup_num_steps)``). One deliberate difference:
past ``total_num_steps`` the cosine stays at ``cos_min_ratio`` (DeepSpeed's rises
again along the cosine).

``total_num_steps = "auto"`` is the run's length, which the loop that knows it fills in
before the config is read: ``zeroplug train`` from ``--steps``. A schedule that reaches
the engine with "auto" still in it is refused: a user's own loop names its length.
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
    warmup_num_steps: int = opt(1000, "Steps of warm-up (at least 2 are used, as in DeepSpeed).", min=1)
    warmup_type: Literal["log", "linear"] = opt("log", "Shape of the warm-up curve.")


def _warmup_fraction(step: int, warmup_steps: int, warmup_type: str) -> float:
    """0 at step 0, 1 from ``warmup_steps`` on (``warmup_steps >= 2``)."""
    if step >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


class Warmup(Scheduler):
    """WarmupLR: min -> max over warmup_num_steps, then constant."""
    Options = WarmupOptions

    def __init__(self, options, run, base_lr):
        super().__init__(options, run, base_lr)
        self.max_lr = base_lr if options.warmup_max_lr == AUTO else options.warmup_max_lr
        self.warmup_steps = max(2, options.warmup_num_steps)     # as DeepSpeed

    def _gamma(self, step: int) -> float:
        return _warmup_fraction(step, self.warmup_steps, self.options.warmup_type)

    def lr_at(self, step: int) -> float:
        lo = self.options.warmup_min_lr
        return lo + (self.max_lr - lo) * self._gamma(step)


def check_length(path: str, total, warmup: int) -> None:
    """A schedule's length: a number of steps no shorter than its warm-up ("auto" filled in)."""
    if total == AUTO:
        raise ConfigError(f"{path}.total_num_steps = \"auto\" is the run's length, which `zeroplug train` fills in "
                          f"from --steps; a loop of your own (or the Trainer's, Lightning's) sets it to its number "
                          f"of optimizer steps, e.g. {path}.total_num_steps = 10000", key=f"{path}.total_num_steps")
    if total < warmup:
        raise ConfigError(f"{path}.total_num_steps = {total} is smaller than warmup_num_steps = {warmup}; "
                          f"raise it", key=f"{path}.total_num_steps")


_LENGTH_HELP = "; \"auto\" = the run's length (`zeroplug train`: its --steps)"


@dataclass(frozen=True)
class WarmupDecayOptions(WarmupOptions):
    total_num_steps: int | Literal["auto"] = opt(
        10000, "Step at which the lr has decayed linearly back to warmup_min_lr" + _LENGTH_HELP + ".", min=1)

    def validate(self, path: str) -> None:
        check_length(path, self.total_num_steps, self.warmup_num_steps)


class WarmupDecay(Warmup):
    """WarmupDecayLR: WarmupLR, then linear decay to warmup_min_lr at total_num_steps."""
    Options = WarmupDecayOptions

    def _gamma(self, step: int) -> float:
        if step < self.warmup_steps:
            return super()._gamma(step)
        total = self.options.total_num_steps
        return max(0.0, (total - step) / max(1, total - self.warmup_steps))


@dataclass(frozen=True)
class WarmupCosineOptions:
    total_num_steps: int | Literal["auto"] = opt(
        10000, "Step at which the cosine reaches cos_min_ratio" + _LENGTH_HELP + ".", min=1)
    warmup_num_steps: int = opt(1000, "Steps of warm-up (at least 2 are used, as in DeepSpeed).", min=0)
    warmup_min_ratio: float = opt(0.0, "lr / optimizer.lr at step 0.", min=0.0, max=1.0)
    cos_min_ratio: float = opt(1e-4, "lr / optimizer.lr at the end of the cosine.", min=0.0, max=1.0)
    warmup_type: Literal["log", "linear"] = opt("log", "Shape of the warm-up curve.")

    def validate(self, path: str) -> None:
        check_length(path, self.total_num_steps, self.warmup_num_steps)


class WarmupCosine(Scheduler):
    """WarmupCosineLR: ratio warm-up, then cosine decay to cos_min_ratio x lr."""
    Options = WarmupCosineOptions

    def __init__(self, options, run, base_lr):
        super().__init__(options, run, base_lr)
        self.warmup_steps = max(2, options.warmup_num_steps)     # as DeepSpeed

    def lr_at(self, step: int) -> float:
        o = self.options
        w = self.warmup_steps
        if step < w:
            g = _warmup_fraction(step, w, o.warmup_type)
            ratio = o.warmup_min_ratio + (1 - o.warmup_min_ratio) * g
        else:
            # DeepSpeed counts the first cosine step as 1 (real_last_step = step - w + 1)
            span = max(1, o.total_num_steps - w)
            progress = min(1.0, (step - w + 1) / span)
            ratio = o.cos_min_ratio + (1 - o.cos_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.base_lr * ratio


@hookimpl
def zeroplug_register_schedulers(register):
    register("none", Constant)
    register("warmup", Warmup)
    register("warmup_decay", WarmupDecay)
    register("warmup_cosine", WarmupCosine)
