"""Checkpoints: sharded, atomic, verified, independent of the world size.

This module is the save / load protocol and the public API. The files themselves (the
directory layout, atomic writes, manifests and sha256 verification, part files, reading
rank files back) are :mod:`.files`; consolidation into one state dict
and export are :mod:`.exporting`; the directory (checked, locked, its space) is
:mod:`.directory`. Their public names are importable from here too.

Saving: rank 0 creates ``<dir>/.tmp-<tag>-<random>`` and broadcasts its name; every rank
writes and fsyncs its file there (hashing the bytes as they are written); the ranks
exchange sizes and digests (which is also the barrier); rank 0 writes the manifest,
fsyncs, renames the directory to ``<dir>/<tag>`` and only then replaces ``latest``. A
crash at any point leaves ``latest`` naming the previous complete checkpoint; a stale
``.tmp-*`` directory is never read and is removed by the next successful save.

A rank file is a dict::

    format, version, rank, world_size
    counters       global_step, micro_step, skipped_steps, lr_step
    precision      precision.state_dict() (the loss scaler)
    rng            torch CPU (+ CUDA device), python random, numpy (if installed)
    client_state   the caller's dict
    plugins        the merged dicts of the zeroplug_checkpoint_state_save hook
    model          the partitioner's part (world-size independent):
        pieces        {param name: [{"start", "end", "param", ["master"], ["optim": {key: t}]}]}
                      the elements [start, end) of the parameter's flattened numbering that
                      this rank owns: model-dtype values, fp32 master values (absent when
                      the master *is* the parameter) and element-wise optimizer states
        optim_scalars per-tensor optimizer state that is not element-wise ("step")
        optim_groups  the optimizer's hyper-parameters (without "params")
        extras        rank 0: state-dict entries outside the partitioned parameters
                      (buffers, frozen parameters of stages 0-2), whole

Pieces are written as zero-copy views whose storage is exactly the piece (DLPack), so a
save needs no second copy of the states and each file holds only what its rank owns.
Loading reads each file once, without following links, and loads it from the bytes it
verified (:mod:`.reading`); every field is checked (:mod:`.validate`) and the partitioner
checks everything it will copy before it copies anything; the ranks agree that all
passed (:meth:`ShardSet.commit`) before any engine changes. Rank files are mapped one
at a time; each loading rank copies out the pieces that intersect what it owns now,
whatever the world size that wrote them.
"""
from __future__ import annotations

import contextvars
import logging
import secrets
import shutil
import time
from pathlib import Path

import torch

from . import directory as checkpoint_dir
from zeroplug.errors import StepFailedError
from .files import (
    FORMAT, LATEST, TMP_PREFIX, CheckpointError, PartWriter, atomic_write_text, fsync_dir, install, rank_file_name,
    write_manifest, write_torch_file,
)
from .loading import (
    ShardSet, agree, newest_verified, open_checkpoint, prune, read_latest, read_manifest, resolve, verify,
)
from .rng import rng_states, set_rng_states
from .validate import Fields, check_like, check_rng
# Re-exported: the engine, the CLI, the zero plugin and the tests import them from here.
from .exporting import consolidate, export  # noqa: F401
from .files import atomic_torch_save, load, piece_view  # noqa: F401

log = logging.getLogger("zeroplug")


_ACTIVE_PARTS: contextvars.ContextVar[PartWriter | None] = contextvars.ContextVar("zeroplug_parts", default=None)


def active_part_writer() -> PartWriter | None:
    """The :class:`PartWriter` of the save in progress (None outside one): for a
    partitioner reached through a subclass's ``checkpoint_state`` that does not pass
    ``parts`` on."""
    return _ACTIVE_PARTS.get()


# --- client state --------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _check_plain(obj, where: str) -> None:
    """Only what ``torch.load(weights_only=True)`` can read back: fail at save time, not at load."""
    if isinstance(obj, _PLAIN) or torch.is_tensor(obj):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise CheckpointError(f"{where}: key {k!r} of type {type(k).__name__} cannot be stored")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint stores only tensors "
        "and plain values (dict, list, tuple, str, int, float, bool, None) so that loading never runs code")


# --- save ------------------------------------------------------------------------------

def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r}: use a plain name (no '/', not starting with '.', "
                              f"not {LATEST!r})")


