"""A thin layer over ``torch.distributed``.

Note: with world size 1 every call is a no-op that returns a finished handle, so a
single process needs no process group and adds no copies. NCCL runs asynchronous
collectives on its own internal stream and ``handle.wait()`` makes the current
stream wait for them, so launching with ``async_op=True`` is what lets communication
overlap compute on GPU; gloo runs them on its own threads on CPU.
"""
from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist


class _Done:
    """The handle of an operation that had nothing to do."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()

# Note: torch 2.13 renamed the flat-tensor collectives (the old names warn); the
# GPU image has torch 2.11, which only has the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, t: torch.Tensor, op=None, async_op: bool = False):
        if not self.distributed:
            return DONE
        return dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group, async_op=async_op) or DONE

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Sum ``inp`` (world_size x out.numel()) over ranks; this rank's chunk lands in ``out``."""
        if not self.distributed:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return DONE
        return _reduce_scatter_flat(out, inp, group=self.group, async_op=async_op) or DONE

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Every rank's ``inp`` side by side in ``out``; ``inp`` may be this rank's chunk of ``out``."""
        if not self.distributed:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return DONE
        return _all_gather_flat(out, inp, group=self.group, async_op=async_op) or DONE

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """``inp`` cut along dim 0 into world_size equal chunks: chunk j goes to rank j, and
        chunk i of ``out`` comes from rank i (both contiguous, of the same shape)."""
        if not self.distributed:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return DONE
        return dist.all_to_all_single(out, inp, group=self.group, async_op=async_op) or DONE

    def broadcast(self, t: torch.Tensor, src: int = 0):
        if self.distributed:
            dist.broadcast(t, src=src, group=self.group)

    def barrier(self) -> None:
        """Every rank's host waits for the others (a one-element all-reduce read back: no
        guess of the device, unlike torch's barrier with NCCL)."""
        if self.distributed:
            flag = torch.zeros(1, device=self._wire())
            dist.all_reduce(flag, group=self.group)
            flag.item()

    # Note: torch's broadcast_object_list / all_gather_object go through numpy, which a
    # fresh install may lack; pickled bytes in a uint8 tensor need nothing more.
    def _wire(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` from rank ``src`` (a rank in this group) on every rank."""
        if not self.distributed:
            return obj
        import pickle
        dev = self._wire()
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        self.broadcast(size, src=self._global(src))
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if self.rank == src
               else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
        self.broadcast(buf, src=self._global(src))
        if self.rank == src:
            return obj
        host = buf.cpu()
        return pickle.loads(ctypes.string_at(host.data_ptr(), host.numel()))

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, by rank."""
        if not self.distributed:
            return [obj]
        return [self.broadcast_object(obj, src=r) for r in range(self.world_size)]

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def all_reduce_scalar(self, value: float, op=None) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._wire())
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t.item()
