"""``deepspeed.runtime.zero.stage3``: its memory estimators (:mod:`.estimates`)."""
from .estimates import (estimate_zero3_model_states_mem_needs_all_cold,  # noqa: F401
                        estimate_zero3_model_states_mem_needs_all_live, model_to_params)

__all__ = ["estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold"]
