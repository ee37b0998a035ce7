"""``zeroplug.init`` for stage 3: build a model already sharded, never whole on a rank.

Each module's floating-point parameters are sharded as soon as that module's
``__init__`` returns: the rank keeps its slice of one padded flat buffer (an
:class:`InitGroup`), and every parameter becomes a :class:`ShardedParam`, an
``nn.Parameter`` whose own data is empty.

Note: code that runs after a module's constructor still sees whole parameters.
Hugging Face's ``post_init`` / ``_init_weights``, peft's ``reset_lora_parameters``,
``nn.init`` calls after ``to_empty``: a ShardedParam reports its whole shape, and a
torch operation that writes it runs on a whole temporary copy (gathered from the ranks'
shards), after which each rank keeps its slice again. Random initialisers therefore
draw exactly the numbers a plain build draws, in the same order. Reads gather too. So
the largest single parameter exists whole for a moment, nothing bigger; every rank
runs the same construction code, so the gathers pair up across ranks.

Note: ``from_pretrained`` builds on the meta device and then assigns the loaded tensors
(``setattr(module, name, Parameter(value))``). While ``zeroplug.init`` is active, a
parameter registration hook catches that assignment on a sharded module and keeps only
this rank's slice of the value, in the existing parameter.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch

from .flat_layout import FlatLayout

from .unit import OWN_OPS, SHAPE_OPS, NoGatherRepr, op_name

# detach() is answered from the shape too: module.state_dict() calls it on every parameter
# (from_pretrained lists its keys that way), and gathering there would hold the whole model
_SHAPE_OPS = SHAPE_OPS | {"detach"}
# conversions inside Module._apply (.to, to_empty, .half): the values stay in the shard
_CONVERSIONS = {"to", "cuda", "cpu", "empty_like", "float", "half", "bfloat16", "double", "type", "_to_copy"}

# views handed out of a gathered copy: (group, copy, its version then); written back at the
# next flush if the caller wrote through them
_pending: list = []

# the constructors PartitionedInit put in place of the classes' own (one wrapper per class,
# however many contexts are entered)
_WRAPPERS: "weakref.WeakSet" = weakref.WeakSet()


class InitGroup:
    """The floating-point parameters of one module, sharded while the model was being built."""

    def __init__(self, params, layout: FlatLayout, shard: torch.Tensor, comm, rank: int, world=None):
        # comm: the shard group (gathers); world: every rank (a modifier rank's writes, checks)
        self.params, self.layout, self.shard, self.comm, self.rank = params, layout, shard, comm, rank
        self.world = world if world is not None else comm

    def index_of(self, p) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)     # by identity, never ==

    def whole(self) -> torch.Tensor:
        """Every rank's shard, gathered (one rank: the shard itself, written in place)."""
        if self.layout.world_size == 1:
            return self.shard
        out = torch.empty(self.layout.padded, dtype=self.shard.dtype, device=self.shard.device)
        self.comm.all_gather(out, self.shard)
        return out

    def keep_slice(self, whole: torch.Tensor) -> None:
        if self.layout.world_size > 1:
            lo, hi = self.layout.shard_range(self.rank)
            self.shard.copy_(whole[lo:hi])

    def assign(self, i: int, value: torch.Tensor) -> None:
        """Parameter i := ``value`` (whole): only this rank's slice is copied, no collective."""
        lo, _ = self.layout.shard_range(self.rank)
        flat = value.detach().reshape(-1)
        for j, a, b in self.layout.shard_pieces(self.rank):
            if j == i:
                dst = self.layout.offsets[i] + a - lo
                self.shard[dst:dst + b - a].copy_(flat[a:b])

    def release(self) -> None:
        """The engine takes the parameters over: plain ``nn.Parameter`` objects again."""
        for p in self.params:
            p.__class__ = torch.nn.Parameter
            p.__dict__.pop("_zp_group", None)


def flush_pending() -> None:
    """Write back views of gathered copies that may have been written since."""
    while _pending:
        group, whole, version = _pending.pop()
        if whole._version != version:
            group.keep_slice(whole)


