"""Checkpoint files: the on-disk layout, atomic writes, manifests and verification.

A checkpoint directory::

    <dir>/latest                 the newest complete tag (written last: temp file, fsync, rename)
    <dir>/<tag>/manifest.json    format, counters, the model's parameter names / shapes / dtype,
                                 each file's size and sha256 (and its own checksum)
    <dir>/<tag>/rank_00000.pt    one file per rank (``torch.save``; read with ``weights_only=True``)
    <dir>/<tag>/rank_00000.sg00003.pt
                                 part files of a rank (format version 2): states written one
                                 sub-group at a time (the nvme tier streams them from its swap
                                 files); listed in the manifest with "part" (and size, sha256)

Part files (version 2): a piece may carry ``"part": "rank_00000.sg00003.pt"`` instead of
its "master" / "optim" tensors; that file (``format``, ``version``, ``rank``, ``part``,
``pieces``) holds, under the same name and [start, end), a piece with exactly those
tensors. The partitioner writes part files through the :class:`PartWriter` that
``checkpoint_state(optimizer, parts=...)`` receives; :meth:`ShardSet.piece_states`
resolves a piece either way. Checkpoints without part files are written as version 1.

The save / load protocol that uses these is :mod:`zeroplug.checkpoint`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import torch

from zeroplug.errors import ZeroplugError

from .reading import ReadError, VerifiedFile, open_dir, open_regular, read_small

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


def _atomic_write(path, write, mode: str) -> None:
    """``write(f)`` into ``path`` so that a crash leaves either the old file or the new one
    (temporary file, fsync, rename, fsync the directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)          # mkstemp's 0600 would hide it from other users
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj, path) -> None:
    """``torch.save`` to ``path`` atomically."""
    _atomic_write(path, lambda f: torch.save(obj, f), "wb")


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    _atomic_write(path, lambda f: f.write(text), "w")


def load(path, map_location="cpu", mmap: bool = False):
    """Load a file written by zeroplug; never executes code (``weights_only=True``)."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b) -> int:
        self.sha.update(b)
        try:
            n = self.f.write(b)
        except OSError as exc:
            self.error = exc        # torch.save reports it as "unexpected pos": keep the cause
            raise
        self.size += len(memoryview(b).cast("B"))
        return n

    def flush(self) -> None:
        self.f.flush()


def write_torch_file(obj, path) -> tuple[int, str]:
    """``torch.save`` ``obj`` into a new file, fsynced; returns (size, sha256) of its bytes.
    A failed write raises the ``OSError`` (ENOSPC, EIO, ...) with the file's path."""
    w = None
    try:
        with open(path, "xb") as f:
            w = _HashingWriter(f)
            try:
                torch.save(obj, w)
            except RuntimeError:
                if w.error is None:
                    raise
                raise w.error from None
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
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

def piece_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory whose storage is exactly ``t`` (no copy), so that
    ``torch.save`` writes only these elements rather than the whole underlying buffer."""
    t = t.detach()
    if not t.is_contiguous():
        return t.contiguous()
    return torch.from_dlpack(t)


# --- manifest ------------------------------------------------------------------------

def _manifest_checksum(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    manifest = dict(manifest, checksum=_manifest_checksum(manifest))
    with open(directory / MANIFEST, "x") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# --- directories ---------------------------------------------------------------------

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


def _manifest_step(d: Path) -> int:
    """The global step a tag's manifest gives (-1 if it cannot say); read without following links."""
    try:
        fd = open_dir(d, follow=False)
        try:
            step = json.loads(read_small(fd, MANIFEST, MAX_MANIFEST)).get("global_step", -1)
        finally:
            os.close(fd)
        return step if isinstance(step, int) and not isinstance(step, bool) else -1
    except (OSError, ReadError, ValueError, TypeError, AttributeError, RecursionError):
        return -1


def _tags_by_age(save_dir: Path) -> list[Path]:
    found = []
    for d in save_dir.iterdir():
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        step = _manifest_step(d)
        found.append((step, d.stat().st_mtime, d.name, d))
    return [d for *_, d in sorted(found)]


