"""A partitioner's state in and out of checkpoints, independent of the world size.

What a rank owns is described in each parameter's own flattened numbering: for
every parameter NAME, the ranges ``[start, end)`` of its elements that fall into
this rank's shard (``FlatLayout.shard_pieces``). Per range a rank file holds the
model-dtype values, the fp32 master values (omitted when the master *is* the
parameter: fp32 on the optimizer's device) and each element-wise optimizer state
(``exp_avg``, ``exp_avg_sq``, ...). Nothing in it depends on the world size, the
stage, the bucket size, the padding or the sub-group size that wrote it, so a
checkpoint saved by N ranks of one stage loads on M ranks of any stage: each
loading rank walks the rank files one at a time and copies out the parts of the
ranges that intersect what it owns now. The file layout is documented in
:mod:`zeroplug.checkpoint` (core reads it alone for ``zeroplug export``).

Ranges are cut where optimizer tensors (sub-groups of ``sub_group_size``) end,
so each saved range maps onto one master tensor and its states; every saved
tensor is a zero-copy view of live memory (``piece_view``).

A tier that keeps states out of memory between steps (``capabilities.in_memory`` false:
e.g. in swap files) is streamed: saving brings one sub-group in at a time
(``tier.export(k)``, read-only), writes its pieces' masters and optimizer states into a
part file of their own (``rank_00000.sg00003.pt``; the rank file's pieces name it under
"part") and lets it go again, so a save needs about one sub-group's states of extra host
memory, not a copy of all of them. Loading into such a tier first copies what lives in
memory (model-dtype shards, scalars, extras) from every rank file, then brings one
sub-group in at a time (``tier.import_(k)``), fills its master and states from the pieces
(in the rank files or their part files) that intersect it, publishes it and lets the
tier write it back. A checkpoint with or without part files loads into every tier.

Stage 3 parameter shards that the param tier keeps out of memory (``absent(u)``) stream
the same way: a piece of such a unit keeps its "param" (and its master and states) in
the part file of its sub-group, written while that sub-group's units are fetched (and
evicted after); loading fills such a shard one unit at a time (``update(u)``).
"""
from __future__ import annotations

import logging
from bisect import bisect_right
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch

from zeroplug.checkpoint import CheckpointError, piece_view

from .checkpoint_state import (
    check_covered, check_model, check_optimizer, install_optimizer_state, state_buffer,
)
from .state_blocks import Plan, codes_buffers, decode, fill_exact, is_absmax, piece_blocks, source

log = logging.getLogger("zeroplug")


class Segment(NamedTuple):
    name: str            # the parameter's (first) name in the module
    a: int               # [a, b): elements in the parameter's flattened numbering
    b: int
    shard: torch.Tensor  # the unit's model-dtype shard, holding them from offset ``q``
    k: int               # index of the master tensor (in master_params()) holding them
    mloc: int            # offset of element ``a`` inside that master tensor
    unit: int            # the unit's index
    q: int

    @property
    def lp(self) -> torch.Tensor:
        """The model-dtype values (a view of the shard; made on use, since a shard out of
        memory has no memory to view while it is out)."""
        return self.shard[self.q:self.q + (self.b - self.a)]

    def master(self, masters) -> torch.Tensor:
        """The fp32 values (a view of master ``k``; made on use, since a moved-out
        master has no memory to view)."""
        return masters[self.k][self.mloc:self.mloc + (self.b - self.a)]


