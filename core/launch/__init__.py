"""The process group under a launcher: started by ``zeroplug.initialize`` / ``zeroplug.init``
when torchrun (or the ``deepspeed`` launcher, or any launcher that sets torchrun's variables)
started the ranks and the script did not call ``torch.distributed.init_process_group``.

Note: without it every rank would train alone on its own data with no error; DeepSpeed's
``initialize`` starts the group itself, and scripts written for it never do.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os

import torch
import torch.distributed as dist

from zeroplug.errors import ZeroplugError

log = logging.getLogger("zeroplug")

# the variables torchrun sets for every rank (env:// rendezvous reads them)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 when not launched)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ZeroplugError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; "
                            "launch with torchrun, or unset WORLD_SIZE") from None


def local_rank() -> int:
    """This rank's index on its host (LOCAL_RANK; 0 when not launched)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def local_ranks(env=None) -> int:
    """Ranks on this host: torchrun's / the launchers' LOCAL_WORLD_SIZE (1 when not set)."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        try:
            n = int(str(env.get(key, "")).split("(")[0])
        except ValueError:
            continue
        if n > 0:
            return n
    return 1


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def start_process_group(device_type: str | None = None, backend: str | None = None,
                        timeout: float | datetime.timedelta | None = None, init_method: str | None = None,
                        announce: bool = True, single: bool = False) -> bool:
    """Start the default process group when the launcher's variables say WORLD_SIZE > 1 and
    none is started (``single``: also a group of one rank when a launcher started one
    process, as ``deepspeed.init_distributed`` does); True when distributed. A default gloo
    group, started here or before, is destroyed when the process exits. ``device_type``: the training device's type
    ("cuda" picks nccl, anything else gloo) when ``backend`` is not given; None: cuda when
    available. A group already started is kept as it is. Raises :class:`ZeroplugError` (one
    line) when the variables are incomplete or the group cannot start."""
    if dist.is_available() and dist.is_initialized():
        _destroy_at_exit()
        return dist.get_world_size() > 1
    world = launched_world_size()
    if world < 1 or (world == 1 and not (single and all(os.environ.get(k) for k in LAUNCHER_VARS))):
        return False
    if not dist.is_available():
        raise ZeroplugError(f"WORLD_SIZE={world} but this torch build has no torch.distributed; "
                            "install a torch with distributed support, or run one process")
    missing = [k for k in LAUNCHER_VARS if not os.environ.get(k)] if init_method is None else []
    if missing:
        raise ZeroplugError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the ranks with "
                            "torchrun (it sets RANK, MASTER_ADDR and MASTER_PORT), or call "
                            "torch.distributed.init_process_group yourself before zeroplug.initialize")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = backend or default_backend(device_type)
    if device_type == "cuda" and torch.cuda.is_available():
        # Note: every rank would otherwise train on cuda:0 (torch's current device)
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    if backend == "nccl":
        nccl_fault_handling()
    kw = {}
    if timeout is not None:
        kw["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    try:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None or init_method is not None:
            dist.init_process_group(backend, init_method=init_method, **kw)
        else:
            # Note: torchrun's agent serves one store to every attempt of the job, and the keys the
            # killed attempt's ranks wrote (their addresses) stay in it; a restarted rank may read
            # a dead peer's address there and fail ("Gloo connectFullMesh failed ... Connection
            # refused"). A prefix per attempt keeps the attempts apart.
            store, rank, size = next(dist.rendezvous("env://", **kw))
            store = dist.PrefixStore(f"zeroplug/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kw)
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ZeroplugError(f"could not start the {backend} process group of {world} ranks "
                            f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT="
                            f"{os.environ.get('MASTER_PORT')}): {first}") from None
    _destroy_at_exit()
    if announce and dist.get_rank() == 0 and world > 1:
        log.warning("[zeroplug] started the %s process group of %d ranks from the launcher's "
                    "environment (torch.distributed.init_process_group was not called)", backend, world)
    return world > 1


#: torch's own NCCL fault handling, set where the environment leaves it unset
NCCL_FAULT_HANDLING = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",     # a failed or timed-out collective ends the rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",          # ... after the flight recorder dumps its records
    "TORCH_FR_BUFFER_SIZE": "2000",             # the flight recorder: the last collectives per group
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",     # (its name before torch 2.7)
}


def nccl_fault_handling() -> None:
    """Turn on torch's NCCL fault handling for the group about to start, where the environment
    does not choose: a collective that fails or outlives the process group's timeout ends its
    rank (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, so torchrun's agent ends the others) once torch's
    flight recorder has dumped the group's last collectives (TORCH_NCCL_DEBUG_INFO_TEMP_FILE,
    by default /tmp/nccl_trace_rank_<rank>). docs/reliability.md, section 11."""
    for key, value in NCCL_FAULT_HANDLING.items():
        os.environ.setdefault(key, value)


_DESTROY_AT_EXIT: set[int] = set()     # the groups an exit handler is registered for


def _destroy_at_exit() -> None:
    """Destroy the default gloo group zeroplug runs on (started here or by the script) when
    the process exits, unless the script destroyed it first.

    Note: processes that exit with a gloo group alive abort in about one two-rank run in five
    ("terminate called without an active exception", exit -6, after the script's work is
    done: torch's c10d tears the group down during interpreter finalization), and torchrun
    then reports the job failed. Scripts written for DeepSpeed never destroy the group that
    its ``initialize`` started, nor do the Trainer's and Lightning's loops theirs. NCCL groups
    are left as they are (torch only warns for them, and a rank that exits after an error
    must not wait there for ranks that are gone)."""
    group = dist.group.WORLD
    if group is None or id(group) in _DESTROY_AT_EXIT or dist.get_backend(group) != "gloo":
        return
    _DESTROY_AT_EXIT.add(id(group))

    def destroy() -> None:
        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
    atexit.register(destroy)
