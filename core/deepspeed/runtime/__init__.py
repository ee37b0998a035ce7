"""``deepspeed.runtime``: the memory estimators under their DeepSpeed module paths."""
