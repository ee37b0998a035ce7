"""A partitioner's state loaded from a checkpoint written by any world size and stage (the
format: :mod:`.checkpointing`).

A :class:`Loader`: :meth:`~Loader.check` reads every file this rank needs and checks it
without changing anything, recording one :class:`Piece` per overlap of a saved piece with a
segment of this rank; :meth:`~Loader.apply` (once every rank's checks passed) copies them in.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from zeroplug.checkpoint import CheckpointError

from .checkpoint_state import (
    check_covered, check_model, check_optimizer, install_optimizer_state, state_buffer,
)
from .checkpointing import copy_tensors, elementwise
from .segments import Segment, checkpoint_meta, segments, storage_key
from .state_blocks import Plan, codes_buffers, decode, fill_exact, is_absmax, source

log = logging.getLogger("zeroplug")


def import_state(part, states, optimizer=None, load_master: bool = True,
                 load_optimizer_states: bool = True) -> None:
    """Load this rank's part from ``states`` (a :class:`zeroplug.checkpoint.ShardSet`: the
    rank files' ``model`` parts, one at a time), whatever world size wrote them: the
    :class:`Loader` checks everything, then ``states.commit()`` (where several ranks agree
    that all passed), then it copies."""
    loader = Loader(part, states, optimizer, load_master, load_optimizer_states)
    loader.check()
    commit = getattr(states, "commit", None)
    if commit is not None and not getattr(states, "committed", False):
        commit()
    loader.apply()


PART, RANK = 0, 1       # Source.kind: part files sort first


@dataclass(frozen=True, order=True)
class Source:
    """Where a saved piece is read again after its file was let go: part file ``ref`` (by
    name), or piece ``index`` of its parameter in rank ``ref``'s file. Sorted, pieces of one
    file come together, so each file is mapped once per pass."""
    kind: int               # PART or RANK
    ref: str | int          # the part file's name, or the rank
    index: int = 0          # RANK: the piece's position in that file's list for the parameter


@dataclass(frozen=True)
class Piece:
    """What one saved piece gives one segment of this rank: the elements ``[lo, hi)`` of
    parameter ``name``, out of the piece that holds ``[start, end)``. It holds no tensor
    of a file (files are mapped again, one at a time, when the piece is read)."""
    segment: Segment
    position: int           # the segment's position in the Loader's ``segments``
    name: str
    rank: int               # the rank file that lists the piece,
    index: int              # as its piece ``index`` of ``name``
    part: str | None        # the part file that holds its masters and states, if any
    has_param: bool         # the rank file's piece holds the model-dtype values
    start: int
    end: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def src(self) -> slice:
        """The elements it gives, as positions in the saved piece's tensors."""
        return slice(self.lo - self.start, self.hi - self.start)

    @property
    def at(self) -> int:
        """Where they go: the position of ``lo`` in the segment."""
        return self.lo - self.segment.a

    @property
    def values_source(self) -> Source:
        """Where its model-dtype values are: the rank file, unless only the part file has them
        (a shard that was out of memory when it was saved)."""
        if self.has_param or self.part is None:
            return Source(RANK, self.rank, self.index)
        return Source(PART, self.part)

    @property
    def states_source(self) -> Source:
        """Where its masters and optimizer states are."""
        return Source(PART, self.part) if self.part is not None else Source(RANK, self.rank, self.index)

    def reopen(self, states, where: Source) -> dict:
        """The piece's entry as found in ``where`` (mapping that file again)."""
        if where.kind == PART:
            return {"start": self.start, "end": self.end, "part": where.ref}
        return states.rank_piece(where.ref, self.name, where.index)


@dataclass
class _Tally:
    """What :meth:`Loader.check` counts over all the files: elements of each (master,
    optimizer state) found, and the dtype each state was first seen in."""
    filled: dict[tuple[int, str], int] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)


