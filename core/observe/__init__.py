"""What the engine measures about itself: memory readings and the memory report
(:mod:`zeroplug.observe.memory`), the phases of a step (:mod:`zeroplug.observe.phases`)."""
