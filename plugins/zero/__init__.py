"""ZeRO stages 0-3 as partitioner plugins (the ``[zero]`` slot)."""
from zeroplug import hookimpl

from .partitioner import Stage0, Stage1, Stage2
from .stage3 import Stage3


@hookimpl
def zeroplug_register_partitioners(register):
    register("stage0", Stage0)
    register("stage1", Stage1)
    register("stage2", Stage2)
    register("stage3", Stage3)


@hookimpl
def zeroplug_gathered_params(params, modifier_rank):
    """Parameters sharded by ``zeroplug.init`` (stage 3) and not yet given to an engine."""
    from .partitioned_init import ShardedParam, gathered_init_params
    mine = [p for p in params if isinstance(p, ShardedParam)]
    if not mine:
        return None
    return gathered_init_params(mine, modifier_rank), mine
