"""``deepspeed.zero``: ``Init`` (build a model already partitioned) and ``GatheredParameters``
(whole parameters for a block; writes made by ``modifier_rank`` reach every rank)."""
from __future__ import annotations

import torch

from zeroplug.errors import ConfigError
from zeroplug.gathering import gathered_parameters

__all__ = ["Init", "MiCS_Init", "GatheredParameters", "register_external_parameter"]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = build()``: zeroplug.init
    at ZeRO stage 3 (every module's parameters sharded as its constructor returns).

    ``config_dict_or_path`` / ``config``: the config that ``initialize`` gets (its precision
    and world size must match); none: stage 3 in ``dtype`` (fp32 by default). ``remote_device``
    and ``pin_memory`` are accepted: the shards move to the ``offload_param`` tier of the
    config at ``initialize``. ``enabled=False``: a plain build."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None,
                 param_swapper=None, **_unused):
        if module is not None and enabled:
            raise ConfigError("deepspeed.zero.Init(module=...) partitions an existing model: zeroplug partitions "
                              "it in deepspeed.initialize; build inside `with deepspeed.zero.Init():` to never "
                              "hold it whole", key="zero.Init.module")
        for name, value in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                            ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group)):
            if value is not None:
                raise ConfigError(f"deepspeed.zero.Init({name}=...): zeroplug shards over every rank of the "
                                  "default process group; leave it out", key=f"zero.Init.{name}")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ConfigError("deepspeed.zero.Init(zero_quantized_weights=True): zeroplug gathers weights in the "
                              "model dtype (no ZeRO++ quantized weights); leave it out", key="zero.Init")
        if dtype is not None and dtype not in _DTYPES:
            raise ConfigError(f"deepspeed.zero.Init(dtype={dtype}): zeroplug trains fp32, bf16 or fp16",
                              key="zero.Init.dtype")
        self.enabled = enabled
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype
        self._ctx = None

    def _overrides(self) -> list:
        from zeroplug.config import load
        if self.config is None:
            return [("zero.plugin", "stage3"), ("precision.plugin", _DTYPES.get(self.dtype, "fp32"))]
        cfg = load(self.config)
        out = [] if cfg.slot("zero").name == "stage3" else [("zero.plugin", "stage3")]
        if self.dtype is not None and _DTYPES[self.dtype] != cfg.slot("precision").name:
            raise ConfigError(f"deepspeed.zero.Init(dtype={self.dtype}) but the config trains "
                              f"{cfg.slot('precision').name}: leave dtype out (the config's is used)",
                              key="zero.Init.dtype")
        return out

    def __enter__(self):
        if not self.enabled:
            return self
        import zeroplug
        self._ctx = zeroplug.init(self.config, self._overrides())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is None:
            return False
        ctx, self._ctx = self._ctx, None
        return ctx.__exit__(*exc)


class MiCS_Init(Init):
    """``with deepspeed.zero.MiCS_Init(config_dict_or_path=ds_config): model = build()``: as
    :class:`Init`, sharded within the groups of the config's ``mics_shard_size`` ranks
    (``zero.shard_group_size``), as ``initialize`` then trains them."""


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0): ...``: inside, each
    parameter of ``params`` (one, or an iterable) holds its whole value on every rank (every
    rank must enter with the same parameters). On exit, with ``modifier_rank``: the values of
    that rank are partitioned again to every rank (into the fp32 master weights too, after
    ``initialize``); without it, parameters written inside are refused (StateError), never
    dropped silently. ``fwd_module`` is accepted (zeroplug gathers parameters read outside a
    module's forward itself). ``enabled=False``: nothing happens."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled = enabled
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)] if enabled else []
        self.modifier_rank = modifier_rank
        self._ctx = None

    def __enter__(self):
        if not self.enabled or not self.params:
            return None
        self._ctx = gathered_parameters(self.params, self.modifier_rank)
        self._ctx.__enter__()
        return None

    def __exit__(self, *exc):
        if self._ctx is None:
            return False
        ctx, self._ctx = self._ctx, None
        return ctx.__exit__(*exc)


def register_external_parameter(module, parameter) -> None:
    """Accepted: zeroplug gathers a parameter read outside its module's forward on use."""
