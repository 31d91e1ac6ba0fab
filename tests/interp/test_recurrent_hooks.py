"""Hook points of the recurrent mixers (Mamba, Mamba-2, Gated DeltaNet, causal linear
attention) through a scanned stack: their names and shapes, `hook_state` against the
decode cache after prefilling the same tokens, the per-token output (`hook_ssm_out`;
linear attention's `hook_z`) as a patch point and `hook_state` as a capture point
(replacing it changes no logits of a whole-sequence run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.interp import hook_names, run_with_cache, run_with_hooks

B, T, L, D = 2, 7, 2, 32  # T = 7: not a multiple of the chunks of 4 (the scans pad)
TINY = dict(vocab_size=61, d_model=D, num_layers=L, num_heads=4, d_ff=48, max_len=64,
            norm="rmsnorm", position="none", ffn_pattern=("none",), init_std=0.5)
KINDS = {  # kind -> (its config, {hook: shape}); mixer-only layers, scanned over 2 cycles
    "mamba": (dict(ssm=dict(d_state=4, d_conv=3, dt_rank=4, chunk=4)),
              {"hook_ssm_input": (B, T, 64), "hook_ssm_out": (B, T, 64),
               "hook_state": (B, 64, 4)}),
    "mamba2": (dict(mamba2=dict(d_state=4, head_dim=16, n_groups=2, d_conv=3, chunk=4)),
               {"hook_ssm_input": (B, T, 4, 16), "hook_ssm_out": (B, T, 4, 16),
                "hook_state": (B, 4, 16, 4)}),
    "gated_deltanet": (dict(gdn=dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6,
                                     chunk=4)),
                       {"hook_ssm_out": (B, T, 4, 6), "hook_state": (B, 4, 8, 6)}),
    "linear": (dict(linear=dict(chunk=4)),  # 4 heads of 8, elu+1 features of width 8
               {"hook_z": (B, T, 4, 8), "hook_state": (B, 4, 8, 8),
                "hook_state_norm": (B, 4, 8)}),
}
OUTPUT = {"linear": "hook_z"}  # the per-token output a patch changes; else hook_ssm_out


@functools.cache
def model(kind: str):
    cfg = model_config({**TINY, **KINDS[kind][0], "layer_pattern": (kind,)})
    assert cfg.scan_layers
    return models.build(cfg, rngs=nnx.Rngs(0))


def tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, TINY["vocab_size"])


def zero(x, hook):
    return jnp.zeros_like(x)


@pytest.mark.parametrize("kind", KINDS)
def test_names_shapes_and_the_final_state_equal_the_prefilled_cache_s(kind):
    m, t = model(kind), tokens()
    logits, cache = run_with_cache(m, t, names=lambda n: ".attn." in n)
    shapes = KINDS[kind][1]
    assert {k: v.shape for k, v in cache.items()} == {
        f"blocks.{l}.attn.{n}": s for l in range(L) for n, s in shapes.items()}
    assert all(cache[f"blocks.{l}.attn.hook_state"].dtype == jnp.float32 for l in range(L))
    names = hook_names(m, t)
    assert "blocks.0.attn.hook_q" not in names and "blocks.0.attn.hook_pattern" not in names
    # what a prefill of the same tokens leaves in the decode cache, per layer (cycle)
    last, decode = m.step(t, m.init_cache(B, 16))
    state = decode.layers["cycles"][0]["attn"]
    held = state.ssm if kind in ("mamba", "mamba2") else state.S  # [C, B, ...]
    assert float(jnp.abs(held[0] - held[1]).max()) > 0  # the layers' states differ
    for l in range(L):
        np.testing.assert_allclose(cache[f"blocks.{l}.attn.hook_state"], held[l], atol=1e-5,
                                   err_msg=f"layer {l}")
        if kind == "linear":  # and its normaliser's running sum
            np.testing.assert_allclose(cache[f"blocks.{l}.attn.hook_state_norm"], state.z[l],
                                       atol=1e-5, err_msg=f"layer {l}")
    np.testing.assert_allclose(logits[:, -1:], last, atol=1e-4)  # the same prefill


@pytest.mark.parametrize("kind", KINDS)
def test_zeroing_ssm_out_is_zeroing_the_mixer_s_output_and_the_state_is_capture_only(kind):
    m, t = model(kind), tokens()
    logits = run_with_hooks(m, t, fwd_hooks=[])
    # no biases: a zero scan output gives a zero mixer output (Mamba: 0 * silu(z); Mamba-2
    # and Gated DeltaNet: their RMSNorm of 0 is 0), so this is the layer's mixer ablated
    out = OUTPUT.get(kind, "hook_ssm_out")
    patched = run_with_hooks(m, t, fwd_hooks=[(f"blocks.1.attn.{out}", zero)])
    by_hand = run_with_hooks(m, t, fwd_hooks=[("blocks.1.hook_attn_out", zero)])
    assert float(jnp.abs(patched - logits).max()) > 1e-3
    np.testing.assert_allclose(patched, by_hand, atol=1e-5)
    # only layer 1's: layer 0's ablation is another run
    other = run_with_hooks(m, t, fwd_hooks=[(f"blocks.0.attn.{out}", zero)])
    assert float(jnp.abs(other - patched).max()) > 1e-3
    # nothing in a whole-sequence run reads the final state
    unread = run_with_hooks(m, t, fwd_hooks=[(lambda n: "hook_state" in n, zero)])
    np.testing.assert_array_equal(unread, logits)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_the_ssm_input_is_what_the_scan_reads(kind):
    m, t = model(kind), tokens()
    _, cache = run_with_cache(m, t, names=lambda n: n.startswith("blocks.0.attn."))
    # the scanned input patched to zero: no input enters the state, and the skip D x is 0
    _, patched = run_with_cache(m, t, names=lambda n: n.startswith("blocks.0.attn."),
                                fwd_hooks=[("blocks.0.attn.hook_ssm_input", zero)])
    np.testing.assert_array_equal(patched["blocks.0.attn.hook_ssm_out"], 0.0)
    np.testing.assert_array_equal(patched["blocks.0.attn.hook_state"], 0.0)
    assert float(jnp.abs(cache["blocks.0.attn.hook_state"]).max()) > 0
