"""Ranks compare what they are about to do before they do it.

Before each collective whose partners depend on the path a rank takes (a stage-3 gather of
a forward, every backward, a checkpoint save or load, close, the end of the run) every rank
hashes what it is about to do (what, which engine, which step and micro-step, which unit, a
hash of an argument) and contributes ``[h, -h]`` to one all-reduce of MAX: the result is
``[max, -min]``, so one collective tells every rank at once whether all agree. Where they do
not, every rank learns it in the same call, before any of them issues the collective that
would block; they then exchange their descriptions (one small all-gather, which every
rank is in) and all raise :class:`RanksDisagree` with the same one-line message.

Note: what a backward gathers and reduces follows from what its forward ran, which the
ranks compared (each gather of a forward with a hash of the units run so far, and the
backward with the hash of them all: ``Faults.forward_path``): the backward visits the
modules the forward ran, in reverse, and the reductions run in one fixed unit order, every
unit once per micro-step (``Stage2._end_micro_step``); a comparison before each of them
would cost a round trip per unit and find nothing the forward's did not (a divergence there
would block until the watchdog's limit, which names every rank's last collective). The
optimizer step is not compared either: a reduction may be in one rank's backward and in
another's step.

Note: the comparisons run on a gloo group of their own, so that they pair only with each
other, never with a data collective that another rank issued meanwhile, and cost no device
synchronisation with NCCL (their tensors stay in host memory). Each is one round trip
between the ranks' hosts (measured in docs/reliability.md, "What the checks cost").
"""
from __future__ import annotations

import logging
import hashlib

import torch
import torch.distributed as dist

from zeroplug.comm import Comm
from zeroplug.errors import RanksDisagree  # noqa: F401  (raised by the plugin's Faults.agree)

from .record import describe_collective

log = logging.getLogger("zeroplug")

#: what a comparison is about (its code is the first integer compared)
KINDS = {"config": 1, "all_gather": 2, "refill": 3, "reduce": 4, "backward": 5,
         "save_checkpoint": 7, "load_checkpoint": 8, "close": 9, "exit": 10}
UNIT_KINDS = ("all_gather", "refill", "reduce")


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class Agreement:
    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.comm = Comm(group)
        self.count = 0          # comparisons made (a statistic: tests, the benchmark)
        # Note: one tensor for every comparison, held here. gloo's worker thread drops a finished
        # collective's work after wait() has returned; a tensor Python no longer holds is freed
        # there, and freeing its Python object takes the GIL. At interpreter exit, where the last
        # comparison is, Python ends a thread that asks for the GIL, and a thread ended inside
        # that C++ destructor aborts the process ("terminate called without an active exception",
        # seen in a core dump of 1 of 50 finished runs)
        self._wire = torch.zeros(2, dtype=torch.int64)

    def compare(self, values: list[int]) -> bool:
        """Whether every rank passed the same ``values`` (compared as one 62-bit hash: two
        integers on the wire, the fewest a MAX over ``[v, -v]`` needs)."""
        h = text_hash(repr(values))
        wire = self._wire
        wire[0], wire[1] = h, -h
        dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=self.group)
        self.count += 1
        return int(wire[0]) == -int(wire[1])

    def descriptions(self, mine: dict) -> list[dict]:
        return self.comm.all_gather_object(mine)


def unit_module(kind: str, index: int, describe) -> str | None:
    """The module path a unit collective belongs to (stage 3's describe gives one), or None."""
    if kind not in UNIT_KINDS or describe is None or index < 0:
        return None
    try:
        return describe(index)
    except Exception as exc:        # a message must never fail for want of a name
        log.debug("faults: no module name for unit %d: %r", index, exc)
        return None


