"""Mixture of Experts: routing vs per-token dense evaluation, capacity dropping,
auxiliary losses, and expert parallelism on 8 simulated devices vs 1 device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfjax.config import DEFAULT_RULES, MoEConfig, model_config
from tfjax.models import build
from tfjax.nn.moe import MoE, capacity_slots, moe_aux
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import use_rules

D, F, E = 8, 12, 4


def make(**kw):
    """An MoE of E experts, top-2, SwiGLU; `kw`: fields of its `MoEConfig`, or the
    layer's own `activation`, `use_bias`, `init_std`."""
    args = dict(num_experts=E, experts_per_token=2, activation="swiglu", init_std=0.5)
    args.update(kw)
    own = {k: args.pop(k) for k in ("activation", "use_bias", "init_std") if k in args}
    return MoE(D, F, MoEConfig(**args), **own, rngs=nnx.Rngs(0))


def run(moe, x):
    return nnx.jit(lambda m, x: m(x))(moe, x)


def x_of(B=2, T=7, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, D))


def np_act(name, h):
    if name in ("swiglu", "silu"):
        return h / (1 + np.exp(-h))
    if name in ("relu", "reglu"):
        return np.maximum(h, 0)
    raise NotImplementedError(name)


def per_token(moe, x, keep=None):
    """Plain loop: each token's top-k experts, each expert a small FFN (float64)."""
    p = {k[0]: np.asarray(v[...], np.float64) for k, v in nnx.state(moe, nnx.Param).flat_state()
         if len(k) == 1}
    zero = np.zeros((E, F))
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    out = np.zeros_like(x)
    for b in range(B):
        for t in range(T):
            logits = x[b, t] @ p["router"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = np.argsort(-probs, kind="stable")[:moe.k]
            g = probs[top] / (probs[top].sum() if moe.renormalize else 1.0)
            for j, e in enumerate(top):
                if keep is not None and not keep[b, t, j]:
                    continue
                if moe.gated:
                    h = np_act(moe.activation, x[b, t] @ p["wi_gate"][e] + p.get("bi_gate", zero)[e])
                    h = h * (x[b, t] @ p["wi_up"][e] + p.get("bi_up", zero)[e])
                else:
                    h = np_act(moe.activation, x[b, t] @ p["wi"][e] + p.get("bi", zero)[e])
                y = h @ p["wo"][e] + (p["bo"][e] if "bo" in p else 0)
                out[b, t] += g[j] * y
    if moe.shared is not None:
        out += np.asarray(moe.shared(jnp.asarray(x, jnp.float32)), np.float64)
    return out


@pytest.mark.parametrize("kw", [
    dict(),
    dict(router_renormalize=False, activation="relu", use_bias=True, experts_per_token=3),
    dict(shared_experts=2, shared_d_ff=6),
])
def test_dropless_matches_per_token_evaluation(kw):
    x = x_of()
    want = per_token(make(**kw), x)
    for impl in ("ragged", "dense"):
        moe = make(impl=impl, **kw)
        np.testing.assert_allclose(run(moe, x), want, rtol=2e-5, atol=2e-5, err_msg=impl)
        assert float(moe.dropped_fraction[...]) == 0.0


def test_ragged_and_dense_gradients_agree():
    x = x_of()

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x))) + moe_aux(m)["aux_loss"]

    grads = {}
    for impl in ("ragged", "dense"):
        grads[impl] = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(make(impl=impl), x)
    a, b = (jax.tree.leaves(nnx.state(g[0], nnx.Param)) + [g[1]] for g in grads.values())
    for ga, gb in zip(a, b):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(grads["ragged"][0].router[...]).sum()) > 0


def expected_keep(experts, C):
    """Reference capacity rule: first choices before second choices, then by position."""
    B, T, k = experts.shape
    keep = np.zeros(experts.shape, bool)
    for b in range(B):
        used = {}
        for j in range(k):
            for t in range(T):
                e = int(experts[b, t, j])
                if used.get(e, 0) < C:
                    keep[b, t, j] = True
                    used[e] = used.get(e, 0) + 1
    return keep


