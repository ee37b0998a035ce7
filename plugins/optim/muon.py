"""Muon for the hidden matrices, AdamW for the rest, over ZeRO's flat shards (``plugin = "muon"``).

Which parameters are Muon's (:func:`split`): a group of ``model_parameters`` that says
``"use_muon": true`` or ``false`` decides for its parameters; else a parameter's own
``use_muon`` attribute (DeepSpeed's tag) does; else the default rule: a parameter with two or
more dimensions that belongs to no ``torch.nn.Embedding`` and none of whose name's components
contains an entry of ``muon_exclude`` (the embeddings, the output head, classifiers). The
split becomes two parameter groups per user group, so the stage lays Muon's and AdamW's
parameters out in different units and every optimizer tensor is one or the other.

The step of a Muon tensor (:class:`MuonAdamW`): the momentum is element-wise, so each rank
updates the momentum of its own shard; the Nesterov mix of gradient and momentum is
element-wise too. Orthogonalisation needs whole matrices, so every rank sends its shard of
the mixed momentum (in the orthogonaliser's input dtype) to every other (one all-gather per
optimizer tensor, on the training device); each matrix has one *owner* rank (largest matrices
first, each to the least loaded rank, the same on every rank) that runs Newton-Schulz on it
there (on the GPU, also when the states are offloaded to the host) and writes the result into
a zeroed buffer; one reduce-scatter then hands every rank its shard of every result (a sum
with one non-zero term: exact). Each rank applies its shard. On one rank nothing is sent.

Note: owners rather than every rank orthogonalising every matrix: Newton-Schulz costs about
``6 x steps x rows x cols x min(rows, cols)`` flops per matrix, which for a 1.3B model is
comparable to a forward and backward of a micro-batch; spread over N ranks it costs 1/N each,
for the price of one all-gather and one reduce-scatter of the Muon tensors in bf16 (a stage-3
step moves 3 times that much in its parameter gathers and gradient reductions anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from zeroplug.errors import ConfigError
from zeroplug.options import opt
from zeroplug.param_groups import ParamGroups
from zeroplug.shard_map import check_training_thread
from zeroplug.slots import OptimizerFactory

from .deepspeed_rules import adam_moments, with_grads
from .newton_schulz import (
    TORCH_COEFFICIENTS, adjusted_lr, as_matrix, input_dtype, orthogonalize_deepspeed, orthogonalize_torch,
)

# Note: a step orthogonalises its tensors in batches of at most this many elements (their
# mixed momenta and results in bf16 on the training device at once: 2 x 512 MiB)
_BATCH_ELEMENTS = 1 << 28
# host slices of the momentum pass (fp32 gradient and momentum: 2 x 8 MiB, cache-sized)
_HOST_SLICE = 1 << 21
DEFAULT_EXCLUDE = ("embed", "wte", "wpe", "lm_head", "head", "classifier", "score")


@dataclass(frozen=True)
class MuonOptions:
    lr: float = opt(1e-3, "Learning rate (the peak, when a schedule warms up to it) of both parts, unless "
                          "muon_lr / adam_lr set their own; a schedule scales both in proportion.", min=0.0)
    muon_lr: float = opt(0.0, "Learning rate of the Muon matrices (0 = lr). DeepSpeed: optimizer.params.muon_lr.",
                         min=0.0)
    adam_lr: float = opt(0.0, "Learning rate of the AdamW parameters (0 = lr). DeepSpeed: "
                              "optimizer.params.adam_lr.", min=0.0)
    momentum: float = opt(0.95, "Muon's momentum.", min=0.0, below=1.0)
    nesterov: bool = opt(True, "Muon's Nesterov momentum (rule \"deepspeed\": always on).")
    weight_decay: float = opt(0.0, "Decoupled weight decay of both parts (lr x weight_decay per step).", min=0.0)
    betas: tuple[float, float] = opt((0.9, 0.999), "AdamW's (beta1, beta2) for the non-Muon parameters.",
                                     min=0.0, below=1.0)
    eps: float = opt(1e-8, "AdamW's eps.", min=0.0)
    ns_steps: int = opt(5, "Newton-Schulz iterations.", min=1, max=99)
    ns_coefficients: tuple[float, ...] = opt(TORCH_COEFFICIENTS, "The quintic iteration's (a, b, c).")
    ns_dtype: Literal["bf16", "fp32"] = opt(
        "bf16", "Rule \"torch\": the dtype of the Newton-Schulz iterations: \"bf16\" as torch.optim.Muon "
                "(on the GPU's tensor cores), or \"fp32\" (exact to fp32 rounding; several times slower).")
    ns_eps: float = opt(1e-7, "Rule \"torch\": the smallest norm Newton-Schulz divides by.", above=0.0)
    adjust_lr: Literal["original", "match_rms_adamw", "none"] = opt(
        "original", "Rule \"torch\": the per-shape learning rate of a matrix (torch.optim.Muon's "
                    "adjust_lr_fn): \"original\" lr x sqrt(max(1, rows / cols)), \"match_rms_adamw\" "
                    "lr x 0.2 x sqrt(max(rows, cols)), \"none\" lr.")
    rule: Literal["torch", "deepspeed"] = opt(
        "torch", "Update rule: \"torch\" = torch.optim.Muon on the matrices and torch.optim.AdamW on the rest; "
                 "\"deepspeed\" = DeepSpeed's Muon (its Newton-Schulz, ns_method, its Adam; what a DeepSpeed "
                 "JSON with optimizer.type = \"Muon\" becomes).")
    ns_method: Literal["gram", "standard"] = opt(
        "gram", "Rule \"deepspeed\": DeepSpeed's ns_method: \"gram\" (fp16, on the Gram matrix) or \"standard\" "
                "(bf16).")
    muon_exclude: tuple[str, ...] = opt(
        DEFAULT_EXCLUDE, "Default rule: a parameter whose name has a dot-separated component containing one of "
                         "these (case-insensitive) steps with AdamW; parameters of torch.nn.Embedding modules "
                         "always do. A model_parameters group's \"use_muon\" or a parameter's use_muon attribute "
                         "overrides the rule.")

    def validate(self, path: str) -> None:
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"{path}.ns_coefficients: give three numbers (a, b, c), got "
                              f"{len(self.ns_coefficients)}", key=f"{path}.ns_coefficients")


def _default_muon(name: str, p: torch.Tensor, embedded: set[int], exclude: tuple[str, ...]) -> bool:
    if p.ndim < 2 or id(p) in embedded:
        return False
    parts = name.lower().split(".")
    return not any(x.lower() in part for x in exclude for part in parts)


def split(module: torch.nn.Module, groups: ParamGroups, exclude=DEFAULT_EXCLUDE) -> tuple[ParamGroups, dict]:
    """``groups`` with every group split into its Muon and its AdamW parameters (see the
    module doc); the second value: parameter name -> whether it is Muon's (for messages)."""
    embedded = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    parts: dict[tuple[int, bool], list] = {}
    which = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        g = groups.index(p)
        own = groups.settings[g].get("use_muon")
        tag = getattr(p, "use_muon", None)
        use = bool(own) if own is not None else bool(tag) if tag is not None else \
            _default_muon(name, p, embedded, exclude)
        if use and p.ndim < 2:
            raise ConfigError(f"parameter {name!r} of shape {tuple(p.shape)} is marked use_muon, but Muon steps "
                              "matrices (2 or more dimensions); set use_muon = false for it (AdamW steps it)",
                              key="model_parameters")
        parts.setdefault((g, use), []).append(p)
        which[name] = use
    group_of, settings = {}, []
    for (g, use), ps in sorted(parts.items()):
        s = {k: v for k, v in groups.settings[g].items() if k != "use_muon"}
        s["use_muon"] = use
        for p in ps:
            group_of[id(p)] = len(settings)
        settings.append(s)
    return ParamGroups(group_of, tuple(settings) or ({"use_muon": False},)), which


