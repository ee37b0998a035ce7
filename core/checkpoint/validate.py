"""What a manifest, a rank file and a part file may hold, checked before anything uses them.

A manifest that verifies says only that nobody changed it since it was sealed; whoever can
write the directory can seal one of their own. So every field is checked for what it can
be (types, ranges, the sizes the files can hold) and every rank and part file for the
layout the manifest declares (keys, tensors where tensors belong, their dtypes, and
exactly the elements ``[start, end)`` a piece claims), each refusal one line naming the
file and the field. Whether the checkpoint fits a given engine is the loader's check.
"""
from __future__ import annotations

import logging
import math
import re

import torch

from ..quantized_states import BLOCK
from ..quantized_states import CODE_DTYPES as CODE_DTYPE_LIST
from .files import FORMAT, VERSION, CheckpointError, plain_name

log = logging.getLogger("zeroplug")

MAX_WORLD = 1 << 20
MAX_COUNT = 1 << 62
MAX_NUMEL = 1 << 48
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
_SHA = re.compile(r"^[0-9a-f]{64}$")
RANK_KEYS = {"format", "version", "rank", "world_size", "counters", "precision", "rng", "client_state",
             "plugins", "model"}
COUNTERS = ("global_step", "micro_step", "skipped_steps", "lr_step")
MODEL_KEYS = {"pieces", "optim_scalars", "optim_keys", "optim_groups", "extras"}
PIECE_KEYS = {"start", "end", "param", "master", "optim", "blocks", "part"}
#: 8-bit codes of block-quantised optimizer states (zeroplug.quantized_states), with their absmax
CODE_DTYPES = {str(d).replace("torch.", ""): d for d in CODE_DTYPE_LIST}
PART_KEYS = {"format", "version", "rank", "part", "pieces"}


def show(v) -> str:
    """A value as a message may quote it: one line, bounded, control characters escaped."""
    if torch.is_tensor(v):
        return f"a {str(v.dtype).replace('torch.', '')} tensor of shape {tuple(v.shape)}"
    try:
        r = repr(v)
    except Exception as exc:    # noqa: BLE001 - a value whose repr fails is still named
        log.debug("repr of a %s failed: %r", type(v).__name__, exc)
        r = f"a {type(v).__name__}"
    r = r.encode("ascii", "backslashreplace").decode()
    return r if len(r) <= 60 else r[:57] + "..."


