"""The data side of sequence parallelism: each rank of a group gets its slice of the sample.

:func:`shard_batch` cuts one batch of whole sequences (the same on the group's ranks) into
this rank's slice: the sequence is padded to a multiple of the group's size, the labels are
shifted to the next token before the cut (a slice's last position is labelled with the next
slice's first token, which the next rank holds), and padding becomes ``ignore_index`` in the
labels. Right padding needs no attention mask: attention is causal, so no real token attends
to the padding after it. :class:`ShardedLoader` does it for a loader whose ranks each load
their own samples (a ``DistributedSampler`` over every rank, as DeepSpeed's
UlyssesSPDataLoaderAdapter takes): each of the group's samples is sharded in turn.
"""
from __future__ import annotations

import torch

from .groups import SequenceGroup

#: keys whose dim 1 is the sequence (everything else is passed on as it is)
SEQUENCE_KEYS = ("input_ids", "idx", "inputs_embeds", "labels", "shift_labels", "targets", "position_ids",
                 "attention_mask")


def _pad(t: torch.Tensor, length: int, value) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    shape = (t.shape[0], length - t.shape[1], *t.shape[2:])
    return torch.cat((t, torch.full(shape, value, dtype=t.dtype, device=t.device)), dim=1)


def shard_batch(batch: dict, rank: int, degree: int, ignore_index: int = -100, pad_token_id: int = 0) -> dict:
    """This rank's slice (``rank`` of ``degree``) of a batch of whole sequences.

    ``batch``: a dict with ``input_ids`` (or ``idx`` / ``inputs_embeds``), ``[B, S]``, and
    optionally ``labels`` (Hugging Face's: equal to the inputs; shifted here into
    ``shift_labels``), ``shift_labels`` or ``targets`` (already the next token's),
    ``position_ids`` (default ``0 .. S-1``) and ``attention_mask`` (right padding only: its
    zeros become ignored labels; dropped). Other keys pass through. Returns a new dict with
    ``position_ids`` always set."""
    ids_key = next((k for k in ("input_ids", "idx", "inputs_embeds") if batch.get(k) is not None), None)
    if ids_key is None:
        raise ValueError("shard_batch: the batch has no input_ids (or idx / inputs_embeds)")
    ids = batch[ids_key]
    B, S = ids.shape[:2]
    out = {k: v for k, v in batch.items() if k not in SEQUENCE_KEYS}
    mask = batch.get("attention_mask")
    real = None
    if mask is not None:
        real = mask.bool()
        ends = real.sum(1)
        if not bool((real == (torch.arange(S, device=mask.device) < ends.unsqueeze(1))).all()):
            raise ValueError("shard_batch: attention_mask is not right padding (ones, then zeros): left padding "
                             "and packed sequences are not supported under sequence parallelism")
    if batch.get("labels") is not None:
        labels = batch["labels"]
        if real is not None:
            labels = labels.masked_fill(~real, ignore_index)
        targets_key, targets = "shift_labels", torch.cat(
            (labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)), dim=1)
    elif batch.get("shift_labels") is not None or batch.get("targets") is not None:
        targets_key = "shift_labels" if batch.get("shift_labels") is not None else "targets"
        targets = batch[targets_key]
        if real is not None:
            targets = targets.masked_fill(~real, ignore_index)
    else:
        targets_key = targets = None
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(S, device=ids.device).unsqueeze(0).expand(B, -1)
    length = -(-S // degree) * degree
    s = length // degree
    lo, hi = rank * s, (rank + 1) * s
    pad = pad_token_id if ids_key != "inputs_embeds" else 0.0
    out[ids_key] = _pad(ids, length, pad)[:, lo:hi]
    if targets is not None:
        out[targets_key] = _pad(targets, length, ignore_index)[:, lo:hi]
    # Note: padding continues the positions (a model with learned positions needs valid indices;
    # the padded tokens' outputs are never used: they come last and their labels are ignored)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(B, -1)
    extra = torch.arange(S, length, device=positions.device).unsqueeze(0).expand(B, -1)
    out["position_ids"] = torch.cat((positions, extra), dim=1)[:, lo:hi]
    return out


class ShardedLoader:
    """Wraps a loader whose batches are dicts of whole sequences, different on every rank: the
    group's ranks exchange their batches and each yields its slice of the first rank's, then
    of the second's, ... (``degree`` slices per loaded batch). Every rank of a group must
    load as many batches."""

    def __init__(self, loader, group: SequenceGroup, ignore_index: int = -100, pad_token_id: int = 0):
        self.loader, self.group = loader, group
        self.ignore_index, self.pad_token_id = ignore_index, pad_token_id

    def __len__(self):
        return len(self.loader) * self.group.degree

    def __iter__(self):
        g = self.group
        for batch in self.loader:
            if not g.distributed:
                yield shard_batch(batch, 0, 1, self.ignore_index, self.pad_token_id)
                continue
            host = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            everyone = g.comm.all_gather_object(host)
            device = next((v.device for v in batch.values() if torch.is_tensor(v)), torch.device("cpu"))
            for theirs in everyone:
                on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in theirs.items()}
                yield shard_batch(on_device, g.rank, g.degree, self.ignore_index, self.pad_token_id)