def copy_tensors(obj):
    """``obj`` (nested dicts, lists, tuples) with every tensor cloned."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_tensors(v) for v in obj)
    return obj


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _names(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def _canonical(part) -> dict[int, str]:
    names = _names(part.module)
    out = {}
    for u in part.units:
        for p in u.params:
            ns = names.get(id(p))
            if not ns:
                raise CheckpointError("a partitioned parameter is not reachable from the module "
                                      "(module.named_parameters() does not list it)")
            out[id(p)] = ns[0]
    return out


def checkpoint_meta(part) -> dict:
    """JSON-able: every partitioned parameter's name, shape and dtype, and the module's
    state-dict keys in order (each naming its parameter, or None for other entries)."""
    names = _names(part.module)
    params = {}
    for u in part.units:
        for i, p in enumerate(u.params):
            ns = names[id(p)]
            params[ns[0]] = {"shape": list(u.layout.shapes[i]), "dtype": _dtype_name(part.pdtype),
                             "aliases": ns[1:]}
    canon = _canonical(part)
    keys = [[k, canon.get(id(v))] for k, v in part.module.state_dict(keep_vars=True).items()]
    return {"params": params, "state_dict": keys}


def _storage_key(t: torch.Tensor):
    # the storage object, not its address: moved-out masters all have none
    return (t.device, t.untyped_storage()._cdata)


def segments(part) -> list[Segment]:
    """This rank's pieces of every parameter, each inside one master tensor."""
    canon = _canonical(part)
    masters = part.master_params()
    index: dict = {}
    for k, t in enumerate(masters):
        index.setdefault(_storage_key(t), []).append((t.storage_offset(), t.numel(), k))
    for v in index.values():
        v.sort()
    out = []
    for u in part.units:
        if u.hi <= u.lo:
            continue
        cands = index.get(_storage_key(u.master))
        if cands is None:
            raise CheckpointError("a unit's master is not a view of any optimizer tensor; the partitioner "
                                  "layout is not one this checkpointing understands")
        starts = [c[0] for c in cands]
        base = u.master.storage_offset()
        for i, a, b in u.layout.shard_pieces(part.layout_rank):
            name = canon[id(u.params[i])]
            p0 = u.layout.offsets[i] + a - u.lo         # position in the shard / unit master
            x, end = base + p0, base + p0 + (b - a)     # storage offsets covered
            j = bisect_right(starts, x) - 1
            while x < end:
                if j < 0 or j >= len(cands) or not cands[j][0] <= x < cands[j][0] + cands[j][1]:
                    raise CheckpointError(f"parameter {name!r}: part of its master is not an optimizer tensor")
                off, n, k = cands[j]
                y = min(end, off + n)
                s = a + (x - base - p0)
                q = x - base
                out.append(Segment(name, s, s + (y - x), u.shard, k, x - off, u.index, q))
                x = y
                j += 1
    return out


def _elementwise(v, t: torch.Tensor) -> bool:
    return torch.is_tensor(v) and v.shape == t.shape


def _piece_states(seg: Segment, masters, states, alias: bool) -> dict:
    """Zero-copy views of a segment's fp32 master and element-wise optimizer states."""
    t = masters[seg.k]
    out = {}
    if not alias:
        out["master"] = piece_view(seg.master(masters))
    st = states.get(t) or {}
    n = seg.b - seg.a
    opt = {key: piece_view(v.view(-1)[seg.mloc:seg.mloc + n]) for key, v in st.items() if _elementwise(v, t)}
    if opt:
        out["optim"] = opt
        blocks = piece_blocks(st, seg.mloc, n)      # block-quantised states: their blocks' absmax
        if blocks is not None:
            out["blocks"] = blocks
    return out


