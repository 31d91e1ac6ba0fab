"""`tfjax.interp.analysis` on tiny models: logit lens, direct logit attribution,
patching sweeps and head ablation against the same readings made by hand with
`run_with_cache` / `run_with_hooks`, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.interp import (ablate_heads, direct_logit_attribution, logit_attribution, logit_lens,
                          patching_sweep, run_with_cache, run_with_hooks)

TINY = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, d_ff=48, max_len=64)
CONFIGS = {
    "llama": dict(position="rope", norm="rmsnorm", activation="swiglu", num_kv_heads=2,
                  ffn_bias=False, tie_embeddings=False),
    "gpt2_like": dict(position="learned", norm="layernorm", activation="gelu_tanh"),
}
B, T, L, N = 2, 6, 3, 4


@functools.cache
def model(name: str):
    return models.build(model_config({**TINY, **CONFIGS[name]}), rngs=nnx.Rngs(0))


@functools.cache
def tokens(seed: int = 0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, TINY["vocab_size"])


ANSWER, WRONG = jnp.array([3, 5]), jnp.array([7, 11])


def logit_diff(logits):
    """The metric of the sweeps: mean over rows of answer minus wrong at the last position."""
    last = logits[:, -1]
    return jnp.mean(last[jnp.arange(B), ANSWER] - last[jnp.arange(B), WRONG])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logit_lens_last_row_is_the_logits_and_first_the_embeddings(name):
    m, t = model(name), tokens()
    lens = logit_lens(m, t)
    logits, cache = run_with_cache(m, t)
    assert lens.shape == (L + 1, B, T, TINY["vocab_size"])
    np.testing.assert_allclose(lens[-1], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lens[0], m.head(m.head_input(cache["blocks.0.hook_resid_pre"])),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lens[2], m.head(m.head_input(cache["blocks.1.hook_resid_post"])),
                               rtol=1e-5, atol=1e-5)
    logp = logit_lens(m, t, log_probs=True)
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, rtol=1e-5)


def _head_outputs(m, cache):
    """[L, N, B, T, D]: each head's hook_z through its slice of the output projection."""
    u = models.unrolled(m)
    return jnp.stack([jnp.einsum("btnh,nhd->nbtd", cache[f"blocks.{l}.attn.hook_z"],
                                 u.layers.blocks[l].attn.o.kernel[...]) for l in range(L)])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dla_heads_and_the_rest_sum_to_the_logit_diff(name):
    m, t = model(name), tokens()
    logits, cache = run_with_cache(m, t)
    dla = direct_logit_attribution(m, t, ANSWER, WRONG, per_position=True)
    assert dla.shape == (L, N, T)
    heads = _head_outputs(m, cache)
    rest = cache[f"blocks.{L - 1}.hook_resid_post"] - heads.sum(axis=(0, 1))
    rest_attr = logit_attribution(m, t, rest, ANSWER, WRONG).mean(0)  # [T]
    # the norm's bias (and the head's): the logits with the normalised residual zeroed
    zeroed = run_with_hooks(m, t, [("ln_final.hook_normalized", lambda y, hook: 0 * y)])
    bias = (zeroed[jnp.arange(B), :, ANSWER] - zeroed[jnp.arange(B), :, WRONG]).mean(0)
    want = (logits[jnp.arange(B), :, ANSWER] - logits[jnp.arange(B), :, WRONG]).mean(0)
    np.testing.assert_allclose(dla.sum((0, 1)) + rest_attr + bias, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(direct_logit_attribution(m, t, ANSWER, WRONG), dla[..., -1],
                               rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dla_of_one_head_by_hand(name):
    m, t = model(name), tokens()
    _, cache = run_with_cache(m, t)
    final = cache[f"blocks.{L - 1}.hook_resid_post"]
    out = _head_outputs(m, cache)[1, 2]  # layer 1, head 2: [B, T, D]
    centre = (lambda x: x - x.mean(-1, keepdims=True)) if name == "gpt2_like" else (lambda x: x)
    scale = jnp.sqrt(jnp.mean(centre(final) ** 2, -1, keepdims=True) + m.final_norm.epsilon)
    w = m.final_norm.scale[...]
    unembed = (m.embed.tokens.embedding[...].T if m.embed.head is None
               else m.embed.head.kernel[...])  # [D, V]
    direction = unembed[:, ANSWER].T  # [B, D]: answer only
    want = jnp.einsum("btd,bd->bt", centre(out) / scale * w, direction).mean(0)
    got = direct_logit_attribution(m, t, ANSWER, per_position=True)[1, 2]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _patch_resid(m, clean_cache, layer, pos):
    name = f"blocks.{layer}.hook_resid_pre"
    return run_with_hooks(m, tokens(1), [(name, lambda x, hook: x.at[:, pos].set(
        clean_cache[name][:, pos]))])


def test_patching_sweep_resid_cells_equal_single_patches():
    m, clean, corrupted = model("llama"), tokens(0), tokens(1)
    sweep = patching_sweep(m, clean, corrupted, logit_diff, "resid_pre", chunk=4)  # 18 cells
    assert sweep.shape == (L, T)
    _, cache = run_with_cache(m, clean)
    for layer, pos in [(0, 0), (2, T - 1)]:
        want = logit_diff(_patch_resid(m, cache, layer, pos))
        np.testing.assert_allclose(sweep[layer, pos], want, rtol=1e-4, atol=1e-5)


def test_patching_sweep_full_patch_recovers_the_clean_metric():
    m, clean, corrupted = model("llama"), tokens(0), tokens(1)
    # with one position, every cell patches the whole residual: the clean run from there on
    one_clean, one_corrupted = clean[:, :1], corrupted[:, :1]
    sweep = patching_sweep(m, one_clean, one_corrupted, logit_diff, "resid_pre")
    np.testing.assert_allclose(sweep[:, 0], logit_diff(m(one_clean)), rtol=1e-4, atol=1e-5)


def test_patching_sweep_head_cells_equal_single_patches():
    m, clean, corrupted = model("gpt2_like"), tokens(0), tokens(1)
    sweep = patching_sweep(m, clean, corrupted, logit_diff, "heads", chunk=5)  # 12 cells
    assert sweep.shape == (L, N)
    _, cache = run_with_cache(m, clean)
    for layer, head in [(0, 1), (2, 3)]:
        zname = f"blocks.{layer}.attn.hook_z"
        patched = run_with_hooks(m, corrupted, [(zname, lambda z, hook: z.at[:, :, head].set(
            cache[zname][:, :, head]))])
        np.testing.assert_allclose(sweep[layer, head], logit_diff(patched), rtol=1e-4, atol=1e-5)


def test_zero_ablation_equals_a_zeroing_hook():
    m, t = model("llama"), tokens()
    got = ablate_heads(m, t, [(0, 1), (2, 3), (2, 0)])
    want = run_with_hooks(m, t, [
        ("blocks.0.attn.hook_z", lambda z, hook: z.at[:, :, 1].set(0)),
        ("blocks.2.attn.hook_z", lambda z, hook: z.at[:, :, jnp.array([3, 0])].set(0))])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, m(t), atol=1e-4)
    np.testing.assert_allclose(ablate_heads(m, t, []), m(t), rtol=1e-5, atol=1e-5)


def test_mean_ablation_by_hand():
    m, t = model("gpt2_like"), tokens()
    _, cache = run_with_cache(m, t)
    z0, z1 = cache["blocks.0.attn.hook_z"], cache["blocks.1.attn.hook_z"]
    m0 = z0[:, :, 2].reshape(-1, z0.shape[-1]).mean(0)  # the clean run's mean, [H]
    m1 = z1[:, :, 0].reshape(-1, z1.shape[-1]).mean(0)
    want = run_with_hooks(m, t, [
        ("blocks.0.attn.hook_z", lambda z, hook: z.at[:, :, 2].set(m0)),
        ("blocks.1.attn.hook_z", lambda z, hook: z.at[:, :, 0].set(m1))])
    got = ablate_heads(m, t, [(0, 2), (1, 0)], how="mean")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, ablate_heads(m, t, [(0, 2), (1, 0)]), atol=1e-4)


