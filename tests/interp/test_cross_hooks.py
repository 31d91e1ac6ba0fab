"""Hook points of Llama-3.2-Vision's gated cross-attention layers (`MllamaModel`, built
from the config): `blocks.{l}.attn.hook_pattern` `[B, N, T, S]` of a "cross" layer is
the attention of the text tokens over the image tokens (each tile's class token, then
its patches in row-major order), against a plain jnp reference from the layer's
parameters (QK-norm per head, GQA, the cross_attention_mask's bias); a token that sees
no tile has no key masked (HF's rule)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax import models
from tfjax.interp import hook_names, run_with_cache
from tfjax.models.mllama import cross_attention_inputs

CFG = dict(vocab_size=30, d_model=24, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=32,
           norm="rmsnorm", activation="swiglu", ffn_bias=False, tie_embeddings=False,
           layer_pattern=("global", "cross", "cross"), scan_layers=False, init_std=0.3,
           vision=dict(image_size=12, patch_size=4, d_model=16, num_layers=1, num_heads=2,
                       d_ff=24, activation="gelu", max_num_tiles=2))


def test_cross_layer_pattern_against_the_reference():
    model = models.build(CFG, rngs=nnx.Rngs(0))
    for block in model.text.layers.blocks:  # open the gates: layer 2 then reads layer 1
        if block.attn_gate is not None:
            block.attn_gate.value = jnp.asarray(0.8)
            block.ffn_gate.value = jnp.asarray(-0.5)
    B, T, M, tiles = 2, 5, 1, 2
    r = np.random.default_rng(0)
    images = dict(pixel_values=jnp.asarray(r.normal(size=(B, M, tiles, 3, 12, 12)), jnp.float32),
                  aspect_ratio_ids=jnp.asarray([[2], [1]]),
                  aspect_ratio_mask=jnp.asarray([[[1, 1]], [[1, 0]]]))
    cross = np.ones((B, T, M, tiles), np.int32)
    cross[0, :2, 0, 1] = 0  # row 0's first tokens see tile 0 only
    cross[1, 3] = 0  # row 1's token 3 sees no tile
    tokens = jnp.asarray(r.integers(0, 30, (B, T)))
    names = [f"blocks.{l}.{n}" for l in (1, 2) for n in ("ln1.hook_normalized", "attn.hook_pattern")]
    _, cache = run_with_cache(model, tokens, names, cross_attention_mask=jnp.asarray(cross),
                              **images)
    context = model.image_features(images["pixel_values"], images["aspect_ratio_ids"],
                                   images["aspect_ratio_mask"])
    P = model.vision_config.patches  # 9 patches and the class token a tile
    S = M * tiles * P
    bias, _ = cross_attention_inputs(jnp.asarray(cross), P)
    for l in (1, 2):
        attn = model.text.layers.blocks[l].attn
        h = cache[f"blocks.{l}.ln1.hook_normalized"]
        q = attn._norm(attn.q_norm, attn.q(h))  # [B, T, N, H], QK-norm per head
        k = attn._norm(attn.k_norm, attn.k(context))  # [B, S, K, H]
        k = jnp.repeat(k, CFG["num_heads"] // CFG["num_kv_heads"], axis=2)  # GQA
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) * attn.scale + bias
        want = jax.nn.softmax(scores, axis=-1)
        got = cache[f"blocks.{l}.attn.hook_pattern"]
        assert got.shape == (B, CFG["num_heads"], T, S)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got[0, :, :2, P:], 0.0, atol=1e-7)  # tile 1 masked
        assert (got[1, :, 3] > 0).all()  # sees no tile: nothing masked (HF's rule)


def test_the_tiled_towers_blocks_have_their_own_names():
    model = models.build(dict(CFG, vision=dict(CFG["vision"], num_layers=2,
                                               num_global_layers=1)), rngs=nnx.Rngs(0))
    names = hook_names(model, jnp.zeros((1, 3), jnp.int32),
                       pixel_values=jnp.zeros((1, 1, 2, 3, 12, 12)),
                       aspect_ratio_ids=jnp.ones((1, 1), jnp.int32))
    tower = [n for n in names if n.startswith("vision.") and n.endswith("hook_pattern")]
    assert tower == ["vision.blocks.0.attn.hook_pattern", "vision.blocks.1.attn.hook_pattern",
                     "vision.global_blocks.0.attn.hook_pattern"]
