"""``deepspeed.ops``: the optimizer classes scripts build before ``deepspeed.initialize``.

They are ``torch.optim.Optimizer`` objects that hold the parameter groups and settings
(so that schedulers such as ``transformers.get_scheduler`` accept them); the engine that
``initialize`` returns steps the same update with zeroplug's optimizer (see
docs/deepspeed-api.md). Stepped on their own, outside an engine, they refuse.
"""
from . import adam, lamb

__all__ = ["adam", "lamb"]