def test_errors_name_the_argument_and_the_fix():
    m, t = model("llama"), tokens()
    with pytest.raises(ValueError, match="what='mlp'"):
        patching_sweep(m, t, t, logit_diff, "mlp")
    with pytest.raises(ValueError, match="differ in shape"):
        patching_sweep(m, t, t[:, :3], logit_diff)
    with pytest.raises(ValueError, match="chunk=0"):
        patching_sweep(m, t, t, logit_diff, chunk=0)
    with pytest.raises(ValueError, match="how='random'"):
        ablate_heads(m, t, [(0, 0)], how="random")
    with pytest.raises(ValueError, match=r"\(3, 0\) is not in 0..2 x 0..3"):
        ablate_heads(m, t, [(3, 0)])
    with pytest.raises(ValueError, match="answer_tokens: one token per row"):
        direct_logit_attribution(m, t, jnp.zeros((B, T), int))
    with pytest.raises(ValueError, match="wrong_tokens"):
        direct_logit_attribution(m, t, ANSWER, jnp.array([1]))
    capped = models.build(model_config({**TINY, "final_softcap": 10.0}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="final_softcap"):
        direct_logit_attribution(capped, t, ANSWER)
    sandwich = models.build(model_config({**TINY, "norm_placement": "sandwich"}),
                            rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="norm_placement='sandwich'"):
        direct_logit_attribution(sandwich, t, ANSWER)
    with pytest.raises(TypeError, match="decoder LM"):
        logit_lens(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), t)
