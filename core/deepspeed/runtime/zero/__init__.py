"""``deepspeed.runtime.zero``: ``stage_1_and_2`` and ``stage3``'s memory estimators."""
