"""Observation of a run: where each step's time goes (``phase_*`` metrics) and the bytes
each state holds (``engine.memory_report()``, printed once after the first step).

A built-in plugin on the hooks a third party would use: ``zeroplug_phase`` marks the
phases, ``zeroplug_step_end`` adds the readings to the step's metrics before the monitors
write them (``tryfirst``), ``zeroplug_memory_report`` answers ``engine.memory_report()``.
"""
from __future__ import annotations

import weakref

from zeroplug import hookimpl

from .memory import format_memory_report, memory_report
from .phases import PhaseClock

#: one clock per engine, gone with it
_clocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _clock(engine) -> PhaseClock:
    clock = _clocks.get(engine)
    if clock is None:
        clock = _clocks[engine] = PhaseClock(engine.run.device)
    return clock


@hookimpl
def zeroplug_phase(engine, phase):
    _clock(engine).mark(phase)


@hookimpl(tryfirst=True)
def zeroplug_step_end(engine, metrics):
    metrics.update(_clock(engine).take(keep=metrics.get("record", False)))
    if metrics["step"] == 1 and metrics.get("print"):
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        metrics["memory_report"] = format_memory_report(engine.memory_report(), trainable)


@hookimpl
def zeroplug_memory_report(engine):
    # Note: sizes only, no values: no wait for an overlapped step (its refills gather
    # across ranks, and the report may run on one rank alone)
    return memory_report(engine)


@hookimpl
def zeroplug_engine_closed(engine):
    _clocks.pop(engine, None)
