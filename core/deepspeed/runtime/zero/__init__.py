"""``deepspeed.runtime.zero``: ``stage_1_and_2`` / ``stage3`` (their memory estimators) and
``partition_parameters`` (``Init``, ``GatheredParameters``)."""
