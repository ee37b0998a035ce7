"""The CUDA warm-up ``initialize`` runs (a built-in plugin on ``zeroplug_engine_setup``), so that the first training step costs about what
the later ones do.

Note: a process's first matrix multiply creates cuBLAS's and cuBLASLt's handles and
workspaces, and the first use of each GEMM kernel loads it (CUDA loads modules lazily).
Both land on the first training step, which then takes markedly longer than a steady one;
the kernels cuBLAS picks depend on the row count, so a warm-up at a few rows does not load
those a training batch uses (docs/benchmarks.md, "Cold start and the first steps", has the
figures). The model's inputs are unknown before the first step, so the warm-up runs every
distinct ``nn.Linear`` shape at ``batch.warm_up_rows`` rows on throw-away tensors: no
parameter, gradient or optimizer state is touched, and under stage 3 the modules'
partitioned weights are never gathered (the shapes come from ``in_features`` /
``out_features``).

Note: with several ranks, NCCL sets up an algorithm's connections when a collective first
needs them (NCCL_RUNTIME_CONNECT, on by default since NCCL 2.22) and CUDA loads its kernels
on first use, and the first reduce-scatter of a stage-2 run comes in its first backward. So every rank also runs each
collective the stages use (all-reduce, reduce-scatter, all-gather) once at a small and once
at a large size, in the model's and the reduction's dtypes, on throw-away buffers.
"""
from __future__ import annotations

import logging
import time

import torch

from zeroplug import hookimpl

log = logging.getLogger("zeroplug")

#: the largest output one warm-up matmul allocates; rows are cut to fit (a vocabulary head)
MAX_OUTPUT_BYTES = 512 << 20
#: elements per rank of each warm-up collective: a small message and a large one (NCCL picks
#: its algorithm and protocol by size, and connects each on first use)
COLLECTIVE_ELEMENTS = (1 << 10, 1 << 23)
#: distinct shapes warmed at most (LoRA adapters and the like add many small ones)
MAX_SHAPES = 32


def plan(model: torch.nn.Module, dtype: torch.dtype, rows: int) -> list[tuple[int, int, bool, int]]:
    """``(in_features, out_features, has_bias, rows)`` for each distinct ``nn.Linear`` shape
    of ``model`` in ``modules()`` order (at most ``MAX_SHAPES``), rows cut so that no input
    or output passes ``MAX_OUTPUT_BYTES``."""
    seen: dict[tuple[int, int, bool], None] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            seen.setdefault((m.in_features, m.out_features, m.bias is not None))
    return [(n_in, n_out, bias, max(1, min(rows, MAX_OUTPUT_BYTES // (max(n_in, n_out) * dtype.itemsize))))
            for n_in, n_out, bias in list(seen)[:MAX_SHAPES]]


def run_plan(shapes, dtype: torch.dtype, device: torch.device) -> int:
    """Forward and backward of each planned shape on throw-away zero tensors, after one small
    matmul (cuBLAS's handles); how many shapes ran. A device out of memory stops it early
    (the first step pays for the rest)."""
    done = 0
    try:
        with torch.enable_grad():
            a = torch.zeros(64, 64, device=device, dtype=dtype, requires_grad=True)
            torch.autograd.grad(a @ a, a, grad_outputs=torch.zeros(64, 64, device=device, dtype=dtype))
            for n_in, n_out, bias, r in shapes:
                x = torch.zeros(r, n_in, device=device, dtype=dtype, requires_grad=True)
                w = torch.zeros(n_out, n_in, device=device, dtype=dtype, requires_grad=True)
                b = torch.zeros(n_out, device=device, dtype=dtype, requires_grad=True) if bias else None
                y = torch.nn.functional.linear(x, w, b)
                torch.autograd.grad(y, [x, w] + ([b] if bias else []), grad_outputs=y)
                done += 1
                del x, w, b, y
    except torch.cuda.OutOfMemoryError:
        pass
    return done


def warm_up_collectives(comm, device: torch.device, dtypes) -> int:
    """All-reduce, reduce-scatter and all-gather of each dtype in ``dtypes``, at
    ``COLLECTIVE_ELEMENTS`` elements per rank each, on ``comm``; how many ran (0 with one
    rank). Every rank must call it with the same dtypes, as every collective."""
    if not comm.distributed:
        return 0
    n = 0
    for dtype in dict.fromkeys(dtypes):
        for numel in COLLECTIVE_ELEMENTS:
            shard = torch.zeros(numel, device=device, dtype=dtype)
            full = torch.zeros(numel * comm.world_size, device=device, dtype=dtype)
            comm.all_reduce(shard)
            comm.reduce_scatter(shard, full)
            comm.all_gather(full, shard)
            n += 3
            del shard, full
    return n


def warm_up_cuda(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, rows: int,
                 comm=None, reduce_dtype: torch.dtype = torch.float32) -> None:
    """The warm-up of ``model``'s Linear shapes at ``rows`` rows in ``dtype`` and, with
    several ranks, of ``comm``'s collectives; nothing on a device other than CUDA or with
    ``rows == 0``."""
    if device.type != "cuda" or rows <= 0:
        return
    t0 = time.perf_counter()
    shapes = plan(model, dtype, rows)
    with torch.cuda.device(device):
        done = run_plan(shapes, dtype, device)
        # Note: after an out-of-memory on one rank the others still run the collectives
        # (a rank that skipped them would leave the rest waiting)
        collectives = warm_up_collectives(comm, device, (dtype, reduce_dtype, torch.float32)) if comm else 0
        torch.cuda.synchronize(device)
    if done < len(shapes):
        log.info("[zeroplug] CUDA warm-up: out of device memory after %d of %d Linear shapes; "
                 "the first step loads the rest", done, len(shapes))
    elif comm is None or comm.rank == 0:
        log.info("[zeroplug] CUDA warm-up: cuBLAS set up, %d Linear shape(s) run forward and backward at "
                 "up to %d rows, %d collective(s) in %.2f s (batch.warm_up_rows)", done, rows, collectives,
                 time.perf_counter() - t0)


@hookimpl
def zeroplug_engine_setup(engine):
    """Every rank warms its kernels and collectives before the ranks meet at the end of
    ``initialize`` (``batch.warm_up_rows`` rows per ``nn.Linear`` shape; 0 turns it off)."""
    warm_up_cuda(engine.module, engine.precision.param_dtype, engine.run.device,
                 engine.config.batch.warm_up_rows, engine.run.comm, engine.precision.reduce_dtype)
