"""The phases of a step, as the engine announces them (``zeroplug_phase``)."""

#: in step order; "other" is the time between two steps (the training loop's own work:
#: data, logging, evaluation)
PHASES = ("forward", "backward", "wait_gradients", "optimizer", "other")