def materialize(group: InitGroup) -> None:
    """Give every parameter of ``group`` its whole value again (to be laid out anew)."""
    flush_pending()
    views = group.layout.views(group.whole())
    group.release()
    for p, v in zip(group.params, views):
        p.data = v.clone()


class ShardedParam(NoGatherRepr, torch.nn.Parameter):
    """A parameter built under ``zeroplug.init``: this rank's slice lives in its InitGroup."""
    _zp_where = "sharded by zeroplug.init"
    _zp_group: InitGroup        # set on each parameter as it becomes one (see init_group)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        with torch._C.DisableTorchFunctionSubclass():
            if name in OWN_OPS:
                return func(*args, **kwargs)
            me = args[0] if args and isinstance(args[0], ShardedParam) else None
            if name in _SHAPE_OPS and me is not None:
                return func(_stand_in(me), *args[1:], **kwargs)
            if name in _CONVERSIONS and me is not None:
                return me.data
            flush_pending()
            wholes: dict[int, tuple] = {}

            def whole_of(t):
                if not isinstance(t, ShardedParam):
                    return t
                g = t._zp_group
                if id(g) not in wholes:
                    w = g.whole()
                    wholes[id(g)] = (g, w, w._version)
                return g.layout.views(wholes[id(g)][1])[g.index_of(t)]

            a = [whole_of(t) for t in args]
            kw = {k: whole_of(v) for k, v in kwargs.items()}
            out = func(*a, **kw)
            for g, w, version in wholes.values():
                if w._version != version:       # written (nn.init, copy_, an in-place op)
                    g.keep_slice(w)
            if me is not None and a and out is a[0]:
                return me
            if torch.is_tensor(out):      # perhaps a view that the caller writes next
                _pending.extend((g, w, w._version) for g, w, _ in wholes.values() if g.layout.world_size > 1)
            return out


def init_group(p: torch.Tensor) -> InitGroup | None:
    """The InitGroup holding ``p``'s shard, if ``zeroplug.init`` built it and no engine took it yet."""
    return p.__dict__.get("_zp_group")


def _stand_in(p: ShardedParam) -> torch.Tensor:
    g = p._zp_group
    return torch.empty(g.layout.shapes[g.index_of(p)], dtype=p.dtype, device="meta")