class Fields:
    """Refusals that name a file and a field: ``Fields(where)("counters.global_step", "...")``."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, field: str, problem: str):
        raise CheckpointError(f"{self.where} field {field} {problem}")

    def int_(self, field: str, v, lo: int = 0, hi: int = MAX_COUNT) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self(field, f"= {show(v)}: not an integer")
        if not lo <= v <= hi:
            self(field, f"= {v}: out of range [{lo}, {hi}]")
        return v

    def dict_(self, field: str, v) -> dict:
        if not isinstance(v, dict):
            self(field, f"= {show(v)}: not a table (dict)")
        return v

    def keys(self, field: str, d: dict, required, allowed) -> None:
        for k in required:
            if k not in d:
                self(f"{field}{'.' if field else ''}{k}", "is missing")
        for k in d:
            if k not in allowed:
                self(f"{field}{'.' if field else ''}{show(k)}", "is not one this file can hold")

    def number(self, field: str, v) -> None:
        if torch.is_tensor(v):
            if v.numel() != 1 or v.is_complex():
                self(field, f"= {show(v)}: not a single number")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self(field, f"= {show(v)}: not a number")
        if not math.isfinite(v):
            self(field, f"= {show(v)}: not a finite number")


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


# --- the manifest ------------------------------------------------------------------------------

def check_manifest(m: dict, where: str) -> None:
    """Every field a load reads, checked (``where``: ``checkpoint '<dir>': manifest.json``)."""
    bad = Fields(where)
    v = m.get("version", 1)
    if isinstance(v, int) and not isinstance(v, bool) and v > VERSION:
        raise CheckpointError(f"{where} has format version {v}; this zeroplug reads up to {VERSION}: "
                              "upgrade zeroplug")
    bad.int_("version", v, 1, VERSION)
    world = bad.int_("world_size", m.get("world_size"), 1, MAX_WORLD)
    if "global_step" in m:
        bad.int_("global_step", m["global_step"])
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        bad("files", f"= {show(files)}: lists no files")
    ranks: dict[int, str] = {}
    total = 0
    for name, e in files.items():
        if not plain_name(name):
            raise CheckpointError(f"{where} names the file {show(name)}, which is outside the checkpoint; refused")
        f = f"files[{show(name)}]"
        bad.dict_(f, e)
        r = bad.int_(f"{f}.rank", e.get("rank"), 0, world - 1)
        total += bad.int_(f"{f}.size", e.get("size"), 0, MAX_COUNT)
        if not isinstance(e.get("sha256"), str) or not _SHA.match(e["sha256"]):
            bad(f"{f}.sha256", f"= {show(e.get('sha256'))}: not a sha256 digest")
        if "part" in e:
            if not isinstance(e["part"], str) or not re.match(r"^[a-z][a-z0-9]{0,31}$", e["part"]):
                bad(f"{f}.part", f"= {show(e['part'])}: not a part label")
        elif r in ranks:
            bad(f, f"is a second file of rank {r} (also {ranks[r]})")
        else:
            ranks[r] = name
    for r in range(world):
        if r not in ranks:
            bad("files", f"has no file of rank {r} (world_size is {world})")
    model = bad.dict_("model", m.get("model"))
    params = bad.dict_("model.params", model.get("params"))
    need = 0
    for name, p in params.items():
        f = f"model.params[{show(name)}]"
        if not isinstance(name, str):
            bad(f, "is not named by a string")
        bad.dict_(f, p)
        shape = p.get("shape")
        if not isinstance(shape, list) or len(shape) > 16:
            bad(f"{f}.shape", f"= {show(shape)}: not a list of dimensions")
        numel = 1
        for d in shape:
            numel *= bad.int_(f"{f}.shape", d, 0, MAX_NUMEL)
            if numel > MAX_NUMEL:
                bad(f"{f}.shape", f"= {show(shape)}: {numel} elements is more than {MAX_NUMEL}")
        dt = p.get("dtype")
        if not isinstance(dt, str) or dt not in DTYPES:
            bad(f"{f}.dtype", f"= {show(dt)}: not one of {', '.join(DTYPES)}")
        aliases = p.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            bad(f"{f}.aliases", f"= {show(aliases)}: not a list of names")
        need += numel * DTYPES[dt].itemsize
    if need > total:
        bad("model.params", f"declare {_size(need)} of values; the checkpoint's files hold {_size(total)}")
    sd = model.get("state_dict")
    if not isinstance(sd, list):
        bad("model.state_dict", f"= {show(sd)}: not a list")
    for i, entry in enumerate(sd):
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not (entry[1] is None or isinstance(entry[1], str) and entry[1] in params)):
            bad(f"model.state_dict[{i}]", f"= {show(entry)}: not a [key, parameter name or null] pair")


# --- rank and part files ---------------------------------------------------------------------

def _check_pieces(bad: Fields, pieces, params: dict, manifest_files: dict, rank: int, in_part: bool) -> None:
    bad.dict_("pieces" if in_part else "model.pieces", pieces)
    base = "pieces" if in_part else "model.pieces"
    for name, ps in pieces.items():
        f = f"{base}[{show(name)}]"
        if name not in params:
            bad(f, "is not a parameter the manifest lists")
        if not isinstance(ps, list):
            bad(f, f"= {show(ps)}: not a list of pieces")
        p = params[name]
        numel = math.prod(p["shape"])
        dtype = DTYPES[p["dtype"]]
        for i, pc in enumerate(ps):
            g = f"{f}[{i}]"
            bad.dict_(g, pc)
            bad.keys(g, pc, ("start", "end"), PIECE_KEYS - ({"part"} if in_part else set()))
            a = bad.int_(f"{g}.start", pc["start"], 0, numel)
            b = bad.int_(f"{g}.end", pc["end"], 0, numel)
            if b <= a:
                bad(g, f"= [{a}, {b}): an empty range")
            n = b - a
            for key, want in (("param", dtype), ("master", torch.float32)):
                if key in pc:
                    _range_tensor(bad, f"{g}.{key}", pc[key], n, want)
            if "optim" in pc:
                bad.dict_(f"{g}.optim", pc["optim"])
                coded = _check_blocks(bad, g, pc, n)
                for key, t in pc["optim"].items():
                    if not isinstance(key, str):
                        bad(f"{g}.optim", f"has the key {show(key)}, not a name")
                    _range_tensor(bad, f"{g}.optim[{show(key)}]", t, n, None, coded=key in coded)
            if "part" in pc:
                ref = pc["part"]
                e = manifest_files.get(ref) if isinstance(ref, str) else None
                if e is None or "part" not in e or e.get("rank") != rank:
                    bad(f"{g}.part", f"= {show(ref)}: not a part file of rank {rank} that the manifest lists")
            elif not in_part and "param" not in pc:
                bad(g, "has no values (no 'param' and no 'part')")


def _check_blocks(bad: Fields, g: str, pc: dict, n: int) -> set:
    """A piece's ``blocks`` (the absmax of its block-quantised optimizer states): the keys it covers."""
    if "blocks" not in pc:
        return set()
    blocks = bad.dict_(f"{g}.blocks", pc["blocks"])
    bad.keys(f"{g}.blocks", blocks, ("phase", "absmax"), {"phase", "absmax"})
    phase = bad.int_(f"{g}.blocks.phase", blocks["phase"], 0, BLOCK - 1)
    count = (phase + n + BLOCK - 1) // BLOCK
    for key, t in bad.dict_(f"{g}.blocks.absmax", blocks["absmax"]).items():
        if key not in pc["optim"]:
            bad(f"{g}.blocks.absmax", f"has the key {show(key)}, which optim does not")
        _range_tensor(bad, f"{g}.blocks.absmax[{show(key)}]", t, count, torch.float32)
    return set(blocks["absmax"])


