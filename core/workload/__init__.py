"""What ``zeroplug train`` trains: the reference GPT (:mod:`.models`, the presets of the
reference workload) on a byte-level corpus (:mod:`.data`, the Python standard library's
own sources by default). Outside the core: it only uses the public surface."""
