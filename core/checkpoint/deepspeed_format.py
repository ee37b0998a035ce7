"""A DeepSpeed ZeRO checkpoint (stages 1-3) read as zeroplug's world-size-independent pieces.

DeepSpeed keeps, per data-parallel rank, fp32 master partitions of flat buffers and the
torch optimizer's state over them:

* Stages 1 and 2 (``DeepSpeedZeroOptimizer``, and ``BF16_Optimizer``'s ``bf16_`` files):
  per parameter group, the trainable parameters (in ``param_shapes`` order) are flattened
  into one buffer, padded at the end to a multiple of ``2 * world``, and cut into ``world``
  equal partitions; rank ``r`` owns ``[r * P, (r + 1) * P)``. Its
  ``single_partition_of_fp32_groups[g]`` is that partition (without the padding, in
  ``DeepSpeedZeroOptimizer``'s files); ``base_optimizer_state`` is the torch optimizer's
  ``state_dict()`` over the padded partitions (or, with ``elastic_checkpoint``, a list of
  per-group states without padding and ``base_optimizer_state_step``).
* Stage 3: every parameter is cut on its own into ``world`` parts of ``ceil(numel / world)``
  (the last padded); rank ``r``'s parts of the parameters of each sub-group, concatenated,
  are its ``fp32_flat_groups[k]``; ``optimizer_state_dict`` is the torch optimizer's state
  over those flat tensors (one per sub-group).

:class:`DeepSpeedCheckpoint` maps each rank file onto the elements ``[start, end)`` of each
parameter's own numbering, which is how zeroplug's checkpoints describe what a rank holds;
:class:`DeepSpeedShards` presents that to the partitioner's ``load_checkpoint_state`` in
place of a :class:`zeroplug.checkpoint.ShardSet`, so a DeepSpeed checkpoint written by N
ranks at stage s loads on M ranks at any stage, exactly as a zeroplug checkpoint does.
:func:`load_deepspeed_checkpoint` is the engine's entry point; :class:`DeepSpeedSource`
feeds ``zeroplug export --dtype fp32``.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from .deepspeed_files import (SCHEDULER_KEY, ZeroStageEnum, find_deepspeed_checkpoint, load_deepspeed_file, model_file,
                              optim_files)
from .files import CheckpointError
from .writers import Entry, out_dtype

log = logging.getLogger("zeroplug")

#: model-states keys DeepSpeed writes itself; any other top-level key is the client state
DS_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                 "ds_version", "ds_autoep_layers", "autoep_layers", "universal_checkpoint_info", "compiled_autograd"}
_NOT_HYPER = {"params", "step", "initial_lr"}


def _numel(shape) -> int:
    return int(math.prod(int(s) for s in shape))


def _step_value(v) -> float | None:
    if v is None:
        return None
    if torch.is_tensor(v):
        return float(v.item())
    return float(v)


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed checkpoint: its layout (from the model-states file and each
    rank's optimizer file) and, per rank, the pieces it holds."""

    def __init__(self, path):
        self.path = Path(path)
        self.files = optim_files(self.path)
        self.world = len(self.files)
        first = self._optim(0)
        stage = first.get("zero_stage")
        # BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation) writes no stage: its layout is stage 1's
        self.stage = int(stage) if stage is not None else int(ZeroStageEnum.optimizer_states)
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"{self.path}: ZeRO stage {self.stage}; zeroplug reads the checkpoints of "
                                  "stages 1, 2 and 3")
        count = first.get("partition_count", self.world)
        counts = count if isinstance(count, (list, tuple)) else [count]
        if any(int(c) != self.world for c in counts):
            raise CheckpointError(f"{self.path}: partition_count {count} but {self.world} optimizer files "
                                  "(an incomplete save, or expert parallelism, which zeroplug does not read)")
        self.lean = "zero_stage" in first        # DeepSpeedZeroOptimizer drops the padding of its partitions
        # the partition size of each group, as rank 0's file has it (its elements and padding)
        flats0 = first.get("single_partition_of_fp32_groups") or [] if self.stage < 3 else []
        pads0 = first.get("group_paddings") or [0] * len(flats0)
        self._parts = [int(f.numel()) + (int(p) if self.lean else 0) for f, p in zip(flats0, pads0)]
        del first, flats0
        self.model_path = model_file(self.path, self.stage)
        ms = load_deepspeed_file(self.model_path)
        self.model_states = ms
        shapes = ms.get("param_shapes")
        if not isinstance(shapes, (list, tuple)) or not shapes:
            raise CheckpointError(f"{self.model_path}: no param_shapes (not a ZeRO checkpoint)")
        self.groups = [[(str(n), tuple(int(x) for x in s)) for n, s in g.items()] for g in shapes]
        self.shapes = {n: s for g in self.groups for n, s in g}
        self.module = ms.get("module") or {}
        self.shared = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
        self.buffer_names = list(ms.get("buffer_names") or [])
        self.dtype = next((v.dtype for k, v in self.module.items()
                           if k in self.shapes and torch.is_tensor(v) and v.dtype.is_floating_point), torch.float32)
        self._index = self._layout()

    # -- files -------------------------------------------------------------------------
    def _optim(self, rank: int) -> dict:
        sd = load_deepspeed_file(self.files[rank])
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict):
            raise CheckpointError(f"{self.files[rank]}: no optimizer_state_dict (not a DeepSpeed ZeRO file)")
        return osd

    # -- layout ----------------------------------------------------------------------
    def _layout(self):
        """Per rank the segments it holds: (name, start, end, flat index, offset in that flat)."""
        out = []
        if self.stage == 3:
            params = [p for g in self.groups for p in g]
            for r in range(self.world):
                segs, off = [], 0
                for name, shape in params:
                    n = _numel(shape)
                    part = -(-n // self.world)
                    a, b = min(n, r * part), min(n, (r + 1) * part)
                    segs.append((name, a, b, off))
                    off += part
                out.append((segs, off))
        else:
            for r in range(self.world):
                segs = []
                for g, params in enumerate(self.groups):
                    total = sum(_numel(s) for _, s in params)
                    part = self.group_partition(g)
                    r0, r1 = r * part, min(total, (r + 1) * part)
                    o = 0
                    for name, shape in params:
                        n = _numel(shape)
                        a, b = max(o, r0), min(o + n, r1)
                        if a < b:
                            segs.append((name, a - o, b - o, g, a - r0))
                        o += n
                out.append((segs, None))
        return out

    def group_partition(self, g: int) -> int:
        """Elements per rank of group ``g``'s flat buffer: rank 0's partition with its padding
        (DeepSpeed pads the buffer to a multiple of ``2 * world``: the same, when it agrees)."""
        total = sum(_numel(s) for _, s in self.groups[g])
        if len(self._parts) != len(self.groups):
            raise CheckpointError(f"{self.files[0]}: {len(self._parts)} fp32 partition(s) but param_shapes has "
                                  f"{len(self.groups)} parameter group(s)")
        part = self._parts[g]
        if part * self.world < total or (part - 1) * self.world >= total + 2 * self.world:
            raise CheckpointError(f"{self.files[0]}: group {g}'s partitions of {part} elements on {self.world} "
                                  f"ranks do not hold its {total} elements")
        return part

    # -- per rank ----------------------------------------------------------------------
    def rank_pieces(self, rank: int, optim: bool = True) -> tuple[dict, dict]:
        """(pieces, info) of rank ``rank``: pieces ``{name: [{"start", "end", "master",
        ["optim": {key: tensor}]}]}`` (views of the memory-mapped file) and info
        ``{"step", "group", "keys"}`` from its optimizer state."""
        osd = self._optim(rank)
        where = self.files[rank]
        if self.stage == 3:
            flats = osd.get("fp32_flat_groups")
            base = osd.get("optimizer_state_dict")
            if not isinstance(flats, (list, tuple)):
                raise CheckpointError(f"{where}: no fp32_flat_groups (not a stage-3 file)")
        else:
            flats = osd.get("single_partition_of_fp32_groups")
            base = osd.get("base_optimizer_state")
            if not isinstance(flats, (list, tuple)) or len(flats) != len(self.groups):
                raise CheckpointError(f"{where}: single_partition_of_fp32_groups does not match the "
                                      f"{len(self.groups)} parameter groups of param_shapes")
        states, step, group = self._optimizer_states(base, len(flats), where, optim,
                                                     osd.get("base_optimizer_state_step"))
        pieces: dict[str, list] = {}
        if self.stage == 3:
            segs, total = self._index[rank]
            bounds, acc = [], 0
            for f in flats:
                bounds.append((acc, acc + f.numel()))
                acc += f.numel()
            if acc != total:
                raise CheckpointError(f"{where}: fp32_flat_groups hold {acc} elements; the parameters' partitions "
                                      f"need {total}")
            for name, a, b, off in segs:
                x = off
                while a < b:            # split where a sub-group's flat ends
                    k = next(i for i, (lo, hi) in enumerate(bounds) if lo <= x < hi)
                    lo, hi = bounds[k]
                    n = min(b - a, hi - x)
                    pieces.setdefault(name, []).append(self._piece(flats[k], states[k], a, a + n, x - lo))
                    a, x = a + n, x + n
        else:
            pads = osd.get("group_paddings") or [0] * len(flats)
            for g, f in enumerate(flats):
                part = self.group_partition(g)
                total = sum(_numel(s) for _, s in self.groups[g])
                lean = max(0, min(part, total - rank * part))
                if f.numel() + (int(pads[g]) if self.lean else 0) != part or f.numel() < lean:
                    raise CheckpointError(f"{where}: group {g}'s fp32 partition has {f.numel()} elements (padding "
                                          f"{pads[g]}); rank 0's partitions have {part}")
            for name, a, b, g, x in self._index[rank][0]:
                pieces.setdefault(name, []).append(self._piece(flats[g], states[g], a, b, x))
        return pieces, {"step": step, "group": group, "keys": sorted({k for s in states for k in s})}

    @staticmethod
    def _piece(flat, state: dict, a: int, b: int, x: int) -> dict:
        master = flat[x:x + (b - a)]
        # Note: the model-dtype values are the masters rounded, as DeepSpeed's next step writes them
        pc = {"start": a, "end": b, "master": master, "param": master}
        if state:
            pc["optim"] = {k: v[x:x + (b - a)] for k, v in state.items()}
        return pc

    def _optimizer_states(self, base, n: int, where, optim: bool, elastic_step=None):
        """Per flat tensor its element-wise states; the step; group 0's hyper-parameters."""
        if not optim:
            return [{} for _ in range(n)], None, None
        step, group = None, None
        if isinstance(base, dict) and "state" in base:            # torch optimizer state_dict
            st = base["state"]
            groups = base.get("param_groups") or []
            order = [i for g in groups for i in g.get("params", [])] or sorted(st)
            if len(order) != n:
                raise CheckpointError(f"{where}: the optimizer state has {len(order)} tensors, the fp32 "
                                      f"partitions {n}")
            per = [st.get(i, {}) for i in order]
            if groups:
                group = {k: v for k, v in groups[0].items() if k not in _NOT_HYPER}
                step = _step_value(groups[0].get("step"))
        elif isinstance(base, (list, tuple)):                       # elastic_checkpoint
            per = list(base)
            step = _step_value(elastic_step)
        else:
            raise CheckpointError(f"{where}: no optimizer state (base_optimizer_state / optimizer_state_dict)")
        out = []
        for i, s in enumerate(per):
            if "step" in s:
                step = _step_value(s["step"])
            out.append({k: v.view(-1) for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
        return out, step, group

    # -- counters and the rest -----------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return int(self.model_states.get("global_steps") or 0)

    @property
    def skipped_steps(self) -> int:
        return int(self.model_states.get("skipped_steps") or 0)

    @property
    def lr_step(self) -> int:
        """Scheduler steps taken: DeepSpeed steps its scheduler on every step it does not skip."""
        sched = self.model_states.get("lr_scheduler")
        if isinstance(sched, dict):
            if "last_batch_iteration" in sched:         # DeepSpeed's own schedulers
                return int(sched["last_batch_iteration"]) + 1
            if "last_epoch" in sched:                   # a torch LR scheduler
                return int(sched["last_epoch"])
        return self.global_steps - self.skipped_steps

    def client_state(self) -> dict:
        return {k: v for k, v in self.model_states.items() if k not in DS_MODEL_KEYS}

    def loss_scale(self) -> dict | None:
        """The fp16 loss scaler's state (``cur_scale``, ...), None for bf16/fp32."""
        osd = self._optim(0)
        sc = osd.get("loss_scaler")
        if sc is None or not getattr(sc, "dynamic", False) and float(getattr(sc, "cur_scale", 1.0)) == 1.0:
            return None
        return {k: v for k, v in vars(sc).items() if isinstance(v, (int, float, bool))}

    def extras(self) -> dict:
        """State-dict entries outside the trainable parameters (buffers; frozen parameters
        the 16-bit module holds whole)."""
        out = {}
        for k, v in self.module.items():
            if k in self.shapes or self.shared.get(k) in self.shapes or not torch.is_tensor(v):
                continue
            if v.numel() == 0 and k not in self.buffer_names:
                continue                # a stage-3 parameter placeholder
            out[k] = v
        return out

    def meta(self) -> dict:
        """zeroplug's checkpoint metadata: the parameters (trainable ones) and state-dict keys."""
        aliases: dict[str, list] = {}
        for alias, canon in self.shared.items():
            aliases.setdefault(canon, []).append(alias)
        dt = str(self.dtype).replace("torch.", "")
        params = {n: {"shape": list(s), "dtype": dt, "aliases": aliases.get(n, [])} for n, s in self.shapes.items()}
        keys = []
        for k in self.module:
            name = k if k in self.shapes else self.shared.get(k) if self.shared.get(k) in self.shapes else None
            keys.append([k, name])
        if not keys:            # no module saved: the parameters alone
            keys = [[n, n] for n in self.shapes]
        return {"params": params, "state_dict": keys}


class DeepSpeedShards:
    """A DeepSpeed checkpoint as the partitioner's ``load_checkpoint_state`` reads a
    :class:`zeroplug.checkpoint.ShardSet`: ``meta``, ``items()`` (each rank file's pieces,
    one file at a time), ``piece_states``, ``rank_piece``, ``release``."""

    def __init__(self, ck: DeepSpeedCheckpoint, optim: bool = True):
        self.ck, self.optim = ck, optim
        self.path = ck.path
        self.meta = ck.meta()
        self.world_size = ck.world
        self._open: tuple[int, dict] | None = None
        self.step: float | None = None

    def _model(self, rank: int) -> dict:
        if self._open is not None and self._open[0] == rank:
            return self._open[1]
        self._open = None
        pieces, info = self.ck.rank_pieces(rank, self.optim)
        if info["step"] is not None:
            self.step = info["step"]
        model = {"pieces": pieces, "extras": self.ck.extras() if rank == 0 else {},
                 "optim_scalars": {}, "optim_keys": {}, "optim_groups": []}
        if self.optim and info["keys"]:
            if info["step"] is None:
                raise CheckpointError(f"{self.ck.files[rank]}: the optimizer state has no step count")
            model["optim_keys"] = {k: "float32" for k in info["keys"]}
            model["optim_scalars"] = {"step": torch.tensor(float(info["step"]), dtype=torch.float32)}
            if info["group"]:
                model["optim_groups"] = [info["group"]]
        self._open = (rank, model)
        return model

    def items(self):
        for r in range(self.world_size):
            model = self._model(r)
            yield r, model
            del model
            self._open = None

    def __iter__(self):
        for _, model in self.items():
            yield model

    def piece_states(self, name: str, pc: dict) -> dict:
        return pc

    def rank_piece(self, rank: int, name: str, i: int) -> dict:
        try:
            return self._model(rank)["pieces"][name][i]
        except (KeyError, IndexError):
            raise CheckpointError(f"{self.ck.files[rank]}: no piece {i} of {name!r}") from None

    def release(self) -> None:
        self._open = None


class DeepSpeedSource:
    """A DeepSpeed checkpoint as tensors for :func:`zeroplug.checkpoint.fp32_export.write_state_dict`:
    each parameter merged from the fp32 partitions of every rank (cast to ``dtype``; None: the
    module's 16-bit dtype), buffers as saved (floating ones cast, as DeepSpeed's ``zero_to_fp32`` does). Rank files are mapped one at a time and
    let go after ``budget`` bytes read (default: the largest tensor's)."""

    def __init__(self, path, dtype: torch.dtype | None = torch.float32, budget: int | None = None):
        self.ck = DeepSpeedCheckpoint(path)
        self.path = self.ck.path
        self.dtype = dtype
        self._extras = self.ck.extras()
        largest = max([_numel(s) * 4 for s in self.ck.shapes.values()] + [1])
        self.budget = budget if budget is not None else largest
        self._maps: dict[int, dict] = {}
        self._touched = 0

    def entries(self) -> list[Entry]:
        out = []
        for key, name in self.ck.meta()["state_dict"]:
            if name is None:
                v = self._extras.get(key)
                if v is None:
                    continue            # an empty placeholder
                out.append(Entry(key, ("extra", key), v.shape, out_dtype(v.dtype, self.dtype)))
            else:
                out.append(Entry(key, ("param", name), self.ck.shapes[name], out_dtype(self.ck.dtype, self.dtype)))
        return out

    def _pieces(self, rank: int) -> dict:
        if rank not in self._maps:
            self._maps[rank] = self.ck.rank_pieces(rank, optim=False)[0]
        return self._maps[rank]

    def release(self) -> None:
        self._maps.clear()
        self._touched = 0

    def produce(self, e: Entry) -> torch.Tensor:
        kind, name = e.source
        if kind == "extra":
            return self._extras[name].to(e.dtype, copy=True)
        n = _numel(self.ck.shapes[name])
        out = torch.empty(n, dtype=e.dtype)
        filled = 0
        for r in range(self.ck.world):
            for pc in self._pieces(r).get(name, ()):
                out[pc["start"]:pc["end"]].copy_(pc["master"])
                filled += pc["end"] - pc["start"]
                self._touched += pc["master"].numel() * 4
        if filled != n:
            raise CheckpointError(f"{self.path}: the rank files hold {filled} of the {n} elements of {name!r}")
        if self._touched >= self.budget:
            self.release()
        return out.view(e.shape)


def _scaler_state(engine, ds: dict | None) -> dict | None:
    """DeepSpeed's loss-scaler attributes as zeroplug's precision state (fp16 only)."""
    cur = engine.precision.state_dict()
    if ds is None or "scale" not in cur:
        return None
    out = dict(cur)
    out["scale"] = float(ds.get("cur_scale", cur["scale"]))
    if "cur_hysteresis" in ds:
        out["cur_hysteresis"] = int(ds["cur_hysteresis"])
    if "cur_iter" in ds and "last_overflow_iter" in ds:
        out["clean_steps"] = max(0, int(ds["cur_iter"]) - int(ds["last_overflow_iter"]) - 1)
    return out


def load_deepspeed_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                              load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load a DeepSpeed ZeRO checkpoint (stages 1-3, any world size) into ``engine``, at any
    world size and stage: fp32 masters, Adam's ``exp_avg`` / ``exp_avg_sq`` and step, the
    step counters, the fp16 loss scale. Every rank must call it. Returns ``(path,
    client_state)`` as ``engine.load_checkpoint`` does."""
    path = find_deepspeed_checkpoint(load_dir, tag)
    if path is None:
        raise CheckpointError(f"no DeepSpeed checkpoint in {str(load_dir)!r}"
                              f"{f' (tag {tag!r})' if tag is not None else ''}: expected <tag>/*_optim_states.pt "
                              "and a 'latest' file naming the tag")
    comm = engine.run.comm
    ck = DeepSpeedCheckpoint(path)
    want_opt = load_optimizer_states and not load_module_only
    # Note: every rank file is read and its layout checked before the engine changes, so a
    # broken checkpoint is refused with the engine's states as they were.
    info = [ck.rank_pieces(r, want_opt)[1] for r in range(ck.world)]
    if want_opt and any(i["keys"] and i["step"] is None for i in info):
        raise CheckpointError(f"{path}: the optimizer state has no step count")
    del info
    shards = DeepSpeedShards(ck, optim=want_opt)
    engine.partitioner.release_all()
    engine.partitioner.load_checkpoint_state(shards, optimizer=engine.optimizer, load_master=not load_module_only,
                                             load_optimizer_states=want_opt)
    shards.release()
    if not load_module_only:
        engine.global_step = ck.global_steps
        engine.skipped_steps = ck.skipped_steps
        engine.micro_step = ck.global_steps * engine.gradient_accumulation_steps
        if load_lr_scheduler_states:
            engine.lr_step = ck.lr_step
        scaler = _scaler_state(engine, ck.loss_scale())
        if scaler is not None:
            engine.precision.load_state_dict(scaler)
    comm.barrier()
    log.info("[zeroplug] loaded DeepSpeed ZeRO-%d checkpoint %s (%d ranks, step %d)", ck.stage, path, ck.world,
             ck.global_steps)
    client = ck.client_state()
    sched = ck.model_states.get("lr_scheduler")
    if load_lr_scheduler_states and not load_module_only and isinstance(sched, dict) and "last_epoch" in sched:
        # a torch LR scheduler's state: zeroplug.deepspeed's engine gives it back to the scheduler
        client.setdefault(SCHEDULER_KEY, sched)
    return str(path), client


def load_any(engine, load_dir, tag=None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
             load_module_only: bool = False):
    """``engine.load_checkpoint``: DeepSpeed's layout when ``load_dir`` holds it, else zeroplug's."""
    if find_deepspeed_checkpoint(load_dir, tag) is not None:
        return load_deepspeed_checkpoint(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                         load_module_only)
    from . import load_checkpoint
    return load_checkpoint(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)


__all__ = ["DeepSpeedCheckpoint", "load_any", "DeepSpeedShards", "DeepSpeedSource", "load_deepspeed_checkpoint",
           "find_deepspeed_checkpoint"]
