"""μP (`model.mup_base_width`, tfjax.models.mup): identical to the standard model at
the base width; at m x the base width each class's init and Adam update scale as
Table 3 of Tensor Programs V says; and the coordinate check: the change of the
logits after a few Adam steps stays put across widths with μP and grows with width
without it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tfjax import config as C
from tfjax import models
from tfjax.models import mup
from tfjax.train.optim import make_optimizer

BASE = dict(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, norm="rmsnorm",
            activation="swiglu", position="rope", max_len=64, tie_embeddings=False)


def model_cfg(width, base=0, **kw):
    return C.model_config(dict(BASE, d_model=width, d_ff=2 * width, mup_base_width=base, **kw))


def first_update(tx, params, grads):
    """The optimizer's first update, jitted (eager optax compiles every op on its own)."""
    return jax.jit(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads)


def params_of(cfg):
    return {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(
                nnx.state(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param),
                is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}


def test_at_the_base_width_mup_is_the_standard_model():
    sp, mu = model_cfg(32), model_cfg(32, base=32)
    assert mu.attention_scale == sp.attention_scale and mu.logits_multiplier == 1.0
    a, b = params_of(sp), params_of(mu)
    for k in a:
        np.testing.assert_array_equal(a[k].get_value(), b[k].get_value(), err_msg=k)
    tx_sp = make_optimizer(C.TrainConfig(), sp)
    tx_mu = make_optimizer(C.TrainConfig(), mu)
    p = nnx.state(models.build(sp, rngs=nnx.Rngs(0)), nnx.Param)
    g = jax.tree.map(lambda v: v.replace(jnp.ones_like(v.get_value())), p,
                     is_leaf=lambda x: isinstance(x, nnx.Variable))
    u_sp, u_mu = first_update(tx_sp, p, g), first_update(tx_mu, p, g)
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), u_sp, u_mu)))


