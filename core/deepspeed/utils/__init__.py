"""``deepspeed.utils``: ``zero_to_fp32`` (the fp32 weights of a ZeRO checkpoint) and the
stage-3 leaf modules (``set_z3_leaf_modules``: a module gathered whole, on every rank, such
as a mixture of experts whose experts a rank may not call)."""
from zeroplug import get_leaf_modules as get_z3_leaf_modules
from zeroplug import is_leaf_module as z3_leaf_module
from zeroplug import set_leaf_modules as set_z3_leaf_modules
from zeroplug import unset_leaf_modules as unset_z3_leaf_modules

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module"]