class Muon(OptimizerFactory):
    """Muon on the hidden matrices (whole matrices orthogonalised on owner ranks), AdamW on the rest."""
    Options = MuonOptions

    @classmethod
    def state_bytes(cls, options, run, state_device):
        return 8.0      # an upper bound: AdamW's parameters hold 8 bytes per element, Muon's 4 (+ padding)

    def param_groups(self, module, groups):
        o = self.options
        out, self.which = split(module, groups, tuple(o.muon_exclude))
        muon_lr, adam_lr = o.muon_lr or o.lr, o.adam_lr or o.lr
        settings = []
        for s in out.settings:
            s = dict(s)
            own = s.pop("muon_lr" if s["use_muon"] else "adam_lr", None)
            s.pop("adam_lr" if s["use_muon"] else "muon_lr", None)
            if own is not None:
                s["lr"] = own
            elif "lr" not in s:
                s["lr"] = muon_lr if s["use_muon"] else adam_lr
            settings.append(s)
        return ParamGroups(out.group_of, tuple(settings))

    def build(self, params, device):
        o = self.options
        groups = params if params and isinstance(params[0], dict) else [{"params": list(params), "use_muon": False}]
        return MuonAdamW(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay,
                         betas=o.betas, eps=o.eps, ns_steps=o.ns_steps, ns_coefficients=tuple(o.ns_coefficients),
                         ns_eps=o.ns_eps, ns_dtype=o.ns_dtype, adjust_lr=o.adjust_lr, rule=o.rule,
                         ns_method=o.ns_method)


