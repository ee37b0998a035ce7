"""Commands built on the engine that are not part of a training step: ``zeroplug tune``
(choose a stage and offload for a model on this machine) and ``zeroplug report`` (one
picture of a run). Imported only by the command that needs them."""