def _range_tensor(bad: Fields, field: str, t, n: int, dtype, coded: bool = False) -> None:
    if not torch.is_tensor(t):
        bad(field, f"= {show(t)}: not a tensor")
    if t.dim() != 1 or t.numel() != n:
        bad(field, f"is {show(t)}; the piece's range holds {n} elements")
    if dtype is not None and t.dtype != dtype:
        bad(field, f"is {show(t)}; the checkpoint declares {str(dtype).replace('torch.', '')}")
    if dtype is None and t.dtype not in DTYPES.values() and not (coded and t.dtype in CODE_DTYPES.values()):
        bad(field, f"is {show(t)}; optimizer states are floating point, or 8-bit codes with their blocks' absmax")


def check_rank_file(obj, where: str, manifest: dict, rank: int) -> None:
    """A rank file's layout (``where``: ``checkpoint '<dir>': file rank_00000.pt``)."""
    bad = Fields(where)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a zeroplug rank file")
    bad.keys("", obj, sorted(RANK_KEYS), RANK_KEYS)
    bad.int_("version", obj["version"], 1, VERSION)
    if bad.int_("rank", obj["rank"], 0, MAX_WORLD) != rank:
        bad("rank", f"= {obj['rank']}: the manifest lists this file as rank {rank}'s")
    if bad.int_("world_size", obj["world_size"], 1, MAX_WORLD) != manifest["world_size"]:
        bad("world_size", f"= {obj['world_size']}: the manifest says {manifest['world_size']}")
    c = bad.dict_("counters", obj["counters"])
    bad.keys("counters", c, COUNTERS, COUNTERS)
    for k in COUNTERS:
        bad.int_(f"counters.{k}", c[k])
    for k in ("precision", "rng", "client_state", "plugins"):
        bad.dict_(k, obj[k])
    model = bad.dict_("model", obj["model"])
    bad.keys("model", model, ("pieces",), MODEL_KEYS)
    params = manifest["model"]["params"]
    _check_pieces(bad, model["pieces"], params, manifest["files"], rank, in_part=False)
    for k, v in bad.dict_("model.optim_scalars", model.get("optim_scalars", {})).items():
        bad.number(f"model.optim_scalars[{show(k)}]", v)
    for k, v in bad.dict_("model.optim_keys", model.get("optim_keys", {})).items():
        if not isinstance(k, str) or not isinstance(v, str) or v not in DTYPES and v not in CODE_DTYPES:
            bad(f"model.optim_keys[{show(k)}]", f"= {show(v)}: not one of {', '.join([*DTYPES, *CODE_DTYPES])}")
    groups = model.get("optim_groups", [])
    if not isinstance(groups, list) or len(groups) > 1 or not all(isinstance(g, dict) for g in groups):
        bad("model.optim_groups", f"= {show(groups)}: not a list of one table of hyper-parameters")
    for k, v in bad.dict_("model.extras", model.get("extras", {})).items():
        if not isinstance(k, str) or not torch.is_tensor(v):
            bad(f"model.extras[{show(k)}]", f"= {show(v)}: not a tensor")


