"""What the Pallas kernels share (`tfjax.ops.pallas.common`): the in-kernel hash
of BigBird's random blocks, which masks the kernels evaluate."""

import jax.numpy as jnp
import numpy as np

from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.pallas.common import _draw_random_block, mask_support, unsupported_mask


def test_in_kernel_random_block_hash_is_bit_identical_to_the_mask():
    """BigBird's random blocks are drawn in the kernels with int32-only arithmetic;
    it must give the draws of sparse_masks.RandomBlocks (uint32 hash) exactly."""
    qb = jnp.arange(0, 5000, 7, dtype=jnp.int32)
    for seed, num_blocks in ((0, 1), (7, 13), (2**31 + 5, 1000), (2**32 - 1, 2**20 + 7)):
        m = SM.RandomBlocks(3, 16, num_blocks, seed)
        for r in range(3):
            np.testing.assert_array_equal(_draw_random_block(seed, qb, r, num_blocks),
                                          m._draw(qb, r))


def test_unsupported_mask_names_the_first_kind_not_evaluated():
    """`unsupported_mask` walks `&` and `|` to the first mask kind outside the given
    ones; `mask_support` (the "pallas" record's refusal) names it."""
    class Custom(M.Mask):
        pass

    positional = (M.Causal, M.SlidingWindow)
    assert unsupported_mask(None, positional) is None
    assert unsupported_mask(M.causal() & M.sliding_window(4), positional) is None
    assert unsupported_mask(M.causal() | (M.sliding_window(4) & Custom()), positional) is Custom
    assert unsupported_mask(M.padding(np.array([3])) & Custom(), positional) is M.Padding
    assert mask_support(M.causal() & Custom()) == \
        "the pallas kernels cannot evaluate a Custom mask in a tile"
    assert mask_support(SM.bigbird(6, 3, 2, 32, seed=1, seq_len=64) & M.causal()) is None
