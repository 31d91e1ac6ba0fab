"""Parallelism: device mesh, logical-axis sharding rules, and ring attention."""

from tfjax.parallel.ring_attention import ring_attention, unzigzag, zigzag
from tfjax.parallel.sharding import logical_to_spec, shard, use_rules, with_logical_axes

__all__ = ["ring_attention", "zigzag", "unzigzag", "shard", "use_rules", "logical_to_spec",
           "with_logical_axes"]
