"""``deepspeed.comm`` for scripts: the collectives they call, straight over ``torch.distributed``.

Every function works in one process without a process group too (rank 0 of 1; collectives
leave the tensors as they are), as a script run with plain ``python`` expects.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zeroplug.launch import local_rank, start_process_group

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_backend", "barrier", "all_reduce", "broadcast", "all_gather",
           "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "gather", "scatter",
           "all_gather_object", "broadcast_object_list", "new_group", "get_global_rank", "destroy_process_group"]


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """Start the process group from the launcher's environment (torchrun's variables), with
    ``dist_backend`` or the device's (nccl on CUDA, gloo otherwise). One process without a
    launcher needs none: nothing happens; one rank started by a launcher gets a group of one,
    as DeepSpeed starts it. A group already started is kept."""
    if dist_init_required is False:
        return
    if rank >= 0 and world_size > 0:
        import os
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    start_process_group(None, backend=dist_backend, timeout=timeout, init_method=init_method,
                        announce=False, single=True)


def is_initialized() -> bool:
    return _on()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if _on() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if _on() else 1


def get_local_rank() -> int:
    return local_rank()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if _on() and group is not None else group_rank


def get_backend(group=None) -> str | None:
    return dist.get_backend(group) if _on() else None


def barrier(group=None, async_op: bool = False, device_ids=None):
    if _on():
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if _on():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if _on():
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if _on():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False):
    if _on():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if _on():
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    output_tensor.copy_(input_tensor.reshape(output_tensor.shape))


allgather_fn = all_gather_into_tensor


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    if _on():
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(input_tensor.reshape(output_tensor.shape))


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    if _on():
        return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)
    if gather_list:
        gather_list[0].copy_(tensor)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    if _on():
        return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)
    if scatter_list:
        tensor.copy_(scatter_list[0])


def all_gather_object(object_list: list, obj, group=None) -> None:
    if _on():
        dist.all_gather_object(object_list, obj, group=group)
    else:
        object_list[0] = obj


def broadcast_object_list(object_list: list, src: int = 0, group=None, device=None) -> None:
    if _on():
        dist.broadcast_object_list(object_list, src, group=group, device=device)


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks, **kwargs) if _on() else None


def destroy_process_group(group=None) -> None:
    if _on():
        dist.destroy_process_group(group)
