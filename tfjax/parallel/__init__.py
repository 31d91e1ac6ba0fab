"""Parallelism: the device mesh, logical-axis sharding, and attention across devices.

One module per concept:

- `mesh`: the five-axis device mesh (`make_mesh`).
- `rules`: logical axis names -> mesh axes for trees of parameters and state.
- `sharding`: the active mesh and rules (`use_rules`), `shard` for activations,
  `logical_to_spec`; `use_rules` targets the ops at the mesh (`tfjax.ops.target`).
- `per_device`: run an attention implementation XLA cannot partition once per
  device (`batch_sharded_attention`, the runner `use_rules` hands the ops).
- `zigzag`: the zig-zag layout that balances causal ring attention, and the
  `zigzag_data` trace context of a batch already in that order.
- `ring_attention`: ring attention and the all-gather baseline.
- `context_parallel`: the layer-level choice between them
  (`context_parallel_attention`).
- `mask_leaves`: how a mask and position biases pass through `shard_map` (used by
  the attention modules above).

The functions `ring_attention` and `zigzag` exported here share their modules'
names, so `tfjax.parallel.ring_attention` / `tfjax.parallel.zigzag` as attributes
are the functions; import other names from the modules with `from
tfjax.parallel.zigzag import zigzag_data`.
"""

from tfjax.parallel.context_parallel import CONTEXT_PARALLEL_MODES, context_parallel_attention
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.per_device import batch_sharded_attention
from tfjax.parallel.ring_attention import all_gather_attention, ring_attention
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import (active_mesh, logical_to_spec, shard, use_rules,
                                     with_logical_axes)
from tfjax.parallel.zigzag import (ZIGZAG_MODES, unzigzag, zigzag, zigzag_data,
                                   zigzag_data_devices, zigzag_order)

__all__ = ["CONTEXT_PARALLEL_MODES", "ZIGZAG_MODES", "active_mesh", "all_gather_attention",
           "batch_sharded_attention", "context_parallel_attention", "logical_rules",
           "logical_to_spec", "make_mesh", "ring_attention", "shard", "tree_shardings",
           "unzigzag", "use_rules", "with_logical_axes", "zigzag", "zigzag_data",
           "zigzag_data_devices", "zigzag_order"]
