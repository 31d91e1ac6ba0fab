"""Parallelism: the device mesh, logical-axis sharding, and attention across devices.

`mesh` (the five-axis mesh, `make_mesh`, within and across slices), `rules` and
`sharding` (logical axis names -> mesh axes; `use_rules`, `shard`), `per_device`
(kernels XLA cannot partition, once per device), `zigzag`, `ring_attention` (ring and
all-gather attention), `ulysses` (Ulysses and USP), `context_parallel` (a layer's
choice among them), `mask_leaves` (a mask's leaves through `shard_map`) and
`collectives` (a compiled program's collectives). The attributes
`tfjax.parallel.ring_attention` and `tfjax.parallel.zigzag` are the functions, not the
modules: import other names from the modules. See docs/long_context.md.
"""

from tfjax.parallel.context_parallel import CONTEXT_PARALLEL_MODES, context_parallel_attention
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.per_device import batch_sharded_attention
from tfjax.parallel.ring_attention import all_gather_attention, ring_attention
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import (active_mesh, logical_to_spec, shard, use_rules,
                                     with_logical_axes)
from tfjax.parallel.ulysses import ulysses_attention
from tfjax.parallel.zigzag import (ZIGZAG_MODES, unzigzag, zigzag, zigzag_data,
                                   zigzag_data_devices, zigzag_order)

__all__ = ["CONTEXT_PARALLEL_MODES", "ZIGZAG_MODES", "active_mesh", "all_gather_attention",
           "batch_sharded_attention", "context_parallel_attention", "logical_rules",
           "logical_to_spec", "make_mesh", "ring_attention", "shard", "tree_shardings",
           "ulysses_attention", "unzigzag", "use_rules", "with_logical_axes", "zigzag",
           "zigzag_data", "zigzag_data_devices", "zigzag_order"]