def export_state(part, optimizer=None, parts=None) -> dict:
    """This rank's part of a checkpoint (see the module docstring). With a tier that keeps
    states out of memory and a ``parts`` writer (:class:`zeroplug.checkpoint.PartWriter`) the
    masters and optimizer states stream into one part file per sub-group; without one
    the caller must hold every sub-group in memory for the call and while it uses the result."""
    run = part.run
    owner = run.rank == part.layout_rank        # stage 0: rank 0 writes the (replicated) state
    out = {"meta": checkpoint_meta(part) if run.rank == 0 else None, "pieces": {},
           "optim_scalars": {}, "optim_keys": {}, "optim_groups": [], "extras": {}}
    masters = part.master_params()
    states = optimizer.state if optimizer is not None else {}
    tier, ptier = part.offload_optimizer, part.offload_param
    streamed = parts is not None and part.offload is not None and not tier.capabilities.in_memory
    # units whose shard lives out of memory between uses
    away = {u.index for u in part.units if ptier.absent(u.index)} if parts is not None else set()
    if owner:
        by_k: dict[int, list[tuple[Segment, dict]]] = {}
        for seg in segments(part):
            pc = {"start": seg.a, "end": seg.b}
            if seg.unit not in away:
                pc["param"] = piece_view(seg.lp)
            if not streamed and seg.unit not in away:
                pc.update(_piece_states(seg, masters, states, part.alias))
            else:
                by_k.setdefault(seg.k, []).append((seg, pc))
            out["pieces"].setdefault(seg.name, []).append(pc)
        for k in sorted(by_k):       # one sub-group in memory at a time, straight into its file
            units = sorted({seg.unit for seg, _ in by_k[k]} & away)
            with tier.export(k, optimizer) if streamed else nullcontext():
                for i in units:      # its parameter shards out of memory too, read-only
                    ptier.fetch(i)
                pieces: dict[str, list] = {}
                for seg, pc in by_k[k]:
                    pieces.setdefault(seg.name, []).append(
                        {"start": seg.a, "end": seg.b, **_piece_states(seg, masters, states, part.alias),
                         **({"param": piece_view(seg.lp)} if seg.unit in away else {})})
                name = parts.write(f"sg{k:05d}", pieces)
                del pieces           # the views must not outlive the block (the storages go)
                for i in units:
                    ptier.evict(i)
            for _, pc in by_k[k]:
                pc["part"] = name
        # Note: the element-wise states of every master (an optimizer may hold different ones
        # for different masters: Muon's momentum beside AdamW's two moments); the scalars of
        # the first one, which every master shares
        for t in masters:
            st = states.get(t) or {}
            if st and not out["optim_keys"]:
                out["optim_scalars"] = {k: v for k, v in st.items()
                                        if not _elementwise(v, t) and not is_absmax(st, k)}
            out["optim_keys"].update({k: _dtype_name(v.dtype) for k, v in st.items() if _elementwise(v, t)})
        if optimizer is not None and optimizer.param_groups:    # hyper-parameters: the same in every group
            out["optim_groups"] = [{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}]
    if run.rank == 0:
        # Note: frozen parameters that stage 3 shards are not saved: they come from the model
        # as it is built (from_pretrained); the checkpoint holds what training changes.
        laid_out = {id(p) for u in part.all_units for p in u.params}
        for k, v in part.module.state_dict(keep_vars=True).items():
            if id(v) in laid_out:
                continue
            if torch.is_tensor(v):
                out["extras"][k] = v.detach()
            else:
                log.warning("[zeroplug] checkpoint: state-dict entry %r is not a tensor; not saved", k)
    return out


def import_state(part, states, optimizer=None, load_master: bool = True,
                 load_optimizer_states: bool = True) -> None:
    """Load this rank's part from ``states`` (a :class:`zeroplug.checkpoint.ShardSet`: the
    rank files' ``model`` parts, one at a time), whatever world size wrote them. With a
    tier that keeps states out of memory, masters and optimizer states are filled one
    sub-group at a time (see the module docstring).

    Two walks over the files: the first checks everything this rank will copy (every
    element it needs exactly once, the values and states there, their dtypes, the
    optimizer's hyper-parameters) and changes nothing; then ``states.commit()`` (where
    several ranks agree that all passed); the second copies."""
    where = repr(str(getattr(states, "path", "")))
    check_model(states.meta, checkpoint_meta(part), where)
    want_opt = load_optimizer_states and optimizer is not None
    plan = Plan()       # block-quantised states: which load as they are (decided by the first walk)
    _walk(part, states, optimizer, load_master, want_opt, where, True, plan)
    commit = getattr(states, "commit", None)
    if commit is not None and not getattr(states, "committed", False):
        commit()
    _walk(part, states, optimizer, load_master, want_opt, where, False, plan)


