"""The loss of a sequence whose tokens are spread over a group of ranks.

Each rank sums the cross entropy of its own tokens; the loss of the sample is that sum over the
group divided by the group's count of real tokens (``ignore_index`` and padding excluded), as
one process computes the mean over the whole sequence.

Note: the ZeRO stage averages gradients over every rank (it divides by the world size W),
while the sequence's gradient is the *sum* of the P slices' gradients, and the data-parallel
average is over W / P groups. So each rank's loss carries the factor P:
``P x local_sum / group_count``; summed over the group's P ranks and divided by W, that is the
mean over the W / P samples of each sample's mean loss, what W / P data-parallel ranks of whole
sequences would train. The value each rank returns is the group's loss itself (the same on
the P ranks, for logging): ``P x local_sum / count`` plus the detached difference to it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import SequenceGroup


def group_mean(local_sum: torch.Tensor, local_count: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """The loss of a sample from this rank's summed loss and real-token count (see the module)."""
    if not group.distributed:
        return local_sum / local_count.clamp(min=1).to(local_sum.dtype)
    stats = torch.stack((local_sum.detach().float(), local_count.float()))
    group.comm.all_reduce(stats)
    count = stats[1].clamp(min=1)
    scaled = local_sum * (group.degree / count)
    return scaled + (stats[0] / count - scaled.detach())


def shift_labels(labels: torch.Tensor, group: SequenceGroup, ignore_index: int) -> torch.Tensor:
    """The next token's label at each position of this rank's slice of ``labels [B, s]`` (Hugging
    Face's convention: labels equal the inputs, the model shifts them): the last position takes
    the first label of the next rank's slice (the group's last rank: ``ignore_index``)."""
    B = labels.shape[0]
    first = labels[:, :1].contiguous()
    if group.distributed:
        everyone = torch.empty((group.degree, B, 1), dtype=labels.dtype, device=labels.device)
        group.comm.all_gather(everyone.view(-1), first.view(-1))
        nxt = everyone[group.rank + 1] if group.rank + 1 < group.degree else torch.full_like(first, ignore_index)
    else:
        nxt = torch.full_like(first, ignore_index)
    return torch.cat((labels[:, 1:], nxt), dim=1)


def tokens_max(local: int, comm, device: torch.device) -> int:
    """The most tokens any rank of ``comm`` holds in this forward (every rank calls it: one
    all-reduce and one read back)."""
    if not comm.distributed:
        return local
    t = torch.tensor([local], dtype=torch.int64, device=device if comm.backend == "nccl" else "cpu")
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
