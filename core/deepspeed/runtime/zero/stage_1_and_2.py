"""``deepspeed.runtime.zero.stage_1_and_2``: its memory estimators (:mod:`.estimates`)."""
from .estimates import (estimate_zero2_model_states_mem_needs_all_cold,  # noqa: F401
                        estimate_zero2_model_states_mem_needs_all_live, model_to_params)

__all__ = ["estimate_zero2_model_states_mem_needs_all_live", "estimate_zero2_model_states_mem_needs_all_cold"]
