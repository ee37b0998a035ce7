"""What loading a checkpoint into a partitioner checks and installs: the model it fits,
that the pieces cover each segment exactly once, the optimizer states' dtypes and
hyper-parameters, and the optimizer state itself (:mod:`.checkpointing` walks the files)."""
from __future__ import annotations

import torch

from zeroplug.checkpoint import CheckpointError

from .state_blocks import codes_buffers

# optimizer hyper-parameters that a checkpoint does not override: lr follows the
# schedule; the rest choose kernels, which the current config decides
GROUP_KEYS_KEPT = {"params", "lr", "fused", "foreach", "capturable", "differentiable"}


def check_model(saved: dict, mine: dict, where) -> None:
    sp, mp = saved["params"], mine["params"]
    missing = sorted(set(mp) - set(sp))
    unexpected = sorted(set(sp) - set(mp))
    shapes = [f"{n}: checkpoint {tuple(sp[n]['shape'])}, model {tuple(mp[n]['shape'])}"
              for n in sorted(set(sp) & set(mp)) if list(sp[n]["shape"]) != list(mp[n]["shape"])]
    sk = {k for k, _ in saved["state_dict"]}
    mk = {k for k, _ in mine["state_dict"]}
    missing += sorted(k for k in mk - sk if k not in missing)
    unexpected += sorted(k for k in sk - mk if k not in unexpected)
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                parts.append(f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}")
        raise CheckpointError(f"checkpoint {where} does not fit this model ({'; '.join(parts)})")


def check_covered(spans: list[tuple[int, int]], s, where: str) -> None:
    """The pieces that fall into ``s`` hold each of its elements exactly once."""
    at = s.a
    for x, y in sorted(spans):
        if x != at:
            what = "twice" if x < at else "not at all"
            raise CheckpointError(f"checkpoint {where} holds element {min(x, at)} of {s.name!r} {what} "
                                  f"(this rank needs [{s.a}, {s.b}))")
        at = y
    if at != s.b:
        raise CheckpointError(f"checkpoint {where} holds {at - s.a} of the elements [{s.a}, {s.b}) "
                              f"of {s.name!r} that this rank needs")


def check_optimizer(where: str, optimizer, seen: dict, keys: dict, groups) -> None:
    """The optimizer states and hyper-parameters the load would install: of the dtypes the
    checkpoint declares, and hyper-parameters of the kinds the optimizer has."""
    for key, dt in seen.items():
        if key not in keys or str(dt).replace('torch.', '') != keys[key]:
            raise CheckpointError(f"checkpoint {where}: optimizer state {key!r} ({str(dt).replace('torch.', '')}) is not one "
                                  f"its optim_keys declare ({', '.join(f'{k}: {v}' for k, v in keys.items()) or 'none'})")
    if not groups or not optimizer.param_groups:
        return
    from zeroplug.checkpoint.validate import Fields, check_like
    bad = Fields(f"checkpoint {where}: model.optim_groups[0]")
    cur = optimizer.param_groups[0]
    for key, v in groups[0].items():
        if key in cur and key not in GROUP_KEYS_KEPT:
            check_like(v, cur[key], bad, key, signs=False)


def state_buffer(optimizer, master: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    """Where a state's loaded values go: the live state tensor when there is one (no second
    copy of the optimizer states while loading into a trained engine), else a new one."""
    cur = (optimizer.state.get(master) or {}).get(key)
    if torch.is_tensor(cur) and cur.shape == master.shape and cur.dtype == dtype:
        return cur
    return torch.zeros(master.shape, dtype=dtype, device=master.device)


def install_optimizer_state(optimizer, masters, new_state, scalars, keys, groups) -> None:
    index, i = {}, 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            index[id(p)] = i
            i += 1
    state = {}
    if keys:                # the checkpoint had optimizer state (else: none, as when it was saved)
        for k, t in enumerate(masters):
            st = new_state[k]
            # a master that got states from the checkpoint keeps those (an optimizer may hold
            # different ones per master); one that got none (only padding on this rank) gets all
            for key, dt in (keys.items() if not any(key in st for key in keys) else ()):
                if key in st:
                    continue
                if dt in ("int8", "uint8"):     # a master that is only padding on this rank
                    codes_buffers(optimizer, t, key, getattr(torch, dt), st)
                else:
                    st[key] = state_buffer(optimizer, t, key, getattr(torch, dt)).zero_()
            for key, v in scalars.items():
                st[key] = v.clone() if torch.is_tensor(v) else v
            if id(t) not in index:
                raise CheckpointError("a master tensor is not a parameter of the optimizer")
            state[index[id(t)]] = st
    cur = optimizer.state_dict()["param_groups"]
    if groups:          # one group's hyper-parameters (every group has the same), applied to all
        for g in cur:
            for key, v in groups[0].items():
                if key in g and key not in GROUP_KEYS_KEPT:
                    g[key] = v
    optimizer.load_state_dict({"state": state, "param_groups": cur})