def test_classes_init_lr_attention_and_logits_scale_with_the_width():
    m = 4
    sp, mu = model_cfg(128), model_cfg(128, base=32)
    a, b = params_of(sp), params_of(mu)
    kinds = {k: mup.classify(v) for k, v in b.items()}
    hidden = {k for k, c in kinds.items() if c == "hidden"}
    assert {k.split("/")[-2] + "/" + k.split("/")[-1] for k in hidden} == {
        "q/kernel", "k/kernel", "v/kernel", "o/kernel", "ffn/wi_gate", "ffn/wi_up", "ffn/wo"} or all(
        any(p in k for p in ("attn/q", "attn/k", "attn/v", "attn/o", "ffn/wi", "ffn/wo"))
        for k in hidden)
    assert kinds["embed/tokens/embedding"] == "input" and kinds["embed/head/kernel"] == "readout"
    assert kinds["final_norm/scale"] == "input"
    for k in a:  # same draws, rescaled: hidden x 1/sqrt(m), the rest untouched
        want = a[k].get_value() * (0.5 if k in hidden else 1.0)
        np.testing.assert_allclose(b[k].get_value(), want, rtol=1e-6, err_msg=k)
    # attention: 1/head_dim, equal to the standard 1/sqrt at the base head dim (32 / 4)
    assert mu.attention_scale == pytest.approx(np.sqrt(8) / 32)
    assert sp.attention_scale == pytest.approx(32 ** -0.5)
    assert mu.logits_multiplier == pytest.approx(1 / m)
    # Adam: the hidden matrices' updates are 1/m of the standard ones, the rest equal
    p = nnx.state(models.build(sp, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    g = jax.tree.map(lambda v: v.replace(jnp.asarray(rng.normal(size=v.shape), jnp.float32)),
                     p, is_leaf=lambda x: isinstance(x, nnx.Variable))
    t = C.TrainConfig(grad_clip=0.0, warmup_steps=0, schedule="constant")
    u_sp = dict(zip(a, jax.tree.leaves(first_update(make_optimizer(t, sp), p, g))))
    u_mu = dict(zip(a, jax.tree.leaves(first_update(make_optimizer(t, mu), p, g))))
    for k in a:
        np.testing.assert_allclose(u_mu[k], u_sp[k] * (1 / m if k in hidden else 1.0),
                                   rtol=1e-5, atol=1e-9, err_msg=k)
    # the readout multiplier: logits of the μP model are the same head's at 1/m input
    model = models.build(mu, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(1, 3, 128)), jnp.float32)
    head = model.embed.head.kernel.get_value()
    np.testing.assert_allclose(model.embed.logits(x), (x / m) @ head, rtol=1e-5, atol=1e-6)


def test_moe_router_is_an_output_matrix():
    cfg = model_cfg(64, base=32, ffn_pattern=("moe",), moe=dict(num_experts=4, experts_per_token=2))
    kinds = {k: mup.classify(v) for k, v in params_of(cfg).items()}
    assert [k for k, c in kinds.items() if c == "output"] == ["layers/cycles/layers/0/ffn/router"]
    assert kinds["layers/cycles/layers/0/ffn/wi_gate"] == "hidden"
    assert mup.init_multiplier("output", 2) == mup.lr_multiplier("output", 2) == 0.5


def _changes(width, base, lr=1e-3, steps=3):
    """RMS change of the logits and of the final hidden states on a fixed batch after
    `steps` Adam steps."""
    cfg = model_cfg(width, base=base)
    model = models.build(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 61)
    tx = make_optimizer(C.TrainConfig(lr=lr, warmup_steps=0, schedule="constant", grad_clip=0.0,
                                      weight_decay=0.0), cfg)

    def logits(p):
        return nnx.merge(graphdef, p, rest)(tokens[:, :-1])

    @jax.jit
    def run(p):
        def step(carry, _):
            p, s = carry
            g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
                logits(p), tokens[:, 1:]).mean())(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None
        (new, _), _ = jax.lax.scan(step, (p, tx.init(p)), None, length=steps)

        def features(p):
            return nnx.merge(graphdef, p, rest).features(tokens[:, :-1])

        def rms(a, b):
            return jnp.sqrt(jnp.mean((a - b) ** 2))
        return rms(logits(new), logits(p)), rms(features(new), features(p))

    return [float(x) for x in run(params)]


def test_coordinate_check_updates_stay_put_across_width_with_mup():
    """Tensor Programs V's check: after a few steps the logits and the last hidden
    states move by amounts that grow with width in the standard parametrization and
    stay put in μP (the readout multiplier keeps the logits, the hidden learning rates
    the hidden states)."""
    widths = (32, 128)
    sp = np.array([_changes(w, 0) for w in widths])  # [width, (logits, hidden)]
    mu = np.array([_changes(w, widths[0]) for w in widths])
    assert (sp[1] / sp[0] > [2.0, 1.5]).all(), sp  # standard: grow with width
    assert (0.5 < mu[1] / mu[0]).all() and (mu[1] / mu[0] < 1.3).all(), mu  # μP: stay put


@pytest.mark.parametrize("values,message", [
    (dict(model=dict(mup_base_width=-1)), "model.mup_base_width: must be >= 0"),
    (dict(model=dict(mup_base_width=32, layer_pattern=("mamba",))),
     "model.mup_base_width: μP's parameter classes are defined here for the attention layer "
     "kinds global, local, chunked, nope, not mamba"),
    (dict(model=dict(mup_base_width=32, arch="encoder")),
     "model.mup_base_width: μP is defined here for arch='decoder'"),
    (dict(model=dict(mup_base_width=16), train=dict(optimizer="sgd")),
     "train.optimizer: μP (model.mup_base_width) scales Adam-type learning rates (adamw, "
     "adafactor, lion), not 'sgd'"),
])
def test_bad_settings_name_the_field(values, message):
    base = dict(model=dict(BASE, d_model=32, d_ff=64))
    for k, v in values.items():
        base[k] = {**base.get(k, {}), **v}
    cfg = C.from_dict(C.RunConfig, base)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()
        models.build(cfg.model, rngs=nnx.Rngs(0))
        make_optimizer(cfg.train, cfg.model)
