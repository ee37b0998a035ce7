"""A unit: the parameters that are laid out, reduced and gathered together.

Stages 0-2 form units from consecutive parameters up to ``reduce_bucket_size``
elements (one gradient bucket each); stage 3 forms one unit per module (the
parameters gathered before that module runs). Every unit owns:

* ``full``  — the model-dtype flat buffer; each parameter's ``.data`` is a view of
  it. Stage 3 frees its storage between uses (views stay valid objects).
* ``shard`` — this rank's slice of ``full`` (a view) or, when parameters are
  sharded (stage 3), a separate tensor that persists; a stage-3 unit gathered from its
  fp32 master (``lp_source``) holds none between checkpoints (its storage is freed).
* ``master`` / ``master.grad`` — the fp32 slice of this rank's optimizer shard.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from zeroplug.flat import alloc_storage, free_storage
from .flat_layout import FlatLayout
from .hpz import SecondaryShard

FREE, INFLIGHT, READY = "free", "inflight", "ready"

# what a parameter answers from its shape alone, and what it answers about itself: neither
# needs its values (shared with zeroplug.init's ShardedParam)
SHAPE_OPS = {"shape", "ndim", "dim", "size", "numel", "nelement", "is_contiguous", "stride", "__len__"}
OWN_OPS = {"dtype", "device", "requires_grad", "requires_grad_", "is_leaf", "grad", "grad_fn", "data",
           "is_floating_point", "is_complex", "element_size", "is_cuda", "is_meta", "is_sparse", "layout",
           "names", "_is_view", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
           "__hash__", "_backward_hooks", "_post_accumulate_grad_hooks", "__setstate__", "_base", "is_shared",
           "untyped_storage", "data_ptr", "storage_offset", "itemsize", "nbytes", "is_pinned", "__set__"}
METADATA_OPS = SHAPE_OPS | OWN_OPS


class NoGatherRepr:
    """``repr`` / ``format`` of a parameter whose values are sharded: a description, never a
    gather (a log line on one rank must not wait for the others)."""

    def __repr__(self):
        return f"Parameter(shape={tuple(self.shape)}, dtype={self.dtype}; {self._zp_where})"

    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)


def op_name(func) -> str:
    """The name of a torch function, or of the property a getter / setter belongs to."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return "__set__" if name == "__set__" else owner or name
    return name


#: each released parameter's gather of its unit (Unit.fetch_on_read). Note: kept beside the
#: parameters, not on them: an attribute would travel with the parameter into a pickle
#: (``torch.save(p)``, ``copy.deepcopy``), and a closure over the engine cannot be pickled.
FETCH_ON_READ: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ReleasedParam(NoGatherRepr, torch.nn.Parameter):
    """A stage-3 parameter whose unit is released (its values are on the ranks' shards).

    Note: a module's own forward gathers its unit before it runs. A parameter read
    anywhere else (``h @ model.lm_head.weight.t()`` in a loss of one's own) would read freed
    memory; as a ReleasedParam it gathers its unit first, which then stays until its
    gradient is reduced (or the next forward). Every rank runs the same code, so the
    gathers pair up. While a unit is gathered its parameters are plain ``nn.Parameter``
    objects: modules' forwards pay nothing for this."""

    def __repr__(self):
        return (f"Parameter(shape={tuple(self.shape)}, dtype={self.dtype}; ZeRO stage 3 shard, "
                "gathered on use)")

    __str__ = __repr__

    def __format__(self, spec):      # no gather: a log line on one rank must not wait for the others
        return repr(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_name(func) not in METADATA_OPS:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, ReleasedParam):
                    FETCH_ON_READ[t]()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


#: elements of the fp32 device buffer a master goes up through before its cast (64 MiB)
UPLOAD_CHUNK = 1 << 24


