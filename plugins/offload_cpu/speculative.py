"""The cpu tier's speculative step (``[offload.optimizer] speculative_step``): sub-groups
stepped during the backward, before the global gradient norm exists.

The step needs the global norm (clipping) and the overflow verdict, which exist only once
every gradient is reduced. Most steps neither clip nor overflow, and then the step is
known in advance: the engine's multiplier is ``1 / loss scale`` and the lr is the
schedule's. So at a boundary backward the engine hands the tier that guess
(``speculate``). From then on each unit's ``grad_ready`` is its last of the
window, so once every unit of sub-group k has handed its gradient over (the backward is
done with those units) the worker thread steps k with the guess and publishes it,
exactly as the step would::

    backward   | units of sub-group N-1 reduced | N-2 | ... | 0 | norm
    worker               | save + step N-1        | save + step N-2 | ...
    step()                                                          validate | the rest

``step()`` compares the multiplier and the optimizer's settings it gets with the guess.
Equal: the sub-groups the worker began are kept, and the rest (those it had not begun)
step the ordinary way, with no copy. Different (the norm clipped, or the settings
changed): each begun sub-group's master and optimizer states are restored from the copy
taken just before its speculative step, and every sub-group steps the ordinary way with
the real multiplier. Overflow (``discard``): the same restore, and the published
model-dtype values are published again from the restored masters, which they round
(the step writes the model-dtype copy as the rounded master). The speculative step
makes the same call with the same arguments as the ordinary step, so kept or redone,
every value equals the non-speculative path's bit for bit.

Cost: the copy (master + states, 12 bytes per element for Adam) is read and written once
before each speculative sub-group step, which runs during the backward, off the critical
path. Host memory holds one copy per sub-group that has stepped speculatively at least
once (allocated then, and only while ``HOST_RESERVE`` stays available): the sub-groups
the worker reaches before the step validates, usually those whose step fits in the
backward. A rollback restores the copies (on the critical path) and redoes the steps.
Sub-groups the worker has not begun when the step validates take no copy.

"auto" speculates only on a GPU (on a CPU the backward and the step share the cores),
not beside the overlapped stage-3 step (the tier decides both), and only while the last
``AUTO_CLEAN_STEPS`` steps neither clipped nor overflowed: when they do, a speculation
would only add the copy and the rollback. Whether a step would have
held is recorded at every boundary, speculating or not.
"""
from __future__ import annotations

import threading
from collections import Counter, deque

import torch

from zeroplug.observe.memory import host_available_bytes
from zeroplug.tiers import fp32_multiplier

#: "auto" speculates after this many steps in a row that neither clipped nor overflowed
AUTO_CLEAN_STEPS = 4
#: host memory left available when a sub-group's copy is allocated (else it does not speculate)
HOST_RESERVE = 2 << 30