class Loader:
    """Loads a checkpoint (``states``: a :class:`zeroplug.checkpoint.ShardSet` or a DeepSpeed
    checkpoint presented the same way) into partitioner ``part``.

    :meth:`check` reads every rank file in turn (and the part files its pieces name) and
    checks what this rank will copy: every element it needs exactly once, the values and
    states there, their dtypes, the extras and the optimizer's hyper-parameters. It changes
    nothing, and records a :class:`Piece` for each overlap of a saved piece with a segment
    of this rank, the optimizer's saved scalars and state dtypes, and which block-quantised
    states load as they are (:class:`~.state_blocks.Plan`). :meth:`apply` copies those
    pieces in: in memory from each rank file as it is read; masters and states that a tier
    keeps out of memory one sub-group at a time, and shards out of memory one unit at a
    time, from their sources in file order."""

    def __init__(self, part, states, optimizer=None, load_master: bool = True,
                 load_optimizer_states: bool = True):
        self.part, self.states, self.optimizer = part, states, optimizer
        self.load_master = load_master
        self.want_opt = load_optimizer_states and optimizer is not None
        self.where = repr(str(getattr(states, "path", "")))
        self.masters = part.master_params()
        # masters and optimizer states out of memory: filled one sub-group at a time
        self.streamed = part.offload is not None and not part.offload_optimizer.capabilities.in_memory
        # units whose model-dtype shard is out of memory: filled one unit at a time
        self.away = {u.index for u in part.units if part.offload_param.absent(u.index)}
        # masters and states filled as each rank file is read
        self.fill_in_place = not self.streamed and (self.load_master and not part.alias or self.want_opt)
        self.plan = Plan()          # block-quantised states: which load as they are
        # what check() finds
        self.segments: list[Segment] = []
        self.pieces: list[Piece] = []
        self.by_unit: dict[int, list[Piece]] = {}     # pieces of each unit out of memory, as found
        self.by_master: list[list[Piece]] = []        # pieces of each master
        self.scalars: dict | None = None
        self.keys: dict = {}
        self.groups: list | None = None
        self.checked = False

    # -- check ------------------------------------------------------------------------------
    def check(self) -> None:
        """Check everything :meth:`apply` will copy, changing nothing (a CheckpointError
        names the file and what is wrong)."""
        states = self.states
        check_model(states.meta, checkpoint_meta(self.part), self.where)
        self.segments = segments(self.part)
        self.pieces = []
        by_name: dict[str, list[tuple[int, Segment]]] = {}
        for j, s in enumerate(self.segments):
            by_name.setdefault(s.name, []).append((j, s))
        live = self.part.module.state_dict(keep_vars=True)
        tally = _Tally()
        with torch.no_grad():
            for rank, model in states.items():
                self._check_file(rank, model, by_name, live, tally)
                del model
            states.release()
            self.by_unit, self.by_master = {}, [[] for _ in self.masters]
            for p in self.pieces:
                self.by_master[p.segment.k].append(p)
                if p.segment.unit in self.away:
                    self.by_unit.setdefault(p.segment.unit, []).append(p)
            covered: list[list[tuple[int, int]]] = [[] for _ in self.segments]
            for p in self.pieces:
                covered[p.position].append((p.lo, p.hi))
            for spans, s in zip(covered, self.segments):
                check_covered(spans, s, self.where)
            for pieces in self.by_unit.values():            # values of shards out of memory: there
                for p in sorted(pieces, key=lambda p: p.values_source):
                    self._values(p.name, p.reopen(states, p.values_source))
            if self.streamed:                               # masters and states out of memory: there
                for pieces in self.by_master:
                    for p in sorted(pieces, key=lambda p: p.states_source):
                        self._check_states(p, p.reopen(states, p.states_source), tally)
            states.release()
            if self.want_opt:
                self._check_complete(tally)
                check_optimizer(self.where, self.optimizer, tally.dtypes, self.keys, self.groups)
        self.checked = True

    def _check_file(self, rank: int, model: dict, by_name: dict, live: dict, tally: _Tally) -> None:
        """One rank file (its locals, which hold views of the mapped file, end with the call)."""
        if self.want_opt:
            if self.scalars is None and model.get("optim_keys"):
                self.scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in model["optim_scalars"].items()}
                self.keys = dict(model["optim_keys"])
            if self.groups is None and model.get("optim_groups"):
                self.groups = copy_tensors(model["optim_groups"])
        fname = self.states.file_of(rank) if hasattr(self.states, "file_of") else f"rank {rank}'s file"
        for k, v in model.get("extras", {}).items():
            dst = live.get(k)
            if dst is None or not torch.is_tensor(dst):
                raise CheckpointError(f"checkpoint {self.where}: file {fname} field model.extras[{k!r}] is not an "
                                      "entry of this model's state dict")
            if dst.shape != v.shape or dst.is_floating_point() != v.is_floating_point() or v.is_complex():
                raise CheckpointError(f"checkpoint {self.where}: file {fname} field model.extras[{k!r}] is "
                                      f"{tuple(v.shape)} {v.dtype}, the model's {tuple(dst.shape)} {dst.dtype}")
        for p, pc in self._overlaps(rank, model, by_name):
            self.pieces.append(p)
            if p.segment.unit not in self.away:
                self._values(p.name, pc)
            if self.fill_in_place:
                self._check_states(p, pc, tally)

    def _overlaps(self, rank: int, model: dict, by_name: dict[str, list[tuple[int, Segment]]]):
        """(Piece, the rank file's entry) for each overlap of a piece of this file with a
        segment (``by_name``: each parameter's segments and their positions)."""
        for name, pieces in model["pieces"].items():
            for j, seg in by_name.get(name, ()):
                for i, pc in enumerate(pieces):
                    lo, hi = max(seg.a, pc["start"]), min(seg.b, pc["end"])
                    if lo >= hi:
                        continue
                    ref = pc.get("part")
                    yield Piece(seg, j, name, rank, i, ref if isinstance(ref, str) else None, "param" in pc,
                                pc["start"], pc["end"], lo, hi), pc

    def _check_states(self, p: Piece, pc: dict, tally: _Tally) -> None:
        """The master values and optimizer states that ``p`` gives are there, of one dtype per state."""
        full = self._full(p, pc)
        if self.load_master and not self.part.alias:
            self._master_value(p, pc, full)
        if not self.want_opt:
            return
        k = p.segment.k
        for key, t in full.get("optim", {}).items():
            tally.filled[(k, key)] = tally.filled.get((k, key), 0) + p.size
            blocks = source(full, key, t, self.where)       # block-quantised: (absmax, phase)
            if tally.dtypes.setdefault(key, t.dtype) != t.dtype:
                raise CheckpointError(f"checkpoint {self.where}: optimizer state {key!r} of {p.name!r} is "
                                      f"{t.dtype}, elsewhere {tally.dtypes[key]}")
            if blocks is not None:
                self.plan.check(k, key, self.masters[k], p.segment.mloc + p.at, blocks, p.src.start, p.size)

    def _check_complete(self, tally: _Tally) -> None:
        """Every optimizer state the checkpoint has covers every element of every master."""
        need: dict[int, int] = {}
        for s in self.segments:
            need[s.k] = need.get(s.k, 0) + (s.b - s.a)
        for (k, key), n in tally.filled.items():
            if n != need[k]:
                raise CheckpointError(f"checkpoint {self.where}: optimizer state {key!r} is incomplete")
        # a master needs the states its pieces were saved with (each piece holds its master's):
        # none at all, where the checkpoint has some, is a gap
        filled = {k for k, _ in tally.filled}
        if self.keys and any(k not in filled for k in need):
            raise CheckpointError(f"checkpoint {self.where}: optimizer states "
                                  f"{', '.join(map(repr, self.keys))} are incomplete")

    # -- apply ------------------------------------------------------------------------------
    def apply(self) -> None:
        """Copy what :meth:`check` found, then publish the masters to the model-dtype shards
        (gathered as the stage keeps parameters). Call it only after check() passed (on
        every rank)."""
        if not self.checked:
            raise RuntimeError("Loader.apply() before Loader.check()")
        part = self.part
        new_state: list[dict] = [{} for _ in self.masters]
        by_rank: dict[int, list[Piece]] = {}
        for p in self.pieces:
            by_rank.setdefault(p.rank, []).append(p)
        live = part.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for rank, model in self.states.items():
                self._apply_file(model, by_rank.get(rank, []), live, new_state)
                del model
            self.states.release()
            if self.streamed:
                self._fill_streamed(new_state)
            if self.want_opt:
                # parameter groups of one's own (model_parameters) keep the settings the engine
                # was built with; the saved ones are one group's
                install_optimizer_state(self.optimizer, self.masters, new_state, self.scalars or {}, self.keys,
                                        self.groups if part.groups.plain else None)
        if not self.streamed:
            _publish(part, self._shard_in, follow=not self.load_master)   # module only: masters follow
        else:
            part.gather_after_step()       # published sub-group by sub-group in _fill_streamed
        part.zero_grad()

    def _apply_file(self, model: dict, pieces: list[Piece], live: dict, new_state: list[dict]) -> None:
        """What one rank file gives in memory (its locals, which hold views of the mapped
        file, end with the call)."""
        for k, v in model.get("extras", {}).items():
            live[k].data.copy_(v)
        for p in pieces:
            pc = model["pieces"][p.name][p.index]
            if p.segment.unit not in self.away:     # an alias (one tensor): exact fp32 masters when saved
                self._copy_values(p, pc)
            if self.fill_in_place:
                self._fill_states(p, pc, new_state[p.segment.k])

    def _copy_values(self, p: Piece, pc: dict) -> None:
        p.segment.lp[p.at:p.at + p.size].copy_(self._values(p.name, pc)[p.src])

    def _fill_states(self, p: Piece, pc: dict, st: dict) -> None:
        """The master and optimizer states of ``p``'s elements (into ``st``: the master's new state)."""
        full = self._full(p, pc)
        seg, masters = p.segment, self.masters
        if self.load_master and not self.part.alias:
            seg.master(masters)[p.at:p.at + p.size].copy_(self._master_value(p, pc, full)[p.src])
        if not self.want_opt:
            return
        k, m0, n = seg.k, seg.mloc + p.at, p.size
        for key, t in full.get("optim", {}).items():
            blocks = source(full, key, t, self.where)
            if blocks is not None and self.plan.exact(k, key):
                if key not in st:
                    codes_buffers(self.optimizer, masters[k], key, t.dtype, st)
                fill_exact(st, key, t, blocks, p.src.start, p.src.stop, m0)
            elif blocks is not None:        # blocks cut differently now: decoded, encoded again later
                if key not in st:
                    st[key] = state_buffer(self.optimizer, masters[k], key, torch.float32)
                st[key].view(-1)[m0:m0 + n].copy_(decode(t, *blocks, p.src.start, p.src.stop))
            else:
                if key not in st:
                    st[key] = state_buffer(self.optimizer, masters[k], key, t.dtype)
                st[key][m0:m0 + n].copy_(t[p.src])

    def _fill_streamed(self, new_state: list[dict]) -> None:
        """A tier that keeps states out of memory: each sub-group in memory in turn (brought in,
        filled, published to the model-dtype shards, written back), so loading holds one
        sub-group's states at a time."""
        part, optimizer, states = self.part, self.optimizer, self.states
        tier = part.offload_optimizer
        keys = self.keys if self.want_opt else {}
        index = {storage_key(t): k for k, t in enumerate(self.masters)}
        units: list[list] = [[] for _ in self.masters]
        for u in part.units:
            k = index.get(storage_key(u.master))
            if k is None:
                raise CheckpointError("a unit's master is not a sub-group of the offload tier")
            units[k].append(u)
        part.release_all()
        for k, (t, pieces) in enumerate(zip(self.masters, self.by_master)):
            with tier.import_(k, optimizer):
                st = new_state[k]
                # a sub-group of pieces gets the states its pieces hold; one of padding alone,
                # every state the checkpoint has
                for key, dt in (keys.items() if not pieces else ()):
                    if dt in ("int8", "uint8") and self.plan.exact(k, key):
                        codes_buffers(optimizer, t, key, getattr(torch, dt), st)
                    else:
                        st[key] = state_buffer(optimizer, t, key, torch.float32 if dt in ("int8", "uint8")
                                               else getattr(torch, dt))
                for p in sorted(pieces, key=lambda p: p.states_source):
                    # file by file: each part file (or rank file) is mapped once per sub-group
                    self._fill_states(p, p.reopen(states, p.states_source), st)
                states.release()                    # unmapped before the next sub-group comes in
                if st:      # the optimizer holds them before the block ends: written out with the master
                    convert = getattr(optimizer, "convert_state", None)
                    if convert is not None:         # in the optimizer's own form (state_dtype) before it goes out
                        convert(t, st)
                    cur = optimizer.state[t]
                    for key in [key for key, v in cur.items()
                                if (elementwise(v, t) or is_absmax(cur, key)) and key not in st]:
                        del cur[key]                # a state the checkpoint does not have
                    cur.update(st)
                for u in units[k]:
                    with self._shard_in(u):         # a shard out of memory: filled, published, written back
                        if not self.load_master:    # module only: masters follow the loaded weights
                            u.master.copy_(u.shard)
                        u.shard.copy_(u.master)

    @contextmanager
    def _shard_in(self, u):
        """``u``'s shard in memory for the block; one out of memory is filled from the
        checkpoint first (one unit at a time) and written back by its tier after."""
        if u.index not in self.away:
            yield
            return
        with self.part.offload_param.update(u.index):
            for p in sorted(self.by_unit.get(u.index, ()), key=lambda p: p.values_source):
                self._copy_values(p, p.reopen(self.states, p.values_source))
            self.states.release()
            yield

    # -- shared -----------------------------------------------------------------------------
    def _full(self, p: Piece, pc: dict) -> dict:
        """The entry holding ``pc``'s masters and states (``pc`` or its part file's copy)."""
        return self.states.piece_states(p.name, pc) if self.load_master or self.want_opt else pc

    def _master_value(self, p: Piece, pc: dict, full: dict) -> torch.Tensor:
        val = full.get("master", full.get("param", pc.get("param")))
        if val is None:
            raise CheckpointError(f"checkpoint {self.where}: a piece of {p.name!r} has no values")
        return val

    def _values(self, name: str, pc: dict) -> torch.Tensor:
        """A piece's model-dtype values (an alias, one tensor: its exact fp32 master when saved)."""
        return _lp_value(self.states, name, pc, self.part.alias and self.load_master)


def _publish(part, shard_in=lambda u: nullcontext(), follow: bool = False) -> None:
    """Masters -> model-dtype shards -> all-gathered as the stage keeps parameters
    (``follow``: the other way round first; ``shard_in(u)``: the unit's shard in memory)."""
    part.release_all()
    with torch.no_grad():
        for u in part.units:
            with shard_in(u):
                if not part.alias:
                    if follow:
                        u.master.copy_(u.shard)
                    u.shard.copy_(u.master)
    part.gather_after_step()


def _lp_value(states, name: str, pc: dict, prefer_master: bool) -> torch.Tensor:
    """A piece's model-dtype values (or its fp32 master, when preferred and saved): in the
    rank file's piece or, for a shard that was out of memory, in the part file it names."""
    val = pc.get("param")
    if val is None or prefer_master:
        full = states.piece_states(name, pc)
        val = full.get("master", full.get("param", val)) if prefer_master else full.get("param", val)
    if val is None:
        raise CheckpointError(f"checkpoint {str(getattr(states, 'path', ''))!r}: a piece of {name!r} "
                              "has no values")
    return val