class PartitionedInit:
    """The context behind ``zeroplug.init`` at stage 3.

    Note: initial values equal a plain build with the same seed because each module
    still initialises its full parameters in its own constructor, consuming the RNG
    in the same order; only then is the rank's slice kept (and later initialisers run
    on whole temporary copies, see the module docstring).
    """

    def __init__(self, run, precision, mesh=None):
        self.run, self.dtype = run, precision.param_dtype
        self.shard_comm = mesh.shard if mesh is not None else run.comm     # groups.py
        self._patched: list[tuple[type, object]] = []
        self._hook = None

    def _partition(self, module: torch.nn.Module, names=None) -> None:
        names = [n for n, p in module._parameters.items()
                 if p is not None and p.is_floating_point() and not isinstance(p, ShardedParam)
                 and (names is None or n in names)]
        if not names:
            return
        params = [module._parameters[n] for n in names]
        world, rank = self.shard_comm.world_size, self.shard_comm.rank
        layout = FlatLayout.build(params, world)
        lo, hi = layout.shard_range(rank)
        shard = torch.zeros(hi - lo, dtype=self.dtype, device=self.run.device)
        for i, a, b in layout.shard_pieces(rank):
            if not params[i].is_meta:     # meta: the values arrive later (from_pretrained, to_empty + init)
                dst = layout.offsets[i] + a - lo
                shard[dst:dst + b - a].copy_(params[i].data.reshape(-1)[a:b])
        group = InitGroup([], layout, shard, self.shard_comm, rank, self.run.comm)
        for n, p in zip(names, params):
            if p.is_meta:       # a meta tensor cannot take real data: a new parameter object
                q = torch.nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.run.device),
                                       requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                module._parameters[n] = p = q
            else:
                p.data = torch.empty(0, dtype=self.dtype, device=self.run.device)
            p.__class__ = ShardedParam
            p._zp_group = group
            group.params.append(p)
        module.__dict__["_zp_sharded"] = True

    def _on_register(self, module, name, param):
        """A parameter assigned to a module that is already sharded (weights being loaded)."""
        if param is None or not module.__dict__.get("_zp_sharded") or isinstance(param, ShardedParam):
            return None
        old = module._parameters.get(name)
        if isinstance(old, ShardedParam) and param.is_floating_point():
            g = old._zp_group
            i = g.index_of(old)
            if tuple(param.shape) == tuple(g.layout.shapes[i]):
                if not param.is_meta:
                    g.assign(i, param)
                extra = {k: v for k, v in param.__dict__.items() if not k.startswith("_zp")}
                old.__dict__.update(extra)
                old.requires_grad_(param.requires_grad)
                return old
        if param.is_floating_point() and not param.is_meta:
            module._parameters[name] = param
            self._partition(module, names={name})
            return module._parameters[name]
        return None

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or orig in _WRAPPERS:
            return
        ctx = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_zp_init_depth", 0)
            object.__setattr__(module, "_zp_init_depth", depth + 1)
            try:
                orig(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_zp_init_depth", depth)
            if depth == 0:
                ctx._partition(module)
        _WRAPPERS.add(__init__)
        cls.__init__ = __init__
        self._patched.append((cls, orig))

    def __enter__(self):
        def walk(c):
            self._wrap(c)
            for s in c.__subclasses__():
                walk(s)
        walk(torch.nn.Module)
        ctx = self
        self._orig_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kw):
            super(torch.nn.Module, cls).__init_subclass__(**kw)
            ctx._wrap(cls)
        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self._hook = torch.nn.modules.module.register_module_parameter_registration_hook(self._on_register)
        return self

    def __exit__(self, *exc):
        flush_pending()
        self._hook.remove()
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        if self._orig_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_subclass
        return False


@contextmanager
def gathered_init_params(params, modifier_rank=None):
    """Whole values of ``params`` (ShardedParam) for the block; on exit the values of rank
    ``modifier_rank`` are kept in every rank's slice (None: a write is refused).

    Note: every parameter of the groups involved is gathered (a group is one flat buffer).
    Inside, they are plain parameters whose data is a view of the gathered copy, so reads
    and writes (``p.data.copy_(loaded)`` on one rank only) run no collective."""
    from zeroplug.gathering import fingerprint
    from zeroplug.gathering import written_error
    flush_pending()
    groups: dict[int, InitGroup] = {}
    for p in params:
        groups.setdefault(id(p._zp_group), p._zp_group)
    wholes = []
    for g in groups.values():
        w = g.whole()
        w = w.clone() if w is g.shard else w       # one rank: a write must not reach the shard unchecked
        wholes.append(w)
        for p, v in zip(g.params, g.layout.views(w)):
            p.__class__ = torch.nn.Parameter
            p.data = v
    before = [fingerprint(w) for w in wholes] if modifier_rank is None else None
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        try:
            if not failed:
                if modifier_rank is not None:
                    for g, w in zip(groups.values(), wholes):
                        if g.world.distributed:
                            g.world.broadcast(w, src=modifier_rank)
                        if g.layout.world_size == 1:
                            g.shard.copy_(w)
                        else:
                            g.keep_slice(w)
                else:
                    gs = list(groups.values())
                    written = sum(len(gs[i].params) for i, w in enumerate(wholes) if fingerprint(w) != before[i])
                    # every rank raises when any rank wrote (a rank left alone would hang later)
                    if gs[0].world.all_reduce_scalar(float(written)) > 0:
                        raise written_error("parameters built by zeroplug.init")
        finally:
            for g in groups.values():
                for p in g.params:
                    p.data = torch.empty(0, dtype=g.shard.dtype, device=g.shard.device)
                    p.__class__ = ShardedParam