def cast_upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``src`` (fp32, host) into ``dst`` (model dtype, device) on the current stream: each
    chunk copied up into an fp32 buffer, then cast. Note: one chunk buffer at a time (the
    copies and casts run in order on one stream), not an fp32 copy of the whole unit."""
    n = dst.numel()
    buf = torch.empty(min(n, UPLOAD_CHUNK), dtype=src.dtype, device=dst.device)
    for s in range(0, n, UPLOAD_CHUNK):
        e = min(n, s + UPLOAD_CHUNK)
        buf[:e - s].copy_(src[s:e], non_blocking=True)
        dst[s:e].copy_(buf[:e - s])


class Unit:
    def __init__(self, index: int, params: list[torch.nn.Parameter], layout: FlatLayout,
                 full: torch.Tensor, rank: int, sharded_params: bool, shard: torch.Tensor | None = None,
                 source=None):
        self.index = index
        #: where its gathered parameters come from (param_sources.py), decided at setup
        self.source = source
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self.position = {p: i for i, p in enumerate(params)}   # keyed by identity
        self.layout = layout
        self.full = full
        self.lo, self.hi = layout.shard_range(rank)
        self.sharded_params = sharded_params
        self.shard = shard if shard is not None else full[self.lo:self.hi]
        self.master: torch.Tensor | None = None
        # stage 3 without model-dtype shards: the fp32 master, cast into the gathered buffer
        self.lp_source: torch.Tensor | None = None
        self.grad_flat: torch.Tensor | None = None     # stages 0-1: persistent, params' .grad are views
        self.grad_views: list[torch.Tensor] = []       # ... each parameter's view of it
        self.group = 0                                 # the parameter group (param_groups.py)
        self.bucket: torch.Tensor | None = None        # stages 2-3: transient, filled by the hooks
        self.pending = len(self.trainable)
        self.reduce_handle = None
        self.reduce_out: torch.Tensor | None = None
        self.reduced = False
        self.ready = False              # gradients complete, reduction waiting for its turn
        self.window_fresh = True        # not reduced yet in this accumulation window
        self.expect: set[int] | None = None     # stage 3 leaf: ids of the parameters this backward reaches
        self.partial = False                    # ... and this backward waits for those only
        # stage 3 gathering
        self.secondary: SecondaryShard | None = None    # ZeRO++ hpZ (hpz.py)
        self.state = READY
        self.gather_handle = None
        self.upload_event = None        # the CUDA event of the last upload of an offloaded shard
        self.persistent = not sharded_params

    @property
    def numel(self) -> int:
        return self.layout.padded

    def bind_params(self) -> None:
        """Point every parameter's ``.data`` at its view of ``full`` (storage kept as it was)."""
        freed = self.full.untyped_storage().size() == 0
        alloc_storage(self.full)
        for p, v in zip(self.params, self.layout.views(self.full)):
            p.data = v
        if freed:
            free_storage(self.full)

    def fetch_on_read(self, fetch: Callable[[], None]) -> None:
        """``fetch()`` gathers this unit when a parameter of it is read while it is released
        (:class:`ReleasedParam`)."""
        for p in self.params:
            FETCH_ON_READ[p] = fetch

    # -- stage 3: gather / release ------------------------------------------------
    def start_gather(self, comm, upload=None) -> None:
        if self.state != FREE:
            return
        alloc_storage(self.full)
        self.gather_handle = self.fill_full(comm, upload)
        self.state = INFLIGHT

    def fill_full(self, comm, upload=None):
        """Start filling ``full`` from this unit's source (:mod:`.param_sources`: every rank's
        shard gathered, a shard in host memory uploaded first on the ``upload`` stream, the
        fp32 master cast; an hpZ secondary shard gathered within its group); returns a handle
        to wait on."""
        return self.source.fill(self, comm, upload)

    def wait_gather(self) -> None:
        if self.state == INFLIGHT:
            self.gather_handle.wait()
            self.gather_handle = None
            self.state = READY
            self.source.gathered(self)
            for p in self.params:
                p.__class__ = torch.nn.Parameter

    def release(self) -> None:
        """Free the gathered copy; waits for an in-flight gather first (never "still in flight")."""
        if self.persistent or self.state == FREE:
            return
        self.wait_gather()
        self.mark_free()

    def mark_free(self) -> None:
        free_storage(self.full)
        self.state = FREE
        for p in self.params:
            p.__class__ = ReleasedParam
