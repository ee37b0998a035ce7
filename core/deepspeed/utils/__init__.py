"""``deepspeed.utils``: ``zero_to_fp32`` (the fp32 weights of a ZeRO checkpoint)."""