def _walk(part, states, optimizer, load_master: bool, want_opt: bool, where: str, dry: bool, plan: Plan) -> None:
    """One walk over the checkpoint's files (see :func:`import_state`): ``dry`` checks
    without changing anything."""
    segs = segments(part)
    by_name: dict[str, list[tuple[int, Segment]]] = {}
    for j, s in enumerate(segs):
        by_name.setdefault(s.name, []).append((j, s))
    masters = part.master_params()
    ptier = part.offload_param
    streamed = part.offload is not None and not part.offload_optimizer.capabilities.in_memory
    away = {u.index for u in part.units if ptier.absent(u.index)}
    lp_later: dict[int, list] = {}      # unit out of memory -> where its pieces' model-dtype values are
    covered: list[list[tuple[int, int]]] = [[] for _ in segs]
    new_state: list[dict] = [{} for _ in masters]
    opt_filled: dict[tuple[int, str], int] = {}
    opt_seen: dict[str, torch.dtype] = {}
    # streamed: per sub-group, where its pieces are: (source, segment, name, start, end, x, y), where
    # source is the part file's name or the piece's (rank, index) in its rank file (no tensors
    # kept: the files are mapped again, one at a time, when the sub-group is in memory)
    later: list[list] = [[] for _ in masters]
    scalars, keys, groups = None, {}, None
    live = part.module.state_dict(keep_vars=True)

    def fill(seg, name, pc, x, y, st):
        """Master and optimizer states of ``seg``'s elements [x, y) from piece ``pc``."""
        src = slice(x - pc["start"], y - pc["start"])
        d0 = x - seg.a
        full = states.piece_states(name, pc) if load_master or want_opt else pc
        if load_master and not part.alias:
            val = full.get("master", full.get("param", pc.get("param")))
            if val is None:
                raise CheckpointError(f"checkpoint {where}: a piece of {name!r} has no values")
            if not dry:
                seg.master(masters)[d0:d0 + (y - x)].copy_(val[src])
        if want_opt:
            for key, t in full.get("optim", {}).items():
                opt_filled[(seg.k, key)] = opt_filled.get((seg.k, key), 0) + (y - x)
                blocks = source(full, key, t, where)        # block-quantised: (absmax, phase)
                m0 = seg.mloc + d0
                if dry:
                    if opt_seen.setdefault(key, t.dtype) != t.dtype:
                        raise CheckpointError(f"checkpoint {where}: optimizer state {key!r} of {name!r} is "
                                              f"{t.dtype}, elsewhere {opt_seen[key]}")
                    if blocks is not None:
                        plan.check(seg.k, key, masters[seg.k], m0, blocks, src.start, y - x)
                    continue
                if blocks is not None and plan.exact(seg.k, key):
                    if key not in st:
                        codes_buffers(optimizer, masters[seg.k], key, t.dtype, st)
                    fill_exact(st, key, t, blocks, src.start, src.stop, m0)
                    continue
                if blocks is not None:      # blocks cut differently now: decoded, encoded again later
                    if key not in st:
                        st[key] = state_buffer(optimizer, masters[seg.k], key, torch.float32)
                    st[key].view(-1)[m0:m0 + (y - x)].copy_(decode(t, *blocks, src.start, src.stop))
                    continue
                if key not in st:
                    st[key] = state_buffer(optimizer, masters[seg.k], key, t.dtype)
                st[key][m0:m0 + (y - x)].copy_(t[src])

    def take(rank: int, model: dict) -> None:
        """Everything of one rank file that this rank needs now (its locals, which hold
        views of the mapped file, end with the call)."""
        nonlocal scalars, keys, groups
        if want_opt:
            if scalars is None and model.get("optim_keys"):
                scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in model["optim_scalars"].items()}
                keys = dict(model["optim_keys"])
            if groups is None and model.get("optim_groups"):
                groups = model["optim_groups"]
        fname = states.file_of(rank) if hasattr(states, "file_of") else f"rank {rank}'s file"
        for k, v in model.get("extras", {}).items():
            dst = live.get(k)
            if dst is None or not torch.is_tensor(dst):
                raise CheckpointError(f"checkpoint {where}: file {fname} field model.extras[{k!r}] is not an entry "
                                      "of this model's state dict")
            if dst.shape != v.shape or dst.is_floating_point() != v.is_floating_point() or v.is_complex():
                raise CheckpointError(f"checkpoint {where}: file {fname} field model.extras[{k!r}] is "
                                      f"{tuple(v.shape)} {v.dtype}, the model's {tuple(dst.shape)} {dst.dtype}")
            if not dry:
                dst.data.copy_(v)
        for name, pieces in model["pieces"].items():
            for j, seg in by_name.get(name, ()):
                for i, pc in enumerate(pieces):
                    x, y = max(seg.a, pc["start"]), min(seg.b, pc["end"])
                    if x >= y:
                        continue
                    src = slice(x - pc["start"], y - pc["start"])
                    d0 = x - seg.a
                    dst = slice(d0, d0 + (y - x))
                    ref = pc.get("part")
                    source = (1, rank, i) if "param" in pc or not isinstance(ref, str) else (0, ref, 0)
                    if seg.unit in away:     # its shard is out of memory: filled unit by unit
                        lp_later.setdefault(seg.unit, []).append((source, seg, name, pc["start"], pc["end"], x, y))
                    else:                # an alias (one tensor): prefer exact fp32 masters when saved
                        val = _lp_value(states, name, pc, part.alias and load_master)
                        if not dry:
                            seg.lp[dst].copy_(val[src])
                    covered[j].append((x, y))
                    if streamed:           # the masters are out of memory: later
                        source = (0, ref, 0) if isinstance(ref, str) else (1, rank, i)
                        later[seg.k].append((source, seg, name, pc["start"], pc["end"], x, y))
                    elif not part.alias and load_master or want_opt:
                        fill(seg, name, pc, x, y, new_state[seg.k])

    @contextmanager
    def shard_in(u):
        """``u``'s shard in memory for the block; one out of memory is filled from the
        checkpoint first (one unit at a time) and written back by its tier after."""
        if u.index not in away:
            yield
            return
        with ptier.update(u.index):
            for (kind, ref, i), seg, name, a, b, x, y in sorted(lp_later.get(u.index, ()), key=lambda e: e[0]):
                pc = {"start": a, "end": b, "part": ref} if kind == 0 else states.rank_piece(ref, name, i)
                d0 = x - seg.a
                seg.lp[d0:d0 + (y - x)].copy_(_lp_value(states, name, pc, part.alias and load_master)[x - a:y - a])
                del pc
            states.release()
            yield

    with torch.no_grad():
        for rank, model in states.items():
            take(rank, model)
            del model
        states.release()
        for j, s in enumerate(segs):
            check_covered(covered[j], s, where)
        if dry:
            for u, entries in lp_later.items():       # values of shards out of memory: there
                for (kind, ref, i), seg, name, a, b, x, y in sorted(entries, key=lambda e: e[0]):
                    pc = {"start": a, "end": b, "part": ref} if kind == 0 else states.rank_piece(ref, name, i)
                    _lp_value(states, name, pc, part.alias and load_master)
            for k in range(len(masters)):             # masters and states out of memory: there
                for (kind, ref, i), seg, name, a, b, x, y in sorted(later[k], key=lambda e: e[0]):
                    pc = {"start": a, "end": b, "part": ref} if kind == 0 else states.rank_piece(ref, name, i)
                    fill(seg, name, pc, x, y, None)
            states.release()
        elif streamed:
            _fill_streamed(part, states, optimizer, later, new_state, fill, keys if want_opt else {},
                          load_master, shard_in, plan)
        if want_opt:
            need: dict[int, int] = {}
            for s in segs:
                need[s.k] = need.get(s.k, 0) + (s.b - s.a)
            for (k, key), n in opt_filled.items():
                if n != need[k]:
                    raise CheckpointError(f"checkpoint {where}: optimizer state {key!r} is incomplete")
            # a master needs the states its pieces were saved with (each piece holds its
            # master's): none at all, where the checkpoint has some, is a gap
            filled = {k for k, _ in opt_filled}
            if keys and any(k not in filled for k in need):
                raise CheckpointError(f"checkpoint {where}: optimizer states {', '.join(map(repr, keys))} "
                                      "are incomplete")
            if dry:
                check_optimizer(where, optimizer, opt_seen, keys, groups)
                return
            # parameter groups of one's own (model_parameters) keep the settings the engine was
            # built with; the saved ones are one group's
            install_optimizer_state(optimizer, masters, new_state, scalars or {}, keys,
                                     groups if part.groups.plain else None)
    if dry:
        return
    if not streamed:
        _publish(part, shard_in, follow=not load_master)    # module only: masters follow the weights
    else:
        part.gather_after_step()       # published sub-group by sub-group in _fill_streamed
    part.zero_grad()


