"""What this rank is doing: written by the training thread, read by the watchdog thread.

Note: plain attribute writes, no lock. The training thread writes a few ints and strings
per engine call or collective; the watchdog reads them once per interval, and a reading
that is one write stale only moves a message by one phase.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref

log = logging.getLogger("zeroplug")


class Record:
    def __init__(self):
        self.engine_ref = None        # weakref to the engine whose calls are tracked
        self.activity = "initialize"  # the engine call or phase in progress ("outside": the loop's own code)
        self.inside = 0               # engine calls (and waits for the others) in progress: > 0 arms the watchdog
        self.busy = 0                 # checkpoint I/O in progress: progress that makes no marks
        self.step = 0                 # the optimizer step in progress (1-based)
        self.micro = 0                # ... and its micro-step (1-based), of
        self.accumulation = 1         # ... this many
        self.completed = 0            # optimizer steps completed
        self.collective = None        # (kind, index, describe) of the last collective zeroplug issued
        self.ticks = 0                # progress marks so far
        self.last = time.monotonic()  # when the last one happened
        self.since = self.last        # when the current activity began
        self.failed = ""              # why this rank stopped (an exception, a disagreement)
        self.raised_in = None         # (exception, where) of the innermost engine call that raised
        self.thread = threading.main_thread().ident     # the training thread (the last to enter)
        self.cpu = False              # a CPU run: the training thread's CPU time counts as progress
        self._outer: list[str] = []   # the activities of the engine calls this one is inside

    # -- written by the training thread ----------------------------------------------
    def track(self, engine, cpu: bool | None = None) -> None:
        self.engine_ref = weakref.ref(engine)
        if cpu is not None:
            self.cpu = cpu

    def tick(self) -> None:
        self.ticks += 1
        self.last = time.monotonic()

    def enter(self, activity: str) -> None:
        """An engine call begins (calls nest: save_checkpoint inside close)."""
        engine = self.engine_ref() if self.engine_ref is not None else None
        if engine is not None and self.inside == 0:
            self.completed = engine.global_step
            self.step = engine.global_step + 1
            self.accumulation = engine.gradient_accumulation_steps
            # (the micro-step a forward or backward runs; the one that just ended for step())
            done = engine.micro_steps_in_window
            self.micro = max(1, min(done + (activity != "step"), self.accumulation))
        self.inside += 1
        self.thread = threading.get_ident()
        self._outer.append(self.activity)
        self.activity = activity
        self.since = time.monotonic()
        self.tick()

    def leave(self) -> None:
        self.inside = max(0, self.inside - 1)
        outer = self._outer.pop() if self._outer else "outside"
        if self.inside == 0:
            engine = self.engine_ref() if self.engine_ref is not None else None
            if engine is not None:
                self.completed = engine.global_step
            self.activity = "outside"
            self.since = time.monotonic()
        else:
            self.activity = outer
        self.tick()

    def raised(self, exc: BaseException) -> None:
        """``exc`` leaves an engine call: where it happened, kept for the messages (the
        innermost call's, which sees it first)."""
        if self.raised_in is None or self.raised_in[0] is not exc:
            self.raised_in = (exc, self.where())

    def where_raised(self, exc: BaseException) -> str:
        """Where ``exc`` left the engine, else where this rank is now."""
        if self.raised_in is not None and self.raised_in[0] is exc:
            return self.raised_in[1]
        return self.where()

    def phase(self, name: str) -> None:
        """A phase of the engine's step begins (``zeroplug_phase``: wait_gradients, optimizer)."""
        if self.inside and name not in ("other", "forward", "backward"):
            self.activity = name
            self.since = time.monotonic()
        self.tick()

    def issued(self, kind: str, index: int, describe) -> None:
        self.collective = (kind, index, describe)
        self.tick()

    # -- read by anyone -------------------------------------------------------------
    def collective_text(self) -> str:
        if self.collective is None:
            return ""
        kind, index, describe = self.collective
        return describe_collective(kind, index, describe)

    def where(self, collective: bool = True) -> str:
        """``step 3 (micro-step 1 of 2), backward; last collective: gradient reduction of unit 4
        (layers.1)`` (``collective``: with the last collective issued)."""
        if self.activity == "initialize" and self.engine_ref is None:
            return "initialize"
        now = time.monotonic()
        if self.inside == 0:
            text = (f"the training loop's own code after step {self.completed}, outside the engine for "
                    f"{now - self.since:.0f} s (its data loader, logging, evaluation)")
        elif self.activity == "initialize":
            text = "zeroplug.initialize"
        elif self.activity in BETWEEN_STEPS:
            text = f"{self.activity} after step {self.completed}"
        else:
            text = f"step {self.step} (micro-step {self.micro} of {self.accumulation}), {self.activity}"
        last = self.collective_text()
        in_step = self.inside and self.activity not in BETWEEN_STEPS
        return f"{text}; last collective: {last}" if collective and last and in_step else text

    def snapshot(self, rank: int) -> dict:
        """What the other ranks read (peers.py)."""
        return {"rank": rank, "where": self.where(), "inside": self.inside, "busy": self.busy,
                "ticks": self.ticks, "idle": round(time.monotonic() - self.last, 1), "wall": time.time(),
                "completed": self.completed, "failed": self.failed}


#: engine calls that belong to no step
BETWEEN_STEPS = ("initialize", "save_checkpoint", "load_checkpoint", "close", "exit")

#: what each kind of collective is called in messages
KIND_TEXT = {"all_gather": "all_gather of", "reduce": "gradient reduction of", "refill": "all_gather (refill) of"}


def describe_collective(kind: str, index: int, describe) -> str:
    what = KIND_TEXT.get(kind, kind)
    if index < 0:
        return what
    name = ""
    if describe is not None:
        try:
            name = describe(index)
        except Exception as exc:        # a message must never fail for want of a name
            log.debug("faults: no module name for unit %d: %r", index, exc)
            name = ""
    return f"{what} unit {index}" + (f" ({name})" if name else "")
