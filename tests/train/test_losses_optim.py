"""Masked loss, z-loss, bits per byte, the schedule, the weight-decay mask, config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import config as C
from tfjax.train.losses import bits_per_byte, cross_entropy_sums
from tfjax.train.metrics import flops_per_token
from tfjax.train.optim import decay_mask, lr_schedule


def test_masked_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5))
    mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    nbytes = np.array([[1, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    out = cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask),
                             jnp.asarray(nbytes))
    lse = np.log(np.exp(logits).sum(-1))
    nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(out["nll"], (nll * mask).sum(), rtol=1e-5)
    np.testing.assert_allclose(out["z"], (lse ** 2 * mask).sum(), rtol=1e-5)
    assert out["tokens"] == mask.sum() and out["bytes"] == (nbytes * mask).sum()
    assert bits_per_byte(out["nll"], out["bytes"]) == pytest.approx(
        float(out["nll"]) / math.log(2) / float(out["bytes"]))
    # masked positions get no gradient, whatever their logits
    g = jax.grad(lambda l: cross_entropy_sums(l, targets, mask)["nll"])(jnp.asarray(logits))
    assert np.abs(np.asarray(g)[mask == 0]).max() == 0


def test_warmup_cosine_schedule():
    cfg = C.TrainConfig(steps=110, lr=1.0, warmup_steps=10, lr_min_ratio=0.1)
    f = lr_schedule(cfg)
    assert float(f(0)) == pytest.approx(0.1)
    assert float(f(9)) == pytest.approx(1.0)
    assert float(f(10)) == pytest.approx(1.0)
    assert float(f(60)) == pytest.approx(0.55, rel=1e-5)
    assert float(f(110)) == pytest.approx(0.1)
    const = lr_schedule(C.TrainConfig(steps=10, lr=2.0, warmup_steps=0, schedule="constant"))
    assert float(const(5)) == 2.0


def test_weight_decay_mask():
    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)), out_sharding=("embed", "mlp"))
            self.stacked_bias = nnx.Param(jnp.ones((3, 4)), out_sharding=("layers", "mlp"))
            self.stacked_w = nnx.Param(jnp.ones((3, 4, 4)), out_sharding=("layers", "embed", "mlp"))
            self.scale = nnx.Param(jnp.ones((4,)))

    with nnx.use_eager_sharding(False):
        params = nnx.state(M(), nnx.Param)
    mask = decay_mask(params)
    got = {k: bool(v.get_value()) for k, v in mask.items()}
    assert got == dict(w=True, stacked_bias=False, stacked_w=True, scale=False)


def test_flops_formula():
    m = C.ModelConfig(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128,
                      vocab_size=100, activation="swiglu")
    p = 2 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128) + 64 * 100
    assert flops_per_token(m, 32) == 3 * (2 * p + 2 * 2 * 32 * 4 * 16)


@pytest.mark.parametrize("section,values,message", [
    ("train", dict(batch_size=0), "train.batch_size: must be > 0"),
    ("train", dict(batch_size=10, microbatches=4), "train.batch_size: 10 is not divisible by train.microbatches=4"),
    ("train", dict(schedule="step"), "train.schedule: got 'step'; allowed: 'cosine', 'constant', 'linear', 'wsd'"),
    ("train", dict(b2=1.0), r"train.b2: must be in \[0, 1\)"),
    ("data", dict(source="web"), "data.source: got 'web'"),
    ("data", dict(source="text"), "data.paths: data.source='text' needs files"),
    ("data", dict(paths=("a.txt",)), "data.paths: the stdlib corpus takes no paths"),
    ("checkpoint", dict(keep=0), "checkpoint.keep: must be > 0"),
    ("train", dict(stepz=3), "train.stepz: unknown field"),
])
def test_config_errors_name_the_field(section, values, message):
    with pytest.raises(ValueError, match=message):
        C.from_dict(C.RunConfig, {section: values}).validate()
