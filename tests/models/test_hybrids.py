"""Hybrid decoders: Mamba / linear-attention / attention mixers with dense / MoE /
no feed-forwards, scanned over lcm(layer_pattern, ffn_pattern) cycles; MoE
losses and metrics reach the caller through `moe_aux`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.nn.moe import MoE, moe_aux
from tfjax.nn.ssm import Mamba

TINY = dict(vocab_size=61, d_model=32, num_heads=4, d_ff=48, max_len=64, position="none",
            norm="rmsnorm", moe=dict(num_experts=4, experts_per_token=2),
            ssm=dict(d_state=4, chunk=4), linear=dict(chunk=4))


def tokens(B, T, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 61)


def test_cycle_is_the_lcm_of_the_patterns():
    cfg = model_config(dict(TINY, num_layers=7, layer_pattern=("mamba", "global", "linear"),
                            ffn_pattern=("moe", "dense")))
    model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))  # no compile
    assert model.layers.pattern == ("mamba", "global", "linear") * 2
    kinds = [type(b.attn).__name__ for b in model.layers.cycles.layers]
    assert kinds == ["Mamba", "MultiHeadAttention", "LinearAttention"] * 2
    ffns = [type(b.ffn).__name__ for b in model.layers.cycles.layers]
    assert ffns == ["MoE", "FeedForward"] * 3
    assert type(model.layers.blocks[0].attn) is Mamba and type(model.layers.blocks[0].ffn) is MoE
    assert model.layers.cycles.layers[0].ffn.load_balance_loss.get_value().shape == (1,)  # one cycle


def test_hybrid_decoder_is_causal_and_moe_losses_reach_the_loss():
    # A cycle of 3 (every mixer, every ffn kind) scanned once, then 1 unrolled layer.
    cfg = model_config(dict(TINY, num_layers=4, layer_pattern=("mamba", "global", "linear"),
                            ffn_pattern=("moe", "dense", "none"), remat="full"))
    model = models.build(cfg, rngs=nnx.Rngs(0))
    assert model.layers.cycles.layers[2].ffn is None
    x = tokens(2, 11, seed=1)
    y = x.at[:, 7:].set((x[:, 7:] + 5) % 61)  # change the future of position 6

    @nnx.jit  # one compile serves causality, gradients and the aux-only gradient
    def step(m, t, ce_weight):
        def loss(m):
            logits = m(t)
            aux = moe_aux(m)
            ce = -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
            return ce_weight * ce + aux["aux_loss"], (logits, aux)
        return nnx.value_and_grad(loss, has_aux=True)(m)

    (value, (lx, aux)), grads = step(model, x, 1.0)
    (_, (ly, _)), g_aux = step(model, y, 0.0)
    np.testing.assert_allclose(lx[:, :7], ly[:, :7], atol=1e-5)
    assert not np.allclose(lx[:, 7:], ly[:, 7:], atol=1e-3), "later logits must see later tokens"
    assert np.isfinite(float(value))
    assert aux["expert_load"].shape == (4,)
    np.testing.assert_allclose(float(aux["expert_load"].sum()), 1.0, rtol=1e-5)
    assert float(aux["dropped_fraction"]) == 0.0 and float(aux["load_balance_loss"]) >= 1.0
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    # One scanned MoE layer + 1 unrolled; the aux loss alone moves both routers,
    # through the scan and the remat.
    assert float(jnp.abs(g_aux.layers.cycles.layers[0].ffn.router[...]).sum()) > 0
    assert float(jnp.abs(g_aux.layers.blocks[0].ffn.router[...]).sum()) > 0


def test_packed_documents_equal_separate_documents():
    cfg = model_config(dict(TINY, num_layers=3, layer_pattern=("mamba", "linear", "global")))
    model = models.build(cfg, rngs=nnx.Rngs(2))
    a, b = tokens(1, 5, seed=3), tokens(1, 7, seed=4)
    # One call: row 0 packs a and b; rows 1 and 2 hold each alone, right-padded
    # (causal layers: padding after a document cannot change it).
    rows = jnp.concatenate([jnp.concatenate([a, b], 1), jnp.pad(a, ((0, 0), (0, 7))),
                            jnp.pad(b, ((0, 0), (0, 5)))])
    seg = jnp.array([[0] * 5 + [1] * 7, [0] * 12, [0] * 12])
    pos = jnp.array([list(range(5)) + list(range(7)), list(range(12)), list(range(12))])
    out = nnx.jit(lambda m, t, p, s: m(t, positions=p, segment_ids=s))(model, rows, pos, seg)
    np.testing.assert_allclose(out[0, :5], out[1, :5], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[0, 5:], out[2, :7], rtol=1e-4, atol=1e-5)


def test_validation_names_fields():
    # Registry-owned names and the layer kinds' decoder-only rule: at build time.
    with pytest.raises(ValueError, match=r"model.layer_pattern\[0\]"):
        models.build(dict(layer_pattern=("ssm",)))
    with pytest.raises(ValueError, match="model.layer_pattern"):
        models.build(dict(arch="encoder", layer_pattern=("mamba",)))
    with pytest.raises(ValueError, match="model.linear.feature_map"):
        models.build(dict(layer_pattern=("linear",), linear=dict(feature_map="cosine")))
    # Ranges: in the config; the old flat field names its section.
    with pytest.raises(ValueError, match="model.ssm.d_state"):
        model_config(dict(layer_pattern=("mamba",), ssm=dict(d_state=0)))
    with pytest.raises(ValueError, match="model.linear_feature_map moved to model.linear."):
        model_config(dict(layer_pattern=("linear",), linear_feature_map="cosine"))
    with pytest.raises(ValueError, match="model.ssm_d_state moved to model.ssm.d_state"):
        model_config(dict(layer_pattern=("mamba",), ssm_d_state=0))