def _fill_streamed(part, states, optimizer, later, new_state, fill, keys: dict, load_master: bool,
                  shard_in, plan: Plan) -> None:
    """A tier that keeps states out of memory: each sub-group in memory in turn (brought in,
    filled, published to the model-dtype shards, written back), so loading holds one
    sub-group's states at a time."""
    tier = part.offload_optimizer
    masters = part.master_params()
    index = {_storage_key(t): k for k, t in enumerate(masters)}
    units: list[list] = [[] for _ in masters]
    for u in part.units:
        k = index.get(_storage_key(u.master))
        if k is None:
            raise CheckpointError("a unit's master is not a sub-group of the offload tier")
        units[k].append(u)
    part.release_all()
    for k, t in enumerate(masters):
        with tier.import_(k, optimizer):
            st = new_state[k]
            # a sub-group of pieces gets the states its pieces hold (``fill``); one of padding
            # alone, every state the checkpoint has
            for key, dt in (keys.items() if not later[k] else ()):
                if dt in ("int8", "uint8") and plan.exact(k, key):
                    codes_buffers(optimizer, t, key, getattr(torch, dt), st)
                else:
                    st[key] = state_buffer(optimizer, t, key, torch.float32 if dt in ("int8", "uint8")
                                           else getattr(torch, dt))
            for (kind, ref, i), seg, name, a, b, x, y in sorted(later[k], key=lambda e: e[0]):
                # file by file: each part file (or rank file) is mapped once per sub-group
                pc = {"start": a, "end": b, "part": ref} if kind == 0 else states.rank_piece(ref, name, i)
                fill(seg, name, pc, x, y, st)
                del pc
            states.release()                    # unmapped before the next sub-group comes in
            if st:      # the optimizer holds them before the block ends: written out with the master
                convert = getattr(optimizer, "convert_state", None)
                if convert is not None:         # in the optimizer's own form (state_dtype) before it goes out
                    convert(t, st)
                cur = optimizer.state[t]
                for key in [key for key, v in cur.items()
                            if (_elementwise(v, t) or is_absmax(cur, key)) and key not in st]:
                    del cur[key]                # a state the checkpoint does not have
                cur.update(st)
            for u in units[k]:
                with shard_in(u):               # a shard out of memory: filled, published, written back
                    if not load_master:         # module only: masters follow the loaded weights
                        u.master.copy_(u.shard)
                    u.shard.copy_(u.master)


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


