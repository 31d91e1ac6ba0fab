"""Decode-shaped requests (`tfjax.ops.pallas.decode`): how many chunks a GPU's
grid splits the keys into. Packing and splitting through `flash_attention`:
test_pallas.py; their numerics: test_implementations.py (mosaic_tpu's decode cases)."""

from tfjax.ops.pallas.decode import auto_kv_splits


def test_auto_kv_splits_fill_the_gpu():
    """Two programs per SM: a batch-1 decode step over a 32k cache with 8 kv heads
    (8 programs) splits into 32 chunks of 1k keys (a divisor of S, at most S / 512);
    a grid already two per SM, or a short cache, does not split."""
    assert auto_kv_splits(1, 8, 4, 32768, 128, 132) == 32
    assert auto_kv_splits(1, 8, 4, 3000, 128, 132) == 5  # 5 chunks of 600 keys
    assert auto_kv_splits(64, 8, 4, 32768, 128, 132) == 1
    assert auto_kv_splits(1, 8, 4, 1000, 128, 132) == 1
    assert auto_kv_splits(1, 32, 2048, 32768, 128, 132) == 1  # a 2k chunk: 512 programs
    assert auto_kv_splits(1, 32, 1024, 32768, 128, 132) == 2  # 1k: 256 < 264