def explain(descs: list[dict], model) -> str:
    """One line: what each rank was about to do, and the fix."""
    groups: dict[str, list[int]] = {}
    for d in descs:
        groups.setdefault(f"{d['what']} in {d['where']}", []).append(d["rank"])
    listing = "; ".join(f"{_ranks(rs)} would run {what}" for what, rs in groups.items())
    kinds = {d["kind"] for d in descs}
    head = f"the ranks are on different paths and would block each other: {listing}"
    ran = [d.get("ran") for d in descs]
    if kinds <= set(UNIT_KINDS) | {"backward"} and all(r is not None for r in ran) and len({tuple(r) for r in ran}) > 1:
        # the same collective next, after forwards that ran different modules (a module a rank
        # skipped whose unit was gathered ahead on every rank): its backward would differ
        sets = [set(r) for r in ran]
        differ = sorted(set.union(*sets) - set.intersection(*sets))     # run on some ranks only
        if not differ:      # the same modules in another order: those where the orders part
            first = next(i for i in range(max(map(len, ran))) if len({r[i] if i < len(r) else None for r in ran}) > 1)
            differ = sorted({r[first] for r in ran if first < len(r)})
        runs = "; ".join(f"rank {d['rank']} ran {_names(d['ran'])}" for d in descs)
        return (f"the ranks' forwards ran different modules ({runs}) and their backwards would gather and "
                f"reduce different units: {listing}. {module_hint(differ, model)}")
    if kinds <= set(UNIT_KINDS) and len({(d["step"], d["micro"]) for d in descs}) == 1:
        return f"{head}. {module_hint([d.get('module') for d in descs], model)}"
    if kinds == {"save_checkpoint"} or kinds == {"load_checkpoint"}:
        call = descs[0]["kind"]
        args = "; ".join(f"rank {d['rank']}: {d['detail']}" for d in descs)
        return (f"the ranks passed different arguments to engine.{call} ({args}): every rank writes its part "
                f"of one checkpoint, so every rank must pass the same directory and tag, on a filesystem they "
                f"all see (a directory made by tempfile.mkdtemp() on each rank differs: make it on rank 0 and "
                f"send its name to the others, or use a fixed path)")
    return (f"{head}. Every rank must run the same number of micro-steps and steps and call save_checkpoint, "
            f"load_checkpoint and close at the same step (a rank whose data ran out early, a loop that stops "
            f"or skips a backward on some ranks, different gradient_accumulation_steps): give every rank the "
            f"same number of batches (a DistributedSampler with drop_last=True), and stop every rank at the "
            f"same step")


def _names(ran: list, most: int = 8) -> str:
    names = [repr(n) if n else "the model's own parameters" for n in ran]
    return ", ".join(names if len(names) <= most else ["..."] + names[-most:])


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def module_hint(paths: list, model) -> str:
    """How to make the modules the ranks differ on gather as one: the lowest module above all
    of them; a ModuleList / ModuleDict is declared as an instance (gathered with the module that
    holds it, which every rank runs), another module by its class (gathered in its own forward)."""
    paths = [p for p in paths if p is not None]
    if not paths or model is None:
        return ("Declare the module every rank calls around them a leaf (zero.stage3_leaf_modules, "
                "zeroplug.set_leaf_modules)")
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if common == split[0] and len(set(paths)) == 1:
        common = common[:-1]        # one module on every rank (another kind of collective): its parent
    names = ", ".join(sorted({repr(p) if p else "the model's own parameters" for p in paths}))
    try:
        lca = model.get_submodule(".".join(common))
    except AttributeError:
        lca = None
    expr = "model" + "".join(f"[{c}]" if c.isdigit() else f".{c}" for c in common)
    if lca is not None and common and isinstance(lca, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        parent = ".".join(common[:-1])
        holder = repr(parent) if parent else "the model's own forward"
        return (f"Stage 3 gathers {names} each in its own module's forward, which some ranks do not run. "
                f"Declare {'.'.join(common)!r} a leaf before zeroplug.initialize: "
                f"zeroplug.set_leaf_modules(model, [{expr}]); stage 3 then gathers it whole with {holder}, "
                f"which every rank runs")
    if lca is not None and common:
        cls = type(lca).__name__
        return (f"Stage 3 gathers {names} each in its own module's forward, which some ranks do not run. "
                f"Declare the class of {'.'.join(common)!r} a leaf: zero.stage3_leaf_modules = [\"{cls}\"] "
                f"(or zeroplug.set_leaf_modules(model, [{cls}]) before zeroplug.initialize); stage 3 then "
                f"gathers it whole in its own forward, on every rank")
    tops = sorted({p.split(".")[0] for p in paths if p})
    exprs = ", ".join(f"model.{t}" if not t.isdigit() else f"model[{t}]" for t in tops)
    return (f"The model's own forward runs {names} on some ranks only. Declare the modules it runs on some "
            f"ranks only leaves of the model before zeroplug.initialize, e.g. zeroplug.set_leaf_modules(model, "
            f"[{exprs}]): stage 3 then gathers each whole with the model's own forward, on every rank; or "
            f"run every module on every rank")


def describe_mine(kind: str, index: int, describe, detail: str, where: str, rank: int, step: int,
                  micro: int, path=None) -> dict:
    ran = None
    if path is not None:
        try:
            ran = [describe(i) if describe is not None else str(i) for i in path()]
        except Exception as exc:        # a message must never fail for want of a name
            log.debug("faults: no path for the message: %r", exc)
    return {"rank": rank, "kind": kind, "what": describe_collective(kind, index, describe) if kind in UNIT_KINDS
            else _KIND_WHAT.get(kind, kind), "where": where, "step": step, "micro": micro,
            "detail": detail, "module": unit_module(kind, index, describe), "ran": ran}


_KIND_WHAT = {"backward": "engine.backward",
              "save_checkpoint": "engine.save_checkpoint", "load_checkpoint": "engine.load_checkpoint",
              "close": "engine.close", "exit": "nothing more (its script ended)", "config": "initialize"}
