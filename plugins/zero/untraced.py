"""Stage 3's hooks run as Python between compiled graphs, never traced by Dynamo."""
from __future__ import annotations

import functools

import torch


def eager(fn):
    """``fn`` run as Python even inside ``torch.compile``: a graph break, never traced.

    Note: gathers and releases resize storages and start collectives, which Dynamo and
    Inductor cannot trace (Inductor: "dynamic shapes, target: resize_storage_bytes_"). As
    FSDP2 does with its hooks, they run between the compiled graphs, so that each module's
    forward compiles over parameters that are already gathered. Dynamo never traces the
    returned hook, nor compiles its frame (a graph break where compiled code calls it);
    while Dynamo is active (the eager parts of a compiled region) the hook runs ``fn`` with
    Dynamo off, so that nothing ``fn`` calls is compiled either; otherwise it calls ``fn``
    directly (``torch._dynamo.disable``'s wrapper costs several times a hook's dispatch)."""
    untraced = torch._dynamo.disable(fn, recursive=True)
    if _dynamo_callback is None or _skip_frame is None:
        return untraced

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if _dynamo_callback() is not None:
            return untraced(*args, **kwargs)
        return fn(*args, **kwargs)
    return _skip_frame(hook)


# torch's own (private) pieces for the fast path: Dynamo's frame callback (None while no
# compiled region runs) and the marking of a function whose frame Dynamo must not compile
_dynamo_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                           "get_eval_frame_callback", None)
try:
    from torch._dynamo.decorators import skip as _skip_frame
except ImportError:     # (then every hook goes through torch._dynamo.disable)
    _skip_frame = None
