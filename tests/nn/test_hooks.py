"""The hook points' context (`tfjax.nn.hooks`): inert without a session, named by
scope, replaced and kept inside one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax.nn import hooks, norms


def test_without_a_session_every_point_is_the_identity():
    x = jnp.ones((2, 3))
    with hooks.scope("attn"), hooks.layer_scope("blocks", (0,)):
        assert hooks.hook("hook_q", x) is x
        assert hooks.active("hook_pattern") is False
        assert hooks.patched("hook_pattern") is False
    assert not hooks.recording()


def test_a_session_names_by_scope_keeps_and_replaces():
    s = hooks.Session(keep=lambda n: n.endswith("hook_q"))
    seen = []
    s.hooks["blocks.3.attn.hook_q"] = [lambda x, h: seen.append(h) or x * 2]
    x = jnp.ones((2, 3))
    with hooks.session(s):
        with hooks.layer_scope("blocks", (3,)), hooks.scope("attn"):
            y = hooks.hook("hook_q", x)
            hooks.hook("hook_k", x)
            assert hooks.active("hook_q") and not hooks.active("hook_v")
            assert hooks.patched("hook_q") is True and hooks.patched("hook_k") is False
        hooks.hook("hook_embed", x)
    assert not hooks.recording()
    assert seen == [hooks.HookPoint("blocks.3.attn.hook_q", 3)]
    assert float(y.sum()) == 12.0
    assert list(s.cache) == ["blocks.3.attn.hook_q"] and s.cache["blocks.3.attn.hook_q"] is y
    assert list(s.seen) == ["blocks.3.attn.hook_q", "blocks.3.attn.hook_k",
                            "blocks.3.attn.hook_v", "hook_embed"]


def test_a_scanned_scope_selects_its_layer_and_emits_per_layer():
    """Layers 1 and 3 at position 1 of two cycles of length 2: the hook of layer 3
    runs only in cycle 1, and the kept values come back under each layer's name."""
    s = hooks.Session(keep=lambda n: True)
    s.hooks["blocks.3.hook_resid_pre"] = [lambda x, h: x + h.layer]
    frame = hooks.Frame()

    def body(carry, c):
        with hooks.layer_scope("blocks", (1, 3), c, frame):
            y = hooks.hook("hook_resid_pre", carry)
            assert hooks.patched("hook_resid_pre").shape == ()  # traced: per cycle
        return carry + 1, frame.values

    with hooks.session(s):
        _, kept = jax.lax.scan(body, jnp.zeros(2), jnp.arange(2))
        frame.emit(kept)
    assert sorted(s.cache) == ["blocks.1.hook_resid_pre", "blocks.3.hook_resid_pre"]
    assert s.cache["blocks.1.hook_resid_pre"].tolist() == [0.0, 0.0]
    assert s.cache["blocks.3.hook_resid_pre"].tolist() == [4.0, 4.0]  # 1 + layer 3


@pytest.mark.parametrize("fn, match", [(lambda x, h: None, "returned None"),
                                       (lambda x, h: x[0], r"returned shape \(3,\)")])
def test_a_bad_hook_function_is_named(fn, match):
    s = hooks.Session(hooks={"hook_embed": [fn]})
    with hooks.session(s), pytest.raises(ValueError, match=f"hook_embed {match}"):
        hooks.hook("hook_embed", jnp.ones((2, 3)))


@pytest.mark.parametrize("kind", list(norms.NORMS))
def test_hook_normalized_is_before_the_norm_s_scale_and_bias(kind):
    """As TransformerLens's: x normalised, then the learned scale and bias, which
    apply to what a hook function gives back; the output is the norm's own."""
    norm = norms.make_norm(kind, 8, eps=1e-5, use_bias=True, dtype=jnp.float32,
                           param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    params = nnx.state(norm, nnx.Param)
    nnx.update(norm, jax.tree.map(lambda a: a + 0.5, params))  # off the identity init
    x = 3.0 * jax.random.normal(jax.random.key(0), (2, 5, 8)) + 1.0
    s = hooks.Session(keep=lambda n: True)
    with hooks.session(s):
        y = norms.hooked_norm("ln1", norm, x)
    np.testing.assert_allclose(y, norm(x), atol=1e-6)
    h = s.cache["ln1.hook_normalized"]
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(jnp.square(h), -1)), 1.0, atol=1e-3)
    if kind == "layernorm":
        np.testing.assert_allclose(jnp.mean(h, -1), 0.0, atol=1e-5)
    s = hooks.Session(hooks={"ln1.hook_normalized": [lambda h, _: jnp.zeros_like(h)]})
    with hooks.session(s):
        zeroed = norms.hooked_norm("ln1", norm, x)
    bias = norm.bias[...] if kind == "layernorm" else jnp.zeros(8)
    np.testing.assert_allclose(zeroed, jnp.broadcast_to(bias, x.shape), atol=1e-6)
    assert norms.hooked_norm("ln1", norm, x) is not None  # no session: the norm itself
