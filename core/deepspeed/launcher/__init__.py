"""``deepspeed.launcher``: the ``deepspeed`` command line, run by torchrun (see :mod:`.runner`)."""
