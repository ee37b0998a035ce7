"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``Init`` and
``GatheredParameters`` (scripts import them from here too) and ``ZeroParamStatus``.

Note: zeroplug's parameters carry no ``ds_id`` / ``ds_status``; code that checks for them
(``hasattr(p, "ds_id")``) takes its path for whole parameters, and a stage-3 parameter read
there is gathered on use (every rank runs the same code).
"""
from __future__ import annotations

from enum import Enum

from zeroplug.deepspeed.zero import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]


class ZeroParamStatus(Enum):
    # parameters are fully present and ready for use on all processes
    AVAILABLE = 1
    # parameters are either partitioned or remote in some or all process
    NOT_AVAILABLE = 2
    # parameters are being gathered
    INFLIGHT = 3
