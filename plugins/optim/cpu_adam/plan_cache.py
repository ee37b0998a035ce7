"""The measured CPU plan, cached per machine, torch version and local rank layout.

One small JSON file per key under ``<zeroplug's cache>/cpu_plan/`` (the directory
cpu_adam's kernel cache lives under: :func:`.cache.cache_root`), named by a hash of
the key, which the file repeats. Each local rank has its own key (its set of cores is part
of it), so ranks never write the same file. A file is written to an exclusively created
temporary file and renamed over the old one (:func:`zeroplug.trust.atomic_write`); a file that is not a regular file of this
user, does not parse, or holds another key is ignored with a warning (and measured again).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat

import torch

from zeroplug.trust import atomic_write, make_dirs

from .cache import cache_root
from .topology import Topology, cpu_model, format_cpulist

FORMAT = 1
SUBDIR = "cpu_plan"
#: a plan file is a few hundred bytes; anything much larger is not one
MAX_BYTES = 1 << 16


def directory() -> str:
    return os.path.join(cache_root(), SUBDIR)


def key(topology: Topology, cpus, most: int, grad_dtype, lp_dtype) -> dict:
    """What a measured plan depends on: the machine (CPU model, CPU count, affinity set,
    NUMA nodes), torch's version, the local rank layout and this rank's set and budget."""
    return {"format": FORMAT, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "topology": topology.describe(), "set": format_cpulist(cpus),
            "most": int(most), "grad_dtype": str(grad_dtype), "lp_dtype": str(lp_dtype)}


def path_for(k: dict, where: str | None = None) -> str:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(where or directory(), f"{digest}.json")


def load(k: dict, where: str | None = None) -> tuple[dict | None, str | None]:
    """(the cached entry or None, a warning or None)."""
    try:
        path = path_for(k, where)
    except Exception as e:      # no home directory, ...
        return None, f"cpu plan: no cache directory ({type(e).__name__}: {e}): measuring"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cpu plan: the cache file {path} cannot be read ({e.strerror or e}): measuring again"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None, f"cpu plan: the cache file {path} is not a file of this user: ignored, measuring again"
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        return None, f"cpu plan: the cache file {path} cannot be read ({e.strerror or e}): measuring again"
    finally:
        os.close(fd)
    try:
        if len(data) > MAX_BYTES:
            raise ValueError("too large")
        entry = json.loads(data.decode())
        if not isinstance(entry, dict):
            raise ValueError("not an object")
        if entry.get("key") != k:
            return None, f"cpu plan: the cache file {path} holds another machine's plan: ignored, measuring again"
        threads, rate = entry.get("threads"), entry.get("rate")
        if (not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= k["most"]
                or not isinstance(rate, (int, float)) or not rate > 0):
            raise ValueError("bad threads or rate")
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"cpu plan: the cache file {path} is corrupt ({e}): measuring again"
    return {"threads": threads, "rate": float(rate)}, None


def store(k: dict, entry: dict, where: str | None = None) -> str | None:
    """Write ``entry`` for key ``k``; a warning when it cannot be written, else None."""
    path = None
    try:
        path = path_for(k, where)
        make_dirs(os.path.dirname(path), 0o700)
        atomic_write(path, json.dumps({**entry, "key": k}, sort_keys=True).encode())
    except Exception as e:
        where_ = os.path.dirname(path) if path else "zeroplug's cache directory"
        return (f"cpu plan: cannot write the plan cache in {where_} ({type(e).__name__}: {e}): "
                f"the next run measures again")
    return None
