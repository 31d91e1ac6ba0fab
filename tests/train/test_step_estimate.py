"""XLA:TPU's step-time estimate as `tfjax.train.aot.estimated_seconds` reads it: the
raw `optimal_seconds` counts each `ConcatBitcast` custom call (the halves of a sliced
prefetch into VMEM, joined) as -1 s; the estimate adds them back."""

import pytest

from tiny_setup import tiny_config
from tfjax.train import aot


def compiled_step(vocab_size):
    cfg = tiny_config(model=dict(vocab_size=vocab_size, d_model=64),
                      train=dict(batch_size=8, seq_len=256, microbatches=1),
                      mesh=dict(fsdp=4)).validate()
    return aot.compile_step(cfg, "v5e:2x2")[0]


def raw_seconds(compiled):
    return aot.xla_cost(compiled)["optimal_seconds"]


@pytest.mark.slow
def test_a_large_vocabulary_step_is_priced_after_its_unpriced_concats():
    """With a 32768-token vocabulary the raw estimate is negative, one second per
    ConcatBitcast; the estimate is positive, under a second, and above the same step's
    with the 259-token byte vocabulary (which has none: its estimate is the raw one)."""
    pytest.importorskip("libtpu")
    small, large = compiled_step(259), compiled_step(32768)
    concats = large.as_text().count('custom_call_target="ConcatBitcast"')
    assert concats > 0 and raw_seconds(large) < 0
    assert aot.estimated_seconds(large) == pytest.approx(raw_seconds(large) + concats)
    assert 'ConcatBitcast' not in small.as_text()
    assert aot.estimated_seconds(small) == raw_seconds(small) > 0
    assert aot.estimated_seconds(small) < aot.estimated_seconds(large) < 1.0
