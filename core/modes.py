"""Modes: the ways a stage or a tier can work, each decided once into a small object.

A stage or tier that can work several ways holds each choice as an object with one job
(the ZeRO stages: a gradient sink, a parameter source per unit, where the states step, what
is prefetched; the host tier: how it steps a sub-group, publishes, lands gradients and
schedules its step). The hot methods call those objects and test no flag.

A mode is a class with a classmethod ``applies(...)`` that reads what its owner settled at
setup (stage, world size, precision, tiers, options, the optimizer), registered in a
:class:`Modes` list; the first class whose ``applies`` answers true is the one chosen.
Adding a mode is one class and one ``register`` line (``before=`` puts it ahead of a mode
it refines); the owner's files do not change.
"""
from __future__ import annotations


class Modes:
    """An ordered registry of mode classes (earlier entries win)."""

    def __init__(self, what: str):
        self.what = what
        self.classes: list[type] = []

    def register(self, cls: type | None = None, *, before: type | None = None):
        """Add ``cls`` (usable as a decorator), last or just ahead of ``before``."""
        def add(c: type) -> type:
            if c in self.classes:
                self.classes.remove(c)
            at = self.classes.index(before) if before is not None else len(self.classes)
            self.classes.insert(at, c)
            return c
        return add(cls) if cls is not None else add

    def pick(self, *facts) -> type:
        """The first registered class whose ``applies(*facts)`` is true."""
        for cls in self.classes:
            if cls.applies(*facts):
                return cls
        raise LookupError(f"no {self.what} applies")    # (the last registered applies always)

    def __iter__(self):
        return iter(self.classes)