def _rank_state(engine, client_state, parts: PartWriter) -> dict:
    _check_plain(client_state, "client_state")
    extras = {}
    for d in engine.hook.zeroplug_checkpoint_state_save(engine=engine) or []:
        if d:
            extras.update(d)
    _check_plain(extras, "zeroplug_checkpoint_state_save")
    run = engine.run
    token = _ACTIVE_PARTS.set(parts)
    try:
        model = engine.partitioner.checkpoint_state(engine.optimizer, parts=parts)
    finally:
        _ACTIVE_PARTS.reset(token)
    return {
        "format": FORMAT, "version": 2 if parts.written else 1,
        "rank": run.rank, "world_size": run.world_size,
        "counters": {"global_step": engine.global_step, "micro_step": engine.micro_step,
                     "skipped_steps": engine.skipped_steps, "lr_step": engine.lr_step},
        "precision": engine.precision.state_dict(),
        "rng": rng_states(),
        "client_state": client_state,
        "plugins": extras,
        "model": model,
    }


def _estimate_bytes(engine) -> int:
    """About how many bytes this rank's files of a checkpoint take, from the sizes of its
    states (known before anything is written): model-dtype values, fp32 masters and the
    optimizer's element-wise states of the elements it owns. 0 (logged) when the states
    cannot be sized: the estimate only guards the free-space check, never a save."""
    try:
        part = engine.partitioner
        # Note: one copy of each shard is written: stage 0's (replicated) by rank 0, a grouped
        # run's (zero.shard_group_size) by the ranks whose rank in their shard group is their own
        if not part.writes_states():
            return 0
        psize = torch.empty((), dtype=engine.precision.param_dtype).element_size()
        # Note: an fp32 model whose masters stay on the training device trains the masters
        # themselves (no second copy is saved); an offloaded tier keeps its own fp32 copy.
        aliased = psize == 4 and not engine.offload_optimizer.capabilities.offloaded
        master = 0 if aliased else 4
        total = 0
        for t in part.master_params():
            st = engine.optimizer.state.get(t, {})
            total += t.numel() * (psize + master) + sum(
                v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.shape == t.shape)
        return total
    except (AttributeError, TypeError, NotImplementedError, RuntimeError) as exc:
        log.warning("[zeroplug] checkpoint: the states could not be sized (%s: %s); the free-space check "
                    "before this save counts only the previous checkpoint", type(exc).__name__, exc)
        return 0


def _previous_bytes(save_dir: Path) -> int:
    """The size of the newest complete checkpoint in ``save_dir`` (0 if none)."""
    try:
        files = read_manifest(resolve(save_dir))["files"].values()
        return sum(int(e.get("size", 0)) for e in files)
    except (CheckpointError, OSError, ValueError, TypeError):
        return 0