def settings(optimizer) -> list[dict]:
    """Each param group's settings (everything but its parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


class Backup:
    """One sub-group's copy of its master and optimizer states, taken before a speculative
    step (tensors copied into buffers kept for the tier's life; other values kept as is)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.values: dict = {}

    def save(self, master: torch.Tensor, state: dict) -> None:
        self.values = {}
        for key, t in [("\0master", master)] + sorted(state.items()):
            if not torch.is_tensor(t):
                self.values[key] = t
                continue
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[key] = torch.empty_like(t, device="cpu")
            buf.copy_(t)

    def restore(self, master: torch.Tensor, state: dict) -> None:
        master.copy_(self.buffers["\0master"])
        for key, t in state.items():
            if torch.is_tensor(t):
                t.copy_(self.buffers[key])
            elif key in self.values:
                state[key] = self.values[key]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class Window:
    """One boundary backward's speculation."""

    def __init__(self, optimizer, multiplier: float, active: bool):
        self.optimizer, self.multiplier, self.active = optimizer, multiplier, active
        self.settings: list[dict] | None = None    # the param groups' settings the first job steps with
        self.lock = threading.Lock()
        self.closed = False                # validated or discarded: no job begins after
        self.begun: list[int] = []         # sub-groups stepped speculatively (saved first)
        self.futures: list = []
        self.uploads: dict[int, object] = {}   # k -> CUDA event of its upload
        self.left: dict[int, int] = {}         # sub-group -> its units whose gradient is still to come


class Speculation:
    """The tier's speculative step (see the module doc); ``tier`` is the host tier."""

    def __init__(self, tier, mode):
        self.tier = tier
        self.mode = mode                   # True or "auto"
        self.window: Window | None = None
        self.backups: dict[int, Backup] = {}
        self.history: deque[bool] = deque(maxlen=AUTO_CLEAN_STEPS)   # True: the guess held
        self.units = Counter(tier.sub_group_of.values()) if tier is not None else Counter()
        # statistics (tests, benchmarks)
        self.speculated_steps = 0          # boundaries at which sub-groups stepped during backward
        self.speculated_groups = 0         # sub-group steps kept
        self.rollbacks = 0                 # boundaries whose speculative steps were undone
        self.rolled_back_groups = 0

    def wanted(self) -> bool:
        if self.mode is True:
            return True
        return len(self.history) == AUTO_CLEAN_STEPS and all(self.history)

    def host_bytes(self) -> int:
        return sum(b.nbytes() for b in self.backups.values())

    # -- backward -----------------------------------------------------------------------
    def request(self, optimizer, loss_scale: float | None) -> bool:
        """The tier's ``speculate``: a boundary backward begins (True if its sub-groups step
        during it), or, with ``loss_scale`` None, what was speculated is undone."""
        if loss_scale is None:
            self.discard()
            return False
        return self.begin(optimizer, loss_scale)

    def begin(self, optimizer, loss_scale: float) -> bool:
        """A boundary backward begins; True if its sub-groups step during it (the engine then
        sets the step's lr, before any gradient arrives)."""
        self.discard()                      # a boundary backward again without a step
        self.window = w = Window(optimizer, fp32_multiplier(1.0 / loss_scale), self.wanted())
        w.left = dict(self.units)
        return w.active

    def landed(self, k: int) -> None:
        """A unit of sub-group k handed its gradient over. After ``begin`` each unit does so
        once (the contract's promise), so the last one makes k's gradients final."""
        w = self.window
        if w is None or not w.active or k not in w.left:
            return
        w.left[k] -= 1
        if w.left[k] == 0:
            del w.left[k]
            self.tier.grads_final(k)

    def final(self, k: int, after) -> None:
        """Sub-group k's gradients are final (``after``: CUDA event of their copy, or None)."""
        w = self.window
        if w.settings is None:
            w.settings = settings(w.optimizer)
        w.futures.append(self.tier.step_worker().submit(self._job, w, k, after))

    def _job(self, w: Window, k: int, after) -> None:
        tier = self.tier
        master = tier.masters[k]
        state = w.optimizer.state[master]
        if k not in self.backups:
            # Note: a copy is allocated when its sub-group first steps speculatively (during a
            # backward, off the critical path): only the sub-groups the worker reaches before
            # the step hold one. Where host memory would run short, k steps at the step instead.
            need = sum(t.numel() * t.element_size() for t in [master, *state.values()] if torch.is_tensor(t))
            if host_available_bytes() < need + HOST_RESERVE:
                return
        with w.lock:
            if w.closed:
                return
            w.begun.append(k)
        if after is not None:
            after.synchronize()             # its gradient is in host memory
        self.backups.setdefault(k, Backup()).save(master, state)
        ev = tier.step_sub_group(w.optimizer, k, w.multiplier, tier.overlap_threads())
        if ev is not None:
            w.uploads[k] = ev

    # -- the step -------------------------------------------------------------------------
    def validate(self, optimizer, multiplier: float) -> tuple[list[int], dict]:
        """At ``step()``: the sub-groups kept (stepped already; their upload events), after
        undoing the others. The caller steps every other sub-group."""
        w, self.window = self.window, None
        if w is None:
            return [], {}
        held = multiplier == w.multiplier and w.settings in (None, settings(optimizer))
        self.history.append(held)
        begun = self._close(w)
        if held:
            if begun:
                self.speculated_steps += 1
                self.speculated_groups += len(begun)
            return begun, w.uploads
        self._undo(w, begun, republish=False)   # the ordinary step writes every sub-group again
        return [], {}

    def discard(self) -> None:
        """Undo what the window in flight stepped (the step is skipped, or never came)."""
        w, self.window = self.window, None
        if w is None:
            return
        self.history.append(False)
        self._undo(w, self._close(w), republish=True)

    def _close(self, w: Window) -> list[int]:
        """No job begins after this; those begun have finished. A job's error is raised here,
        and the run is marked failed: a sub-group may be stepped part-way."""
        with w.lock:
            w.closed = True
            begun = list(w.begun)
        for f in w.futures:
            exc = f.exception()
            if exc is not None:
                run = self.tier.run
                run.failed = run.failed or f"a speculative optimizer step failed ({type(exc).__name__}: {exc})"
                raise exc
        return begun

    def _undo(self, w: Window, begun: list[int], republish: bool) -> None:
        if not begun:
            return
        tier = self.tier
        self.rollbacks += 1
        self.rolled_back_groups += len(begun)
        for k in begun:
            master = tier.masters[k]
            self.backups[k].restore(master, w.optimizer.state[master])
            if republish:
                tier.publish(k, w.optimizer)
        if republish:
            tier.publish_finished()
