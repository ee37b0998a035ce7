"""Stages 0-2 on one rank with an offloaded optimizer: the next forward overlaps the step.

The tier may return from ``step()`` while later sub-groups are still being stepped on
the CPU and their new model-dtype values uploaded into the units' shards (the cpu tier's
``overlap_step``). Stage 3 waits for a unit's sub-group before it gathers the unit; below
stage 3 the parameters are plain views of persistent buffers, so this window makes every
read of a parameter wait instead:

* each module's forward pre-hook waits for the units of its own parameters (the forward
  of the first blocks runs while the CPU steps the last ones);
* every trainable parameter is a :class:`SteppingParam` until its unit is waited for, so a
  read anywhere else (an EMA of the weights after ``engine.step()``, a loss that uses
  another module's weight, ``p.data``) waits for that unit first and never sees values
  half written;
* ``close()`` (the partitioner's ``wait_optimizer``: before gradients, checkpoints,
  ``gathered_params``) ends the window for every unit.

Note: only on one rank. With several ranks each unit's new values are all-gathered after
the step, which would have to move into the forward too (as stage 3 gathers); those steps
stay serial.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten

from .unit import METADATA_OPS, op_name

# what a parameter answers without its values (``.data`` is not among them: it reads them)
_NO_WAIT = METADATA_OPS - {"data"}


class SteppingParam(torch.nn.Parameter):
    """A parameter whose new values the optimizer step may still be writing."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_name(func) not in _NO_WAIT:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, SteppingParam):
                    t._zp_step_wait()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class StepWindow:
    def __init__(self, module, units, offload):
        self.offload = offload
        self.open: set = set()
        self.units = units
        for u in units:
            for p in u.trainable:
                p._zp_step_wait = functools.partial(self.wait, u)
        self.hooks = []
        unit_of = {p: u for u in units for p in u.trainable}
        for m in module.modules():
            mine = sorted({unit_of[p] for p in m.parameters(recurse=False) if p in unit_of}, key=lambda u: u.index)
            if mine:
                self.hooks.append(m.register_forward_pre_hook(functools.partial(self._pre_forward, mine)))

    def start(self) -> None:
        """The tier's step returned with sub-groups in flight: every unit waits before use."""
        self.open = set(self.units)
        for u in self.units:
            for p in u.trainable:
                if type(p) is torch.nn.Parameter:
                    p.__class__ = SteppingParam

    def wait(self, u) -> None:
        if u not in self.open:
            return
        self.offload.wait_unit(u)       # its sub-group stepped, the compute stream after its upload
        self.open.discard(u)
        for p in u.trainable:
            if type(p) is SteppingParam:
                p.__class__ = torch.nn.Parameter

    def _pre_forward(self, units, module, args) -> None:
        for u in units:
            self.wait(u)

    def close(self) -> None:
        """The step is finished (the tier waited for it): no unit waits any longer."""
        for u in list(self.open):
            self.open.discard(u)
            for p in u.trainable:
                if type(p) is SteppingParam:
                    p.__class__ = torch.nn.Parameter

    def remove(self) -> None:
        self.close()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for u in self.units:
            for p in u.trainable:
                p.__dict__.pop("_zp_step_wait", None)
