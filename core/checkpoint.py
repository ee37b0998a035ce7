"""Checkpoints: sharded, atomic, verified, independent of the world size.

A checkpoint directory::

    <dir>/latest                 the newest complete tag (written last: temp file, fsync, rename)
    <dir>/<tag>/manifest.json    format, counters, the model's parameter names / shapes / dtype,
                                 each file's size and sha256 (and its own checksum)
    <dir>/<tag>/rank_00000.pt    one file per rank (``torch.save``; read with ``weights_only=True``)
    <dir>/<tag>/rank_00000.sg00003.pt
                                 part files of a rank (format version 2): states written one
                                 sub-group at a time (the nvme tier streams them from its swap
                                 files); listed in the manifest with "part" (and size, sha256)

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
Loading memory-maps one rank file at a time; each loading rank copies out the pieces
that intersect what it owns now, whatever the world size that wrote them.

Part files (version 2): a piece may carry ``"part": "rank_00000.sg00003.pt"`` instead of
its "master" / "optim" tensors; that file (``format``, ``version``, ``rank``, ``part``,
``pieces``) holds, under the same name and [start, end), a piece with exactly those
tensors. The partitioner writes part files through the :class:`PartWriter` that
``checkpoint_state(optimizer, parts=...)`` receives; :meth:`ShardSet.piece_states`
resolves a piece either way. Checkpoints without part files are written as version 1.
"""
from __future__ import annotations

import contextvars
import hashlib
import inspect
import json
import logging
import os
import random
import re
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

from .errors import ZeroplugError

log = logging.getLogger("zeroplug")

FORMAT = "zeroplug-checkpoint"
VERSION = 2             # the newest format this reads; a save without part files writes version 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


class CheckpointError(ZeroplugError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this model."""


# --- files -----------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path) -> None:
    """``torch.save`` to ``path`` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename, fsync the directory)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)          # mkstemp's 0600 would hide it from other users
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path, map_location="cpu", mmap: bool = False):
    """Load a file written by zeroplug; never executes code (``weights_only=True``)."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        n = self.f.write(b)
        self.size += len(memoryview(b).cast("B"))
        return n

    def flush(self) -> None:
        self.f.flush()


def write_torch_file(obj, path) -> tuple[int, str]:
    """``torch.save`` ``obj`` into a new file, fsynced; returns (size, sha256) of its bytes."""
    with open(path, "xb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return w.size, w.sha.hexdigest()


def file_sha256(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def part_file_name(rank: int, label: str) -> str:
    return f"rank_{rank:05d}.{label}.pt"


_LABEL = re.compile(r"^[a-z][a-z0-9]{0,31}$")


class PartWriter:
    """Writes a rank's part files into the checkpoint being saved (each fsynced and hashed as
    it is written), so that a partitioner can stream states that are not all in memory."""

    def __init__(self, directory: Path, rank: int):
        self.directory, self.rank = Path(directory), rank
        self.written: list[dict] = []       # {"file", "part", "size", "sha256"}

    def write(self, label: str, pieces: dict) -> str:
        """Write ``pieces`` ({param name: [piece, ...]}) as part ``label`` (e.g. "sg00003");
        returns the file name, which the rank file's pieces name under "part"."""
        if not _LABEL.match(label) or any(w["part"] == label for w in self.written):
            raise CheckpointError(f"part label {label!r}: use a new lower-case alphanumeric name")
        name = part_file_name(self.rank, label)
        obj = {"format": FORMAT, "version": VERSION, "rank": self.rank, "part": label, "pieces": pieces}
        size, digest = write_torch_file(obj, self.directory / name)
        self.written.append({"file": name, "part": label, "size": size, "sha256": digest})
        return name


_ACTIVE_PARTS: contextvars.ContextVar[PartWriter | None] = contextvars.ContextVar("zeroplug_parts", default=None)


def active_part_writer() -> PartWriter | None:
    """The :class:`PartWriter` of the save in progress (None outside one): for a
    partitioner reached through a subclass's ``checkpoint_state`` that does not pass
    ``parts`` on."""
    return _ACTIVE_PARTS.get()


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def piece_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory whose storage is exactly ``t`` (no copy), so that
    ``torch.save`` writes only these elements rather than the whole underlying buffer."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()
    return torch.from_dlpack(t)


