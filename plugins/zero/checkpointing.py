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

Loading is :mod:`.loader`'s.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from zeroplug.checkpoint import piece_view

from .segments import Segment, checkpoint_meta, dtype_name, segments
from .state_blocks import is_absmax, piece_blocks

log = logging.getLogger("zeroplug")


def copy_tensors(obj):
    """``obj`` (nested dicts, lists, tuples) with every tensor cloned."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_tensors(v) for v in obj)
    return obj


def elementwise(v, t: torch.Tensor) -> bool:
    return torch.is_tensor(v) and v.shape == t.shape


def _piece_states(seg: Segment, masters, states, alias: bool) -> dict:
    """Zero-copy views of a segment's fp32 master and element-wise optimizer states."""
    t = masters[seg.k]
    out = {}
    if not alias:
        out["master"] = piece_view(seg.master(masters))
    st = states.get(t) or {}
    n = seg.b - seg.a
    opt = {key: piece_view(v.view(-1)[seg.mloc:seg.mloc + n]) for key, v in st.items() if elementwise(v, t)}
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
                                        if not elementwise(v, t) and not is_absmax(st, k)}
            out["optim_keys"].update({k: dtype_name(v.dtype) for k, v in st.items() if elementwise(v, t)})
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
