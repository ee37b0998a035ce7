"""fp16 loss scaling with DeepSpeed's semantics.

* ``loss_scale = 0``: dynamic. Start at ``2**initial_scale_power``.
* On overflow: the step is skipped. With ``hysteresis = h``, the first ``h - 1``
  overflows only spend hysteresis; the next one halves the scale (never below
  ``min_loss_scale``). Without ``consecutive_hysteresis`` the hysteresis budget is
  restored only when the scale grows; with it, after every clean step.
* After ``loss_scale_window`` consecutive clean steps the scale doubles.
* ``loss_scale > 0``: a static scale; overflowed steps are still skipped.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0):
        self.dynamic = loss_scale == 0
        self.scale = 2.0 ** initial_scale_power if self.dynamic else float(loss_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_loss_scale
        self.cur_hysteresis = hysteresis
        self.clean_steps = 0       # consecutive steps without overflow
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if not self.dynamic:
                return
            if self.cur_hysteresis > 1:
                self.cur_hysteresis -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        if not self.dynamic:
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        if self.clean_steps % self.window == 0:
            self.scale *= 2
            self.cur_hysteresis = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis,
                "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