def check_part_file(obj, where: str, manifest: dict, name: str) -> None:
    """A part file's layout (``where``: ``checkpoint '<dir>': file rank_00000.sg00001.pt``)."""
    bad = Fields(where)
    entry = manifest["files"][name]
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a zeroplug part file")
    bad.keys("", obj, sorted(PART_KEYS), PART_KEYS)
    if obj["rank"] != entry["rank"] or isinstance(obj["rank"], bool):
        bad("rank", f"= {show(obj['rank'])}: the manifest lists this file as rank {entry['rank']}'s")
    if obj["part"] != entry["part"]:
        bad("part", f"= {show(obj['part'])}: the manifest says {entry['part']!r}")
    _check_pieces(bad, obj["pieces"], manifest["model"]["params"], manifest["files"], entry["rank"], in_part=True)


# --- what the engine's own state must look like ---------------------------------------------

def check_like(v, like, bad: Fields, field: str, signs: bool = True) -> None:
    """``v`` has the structure of ``like`` (the engine's own state): the same keys, numbers
    where it has numbers (finite; integers where integers; with ``signs``, non-negative and
    positive where ``like`` is), tensors of its shape and dtype."""
    if isinstance(like, dict):
        bad.dict_(field, v)
        bad.keys(field, v, list(like), list(like))
        for k in like:
            check_like(v[k], like[k], bad, f"{field}.{k}", signs)
    elif isinstance(like, (list, tuple)):
        if not isinstance(v, (list, tuple)) or len(v) != len(like):
            bad(field, f"= {show(v)}: not a list of {len(like)}")
        for i, (a, b) in enumerate(zip(v, like)):
            check_like(a, b, bad, f"{field}[{i}]", signs)
    elif torch.is_tensor(like):
        if not torch.is_tensor(v) or v.shape != like.shape or v.dtype != like.dtype:
            bad(field, f"= {show(v)}: not {show(like)}")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad(field, "holds values that are not finite")
    elif isinstance(like, bool) or like is None or isinstance(like, str):
        if type(v) is not type(like):
            bad(field, f"= {show(v)}: not a {type(like).__name__}")
    elif isinstance(like, int):
        bad.int_(field, v, -MAX_COUNT if like < 0 or not signs else 0, MAX_COUNT)
    elif isinstance(like, float):
        bad.number(field, v)
        if signs and like > 0 and not v > 0:
            bad(field, f"= {show(v)}: not a positive number")


def check_rng(st, bad: Fields) -> None:
    """Random-number-generator states that the generators take (tried on fresh ones)."""
    import random
    bad.dict_("rng", st)
    bad.keys("rng", st, ("torch", "python"), ("torch", "python", "cuda", "numpy"))
    t = st["torch"]
    if not torch.is_tensor(t) or t.dtype != torch.uint8 or t.dim() != 1:
        bad("rng.torch", f"= {show(t)}: not a byte tensor")
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, ValueError, TypeError) as exc:
        bad("rng.torch", f"is not a generator state ({str(exc).splitlines()[0][:80]})")
    py = st["python"]
    try:
        v, internal, gauss = py
        random.Random().setstate((v, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        bad("rng.python", f"is not a random.getstate() ({str(exc)[:80]})")
    if "cuda" in st:
        c = st["cuda"]
        if not torch.is_tensor(c) or c.dtype != torch.uint8 or c.dim() != 1:
            bad("rng.cuda", f"= {show(c)}: not a byte tensor")
    if "numpy" in st:
        n = bad.dict_("rng.numpy", st["numpy"])
        try:
            import numpy as np
        except ImportError:
            return
        try:
            np.random.RandomState().set_state({
                "bit_generator": n["bit_generator"],
                "state": {"key": n["key"].numpy().astype("uint32"), "pos": n["pos"]},
                "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        except Exception as exc:     # noqa: BLE001 - numpy raises several kinds: one line
            bad("rng.numpy", f"is not a numpy generator state ({type(exc).__name__}: {str(exc)[:80]})")
