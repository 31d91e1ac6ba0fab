"""Long-context training through the trainer: on a data=2 x sequence=4 mesh the
real decoder's self-attention runs as ring attention (or the all-gather baseline)
over the `sequence` axis, and a few training steps match one device."""

import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tfjax import config as C
from tfjax.nn.attention import MultiHeadAttention
from tfjax.train import Trainer

# The module (tfjax.parallel.ring_attention is also the exported function).
ring_lib = sys.modules["tfjax.parallel.ring_attention"]


def _config(**mesh):
    # seq_len 32 over sequence=4: 8 tokens a device, zig-zag chunks of 4 (T % 2n == 0).
    return C.from_dict(C.RunConfig, dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=1, position="rope", context_parallel=mesh.pop("cp", "ring")),
        train=dict(steps=3, batch_size=4, seq_len=32, warmup_steps=1, lr=1e-2, log_every=1,
                   eval_batches=1, eval_at_end=False, sample_tokens=0, progress=False),
        checkpoint=dict(enabled=False, every_steps=0, async_save=False),
        mesh=mesh))


def _losses(tmp_path, name, n, **mesh):
    tr = Trainer(_config(**mesh), str(tmp_path / name), devices=jax.devices()[:n],
                 log=lambda s: None)
    hist = tr.train()["history"]
    return [hist[k] for k in sorted(hist)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("one"), "one", 1, data=1)


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_sequence_parallel_training_matches_one_device(tmp_path, one_device, mode, monkeypatch):
    # Record which sequence-parallel attention the layer really ran.
    calls = []
    for name in ("ring_attention", "all_gather_attention"):
        inner = getattr(ring_lib, name)

        def spy(*args, _inner=inner, _name=name, **kwargs):
            calls.append(_name)
            return _inner(*args, **kwargs)

        monkeypatch.setattr(ring_lib, name, spy)
    got = _losses(tmp_path, mode, 8, data=2, sequence=4, cp=mode)
    assert len(got) == 3 == len(one_device)
    np.testing.assert_allclose(got, one_device, rtol=1e-4, atol=1e-4)
    assert set(calls) == {"ring_attention" if mode == "ring" else "all_gather_attention"}


def test_context_parallel_is_validated():
    with pytest.raises(ValueError, match="model.context_parallel"):
        _config(cp="gather").validate()
    with pytest.raises(ValueError, match="context_parallel"):
        MultiHeadAttention(32, 4, context_parallel="gather", rngs=nnx.Rngs(0))
