"""DeepSpeed's model-state memory estimators, with zeroplug's numbers.

``estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1)``
(and ``_all_cold(total_params, ...)``, and the ZeRO-3 pair) print DeepSpeed's table, line
for line::

    Estimated memory needed for params, optim states and gradients for a:
    HW: Setup with 1 node, 2 GPUs per node.
    SW: Model with 124M total params.
      per CPU  |  per GPU |   Options
        2.09GB |   0.23GB | offload_optimizer=cpu
        1.39GB |   1.16GB | offload_optimizer=none

The per-GPU column is what zeroplug keeps on each device at the optimizer step for that
choice (``zeroplug estimate``'s model: 16-bit parameters, fp32 masters, gradients, Adam's
two moments; at stage 3 the largest layer gathered whole); the per-CPU column is the host
memory of one node: its ranks' offloaded states, or building the model in fp32 on the host
(each rank, whole; with ``zero_init`` one layer at a time), whichever is larger, times
``additional_buffer_factor`` as DeepSpeed counts it.
"""
from __future__ import annotations

GB = 2 ** 30


def model_to_params(model) -> tuple[int, int]:
    """(distinct parameter elements, largest single module's own parameter elements)."""
    total = sum({p.data_ptr() if p.device.type != "meta" else id(p): p.numel()
                 for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _per_rank(total_params, stage, gpus, offload_optimizer, offload_param):
    from zeroplug.tools.probe import estimate_model_states
    e = estimate_model_states(int(total_params), stage, gpus, 2, offload_optimizer, offload_param)
    return e["device"], e["host"]


def _header(num_gpus_per_node, num_nodes, model_line):
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
          f"SW: {model_line}")
    print("  per CPU  |  per GPU |   Options")


def _row(cpu, gpu, options):
    print(f" {cpu / GB:7.2f}GB | {gpu / GB:6.2f}GB | {options}")


def zero2_rows(total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5):
    """[(cpu bytes per node, gpu bytes per GPU, options)] for offload_optimizer cpu / none."""
    gpus = num_gpus_per_node * num_nodes
    rows = []
    for offload in (True, False):
        dev, host = _per_rank(total_params, 2, gpus, offload, False)
        build = 4 * total_params * num_gpus_per_node
        cpu = max(host * num_gpus_per_node, build) * additional_buffer_factor
        rows.append((int(cpu), int(dev), f"offload_optimizer={'cpu ' if offload else 'none'}"))
    return rows


def zero3_rows(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
               additional_buffer_factor=1.5):
    """DeepSpeed's ZeRO-3 rows: offload of params and optimizer, with and without zero_init."""
    gpus = num_gpus_per_node * num_nodes
    layer = 4 * largest_layer_params            # the gathered layer (and its gradient) in 16-bit
    rows = []
    for offload_opt in (True, False):
        for offload_param in (True, False):
            if offload_param and not offload_opt:
                continue
            for zero_init in (True, False):
                dev, host = _per_rank(total_params, 3, gpus, offload_opt, offload_param)
                build = (4 * largest_layer_params if zero_init else 4 * total_params) * num_gpus_per_node
                cpu = max(host * num_gpus_per_node, build) * additional_buffer_factor
                rows.append((int(cpu), int(dev + layer),
                             f"offload_param={'cpu ' if offload_param else 'none'}, "
                             f"offload_optimizer={'cpu ' if offload_opt else 'none'}, zero_init={int(zero_init)}"))
    return rows


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Print the ZeRO-2 table for ``total_params`` parameters (no model needed)."""
    _header(num_gpus_per_node, num_nodes, f"Model with {int(total_params / 1e6)}M total params.")
    for row in zero2_rows(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor):
        _row(*row)


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Print the ZeRO-2 table for ``model``."""
    estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model)[0], num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """Print the ZeRO-3 table for ``total_params`` parameters, the largest layer holding
    ``largest_layer_params``."""
    _header(num_gpus_per_node, num_nodes, f"Model with {int(total_params / 1e6)}M total params, "
                                          f"{int(largest_layer_params / 1e6)}M largest layer params.")
    for row in zero3_rows(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                          additional_buffer_factor):
        _row(*row)


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Print the ZeRO-3 table for ``model``."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)