# --- RNG ---------------------------------------------------------------------------

def rng_states() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        st = np.random.get_state(legacy=False)
        out["numpy"] = {"bit_generator": st["bit_generator"],
                        "key": torch.from_numpy(st["state"]["key"].astype("int64")),
                        "pos": int(st["state"]["pos"]), "has_gauss": int(st["has_gauss"]),
                        "gauss": float(st["gauss"])}
    return out


def set_rng_states(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    if "numpy" in st:
        try:
            import numpy as np
        except ImportError:
            return
        n = st["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": n["key"].numpy().astype("uint32"), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})


# --- collectives (no-ops on one rank) --------------------------------------------------

def _broadcast(comm, obj):
    return comm.broadcast_object(obj, src=0)


def _all_gather(comm, obj) -> list:
    return comm.all_gather_object(obj)


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


def _partitioner_call(engine, name):
    fn = getattr(engine.partitioner, name, None)
    if fn is None:
        raise CheckpointError(f"the ZeRO plugin {type(engine.partitioner).__name__} does not support "
                              f"checkpoints (it has no {name}() method)")
    return fn


def _rank_state(engine, client_state, parts: PartWriter | None = None) -> dict:
    _check_plain(client_state, "client_state")
    extras = {}
    for d in engine.hook.zeroplug_checkpoint_state_save(engine=engine) or []:
        if d:
            extras.update(d)
    _check_plain(extras, "zeroplug_checkpoint_state_save")
    run = engine.run
    export = _partitioner_call(engine, "checkpoint_state")
    token = _ACTIVE_PARTS.set(parts)
    try:
        model = export(engine.optimizer, parts=parts) if parts is not None and _accepts(export, "parts") \
            else export(engine.optimizer)
    finally:
        _ACTIVE_PARTS.reset(token)
    return {
        "format": FORMAT, "version": 2 if parts is not None and parts.written else 1,
        "rank": run.rank, "world_size": run.world_size,
        "counters": {"global_step": engine.global_step, "micro_step": engine.micro_step,
                     "skipped_steps": engine.skipped_steps, "lr_step": engine.lr_step},
        "precision": engine.precision.state_dict(),
        "rng": rng_states(),
        "client_state": client_state,
        "plugins": extras,
        "model": model,
    }


