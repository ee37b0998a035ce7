"""Finding and reading checkpoints: ``latest``, tags, manifests (every field checked) and
the rank and part files, each opened once without following links and loaded from the
bytes that were verified (:class:`ShardSet`); pruning old ones. The layout and the
writing half are :mod:`.files`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from .files import (
    FORMAT, LATEST, MANIFEST, OLD_PREFIX, TMP_PREFIX, CheckpointError, manifest_checksum, plain_name,
)
from zeroplug.trust import torch_load_reason

from .reading import ReadError, VerifiedFile, open_dir, open_regular, read_small

MAX_LATEST = 4096
MAX_MANIFEST = 64 << 20


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
        sealed = m.get("checksum") == manifest_checksum(m)
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


def _allow_open_files(n: int) -> None:
    """Raise this process's soft limit of open files to ``n`` where the hard limit allows."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < n:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


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
        self.committed = False      # commit() was called (its checks exchanged with every rank)
        self.refused = False        # ... and some rank's checks failed
        self._by_rank = {e["rank"]: n for n, e in manifest["files"].items() if "part" not in e}
        if dir_fd is None:
            try:
                dir_fd = open_dir(self.path, follow=False)
            except ReadError as exc:
                raise CheckpointError(f"checkpoint {str(self.path)!r} {exc}") from None
        self._dir = dir_fd
        self._files: dict[str, VerifiedFile] = {}
        _allow_open_files(len(manifest["files"]) + 64)     # each verified file stays open until close()
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
            raise CheckpointError(f"{self._where(name)} cannot be read: {torch_load_reason(exc)}") from None

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
        try:
            agree(self.comm, error)
        except CheckpointError:
            self.refused = True     # nothing changed: a refusal, not a failure midway
            raise

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