def prune(save_dir, keep_last: int, keep=(), stale_tmp: bool = True) -> list[str]:
    """Delete all but the ``keep_last`` newest checkpoints (and the tags in ``keep``) and,
    with ``stale_tmp``, the temporary directories of interrupted saves; returns the removed
    names. Note: only the holder of the directory's lock may pass ``stale_tmp``: it alone
    writes there, so every temporary directory it did not make belongs to a dead run."""
    save_dir = Path(save_dir)
    removed = []
    for d in save_dir.iterdir() if stale_tmp else ():
        if d.is_dir() and (d.name.startswith(TMP_PREFIX) or d.name.startswith(OLD_PREFIX)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    if keep_last > 0:
        tags = _tags_by_age(save_dir)
        keep = set(keep) | {d.name for d in tags[-keep_last:]}
        try:
            keep.add(read_latest(save_dir))
        except (OSError, CheckpointError):
            pass
        for d in tags:
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    return removed


# --- reading -------------------------------------------------------------------------

MAX_LATEST = 4096
MAX_MANIFEST = 64 << 20


def plain_name(name) -> bool:
    """A name that stays inside its directory: no separators, not hidden, not '..'."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name
            and "\0" not in name and not name.startswith(".") and name.isprintable())


def _root_fd(root: Path) -> int:
    try:
        return open_dir(root)
    except ReadError as exc:
        if "missing" in str(exc) or "not a directory" in str(exc):
            raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist") from None
        raise CheckpointError(f"checkpoint directory {str(root)!r} {exc}") from None


def read_latest(root: Path, root_fd: int | None = None) -> str:
    """The tag that ``<root>/latest`` names (CheckpointError if it is missing, a link, or
    garbage). Read without following links; what a refused file holds is never echoed."""
    root = Path(root)
    latest = root / LATEST
    fd = _root_fd(root) if root_fd is None else root_fd
    try:
        data = read_small(fd, LATEST, MAX_LATEST)
    except ReadError as exc:
        if str(exc) == "is missing":
            raise CheckpointError(f"no checkpoint in {str(root)!r}: there is no {LATEST!r} file "
                                  "(no save completed there); pass tag= to choose one") from None
        raise CheckpointError(f"{str(latest)!r} {exc} (it must be a regular file naming a checkpoint "
                              "tag)") from None
    finally:
        if root_fd is None:
            os.close(fd)
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if tag is None or not tag.isprintable():
        raise CheckpointError(f"{str(latest)!r} is corrupt: {len(data)} bytes of binary data, not the name "
                              "of a checkpoint")
    if len(tag) > 255 or not plain_name(tag):
        raise CheckpointError(f"{str(latest)!r} names {tag[:80]!r}, which is not a checkpoint tag in "
                              f"{str(root)!r} (a plain name: no '/', not starting with '.')")
    return tag


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def open_tag(load_dir, tag=None) -> tuple[Path, int]:
    """The directory of checkpoint ``tag`` under ``load_dir`` (``latest`` when tag is None)
    and a descriptor of it, opened without following a link. ``load_dir`` may also be a tag
    directory itself (it holds a manifest). A tag that leads outside ``load_dir`` (a path, or
    a symbolic link) is refused. The caller closes the descriptor."""
    root = Path(load_dir)
    root_fd = _root_fd(root)
    try:
        if tag is None:
            if _lstat(MANIFEST, root_fd) is not None:      # whatever it is: read_manifest says
                return root, os.dup(root_fd)
            tag = read_latest(root, root_fd)
        elif not plain_name(str(tag)):
            raise CheckpointError(f"checkpoint tag {str(tag)!r}: use a plain name inside {str(root)!r}")
        path = root / str(tag)
        try:
            return path, open_dir(str(tag), dir_fd=root_fd, follow=False)
        except ReadError as exc:
            st = _lstat(str(tag), root_fd)
            if "symbolic link" in str(exc) or st is not None and stat.S_ISLNK(st.st_mode):
                raise CheckpointError(f"checkpoint {str(tag)!r} in {str(root)!r} is a link to "
                                      f"{os.path.realpath(path)!r}, outside the checkpoint directory; "
                                      "refused") from None
            raise CheckpointError(f"checkpoint {str(tag)!r} not found in {str(root)!r}") from None
    finally:
        os.close(root_fd)


def resolve(load_dir, tag=None) -> Path:
    """The directory of checkpoint ``tag`` under ``load_dir`` (see :func:`open_tag`)."""
    path, fd = open_tag(load_dir, tag)
    os.close(fd)
    return path


def newest_verified(root) -> tuple[str | None, list[str]]:
    """The newest checkpoint under ``root`` whose manifest and files verify (by global step,
    then time) and what is wrong with each newer one. Hashes every file it checks."""
    root = Path(root)
    problems = []
    if not root.is_dir():
        return None, problems
    for d in reversed(_tags_by_age(root)):
        try:
            path = resolve(root, d.name)
            verify(path, read_manifest(path))
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        return d.name, problems
    return None, problems


def read_manifest(path: Path, dir_fd: int | None = None) -> dict:
    """``<path>/manifest.json``, read without following a link, its checksum and every field
    checked (one line naming the field when one is wrong)."""
    path = Path(path)
    fd = open_dir(path) if dir_fd is None else dir_fd
    try:
        data = read_small(fd, MANIFEST, MAX_MANIFEST)
    except ReadError as exc:
        if str(exc) == "is missing":
            raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is missing (an incomplete save, "
                                  "or not a zeroplug checkpoint)") from None
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} {exc}") from None
    finally:
        if dir_fd is None:
            os.close(fd)
    try:
        m = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0][:120]
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt ({why})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is not a zeroplug manifest")
    try:
        sealed = m.get("checksum") == _manifest_checksum(m)
    except (TypeError, ValueError, RecursionError):
        sealed = False
    if not sealed:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt (checksum mismatch)")
    # Note: imported here: the checks use this module's names
    from .validate import check_manifest
    check_manifest(m, f"checkpoint {str(path)!r}: {MANIFEST}")
    return m


def _file_problem(path: Path, dir_fd: int, name: str, entry: dict, hash_it: bool) -> str | None:
    try:
        fd, st = open_regular(dir_fd, name)
    except ReadError as exc:
        return f"checkpoint {str(path)!r}: file {name} {exc}"
    try:
        if st.st_size != entry.get("size"):
            return (f"checkpoint {str(path)!r}: file {name} is corrupt (size {st.st_size}, manifest says "
                    f"{entry.get('size')})")
        if hash_it:
            h = hashlib.sha256()
            while b := os.read(fd, 1 << 22):
                h.update(b)
            if h.hexdigest() != entry.get("sha256"):
                return f"checkpoint {str(path)!r}: file {name} is corrupt (sha256 differs from the manifest)"
    finally:
        os.close(fd)
    return None


def verify(path: Path, manifest: dict, comm=None) -> None:
    """Check every file against the manifest; with several ranks each hashes a share of the
    files. Loading checks each file again as it reads it (:class:`ShardSet`): this is for
    finding a checkpoint that verifies, not for what is loaded."""
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    names = sorted(manifest["files"])
    try:
        dir_fd = open_dir(path, follow=False)
    except ReadError as exc:
        problems = [f"checkpoint {str(path)!r} {exc}"]
    else:
        try:
            problems = [p for i, n in enumerate(names)
                        if (p := _file_problem(path, dir_fd, n, manifest["files"][n], i % world == rank))]
        finally:
            os.close(dir_fd)
    if comm is not None:
        problems = sorted({p for ps in comm.all_gather_object(problems) for p in ps})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def load_error(exc: BaseException) -> str:
    """One line for why ``torch.load`` refused a file (its own message runs over lines and
    suggests ``weights_only=False``, which a checkpoint from elsewhere must never get)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    pick = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler error" in ln),
                lines[0] if lines else type(exc).__name__)
    if "weights_only" in pick.lower() or "Weights only load failed" in pick:
        pick = "it holds something other than tensors and plain values"
    return pick[:200]