def _manifest_checksum(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    manifest = dict(manifest, checksum=_manifest_checksum(manifest))
    with open(directory / MANIFEST, "x") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to its tag (an existing tag is replaced)."""
    old = None
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{secrets.token_hex(4)}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tags_by_age(save_dir: Path) -> list[Path]:
    found = []
    for d in save_dir.iterdir():
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        try:
            step = int(json.loads((d / MANIFEST).read_text()).get("global_step", -1))
        except (OSError, ValueError):
            step = -1
        found.append((step, d.stat().st_mtime, d.name, d))
    return [d for *_, d in sorted(found)]


def prune(save_dir, keep_last: int, keep=()) -> list[str]:
    """Delete all but the ``keep_last`` newest checkpoints (and the tags in ``keep``) and
    stale temporary directories of interrupted saves; returns the removed names."""
    save_dir = Path(save_dir)
    removed = []
    for d in save_dir.iterdir():
        if d.is_dir() and (d.name.startswith(TMP_PREFIX) or d.name.startswith(OLD_PREFIX)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    if keep_last > 0:
        tags = _tags_by_age(save_dir)
        keep = set(keep) | {d.name for d in tags[-keep_last:]}
        latest = save_dir / LATEST
        if latest.is_file():
            keep.add(latest.read_text().strip())
        for d in tags:
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    return removed


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True) -> str:
    """Write ``engine``'s complete training state; every rank must call it. Returns the path."""
    engine._require_states("save_checkpoint")
    comm = engine.run.comm
    rank = comm.rank
    save_dir = Path(save_dir)
    client_state = {} if client_state is None else client_state
    tag = str(tag) if tag is not None else f"global_step{engine.global_step}"
    if engine.micro_step % engine.gradient_accumulation_steps:
        log.warning("[zeroplug] save_checkpoint in the middle of gradient accumulation (micro step %d): "
                    "the gradients accumulated so far are not saved", engine.micro_step)

    plan = None
    if rank == 0:
        try:
            _check_tag(tag)
            save_dir.mkdir(parents=True, exist_ok=True)
            tmp_name = f"{TMP_PREFIX}{tag}-{secrets.token_hex(4)}"
            (save_dir / tmp_name).mkdir()
            plan = {"tmp": tmp_name, "tag": tag}
        except (OSError, CheckpointError) as exc:
            plan = {"error": str(exc)}
    plan = _broadcast(comm, plan)
    if "error" in plan:
        raise CheckpointError(f"cannot save checkpoint in {save_dir}: {plan['error']}")
    tag, tmp = plan["tag"], save_dir / plan["tmp"]

    fname = rank_file_name(rank)
    meta, failure = None, None
    try:
        parts = PartWriter(tmp, rank)
        state = _rank_state(engine, client_state, parts)
        meta = state["model"].pop("meta", None)
        size, digest = write_torch_file(state, tmp / fname)
        del state
        report = {"rank": rank, "file": fname, "size": size, "sha256": digest, "parts": parts.written,
                  "error": None}
    except Exception as exc:    # every rank must reach the exchange below, or the others hang
        failure = exc
        report = {"rank": rank, "file": fname, "error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    reports = _all_gather(comm, report)
    errors = [r["error"] for r in reports if r["error"]]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint {tag!r} was not saved ({errors[0]}); "
                              f"{save_dir / LATEST} still names the previous one") from failure

    final = save_dir / tag
    status = None
    if rank == 0:
        try:
            files = {r["file"]: {"rank": r["rank"], "size": r["size"], "sha256": r["sha256"]} for r in reports}
            for r in reports:
                for w in r["parts"]:
                    files[w["file"]] = {"rank": r["rank"], "part": w["part"], "size": w["size"],
                                        "sha256": w["sha256"]}
            manifest = {
                "format": FORMAT, "version": 2 if any(r["parts"] for r in reports) else 1,
                "tag": tag, "created": time.time(),
                "global_step": engine.global_step, "world_size": comm.world_size,
                "zero": engine.config.slot("zero").name, "precision": engine.config.slot("precision").name,
                "files": files,
                "model": meta,
            }
            write_manifest(tmp, manifest)
            fsync_dir(tmp)
            _install(tmp, final)
            if save_latest:
                atomic_write_text(save_dir / LATEST, tag)
            removed = prune(save_dir, engine.config.checkpoint.keep_last, keep={tag})
            if removed:
                log.info("[zeroplug] removed old checkpoints %s", ", ".join(removed))
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            status = f"{type(exc).__name__}: {exc}"
            failure = exc
    status = _broadcast(comm, status)
    if status is not None:
        raise CheckpointError(f"checkpoint {tag!r} was not saved: {status}") from failure
    return str(final)


# --- load ------------------------------------------------------------------------------

def resolve(load_dir, tag=None) -> Path:
    """The directory of checkpoint ``tag`` under ``load_dir`` (``latest`` when tag is None).
    ``load_dir`` may also be a tag directory itself (it holds a manifest)."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        if (root / MANIFEST).is_file():
            return root
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no checkpoint in {str(root)!r}: there is no {LATEST!r} file "
                                  "(no save completed there); pass tag= to choose one")
        tag = latest.read_text().strip()
        if not tag or "/" in tag or "\\" in tag or tag.startswith("."):
            raise CheckpointError(f"{str(latest)!r} names {tag!r}, which is not a checkpoint tag")
    path = root / str(tag)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(tag)!r} not found in {str(root)!r}")
    return path


def read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is missing (an incomplete save, "
                              "or not a zeroplug checkpoint)")
    try:
        m = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not a zeroplug manifest")
    if m.get("checksum") != _manifest_checksum(m):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt (checksum mismatch)")
    if m.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {m['version']}; this zeroplug "
                              f"reads up to {VERSION}: upgrade zeroplug")
    return m


def _file_problem(path: Path, name: str, entry: dict, hash_it: bool) -> str | None:
    f = path / name
    if not f.is_file():
        return f"checkpoint {str(path)!r}: file {name} is missing"
    size = f.stat().st_size
    if size != entry["size"]:
        return f"checkpoint {str(path)!r}: file {name} is corrupt (size {size}, manifest says {entry['size']})"
    if hash_it and file_sha256(f) != entry["sha256"]:
        return f"checkpoint {str(path)!r}: file {name} is corrupt (sha256 differs from the manifest)"
    return None


def verify(path: Path, manifest: dict, comm=None) -> None:
    """Check every file against the manifest; with several ranks each hashes a share of the files."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    names = sorted(manifest["files"])
    problems = [p for i, n in enumerate(names)
                if (p := _file_problem(path, n, manifest["files"][n], i % world == rank))]
    if comm is not None:
        problems = sorted({p for ps in _all_gather(comm, problems) for p in ps})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


class ShardSet:
    """The rank files of one verified checkpoint, read one at a time (memory-mapped), and
    their part files, opened (memory-mapped) when a piece names one."""

    PARTS_OPEN = 1          # part files kept mapped for the pieces that follow

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest
        self.meta = manifest["model"]
        self.world_size = int(manifest["world_size"])
        self._by_rank = {e["rank"]: n for n, e in manifest["files"].items() if "part" not in e}
        self._parts: OrderedDict[str, dict] = OrderedDict()
        self._open: tuple[int, dict] | None = None

    def piece_states(self, name: str, pc: dict) -> dict:
        """The piece of parameter ``name`` that holds ``pc``'s "master" / "optim" tensors:
        ``pc`` itself, or its copy in the part file it names."""
        ref = pc.get("part")
        if ref is None:
            return pc
        index = self._part(ref)
        found = index.get((name, pc["start"], pc["end"]))
        if found is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: part file {ref} has no piece "
                                  f"[{pc['start']}, {pc['end']}) of {name!r}")
        return found

    def _part(self, ref) -> dict:
        hit = self._parts.get(ref)
        if hit is not None:
            self._parts.move_to_end(ref)
            return hit
        entry = self.manifest["files"].get(ref) if isinstance(ref, str) else None
        if entry is None or "part" not in entry:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: a piece names the part file {ref!r}, "
                                  f"which {MANIFEST} does not list")
        try:
            obj = load(self.path / ref, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: file {ref} cannot be read: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("pieces"), dict):
            raise CheckpointError(f"checkpoint {str(self.path)!r}: file {ref} is not a zeroplug part file")
        index = {(n, p["start"], p["end"]): p for n, ps in obj["pieces"].items() for p in ps}
        self._parts[ref] = index
        while len(self._parts) > self.PARTS_OPEN:
            self._parts.popitem(last=False)
        return index

    def rank_piece(self, rank: int, name: str, i: int) -> dict:
        """Piece ``i`` of parameter ``name`` in rank ``rank``'s file (the last file asked for
        stays mapped, so that asking in rank order opens each file once)."""
        if self._open is None or self._open[0] != rank:
            self._open = None
            self._open = (rank, self.load_rank(rank)["model"])
        try:
            return self._open[1]["pieces"][name][i]
        except (KeyError, IndexError):
            raise CheckpointError(f"checkpoint {str(self.path)!r}: rank {rank}'s file has no piece {i} "
                                  f"of {name!r}") from None

    def release(self) -> None:
        """Unmap the files still open."""
        self._parts.clear()
        self._open = None

    def load_rank(self, rank: int) -> dict:
        name = self._by_rank.get(rank)
        if name is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: no file for rank {rank}")
        try:
            obj = load(self.path / name, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: file {name} cannot be read: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: file {name} is not a zeroplug rank file")
        return obj

    def items(self):
        """(rank, ``model`` part) of each rank file; the previous one is released before the
        next is opened."""
        for r in sorted(self._by_rank):
            obj = self.load_rank(r)
            model = obj["model"]
            del obj
            yield r, model
            del model

    def __iter__(self):
        """Each rank file's ``model`` part, one at a time (see :meth:`items`)."""
        for _, model in self.items():
            yield model
            del model


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Restore ``engine`` from a checkpoint (every rank must call it); returns (path, client_state)."""
    engine._require_states("load_checkpoint")
    comm = engine.run.comm
    path = resolve(load_dir, tag)
    manifest = read_manifest(path)
    verify(path, manifest, comm)
    shards = ShardSet(path, manifest)
    engine.partitioner.release_all()
    _partitioner_call(engine, "load_checkpoint_state")(
        shards, optimizer=engine.optimizer, load_master=not load_module_only,
        load_optimizer_states=load_optimizer_states and not load_module_only)
    shards.release()
    rank = comm.rank
    own = shards.load_rank(rank if rank < shards.world_size else 0)
    if not load_module_only:
        c = own["counters"]
        engine.global_step, engine.micro_step = c["global_step"], c["micro_step"]
        engine.skipped_steps = c["skipped_steps"]
        if load_lr_scheduler_states:
            engine.lr_step = c["lr_step"]
        engine.precision.load_state_dict(own["precision"])
        if rank < shards.world_size:
            set_rng_states(own["rng"])
        engine.hook.zeroplug_checkpoint_state_load(engine=engine, states=own["plugins"])
    engine._set_lr(engine.scheduler.lr_at(engine.lr_step))
    client_state = own["client_state"]
    del own
    comm.barrier()
    return str(path), client_state


# --- export ----------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint metadata")
    return dt


def consolidate(load_dir, tag=None) -> dict:
    """The full model state dict (model dtype, the model's own names), read from the
    checkpoint files alone: no engine, no model class, no process group."""
    path = resolve(load_dir, tag)
    manifest = read_manifest(path)
    verify(path, manifest)
    shards = ShardSet(path, manifest)
    meta = shards.meta
    full = {n: torch.empty(int(torch.Size(p["shape"]).numel()), dtype=_dtype(p["dtype"]))
            for n, p in meta["params"].items()}
    filled = dict.fromkeys(full, 0)
    extras = {}
    for model in shards:
        for name, pieces in model["pieces"].items():
            if name not in full:
                raise CheckpointError(f"checkpoint {str(path)!r}: pieces of {name!r}, which the manifest "
                                      "does not list")
            for pc in pieces:
                full[name][pc["start"]:pc["end"]].copy_(pc["param"])
                filled[name] += pc["end"] - pc["start"]
        for k, v in model.get("extras", {}).items():
            extras[k] = v.clone()
    for name, t in full.items():
        if filled[name] != t.numel():
            raise CheckpointError(f"checkpoint {str(path)!r} holds {filled[name]} of the {t.numel()} elements "
                                  f"of {name!r}")
    out = {}
    for key, name in meta["state_dict"]:
        if name is None:
            if key not in extras:
                raise CheckpointError(f"checkpoint {str(path)!r}: state-dict entry {key!r} is missing")
            out[key] = extras[key]
        else:
            out[key] = full[name].view(meta["params"][name]["shape"])
    return out


def export(load_dir, out_path, tag=None) -> str:
    """Write the consolidated model state dict to ``out_path``: ``.safetensors`` (needs the
    safetensors package) or anything else as a ``torch.save`` file (``.pt``)."""
    out_path = Path(out_path)
    if out_path.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(f"{out_path}: writing .safetensors needs the safetensors package "
                                  "(pip install safetensors); or export to a .pt file") from None
        sd = consolidate(load_dir, tag)
        seen, flat = set(), {}
        for k, v in sd.items():      # safetensors refuses shared tensors: tied weights get a copy
            ptr = v.untyped_storage().data_ptr()
            flat[k] = v.clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
        os.close(fd)
        try:
            save_file(flat, tmp)
            os.replace(tmp, out_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    else:
        atomic_torch_save(consolidate(load_dir, tag), out_path)
    return str(out_path)


__all__ = ["CheckpointError", "atomic_torch_save", "load", "save_checkpoint", "load_checkpoint",
           "consolidate", "export", "prune", "resolve", "verify", "ShardSet", "PartWriter"]