def _unchanged(save_dir: Path) -> str:
    latest = save_dir / LATEST
    return f"{latest} still names the previous one" if latest.is_file() else "no checkpoint was written"


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    async_save: bool | None = None) -> str:
    """Write ``engine``'s complete training state; every rank must call it. Returns the path.

    ``async_save`` (None: the config's ``checkpoint.async_save``): return once the states
    are taken, and write in the background (:mod:`.background`)."""
    saves = engine.background_saves
    saves.wait()                                # at most one in flight; its failure is raised here
    if async_save is None:
        async_save = engine.config.checkpoint.async_save
    comm = engine.run.comm
    rank = comm.rank
    save_dir = Path(save_dir)
    try:
        engine.partitioner.wait_optimizer()     # an optimizer step still running must end first
    except Exception as exc:                     # noqa: BLE001 - it failed: recorded just below
        engine.run.failed = engine.run.failed or f"the optimizer step failed ({type(exc).__name__}: {exc})"
    # Note: every rank learns whether any rank's step failed (and the sizes) before any
    # writes, so that all refuse together rather than wait for each other.
    nbytes = _estimate_bytes(engine)
    room = saves.room(nbytes) if async_save else None
    status = comm.all_gather_object({"failed": engine.run.failed, "bytes": nbytes, "room": room})
    failed = next((st["failed"] for st in status if st["failed"]), None)
    if failed is not None:
        raise StepFailedError("save_checkpoint", failed if engine.run.failed else f"on another rank, {failed}")
    engine.require_states("save_checkpoint")
    client_state = {} if client_state is None else client_state
    tag = str(tag) if tag is not None else f"global_step{engine.global_step}"
    if engine.micro_steps_in_window:
        log.warning("[zeroplug] save_checkpoint in the middle of gradient accumulation (micro step %d): "
                    "the gradients accumulated so far are not saved", engine.micro_step)
    short = next((st["room"] for st in status if st["room"]), None) if async_save else None
    if short is not None:
        if rank == 0:
            log.warning("[zeroplug] checkpoint %r is saved synchronously: %s", tag, short)
        async_save = False

    plan = None
    need = sum(st["bytes"] for st in status)
    if rank == 0:
        try:
            _check_tag(tag)
            locked = checkpoint_dir.hold(save_dir, engine)   # refused if another run writes there
            need = max(need, _previous_bytes(save_dir))
            checkpoint_dir.check_space(save_dir, need)
            tmp_name = f"{TMP_PREFIX}{tag}-{secrets.token_hex(4)}"
            try:
                (save_dir / tmp_name).mkdir()
            except OSError as exc:
                raise CheckpointError(checkpoint_dir.os_error_message(exc, save_dir / tmp_name, "creating")) from None
            plan = {"tmp": tmp_name, "tag": tag, "locked": locked, "need": need}
        except (OSError, CheckpointError) as exc:
            plan = {"error": str(exc)}
    plan = comm.broadcast_object(plan, src=0)
    if "error" in plan:
        raise CheckpointError(f"checkpoint {tag!r} was not saved: {plan['error']}; {_unchanged(save_dir)}")
    tag, tmp = plan["tag"], save_dir / plan["tmp"]
    job = _Job(engine, save_dir, tag, tmp, plan, save_latest)
    state, failure = None, None
    try:
        parts = PartWriter(tmp, rank)
        state = _rank_state(engine, client_state, parts)
        job.meta = state["model"].pop("meta", None)
        job.parts = parts
    except Exception as exc:    # every rank must reach the exchange, or the others hang
        failure = exc
    if not async_save:
        return job.write(state, failure, comm)
    return saves.launch(engine, job, state, failure)


class _Job:
    """What the writing half of a save needs, taken when the save was called."""

    def __init__(self, engine, save_dir: Path, tag: str, tmp: Path, plan: dict, save_latest: bool):
        self.save_dir, self.tag, self.tmp, self.plan, self.save_latest = save_dir, tag, tmp, plan, save_latest
        self.rank = engine.run.comm.rank
        self.meta, self.parts = None, None
        self.keep_last = engine.config.checkpoint.keep_last
        self.manifest = {"global_step": engine.global_step, "zero": engine.config.slot("zero").name,
                         "precision": engine.config.slot("precision").name}

    def write(self, state, failure, comm) -> str:
        """Write this rank's file, exchange sizes and digests, and (rank 0) install the
        checkpoint; every rank calls it. Raises :class:`CheckpointError` if any rank failed."""
        rank, tmp, tag, save_dir = self.rank, self.tmp, self.tag, self.save_dir
        fname = rank_file_name(rank)
        try:
            if failure is not None:
                raise failure
            size, digest = write_torch_file(state, tmp / fname)
            state = None
            report = {"rank": rank, "file": fname, "size": size, "sha256": digest, "parts": self.parts.written,
                      "error": None}
        except Exception as exc:    # every rank must reach the exchange below, or the others hang
            failure = exc
            why = (checkpoint_dir.os_error_message(exc, tmp / fname, "writing", self.plan["need"])
                   if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}")
            report = {"rank": rank, "file": fname, "error": f"rank {rank}: {why}"}
        reports = comm.all_gather_object(report)
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {tag!r} was not saved ({errors[0]}); "
                                  f"{_unchanged(save_dir)}") from failure
        final = save_dir / tag
        status = None
        if rank == 0:
            try:
                self._finish(reports, comm.world_size)
            except Exception as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                status = (checkpoint_dir.os_error_message(exc, save_dir, "installing the checkpoint in")
                          if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}")
                failure = exc
        status = comm.broadcast_object(status, src=0)
        if status is not None:
            raise CheckpointError(f"checkpoint {tag!r} was not saved: {status}") from failure
        return str(final)

    def _finish(self, reports, world_size: int) -> None:
        """Rank 0: the manifest, the rename, ``latest``, and the old checkpoints pruned."""
        tmp, save_dir, tag = self.tmp, self.save_dir, self.tag
        files = {r["file"]: {"rank": r["rank"], "size": r["size"], "sha256": r["sha256"]} for r in reports}
        for r in reports:
            for w in r["parts"]:
                files[w["file"]] = {"rank": r["rank"], "part": w["part"], "size": w["size"], "sha256": w["sha256"]}
        manifest = {
            "format": FORMAT, "version": 2 if any(r["parts"] for r in reports) else 1,
            "tag": tag, "created": time.time(),
            "global_step": self.manifest["global_step"], "world_size": world_size,
            "zero": self.manifest["zero"], "precision": self.manifest["precision"],
            "files": files,
            "model": self.meta,
        }
        write_manifest(tmp, manifest)
        fsync_dir(tmp)
        install(tmp, save_dir / tag)
        if self.save_latest:
            atomic_write_text(save_dir / LATEST, tag)
        removed = prune(save_dir, self.keep_last, keep={tag}, stale_tmp=self.plan["locked"])
        if removed:
            log.info("[zeroplug] removed old checkpoints %s", ", ".join(removed))


