"""MoE routers of the 2024-26 families vs Hugging Face's own torch modules (random
weights copied into tfjax's layout, fp32, dense and ragged dispatch): DeepSeek-V3
(sigmoid, group-limited top-k, score-correction bias, routed scaling, shared
experts), gpt-oss (router bias, expert biases, clamped SwiGLU, softmax over the top-k
logits), Qwen2-MoE (sigmoid-gated shared expert), Llama 4 (top-1 sigmoid, input
scaled before the expert, shared expert). Plus gradients of the group-limited sigmoid
router vs a plain jnp reference, and DeepSeek-V3's aux-loss-free bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tfjax import config as C
from tfjax.config import MoEConfig, model_config
from tfjax.models import build
from tfjax.nn.moe import MoE, balance_experts, moe_aux, route
from tfjax.train.step import make_train_step

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

D, F, E = 12, 10, 8
B, T = 2, 7  # M = 14 tokens: not a multiple of E, k or the groups
IMPLS = ("dense", "ragged")


def t2j(t):
    return jnp.asarray(t.detach().numpy())


def randomize(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def x_pair(seed=1):
    x = np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)
    return jnp.asarray(x), torch.from_numpy(x)


def copy_mlp(ffn, mlp):
    """A Hugging Face gate/up/down MLP -> tfjax FeedForward (kernels transposed)."""
    ffn.wi_gate.kernel[...] = t2j(mlp.gate_proj.weight).T
    ffn.wi_up.kernel[...] = t2j(mlp.up_proj.weight).T
    ffn.wo.kernel[...] = t2j(mlp.down_proj.weight).T


def copy_experts_out_in(moe, experts):
    """`gate_up_proj [E, 2F, D]` (gate then up, torch Linear layout), `down_proj [E, D, F]`."""
    gu = t2j(experts.gate_up_proj)
    moe.wi_gate[...] = gu[:, :F].transpose(0, 2, 1)
    moe.wi_up[...] = gu[:, F:].transpose(0, 2, 1)
    moe.wo[...] = t2j(experts.down_proj).transpose(0, 2, 1)


def check(moe, want, x, impl):
    moe.implementation = impl
    got = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


# -- DeepSeek-V3 --------------------------------------------------------------------
def deepseek_pair(n_group=4, topk_group=2, k=3, norm=True, scale=2.5):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                           num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                           n_shared_experts=2, routed_scaling_factor=scale, norm_topk_prob=norm,
                           hidden_act="silu")
    hf = randomize(DeepseekV3MoE(cfg).eval())
    with torch.no_grad():  # a bias large enough to change choices, unlike the gates
        hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E)[torch.randperm(
            E, generator=torch.Generator().manual_seed(3))])
    config = MoEConfig(num_experts=E, experts_per_token=k, score="sigmoid", n_group=n_group,
                       topk_group=topk_group, score_bias=True, router_renormalize=norm,
                       routed_scaling_factor=scale, shared_experts=2)
    moe = MoE(D, F, config, activation="swiglu", rngs=nnx.Rngs(0))
    moe.router[...] = t2j(hf.gate.weight).T
    moe.score_bias[...] = t2j(hf.gate.e_score_correction_bias)
    copy_experts_out_in(moe, hf.experts)
    copy_mlp(moe.shared, hf.shared_experts)
    return moe, hf


@pytest.mark.parametrize("kw", [dict(), dict(norm=False, scale=1.0, k=2, topk_group=1)])
def test_deepseek_v3_matches_hugging_face(kw):
    moe, hf = deepseek_pair(**kw)
    x, xt = x_pair()
    with torch.no_grad():
        want = hf(xt).numpy()
    for impl in IMPLS:
        check(moe, want, x, impl)


def test_group_limited_router_under_capacity_dispatch():
    moe, hf = deepseek_pair()
    x, xt = x_pair()
    with torch.no_grad():
        want = hf(xt).numpy()
    moe.capacity_factor = float(E)  # C = T: the gather dispatch, nothing dropped
    check(moe, want, x, "ragged")
    assert float(moe.dropped_fraction[...]) == 0.0


def test_score_bias_chooses_but_never_weighs():
    logits = jax.random.normal(jax.random.key(0), (5, E))
    bias = jnp.zeros(E).at[3].set(100.0)  # expert 3 always chosen ...
    scores, gates, experts = route(logits, 2, False, score="sigmoid", bias=bias)
    assert bool(jnp.all(experts[:, 0] == 3))
    # ... with its unbiased sigmoid as the gate
    np.testing.assert_allclose(gates[:, 0], jax.nn.sigmoid(logits[:, 3]), rtol=1e-6)
    np.testing.assert_allclose(gates, jnp.take_along_axis(scores, experts, -1), rtol=1e-6)


def test_group_limited_sigmoid_gradients_match_a_jnp_reference():
    moe, _ = deepseek_pair()
    G, TG, k, scale = 4, 2, 3, 2.5
    x = x_pair(seed=2)[0]

    def reference(p, x):  # sorts and one-hot masks, no top_k, every expert on every token
        xf = x.reshape(-1, D)
        s = jax.nn.sigmoid(xf @ p["router"])
        c = s + p["bias"]
        top2 = jnp.sort(c.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(-1)  # [M, G]
        groups = jnp.argsort(-top2, axis=-1)[:, :TG]
        keep = jnp.repeat(jax.nn.one_hot(groups, G).sum(1) > 0, E // G, axis=-1)
        chosen = jnp.argsort(-jnp.where(keep, c, -jnp.inf), axis=-1)[:, :k]
        w = s * jax.nn.one_hot(chosen, E).sum(1)
        w = w / w.sum(-1, keepdims=True) * scale
        h = jax.nn.silu(jnp.einsum("MD,EDF->MEF", xf, p["wi_gate"]))
        h = h * jnp.einsum("MD,EDF->MEF", xf, p["wi_up"])
        y = jnp.einsum("ME,MEF,EFD->MD", w, h, p["wo"])
        return y.reshape(x.shape) + moe.shared(x)

    def loss_ref(p, x):
        return jnp.sum(jnp.sin(reference(p, x)))

    names = ("router", "wi_gate", "wi_up", "wo")
    p = {n: getattr(moe, n)[...] for n in names} | {"bias": moe.score_bias[...]}
    want_p, want_x = jax.grad(loss_ref, argnums=(0, 1))(p, x)

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)))

    for impl in IMPLS:
        moe.implementation = impl
        gm, gx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(moe, x)
        np.testing.assert_allclose(gx, want_x, rtol=1e-4, atol=1e-5, err_msg=impl)
        for n in names:
            np.testing.assert_allclose(getattr(gm, n)[...], want_p[n], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{impl} {n}")
        assert float(jnp.abs(gm.router[...]).sum()) > 0


def test_aux_free_balancing_moves_the_bias_toward_balance():
    gamma = 0.02
    moe = MoE(D, F, MoEConfig(num_experts=E, experts_per_token=2, score="sigmoid",
                              bias_update_rate=gamma),
              init_std=0.3, rngs=nnx.Rngs(0))
    moe.router[...] = moe.router[...].at[:, 0].add(1.0)  # expert 0 hogs the tokens
    x = jax.random.normal(jax.random.key(4), (4, 16, D))
    fwd = nnx.jit(lambda m, x: m(x))

    def step(m):
        y = fwd(m, x)
        load = m.expert_load[...]
        before = m.score_bias[...]
        nnx.update(m, balance_experts(nnx.state(m, nnx.Not(nnx.Param))))
        return y, load, before

    y0, load0, _ = step(moe)
    np.testing.assert_allclose(moe.score_bias[...],
                               gamma * np.sign(np.mean(load0) - np.asarray(load0)), rtol=1e-6)
    assert float(moe.score_bias[0]) < 0  # the overloaded expert's bias goes down
    for _ in range(60):
        _, load, _ = step(moe)
    assert float(jnp.std(load)) < 0.5 * float(jnp.std(load0)), (load0, load)
    # The gates stay the unbiased sigmoid scores of the chosen experts.
    logits = jnp.einsum("BTD,DE->BTE", x, moe.router[...])
    scores, gates, experts = route(logits, 2, True, score="sigmoid", bias=moe.score_bias[...])
    chosen = jnp.take_along_axis(jax.nn.sigmoid(logits), experts, -1)
    np.testing.assert_allclose(gates, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    # A fixed bias (rate 0) never moves.
    fixed = MoE(D, F, MoEConfig(num_experts=E, experts_per_token=2, score_bias=True),
                rngs=nnx.Rngs(0))
    fwd(fixed, x)
    nnx.update(fixed, balance_experts(nnx.state(fixed, nnx.Not(nnx.Param))))
    assert float(jnp.abs(fixed.score_bias[...]).sum()) == 0.0
    assert float(moe_aux(moe)["aux_loss"]) > 0  # the other losses are still reported


# -- gpt-oss ------------------------------------------------------------------------
def test_gpt_oss_matches_hugging_face():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    cfg = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                       num_experts_per_tok=3)
    hf = randomize(GptOssMLP(cfg).eval(), std=1.0)  # large enough that the clamps bite
    x, xt = x_pair()
    x, xt = 2 * x, 2 * xt
    with torch.no_grad():
        want = hf(xt)[0].numpy()
    config = MoEConfig(num_experts=E, experts_per_token=3, router_bias=True, glu="clamped",
                       glu_alpha=cfg.swiglu_alpha, glu_limit=cfg.swiglu_limit)
    moe = MoE(D, F, config, activation="swiglu", use_bias=True, rngs=nnx.Rngs(0))
    moe.router[...] = t2j(hf.router.weight).T
    moe.router_bias[...] = t2j(hf.router.bias)
    gu, gub = t2j(hf.experts.gate_up_proj), t2j(hf.experts.gate_up_proj_bias)  # interleaved
    moe.wi_gate[...], moe.wi_up[...] = gu[..., ::2], gu[..., 1::2]
    moe.bi_gate[...], moe.bi_up[...] = gub[..., ::2], gub[..., 1::2]
    moe.wo[...], moe.bo[...] = t2j(hf.experts.down_proj), t2j(hf.experts.down_proj_bias)
    h = jnp.einsum("BTD,EDF->BTEF", x, moe.wi_gate[...]) + moe.bi_gate[...]
    assert float(jnp.max(h)) > cfg.swiglu_limit, "the test needs the gate clamp to act"
    for impl in IMPLS:
        check(moe, want, x, impl)


# -- Qwen2-MoE / Qwen3-Next ---------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_next"])
def test_qwen_shared_expert_gate_matches_hugging_face(family):
    Fs = 14  # shared_expert_intermediate_size
    kw = dict(hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=Fs,
              num_experts=E, num_experts_per_tok=2, norm_topk_prob=False)
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeSparseMoeBlock as Block)
    else:
        from transformers import Qwen3NextConfig as Config
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextSparseMoeBlock as Block)
        kw["norm_topk_prob"] = True
    hf = randomize(Block(Config(**kw)).eval())
    x, xt = x_pair()
    with torch.no_grad():
        want = hf(xt).numpy()
    config = MoEConfig(num_experts=E, experts_per_token=2,
                       router_renormalize=kw["norm_topk_prob"], shared_experts=1,
                       shared_d_ff=Fs, shared_gate=True)
    moe = MoE(D, F, config, activation="swiglu", rngs=nnx.Rngs(0))
    moe.router[...] = t2j(hf.gate.weight).T
    copy_experts_out_in(moe, hf.experts)
    copy_mlp(moe.shared, hf.shared_expert)
    moe.shared_gate[...] = t2j(hf.shared_expert_gate.weight).T
    for impl in IMPLS:
        check(moe, want, x, impl)


# -- Llama 4 ------------------------------------------------------------------------
def test_llama4_matches_hugging_face():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    cfg = Llama4TextConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                           num_experts_per_tok=1, hidden_act="silu")
    hf = randomize(Llama4TextMoe(cfg).eval())
    x, xt = x_pair()
    with torch.no_grad():
        want = hf(xt.reshape(B * T, D))[0].reshape(B, T, D).numpy()
    config = MoEConfig(num_experts=E, experts_per_token=1, score="sigmoid",
                       router_renormalize=False, gate_input=True, shared_experts=1)
    moe = MoE(D, F, config, activation="swiglu", rngs=nnx.Rngs(0))
    moe.router[...] = t2j(hf.router.weight).T
    gu = t2j(hf.experts.gate_up_proj)  # [E, D, 2F]: gate then up
    moe.wi_gate[...], moe.wi_up[...] = gu[..., :F], gu[..., F:]
    moe.wo[...] = t2j(hf.experts.down_proj)
    copy_mlp(moe.shared, hf.shared_expert)
    for impl in IMPLS:
        check(moe, want, x, impl)


# -- config ---------------------------------------------------------------------------
@pytest.mark.parametrize("moe, field", [
    (dict(score="tanh"), "model.moe.score"),
    (dict(n_group=3), "model.moe.n_group"),
    (dict(n_group=4, topk_group=5), "model.moe.topk_group"),
    (dict(n_group=4, topk_group=1, experts_per_token=3), "model.moe.experts_per_token"),
    (dict(bias_update_rate=-1.0), "model.moe.bias_update_rate"),
    (dict(glu="oai"), "model.moe.glu"),
    (dict(gate_input=True, capacity_factor=1.0), "model.moe.gate_input"),
    (dict(shared_gate=True), "model.moe.shared_gate"),
])
def test_router_config_errors_name_the_field(moe, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model_config(dict(ffn_pattern=("moe",), moe=dict(dict(num_experts=E), **moe)))
    model_config(dict(ffn_pattern=("moe",), moe=dict(num_experts=E, n_group=4, topk_group=2,
                                                     score="sigmoid", bias_update_rate=1e-3)))


def test_the_train_step_applies_the_bias_update_on_a_scanned_model():
    gamma = 0.01
    model = build(dict(vocab_size=64, d_model=16, num_heads=2, num_layers=2, d_ff=24,
                       ffn_pattern=("moe",), moe=dict(num_experts=E, experts_per_token=2,
                                                      score="sigmoid", n_group=4, topk_group=2,
                                                      bias_update_rate=gamma)),
                  rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.1)
    state = dict(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params), rest=rest)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    batch = dict(inputs=tokens, targets=jnp.roll(tokens, -1, 1),
                 positions=jnp.broadcast_to(jnp.arange(9), (2, 9)),
                 segment_ids=jnp.ones((2, 9), jnp.int32), mask=jnp.ones((2, 9), jnp.int32),
                 target_bytes=jnp.ones((2, 9), jnp.int32))
    step = jax.jit(make_train_step(graphdef, tx, C.from_dict(C.TrainConfig, {})))
    new, _ = step(state, batch)
    flat = dict(nnx.to_flat_state(new["rest"]))
    (path,) = [p for p in flat if p[-1] == "score_bias"]
    bias, load = flat[path][...], flat[path[:-1] + ("expert_load",)][...]
    assert bias.shape == (2, E)  # one bias per scanned layer
    np.testing.assert_allclose(bias, gamma * np.sign(load.mean(-1, keepdims=True) - load))
    assert float(jnp.abs(bias).sum()) > 0


def test_first_k_dense_replace_is_an_ffn_pattern():
    L, k = 5, 2  # DeepSeek first_k_dense_replace = 2: dense widths d_ff, experts moe.d_ff
    cfg = model_config(dict(vocab_size=64, d_model=16, num_heads=2, num_layers=L, d_ff=40,
                            activation="swiglu",
                            ffn_pattern=k * ("dense",) + (L - k) * ("moe",),
                            moe=dict(num_experts=E, experts_per_token=2, d_ff=6)))
    model = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))  # no compile
    ffns = [b.ffn for b in model.layers.cycles.layers]
    assert [type(f).__name__ for f in ffns] == ["FeedForward"] * k + ["MoE"] * (L - k)
    assert ffns[0].wi_gate.kernel.shape[-1] == 40 and ffns[-1].wi_gate.shape[-1] == 6