class ShardSet:
    """The rank files of one checkpoint and their part files, each opened once (no links),
    verified against the manifest as it is read and checked for the layout the manifest
    declares (:mod:`.validate`); each is then loaded from the verified bytes, as often as
    a caller walks it, never by name again. Rank files are read one at a time (mapped);
    part files when a piece names one.

    With several ranks, :meth:`commit` is where they agree: a loader calls it after every
    check and before changing anything, and it raises on every rank when any rank found a
    problem. :meth:`close` lets the files go."""

    def __init__(self, path: Path, manifest: dict, dir_fd: int | None = None, comm=None):
        self.path, self.manifest = Path(path), manifest
        self.meta = manifest["model"]
        self.world_size = int(manifest["world_size"])
        self.comm = comm
        self.committed = False
        self._by_rank = {e["rank"]: n for n, e in manifest["files"].items() if "part" not in e}
        if dir_fd is None:
            try:
                dir_fd = open_dir(self.path, follow=False)
            except ReadError as exc:
                raise CheckpointError(f"checkpoint {str(self.path)!r} {exc}") from None
        self._dir = dir_fd
        self._files: dict[str, VerifiedFile] = {}
        self._checked: set[str] = set()
        self._part_open: tuple[str, dict] | None = None     # the last part file asked for stays mapped
        self._open: tuple[int, dict] | None = None

    def _where(self, name: str) -> str:
        return f"checkpoint {str(self.path)!r}: file {name}"

    def _read(self, name: str):
        vf = self._files.get(name)
        if vf is None:
            if self._dir is None:
                raise CheckpointError(f"{self._where(name)}: the checkpoint was closed")
            entry = self.manifest["files"][name]
            try:
                vf = VerifiedFile(self._dir, name, entry["size"], entry["sha256"])
            except ReadError as exc:
                raise CheckpointError(f"{self._where(name)} {exc}") from None
            except OSError as exc:
                raise CheckpointError(f"{self._where(name)} cannot be read ({exc.strerror or exc})") from None
            self._files[name] = vf
        try:
            return vf.load()
        except Exception as exc:       # noqa: BLE001 - whatever torch says about a bad file: one line
            raise CheckpointError(f"{self._where(name)} cannot be read: {load_error(exc)}") from None

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
        if self._part_open is not None and self._part_open[0] == ref:
            return self._part_open[1]
        entry = self.manifest["files"].get(ref) if isinstance(ref, str) else None
        if entry is None or "part" not in entry:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: a piece names the part file {ref!r}, "
                                  f"which {MANIFEST} does not list")
        self._part_open = None
        obj = self._read(ref)
        if ref not in self._checked:
            from .validate import check_part_file
            check_part_file(obj, self._where(ref), self.manifest, ref)
            self._checked.add(ref)
        index = {(n, p["start"], p["end"]): p for n, ps in obj["pieces"].items() for p in ps}
        self._part_open = (ref, index)
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
        """Unmap the files still open (they stay verified: a later read maps them again)."""
        self._part_open = None
        self._open = None

    def load_rank(self, rank: int) -> dict:
        name = self._by_rank.get(rank)
        if name is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: no file for rank {rank}")
        obj = self._read(name)
        if name not in self._checked:
            from .validate import check_rank_file
            check_rank_file(obj, self._where(name), self.manifest, rank)
            self._checked.add(name)
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

    def file_of(self, rank: int) -> str:
        """The name of rank ``rank``'s file."""
        name = self._by_rank.get(rank)
        if name is None:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: no file for rank {rank}")
        return name

    def commit(self, error: str | None = None) -> None:
        """Every check of this rank has passed (``error`` None) or failed; with several ranks
        they all learn whether every one passed (:func:`agree`). Raises (on every rank) if
        any failed; after it, the caller may change its engine."""
        if self.committed:
            raise CheckpointError("ShardSet.commit: called twice")
        self.committed = True
        agree(self.comm, error)

    def close(self) -> None:
        """Let every file go."""
        self.release()
        for vf in self._files.values():
            vf.close()
        self._files.clear()
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:       # noqa: BLE001 - interpreter shutdown
            pass


def agree(comm, error: str | None) -> None:
    """Every rank passes whether its checks failed (``error``); raises on every rank, with
    the first rank's reason, when any did. A collective: every rank must call it."""
    if comm is not None and getattr(comm, "world_size", 1) > 1:
        errors = comm.all_gather_object(error)
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is not None:
            r, e = first
            raise CheckpointError(e if r == comm.rank else f"rank {r}: {e}")
    elif error is not None:
        raise CheckpointError(error)


def open_checkpoint(load_dir, tag=None, comm=None) -> ShardSet:
    """Checkpoint ``tag`` of ``load_dir`` (``latest`` when None) as a :class:`ShardSet`: its
    directory opened without following a link and its manifest read and checked through that
    descriptor. Close it (or use it in a ``with`` block)."""
    path, fd = open_tag(load_dir, tag)
    try:
        manifest = read_manifest(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return ShardSet(path, manifest, fd, comm)