# --- load ------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Restore ``engine`` from a checkpoint (every rank must call it); returns (path, client_state).
    A full load (optimizer states included) is also how an engine whose step failed gets a
    whole state back.

    Every file is read once from what was verified (:class:`ShardSet`) and checked against
    this engine's layout before anything in the engine changes; with several ranks every
    rank's checks must pass (:meth:`ShardSet.commit`). A refused checkpoint leaves the engine
    as it was. Should a load fail after that point, the engine is marked failed: its next
    step refuses until a load succeeds."""
    engine.background_saves.wait()      # a save in flight ends first (its failure is raised)
    failed, engine.run.failed = engine.run.failed, None
    try:
        engine.require_states("load_checkpoint")
    finally:
        engine.run.failed = failed
    comm = engine.run.comm
    shards, own, error = None, None, None
    try:
        shards = open_checkpoint(load_dir, tag, comm)
        own = _own_state(engine, shards, load_module_only)
    except CheckpointError as exc:
        error = str(exc)
    if error is not None:
        if shards is not None:
            shards.close()
        agree(comm, error)          # raises on every rank
    path = shards.path
    midway = None
    with shards:
        if failed is not None:
            _reset_after_failure(engine)
        engine.partitioner.release_all()
        try:
            # Note: the partitioner checks every file against its layout, then calls
            # shards.commit() (every rank agrees) and only then copies.
            engine.partitioner.load_checkpoint_state(
                shards, optimizer=engine.optimizer, load_master=not load_module_only,
                load_optimizer_states=load_optimizer_states and not load_module_only)
        except CheckpointError as exc:
            if shards.refused:      # some rank's checks failed: nothing changed
                raise
            if not shards.committed:
                error = str(exc)
            else:
                midway = exc
        except Exception as exc:    # noqa: BLE001 - a file its checks missed: one line, not a traceback
            if shards.refused:
                raise
            if not shards.committed:
                error = f"checkpoint {str(path)!r} does not fit this engine ({_one_line(exc)})"
            else:
                midway = exc
        if not shards.committed:
            shards.commit(error)    # raises on every rank when any rank's checks failed
    if midway is None:
        try:
            _apply_own(engine, own, load_module_only, load_lr_scheduler_states, comm.rank < shards.world_size)
        except Exception as exc:    # noqa: BLE001 - reported by every rank below
            midway = exc
    client_state = own["client_state"]
    del own
    # every rank learns whether all finished (also the barrier at the end of a load)
    errors = comm.all_gather_object(None if midway is None else _one_line(midway))
    bad = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if bad is not None:
        r, e = bad
        engine.run.failed = (f"loading checkpoint {str(path)!r} failed after it was checked "
                             f"({'' if r == comm.rank else f'rank {r}: '}{e}); the engine holds part of it")
        raise CheckpointError(f"{engine.run.failed}: load a checkpoint again before training") from midway
    if load_optimizer_states and not load_module_only:
        engine.run.failed = None    # every state is the checkpoint's now
    return str(path), client_state


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}" if not isinstance(exc, CheckpointError) \
        else (text[0] if text else "")


def _own_state(engine, shards: ShardSet, load_module_only: bool) -> dict:
    """This rank's counters, scaler, RNG and hook states from its rank file, checked against
    the engine (nothing applied yet)."""
    rank = engine.run.comm.rank
    r = rank if rank < shards.world_size else 0
    obj = shards.load_rank(r)
    where = f"checkpoint {str(shards.path)!r}: file {shards.file_of(r)}"
    # copies: a tensor of the mapped file would keep all of it mapped while the partitioner loads
    own = _copied({k: obj[k] for k in ("counters", "precision", "rng", "plugins", "client_state")})
    del obj
    if not load_module_only:
        like = engine.precision.state_dict()
        if like and own["precision"]:
            check_like(own["precision"], like, Fields(where), "precision")
        else:       # another precision's state (fp32 keeps none): the engine keeps its own
            own["precision"] = None
        if rank < shards.world_size:
            check_rng(own["rng"], Fields(where))
    return own


def _copied(obj):
    """``obj`` with every tensor in it copied out of its file."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def _apply_own(engine, own: dict, load_module_only: bool, load_lr_scheduler_states: bool, own_rng: bool) -> None:
    if not load_module_only:
        c = own["counters"]
        engine.global_step, engine.micro_step = c["global_step"], c["micro_step"]
        engine.skipped_steps = c["skipped_steps"]
        if load_lr_scheduler_states:
            engine.lr_step = c["lr_step"]
        if own["precision"] is not None:
            engine.precision.load_state_dict(own["precision"])
        if own_rng:
            set_rng_states(own["rng"])
        engine.hook.zeroplug_checkpoint_state_load(engine=engine, states=own["plugins"])
    engine.set_lr(engine.scheduler.lr_at(engine.lr_step))


