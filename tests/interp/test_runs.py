"""`tfjax.interp.run_with_cache` / `run_with_hooks` on tiny models: TransformerLens
names and shapes, the scanned stack against its unrolled copy, patterns from every
implementation, patches against the same patch made by hand, jit, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.interp import HookPoint, hook_names, run_with_cache, run_with_hooks

TINY = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, d_ff=48, max_len=64)
CONFIGS = {
    "llama": dict(position="rope", norm="rmsnorm", activation="swiglu", num_kv_heads=2,
                  ffn_bias=False, tie_embeddings=False),
    # a scanned cycle of (local, global) and one unrolled block after it
    "gemma2_like": dict(layer_pattern=("local", "global"), norm="rmsnorm_plus_one",
                        norm_placement="sandwich", final_softcap=15.0, activation="geglu_tanh",
                        scale_embeddings=True,
                        attention=dict(sliding_window=3, softcap=20.0, qk_norm=True)),
    "gpt2_like": dict(position="learned", norm="layernorm", activation="gelu_tanh"),
    "neox_parallel": dict(block="parallel", parallel_shared_norm=False, rope=dict(fraction=0.25)),
    "post_sinusoidal": dict(position="sinusoidal", norm_placement="post", activation="relu"),
    "moe_sinks": dict(ffn_pattern=("dense", "moe"), num_layers=4,
                      moe=dict(num_experts=4, experts_per_token=2),
                      attention=dict(sinks=True)),
    "hybrid_mamba": dict(layer_pattern=("mamba", "global"), num_layers=4),
}
B, T = 2, 7


@functools.cache
def model(name: str, scan: bool = True):
    """The scanned model of CONFIGS[name], or (scan=False) its unrolled copy."""
    if not scan:
        return models.unrolled(model(name))
    return models.build(model_config({**TINY, **CONFIGS[name]}), rngs=nnx.Rngs(0))


@nnx.jit
def forward(m, *args):
    """The model's own call, jitted as run_with_cache's is."""
    return m(*args)


@functools.cache
def tokens(seed: int = 0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, TINY["vocab_size"])


def test_names_and_shapes_are_transformerlens_s():
    m, t = model("llama"), tokens()
    logits, cache = run_with_cache(m, t)
    np.testing.assert_array_equal(logits, forward(m, t))  # the captured run is the model's own
    N, K, H, D, F, L = 4, 2, 8, 32, 48, 3
    want = {"hook_embed": (B, T, D), "ln_final.hook_normalized": (B, T, D)}
    for l in range(L):
        want.update({f"blocks.{l}.{n}": s for n, s in {
            "hook_resid_pre": (B, T, D), "ln1.hook_normalized": (B, T, D),
            "attn.hook_q": (B, T, N, H), "attn.hook_k": (B, T, K, H), "attn.hook_v": (B, T, K, H),
            "attn.hook_rot_q": (B, T, N, H), "attn.hook_rot_k": (B, T, K, H),
            "attn.hook_attn_scores": (B, N, T, T), "attn.hook_pattern": (B, N, T, T),
            "attn.hook_z": (B, T, N, H), "hook_attn_out": (B, T, D),
            "hook_resid_mid": (B, T, D), "ln2.hook_normalized": (B, T, D),
            "mlp.hook_pre": (B, T, F), "mlp.hook_pre_linear": (B, T, F),
            "mlp.hook_post": (B, T, F), "hook_mlp_out": (B, T, D),
            "hook_resid_post": (B, T, D)}.items()})
    assert {k: v.shape for k, v in cache.items()} == want
    assert list(cache) == hook_names(m, t)  # in execution order, layer by layer
    assert list(cache)[:3] == ["hook_embed", "blocks.0.hook_resid_pre",
                               "blocks.0.ln1.hook_normalized"]
    # the residual stream adds up, through the scan's per-layer split
    for l in range(L):
        np.testing.assert_allclose(cache[f"blocks.{l}.hook_resid_mid"],
                                   cache[f"blocks.{l}.hook_resid_pre"]
                                   + cache[f"blocks.{l}.hook_attn_out"], atol=1e-6)
        if l:
            np.testing.assert_array_equal(cache[f"blocks.{l}.hook_resid_pre"],
                                          cache[f"blocks.{l - 1}.hook_resid_post"])
    p = cache["blocks.1.attn.hook_pattern"]
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    assert float(jnp.abs(jnp.triu(p, 1)).max()) == 0.0  # causal
    np.testing.assert_allclose(p, jax.nn.softmax(cache["blocks.1.attn.hook_attn_scores"]),
                               atol=1e-6)


@pytest.mark.parametrize("name", [n if n == "gemma2_like" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONFIGS])
def test_scanned_and_unrolled_give_the_same_cache(name):
    t = tokens()
    logits, cache = run_with_cache(model(name), t)
    np.testing.assert_array_equal(logits, forward(model(name), t))
    u_logits, u_cache = run_with_cache(model(name, scan=False), t)
    assert list(cache) == list(u_cache)
    for k in cache:
        np.testing.assert_allclose(cache[k], u_cache[k], atol=2e-5, err_msg=k)
    np.testing.assert_allclose(logits, u_logits, atol=2e-5)
    layers = TINY["num_layers"] if "num_layers" not in CONFIGS[name] else CONFIGS[name]["num_layers"]
    assert {int(k.split(".")[1]) for k in cache if k.startswith("blocks.")} == set(range(layers))


def test_kinds_have_their_own_hooks_and_lack_the_others():
    names = hook_names(model("hybrid_mamba"), tokens())
    assert "blocks.1.attn.hook_pattern" in names and "blocks.1.attn.hook_q" in names
    assert "blocks.0.hook_attn_out" in names and "blocks.0.attn.hook_q" not in names  # mamba
    moe = hook_names(model("moe_sinks"), tokens())
    assert {"blocks.1.mlp.hook_router_logits", "blocks.1.mlp.hook_expert_weights",
            "blocks.1.mlp.hook_expert_indices"} <= set(moe)
    assert "blocks.0.mlp.hook_router_logits" not in moe and "blocks.0.mlp.hook_post" in moe
    par = hook_names(model("neox_parallel"), tokens())
    assert "blocks.0.hook_resid_mid" not in par and "blocks.0.ln2.hook_normalized" in par


def test_moe_routing_and_sinks():
    _, cache = run_with_cache(model("moe_sinks"), tokens(), names=lambda n: "blocks.3." in n)
    assert cache["blocks.3.mlp.hook_router_logits"].shape == (B, T, 4)
    idx = cache["blocks.3.mlp.hook_expert_indices"]
    assert idx.shape == (B, T, 2) and idx.dtype == jnp.int32
    np.testing.assert_array_equal(idx, jax.lax.top_k(cache["blocks.3.mlp.hook_router_logits"],
                                                     2)[1])
    rows = cache["blocks.3.attn.hook_pattern"].sum(-1)  # the sink takes its share
    assert float(rows.max()) < 1.0 and float(rows.min()) > 0.0


def test_names_limit_what_is_kept():
    m, t = model("llama"), tokens()
    one = ["blocks.2.attn.hook_pattern", "hook_embed"]
    assert sorted(run_with_cache(m, t, names=one)[1]) == sorted(one)
    assert list(run_with_cache(m, t, names="ln_final.hook_normalized")[1]) == [
        "ln_final.hook_normalized"]
    _, cache = run_with_cache(m, t, names=lambda n: n.endswith("hook_z"))
    assert list(cache) == [f"blocks.{l}.attn.hook_z" for l in range(3)]
    # patterns are computed only where kept: none asked, no softmax more than the model's
    graphdef, state = nnx.split(m)

    def exps(f):
        return str(jax.make_jaxpr(lambda s, t: f(nnx.merge(graphdef, s), t))(state, t)).count(
            "= exp ")

    own = exps(lambda m, t: m(t))
    assert exps(lambda m, t: run_with_cache(m, t, names=["hook_embed"])) == own
    assert exps(lambda m, t: run_with_cache(m, t, names=["blocks.2.attn.hook_pattern"])) > own


@pytest.mark.parametrize("how", ["names", "fwd_hooks"])
def test_an_unknown_name_names_the_closest(how):
    m, t = model("llama"), tokens()
    bad = "blocks.1.attn.hook_patern"
    with pytest.raises(ValueError, match=r"no hook point 'blocks.1.attn.hook_patern' in this "
                                         r"DecoderLM; closest: blocks.1.attn.hook_pattern") as e:
        if how == "names":
            run_with_cache(m, t, names=[bad])
        else:
            run_with_hooks(m, t, fwd_hooks=[(bad, lambda x, h: x)])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="closest: blocks.2.hook_resid_pre"):
        run_with_cache(m, t, names=["blocks.3.hook_resid_pre"])  # one layer too far
    with pytest.raises(TypeError, match="each entry is a pair"):
        run_with_hooks(m, t, fwd_hooks=["hook_embed"])


def _zero_head(layer, head):
    def fn(z, hook):
        assert hook == HookPoint(f"blocks.{layer}.attn.hook_z", layer)
        return z.at[:, :, head].set(0.0)
    return fn


def test_zero_ablating_a_head_equals_zeroing_its_output_weights():
    """The patch at hook_z of layer 1 head 2, inside the scan, against the same patch
    made by hand: head 2's rows of layer 1's output projection zeroed, unrolled."""
    m, t = model("llama"), tokens()
    patched = run_with_hooks(m, t, fwd_hooks=[("blocks.1.attn.hook_z", _zero_head(1, 2))])
    by_hand = models.unrolled(m)
    o = by_hand.layers.blocks[1].attn.o.kernel
    o[...] = o[...].at[2].set(0.0)
    np.testing.assert_allclose(patched, forward(by_hand, t), atol=1e-5)
    assert float(jnp.abs(patched - forward(m, t)).max()) > 1e-3  # the patch did something
    _, cache = run_with_cache(m, t, fwd_hooks=[("blocks.1.attn.hook_z", _zero_head(1, 2))])
    assert float(jnp.abs(cache["blocks.1.attn.hook_z"][:, :, 2]).max()) == 0.0
    assert float(jnp.abs(cache["blocks.2.attn.hook_z"][:, :, 2]).max()) > 0.0
    np.testing.assert_array_equal(cache["blocks.0.hook_resid_post"],
                                  run_with_cache(m, t)[1]["blocks.0.hook_resid_post"])


def test_hooks_see_each_layer_as_a_python_int_and_work_under_jit():
    m, t = model("gemma2_like"), tokens()
    seen = []

    def steer(x, hook):
        seen.append(hook.layer)
        return x + 0.1 * (hook.layer + 1)

    hooked = [(lambda n: n.endswith("hook_resid_post"), steer)]
    eager = run_with_hooks(m, t, fwd_hooks=hooked)
    assert sorted(seen) == [0, 1, 2] and all(type(layer) is int for layer in seen)
    jitted = nnx.jit(lambda m, t: run_with_hooks(m, t, fwd_hooks=hooked))(m, t)
    np.testing.assert_allclose(jitted, eager, atol=1e-5)
    np.testing.assert_allclose(run_with_hooks(model("gemma2_like", scan=False), t,
                                              fwd_hooks=hooked), eager, atol=2e-5)
    logits, cache = nnx.jit(lambda m, t: run_with_cache(m, t, names=["blocks.1.attn.hook_pattern"]))(
        m, t)
    np.testing.assert_allclose(cache["blocks.1.attn.hook_pattern"],
                               run_with_cache(m, t)[1]["blocks.1.attn.hook_pattern"], atol=1e-6)


def test_replacing_the_pattern_changes_the_output_as_the_pattern_says():
    """The identity on hook_pattern computes the output from the pattern (the same
    logits); a pattern that looks only at the first token makes the layer's z its
    value there, in a scanned layer, and leaves the other layers as they were."""
    m, t = model("llama"), tokens()
    same = run_with_hooks(m, t, fwd_hooks=[(lambda n: n.endswith("hook_pattern"),
                                            lambda p, h: p)])
    np.testing.assert_allclose(same, forward(m, t), atol=1e-5)

    def first_token(p, hook):
        return jnp.zeros_like(p).at[..., 0].set(1.0)

    _, cache = run_with_cache(m, t, fwd_hooks=[("blocks.1.attn.hook_pattern", first_token)])
    z, v = cache["blocks.1.attn.hook_z"], cache["blocks.1.attn.hook_v"]  # [B,T,N,H], [B,S,K,H]
    want = jnp.repeat(v[:, :1], T, axis=1).repeat(2, axis=2)  # head n reads kv head n // 2
    np.testing.assert_allclose(z, want, atol=1e-6)
    clean = run_with_cache(m, t, names=["blocks.0.attn.hook_z"])[1]
    np.testing.assert_allclose(cache["blocks.0.attn.hook_z"], clean["blocks.0.attn.hook_z"],
                               atol=1e-6)


@pytest.mark.parametrize("impl, name", [("blockwise", "gemma2_like"), ("xla", "llama")])
def test_patterns_of_every_implementation_equal_the_materialised_ones(impl, name):
    """blockwise never materialises the pattern: the captured layers' are the
    reference's, equal to those of the materialising implementation."""
    t = tokens()

    def build(i):
        cfg = model_config({**TINY, **CONFIGS[name], "attention": dict(
            CONFIGS[name].get("attention", {}), impl=i)})
        return models.build(cfg, rngs=nnx.Rngs(0))

    m, ref = build(impl), build("reference")
    logits, cache = run_with_cache(m, t, names=lambda n: "hook_pattern" in n)
    np.testing.assert_array_equal(logits, forward(m, t))  # the implementation's own output
    _, want = run_with_cache(ref, t, names=lambda n: "hook_pattern" in n)
    for k in want:
        np.testing.assert_allclose(cache[k], want[k], atol=1e-6, err_msg=k)
    if name == "gemma2_like":
        local = cache["blocks.0.attn.hook_pattern"]  # sliding window 3: itself and 3 before
        assert int((local > 0).sum(-1).max()) == 4


def test_the_model_s_program_is_unchanged_by_a_session_before_it():
    m, t = model("llama"), tokens()
    graphdef, state = nnx.split(m)
    own = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))
    before = str(own(state, t))
    run_with_hooks(m, t, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, h: z * 0)])
    assert str(own(state, t)) == before


def test_an_encoder_decoder_names_its_two_stacks():
    cfg = model_config(dict(arch="encoder_decoder", vocab_size=61, d_model=32, num_layers=2,
                            num_encoder_layers=2, num_heads=4, d_ff=48, max_len=64, position="t5",
                            norm="rmsnorm", t5=dict(num_buckets=8, max_distance=16)))
    m = models.build(cfg, rngs=nnx.Rngs(0))
    t = tokens()
    logits, cache = run_with_cache(m, t, decoder_tokens=t[:, :5])
    np.testing.assert_array_equal(logits, forward(m, t, t[:, :5]))
    assert cache["encoder.blocks.1.attn.hook_pattern"].shape == (B, 4, T, T)
    assert cache["decoder.blocks.1.cross_attn.hook_pattern"].shape == (B, 4, 5, T)
    assert "decoder.ln_final.hook_normalized" in cache