@dataclass
class _Matrix:
    block: object           # zeroplug.shard_map.Block
    offset: int             # in the block's padded numbering
    numel: int
    shape: tuple[int, int]
    owner: int


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups with ``use_muon`` true, AdamW on the others (see the module
    doc). The stage hands it the map of its flat tensors (``bind_shard_map``); without one,
    each tensor is a whole parameter of its own shape."""

    def __init__(self, params, lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.0, betas=(0.9, 0.999),
                 eps=1e-8, ns_steps=5, ns_coefficients=TORCH_COEFFICIENTS, ns_eps=1e-7, ns_dtype="bf16",
                 adjust_lr="original", rule="torch", ns_method="gram"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=betas,
                        eps=eps, use_muon=False)
        super().__init__(params, defaults)
        self.ns_steps, self.ns_coefficients, self.ns_eps = ns_steps, tuple(ns_coefficients), ns_eps
        self.ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[ns_dtype]
        self.adjust_lr, self.rule, self.ns_method = adjust_lr, rule, ns_method
        self.shard_map = None
        self._plans: dict[int, list[_Matrix]] = {}
        self._adamw = None
        self._host: torch.Tensor | None = None      # the page-locked staging buffer (_staging)

    # -- the stage's map ------------------------------------------------------------------
    def bind_shard_map(self, shard_map) -> None:
        self.shard_map = shard_map
        self._plans = {}
        world = shard_map.comm.world_size
        for g in self.param_groups:
            if not g["use_muon"]:
                continue
            for t in g["params"]:
                mats = [_Matrix(b, s.offset, s.numel, as_matrix(s.shape), 0)
                        for b in shard_map.blocks_of(t) for s in b.spans]
                load = [0.0] * world
                for m in sorted(mats, key=lambda m: -m.numel * min(m.shape)):   # Newton-Schulz's cost
                    m.owner = min(range(world), key=lambda r: load[r])
                    load[m.owner] += m.numel * min(m.shape)
                self._plans[id(t)] = mats

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adam = [g for g in self.param_groups if not g["use_muon"]]
        muon = [(t, g) for g in self.param_groups if g["use_muon"] for t in g["params"] if t.grad is not None]
        batch: list = []
        for t, g in muon:
            if id(t) not in self._plans:        # no map: the tensor is a whole parameter
                self._apply_whole(t, self._mixed(t, g), g)
                continue
            if batch and sum(x.numel() for x, _ in batch) + t.numel() > _BATCH_ELEMENTS:
                self._muon_batch(batch)
                batch = []
            batch.append((t, g))
        if batch:
            self._muon_batch(batch)
        if adam:
            self._adam(adam)
        return loss

    def _adam(self, groups) -> None:
        if self.rule == "torch":
            if self._adamw is None:
                # torch's own AdamW on these groups: their settings and states are this optimizer's
                self._adamw = torch.optim.AdamW([{"params": []}], lr=groups[0]["lr"])
                self._adamw.state = self.state
            # Note: torch's fused kernel (CUDA and CPU, fp32 tensors) is one pass over each
            # tensor where foreach makes a dozen; the same arithmetic to fp32 rounding
            for g in groups:
                for p in g["params"]:
                    st = self.state.get(p)
                    if st and torch.is_tensor(st.get("step")) and st["step"].device != p.device:
                        st["step"] = st["step"].to(p.device)      # (a fused kernel reads it there)
            self._adamw.param_groups = [{**g, "amsgrad": False, "maximize": False, "foreach": None,
                                         "capturable": False, "differentiable": False,
                                         "fused": True if _fusable(g["params"]) else None,
                                         "decoupled_weight_decay": True} for g in groups]
            self._adamw.step()
            return
        for g, p in with_grads(groups):       # DeepSpeed's Adam of its Muon: bias-corrected moments, eps outside the root
            b1, b2 = g["betas"]
            m, v, n = adam_moments(self.state[p], p)
            m.lerp_(p.grad, 1 - b1)
            v.lerp_(p.grad.square(), 1 - b2)
            update = (m / (1 - b1 ** n)) / ((v / (1 - b2 ** n)).sqrt() + g["eps"])
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(update, alpha=-g["lr"])

    def _nesterov(self, g) -> bool:
        return g["nesterov"] or self.rule == "deepspeed"

    def _mixed(self, t: torch.Tensor, g: dict) -> torch.Tensor:
        """The momentum updated, and the (Nesterov) mix of gradient and momentum, in fp32."""
        buf = self._momentum_buffer(t)
        mu = g["momentum"]
        buf.lerp_(t.grad, 1 - mu)
        return t.grad.lerp(buf, mu) if self._nesterov(g) else buf

    def _momentum_buffer(self, t: torch.Tensor) -> torch.Tensor:
        st = self.state[t]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(t)
            st["step"] = torch.tensor(0.0)
        st["step"] += 1
        return st["momentum_buffer"]

    def _mixed_into(self, t: torch.Tensor, g: dict, out: torch.Tensor) -> None:
        """:meth:`_mixed` rounded into ``out`` (the orthogonaliser's dtype, on ``t``'s device).
        Note: on the host in slices of ``_HOST_SLICE`` elements, each read once from memory
        for the momentum, the mix and the cast (the slice stays in the caches between them);
        the values are those of the whole-tensor operations (element-wise)."""
        buf = self._momentum_buffer(t)
        mu, grad = g["momentum"], t.grad
        nesterov = self._nesterov(g)
        n = t.numel()
        step = n if t.device.type != "cpu" else _HOST_SLICE
        for i in range(0, n, step):
            j = min(n, i + step)
            b, gr = buf.view(-1)[i:j], grad.view(-1)[i:j]
            b.lerp_(gr, 1 - mu)
            out[i:j].copy_(gr.lerp(b, mu) if nesterov else b)

    def _muon_batch(self, batch: list) -> None:
        """Muon's step of the mapped tensors in ``batch``: the mixed momenta go to the training
        device (one copy each; through page-locked memory from the host), every rank gathers
        each tensor, the matrices this rank owns are orthogonalised grouped by shape (one
        batched product per product of the iteration), each tensor's results go back to the
        ranks, and each rank applies its shards (from the host: one copy down each)."""
        smap = self.shard_map
        check_training_thread(smap, "Muon")
        comm, world = smap.comm, smap.comm.world_size
        dev = smap.device
        dtype = input_dtype(self.rule, self.ns_method, self.ns_dtype)
        staged = any(t.device != dev for t, _ in batch)
        total = sum(t.numel() for t, _ in batch)
        host = self._staging(total, dtype, dev) if staged else None
        sends, at = [], 0
        for t, g in batch:
            n = t.numel()
            if t.device == dev:
                send = torch.empty(n, dtype=dtype, device=dev)
                self._mixed_into(t, g, send)
            else:
                self._mixed_into(t, g, host[at:at + n])
                send = host[at:at + n].to(dev, non_blocking=True)      # (pinned: queued, the host goes on)
            sends.append(send)
            at += n
        # every rank: the whole tensors; this rank's matrices, grouped by shape
        outs, jobs = [], {}
        for (t, _), send in zip(batch, sends):
            n = t.numel()
            if world > 1:
                full = torch.empty(world * n, dtype=dtype, device=dev)
                comm.all_gather(full, send)
                rows = full.view(world, n)
                out = torch.zeros(world, n, dtype=dtype, device=dev)    # reduce-scatter sums: zeros elsewhere
            else:
                # one rank holds whole blocks: the results overwrite the matrices' inputs
                rows = out = send.view(1, n)
            outs.append(out)
            wholes = {}
            for m in self._plans[id(t)]:
                if m.owner != comm.rank:
                    continue
                b = m.block
                size = b.hi - b.lo
                if id(b) not in wholes:     # the block put together: rank r's shard is its r-th part
                    wholes[id(b)] = rows[:, b.start:b.start + size].reshape(-1) if world > 1 else \
                        rows[0, b.start:b.start + size]
                whole = wholes[id(b)]
                jobs.setdefault(m.shape, []).append((whole[m.offset:m.offset + m.numel].view(m.shape), out, m))
        for shape, items in jobs.items():
            if len(items) == 1:
                results = [self._orthogonalize(items[0][0])]
            else:
                results = self._orthogonalize(torch.stack([x for x, _, _ in items])).unbind(0)
            for (_, out, m), o in zip(items, results):
                self._place(out, m, o.to(dtype), world)
        # every rank: its shards of the results, applied
        mines = []
        for (t, _), out in zip(batch, outs):
            n = t.numel()
            if world > 1:
                mine = torch.empty(n, dtype=dtype, device=dev)
                comm.reduce_scatter(mine, out.view(-1))
            else:
                mine = out.view(-1)
            mines.append(mine)
        if staged:
            at = 0
            for (t, _), mine in zip(batch, mines):
                if t.device != dev:
                    host[at:at + t.numel()].copy_(mine, non_blocking=True)
                at += t.numel()
            if dev.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(dev))   # (the copies' stream)
                done.synchronize()      # the host reads the results next (and the next batch reuses the buffer)
        at = 0
        for (t, g), mine in zip(batch, mines):
            n = t.numel()
            self._apply(t, g, mine if t.device == dev else host[at:at + n])
            at += n

    @staticmethod
    def _place(out: torch.Tensor, m: _Matrix, o: torch.Tensor, world: int) -> None:
        """Matrix ``m``'s result ``o`` into ``out`` (world x n): rank r's part of it in row r."""
        b = m.block
        size = b.hi - b.lo
        o = o.reshape(-1)
        if world == 1:
            out[0, b.start + m.offset:b.start + m.offset + m.numel].copy_(o)
            return
        for r in range(m.offset // size, (m.offset + m.numel - 1) // size + 1):
            x, y = max(m.offset, r * size), min(m.offset + m.numel, (r + 1) * size)
            out[r, b.start + x - r * size:b.start + y - r * size].copy_(o[x - m.offset:y - m.offset])

    def _apply(self, t: torch.Tensor, g: dict, update: torch.Tensor) -> None:
        """This rank's shard ``update`` (``t``'s layout) applied to ``t`` with each matrix's lr."""
        if g["weight_decay"]:
            t.mul_(1 - g["lr"] * g["weight_decay"])
        for m in self._plans[id(t)]:
            b = m.block
            x, y = max(b.lo, m.offset), min(b.hi, m.offset + m.numel)
            if x >= y:
                continue
            a = b.start + x - b.lo
            lr = adjusted_lr(g["lr"], self.adjust_lr, m.shape) if self.rule == "torch" else g["lr"]
            t[a:a + y - x].add_(update[a:a + y - x], alpha=-lr)

    def _staging(self, numel: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """A host buffer of ``numel`` elements for the copies to and from ``dev`` (page-locked
        for a GPU, so that they are asynchronous), kept between steps; the last batch's copies
        are done when it is handed out (its results were waited for before they were read)."""
        buf = self._host
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            pin = dev.type == "cuda" and torch.cuda.is_available()
            buf = self._host = torch.empty(max(numel, buf.numel() if buf is not None else 0), dtype=dtype,
                                           pin_memory=pin)
        return buf[:numel]

    def _orthogonalize(self, matrix: torch.Tensor) -> torch.Tensor:
        if self.rule == "torch":
            return orthogonalize_torch(matrix, self.ns_coefficients, self.ns_steps, self.ns_eps, self.ns_dtype)
        return orthogonalize_deepspeed(matrix, self.ns_steps, self.ns_method, self.ns_coefficients)

    def _apply_whole(self, t, mixed, g) -> None:
        shape = as_matrix(tuple(t.shape))
        out = self._orthogonalize(mixed.reshape(shape)).reshape(t.shape)
        lr = adjusted_lr(g["lr"], self.adjust_lr, shape) if self.rule == "torch" else g["lr"]
        t.mul_(1 - g["lr"] * g["weight_decay"])
        t.add_(out, alpha=-lr)


def _fusable(params) -> bool:
    """Whether torch's fused AdamW takes these tensors (fp32, one device type it has a kernel for)."""
    return bool(params) and len({p.device for p in params}) == 1 and all(
        p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") and (p.grad is None or p.grad.dtype == p.dtype)
        for p in params)


def state_bytes_per_param(optimizer) -> float:
    """Bytes of element-wise optimizer state per master element, as held now (benchmarks)."""
    states = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    elements = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    return states / max(1, elements)