def resume(engine, load_dir, tag=None, fallback: bool = False):
    """Load the checkpoint to continue from; every rank must call it. Returns ``(path,
    client_state)``, or None when ``tag`` is None and ``load_dir`` holds no checkpoint at all
    (a tag asked for by name that is not there is an error).

    ``tag`` None means the one ``latest`` names. When that cannot be loaded (``latest``
    missing or corrupt, the tag missing or failing verification), ``fallback`` loads the
    newest checkpoint that verifies instead (logged); without it the
    :class:`CheckpointError` says what is wrong and its ``newest`` attribute names that
    checkpoint (None if none verifies). An unverified checkpoint is never loaded."""
    comm = engine.run.comm
    root = Path(load_dir)
    empty = None
    if comm.rank == 0:
        empty = not root.is_dir() or not ((root / LATEST).exists() or _has_tags(root))
    if comm.broadcast_object(empty, src=0) and tag is None:
        return None
    try:
        return load_checkpoint(engine, root, tag)
    except CheckpointError as exc:
        first = exc
    found = newest_verified(root) if comm.rank == 0 else None
    newest, problems = comm.broadcast_object(found, src=0)
    if newest is not None and newest == (tag if tag is not None else _named_by_latest(root)):
        newest = None               # it verifies, yet it does not load: no other to offer
    if newest is None or not fallback:
        err = CheckpointError(str(first))
        err.newest, err.problems = newest, problems
        raise err from None
    log.warning("[zeroplug] %s; resuming from %s, the newest checkpoint that verifies", first, newest)
    return load_checkpoint(engine, root, newest)


def _named_by_latest(root: Path) -> str | None:
    try:
        return read_latest(root)
    except (CheckpointError, OSError):
        return None


def _has_tags(root: Path) -> bool:
    return any(not d.name.startswith(".") and (d / "manifest.json").is_file() for d in root.iterdir())


def _reset_after_failure(engine) -> None:
    """Before loading into an engine whose step failed: let whatever that step left in
    flight finish (its errors are known already) and drop its gradients."""
    try:
        engine.partitioner.wait_optimizer()
    except Exception as exc:        # noqa: BLE001 - the failure the load repairs
        log.debug("[zeroplug] load_checkpoint: the failed step's work in flight ended with %r", exc)
    engine.partitioner.zero_grad()


__all__ = ["CheckpointError", "atomic_torch_save", "load", "save_checkpoint", "load_checkpoint", "resume",
           "consolidate", "export", "prune", "resolve", "verify", "ShardSet", "PartWriter"]
