"""``deepspeed.ops.lamb``: zeroplug has no LAMB optimizer; building one refuses with the
alternative."""
from __future__ import annotations

from .optimizer import refuse

__all__ = ["FusedLamb"]

LAMB_ALTERNATIVE = ("zeroplug has no LAMB optimizer; use deepspeed.ops.adam.FusedAdam or "
                    "torch.optim.AdamW (zeroplug's adamw), retuning the learning rate")


class FusedLamb:
    """Refused: ``FusedLamb(...)`` raises ConfigError naming the alternative."""

    def __init__(self, *args, **kwargs):
        refuse("deepspeed.ops.lamb.FusedLamb", LAMB_ALTERNATIVE)