@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_capacity_drops_exactly_the_over_capacity_assignments(cf):
    moe = make(capacity_factor=cf)
    x = x_of(B=3, T=9)
    C = moe.capacity(9)
    logits = jnp.einsum("BTD,DE->BTE", x, moe.router[...])
    experts = np.asarray(jax.lax.top_k(logits, moe.k)[1])
    keep = expected_keep(experts, C)
    assert 0 < keep.sum() < keep.size, "the test needs some drops"
    _, got_keep = capacity_slots(jnp.asarray(experts), E, C)
    np.testing.assert_array_equal(got_keep, keep)
    np.testing.assert_allclose(run(moe, x), per_token(moe, x, keep=keep), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(moe.dropped_fraction[...]), 1 - keep.mean(), rtol=1e-6)


def test_large_capacity_is_dropless():
    x = x_of()
    moe = make(capacity_factor=float(E))  # C = T: nothing can drop
    np.testing.assert_allclose(run(moe, x), run(make(), x), rtol=2e-5, atol=2e-5)
    assert float(moe.dropped_fraction[...]) == 0.0


def test_aux_losses_and_metrics():
    moe = make(aux_loss_weight=0.1, z_loss_weight=0.01)
    x = x_of()
    run(moe, x)
    logits = np.asarray(jnp.einsum("BTD,DE->BTE", x, moe.router[...]), np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[..., :2]
    load = np.bincount(top.ravel(), minlength=E) / top.size
    lb = E * np.sum(load * probs.mean((0, 1)))
    lse = np.log(np.exp(logits).sum(-1))
    z = np.mean(lse ** 2)
    aux = moe_aux(moe)
    np.testing.assert_allclose(aux["expert_load"], load, rtol=1e-6)
    np.testing.assert_allclose(aux["load_balance_loss"], lb, rtol=1e-5)
    np.testing.assert_allclose(aux["router_z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(aux["aux_loss"], 0.1 * lb + 0.01 * z, rtol=1e-5)
    # A uniform router is perfectly balanced: loss 1, z-loss log(E)^2.
    moe.router[...] = jnp.zeros_like(moe.router[...])
    run(moe, x)
    np.testing.assert_allclose(moe.load_balance_loss[...], 1.0, rtol=1e-6)
    np.testing.assert_allclose(moe.router_z_loss[...], np.log(E) ** 2, rtol=1e-6)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="model.moe.num_experts"):
        model_config(dict(ffn_pattern=("moe",)))
    with pytest.raises(ValueError, match="model.moe.experts_per_token"):
        model_config(dict(ffn_pattern=("moe",), moe=dict(num_experts=4, experts_per_token=5)))
    with pytest.raises(ValueError, match="model.num_experts moved to model.moe.num_experts"):
        model_config(dict(ffn_pattern=("moe",), num_experts=4))
    with pytest.raises(ValueError, match="model.ffn_pattern"):  # a registry name: at build time
        build(dict(ffn_pattern=("sparse",)))


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_expert_parallel_equals_one_device(cf):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 devices")
    # data x expert = 2 x 4; E = 8 experts, 2 per device; batch over data and expert.
    mesh = Mesh(devices.reshape(2, 1, 1, 1, 4),
                ("data", "fsdp", "sequence", "tensor", "expert"))
    rules = logical_rules(DEFAULT_RULES)
    moe = MoE(D, F, MoEConfig(num_experts=8, experts_per_token=2, capacity_factor=cf),
              init_std=0.5, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(2), (8, 6, D))

    def loss(m, x):
        y = m(x)
        return jnp.sum(y ** 2) + moe_aux(m)["aux_loss"], y

    f = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (l1, y1), g1 = f(moe, x)

    graphdef, state = nnx.split(moe)
    shardings = tree_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    assert state["wi_gate"][...].sharding.spec[0] == "expert"
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
    moe_p = nnx.merge(graphdef, state)

    def loss_p(m, x):
        with use_rules(mesh, rules):
            return loss(m, x)

    (l8, y8), g8 = nnx.jit(nnx.value_and_grad(loss_p, has_aux=True))(moe_p, xs)
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(g8, nnx.Param)), jax.tree.leaves(nnx.state(g1, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
