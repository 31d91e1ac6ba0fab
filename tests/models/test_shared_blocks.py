"""Transformer blocks shared across layers (Zamba2; `model.shared`, the
"mamba2_shared" layer kind, `tfjax.nn.shared_block`): the model equals a reference
written out here, forward and gradients, scanned and unrolled; the shared weights
exist once and their gradient is the sum over their uses; config errors name the
field.

The reference applies the same parameters explicitly, layer by layer: the Mamba-2
mixer is the layer's own module (tested against its recurrence in
tests/nn/test_mamba2.py), everything the shared block adds is jnp written here.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config

# 7 layers of ("mamba2_shared", "mamba2"): scanned, 3 cycles and one unrolled layer;
# uses at layers 0, 2, 4, 6 run blocks 0, 1, 0, 1 (traced under the scan: one use
# per cycle, two blocks). GQA 2/1 heads of 16 = 2 D / num_heads, Zamba2's shape. The
# scanned model rematerialises its layers (remat="full"), the unrolled one does not.
ZAMBA = dict(vocab_size=61, d_model=16, num_layers=7, num_heads=2, num_kv_heads=1, head_dim=16,
             d_ff=24, max_len=64, position="rope", norm="rmsnorm", activation="geglu",
             ffn_bias=False, ffn_pattern=("none",), tie_embeddings=False, init_std=0.3,
             layer_pattern=("mamba2_shared", "mamba2"),
             mamba2=dict(d_state=4, head_dim=8, n_groups=1, d_conv=3, chunk=4),
             shared=dict(num_blocks=2, adapter_rank=3))
USES = (0, 2, 4, 6)


def build(seed=0, **kw):
    return models.build(model_config({**ZAMBA, **kw}), rngs=nnx.Rngs(seed))


def tokens(B=2, T=9, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, ZAMBA["vocab_size"])


def rms(x, scale, eps=1e-5):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def rope(x, theta=10000.0):  # x [B, T, n, H], "half" layout, positions 0..T-1
    H = x.shape[-1]
    inv = theta ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv  # [T, H/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def shared_ref(x, e, sp, use, scale):
    """One use of a shared block, written out: sp the block's arrays, use the layer's."""
    h = rms(jnp.concatenate([x, e], -1), sp["in_norm"])
    q = jnp.einsum("BTW,WNH->BTNH", h, sp["q"]) + jnp.einsum(
        "BTW,WR,RNH->BTNH", h, use["q_a"], use["q_b"])
    k = jnp.einsum("BTW,WKH->BTKH", h, sp["k"]) + jnp.einsum(
        "BTW,WR,RKH->BTKH", h, use["k_a"], use["k_b"])
    v = jnp.einsum("BTW,WKH->BTKH", h, sp["v"]) + jnp.einsum(
        "BTW,WR,RKH->BTKH", h, use["v_a"], use["v_b"])
    q, k = rope(q), rope(k)
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    T = x.shape[1]
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    a = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s, -1), v)
    a = jnp.einsum("BTNH,NHD->BTD", a, sp["o"])
    f = rms(a, sp["ffn_norm"])
    d = jnp.einsum("BTD,DR,RIF->BTIF", f, use["mlp_a"], use["mlp_b"])
    g = f @ sp["wi_gate"] + d[:, :, 0]
    u = f @ sp["wi_up"] + d[:, :, 1]
    y = (jax.nn.gelu(g, approximate=False) * u) @ sp["wo"]
    return y @ use["out"]


def shared_arrays(model, m):
    """Block m's arrays (of the stacked shared blocks), by name."""
    s = model.layers.shared
    return dict(in_norm=s.in_norm.scale[...][m], q=s.attn.q.kernel[...][m],
                k=s.attn.k.kernel[...][m], v=s.attn.v.kernel[...][m], o=s.attn.o.kernel[...][m],
                ffn_norm=s.ffn_norm.scale[...][m], wi_gate=s.ffn.wi_gate.kernel[...][m],
                wi_up=s.ffn.wi_up.kernel[...][m], wo=s.ffn.wo.kernel[...][m])


def use_arrays(block):
    g = block.mixer_input
    return {n: getattr(g, n)[...] for n in ("q_a", "q_b", "k_a", "k_b", "v_a", "v_b", "mlp_a",
                                           "mlp_b", "out")}


def reference(model, x, shared_of_use, own=None):
    """Logits of an unrolled model, written out; `shared_of_use(u)`: the shared block
    arrays use u runs (the model's: block u % num_blocks); `own`: {u: arrays} replacing
    use u's own (adapters, out)."""
    cfg = model.config
    h = model.embed.tokens.embedding[...][x]
    e, u = h, 0
    for block in model.layers.blocks:
        inp = h
        if block.mixer_input is not None:
            mine = (own or {}).get(u) or use_arrays(block)
            inp = h + shared_ref(h, e, shared_of_use(u), mine, cfg.attention_scale)
            u += 1
        h = h + block.attn(rms(inp, block.attn_norm.scale[...]))
    return rms(h, model.final_norm.scale[...]) @ model.embed.head.kernel[...]


def tied(model):
    M = model.config.shared.num_blocks
    return lambda u: shared_arrays(model, u % M)


def transfer(scanned, unrolled):
    """The scanned model's parameters into the unrolled one, by `layout.where`."""
    src = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    dst = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
    layout = scanned.layers.layout
    for path, var in dst.items():
        if path[:2] != ("layers", "blocks"):
            var.set_value(src[path].get_value())  # embedder, final norm, shared blocks
            continue
        where = layout.where(path[2])
        if where[0] == "cycles":
            _, j, c = where
            var.set_value(src[("layers", "cycles", "layers", j) + path[3:]].get_value()[c])
        else:
            var.set_value(src[("layers", "blocks", where[1]) + path[3:]].get_value())
    nnx.update(unrolled, nnx.from_flat_state(dst))


@pytest.fixture(scope="module")
def pair():
    scanned, unrolled = build(0, remat="full"), build(1, scan_layers=False)
    assert scanned.layers.layout.num_cycles == 3 and unrolled.layers.layout.num_cycles == 0
    transfer(scanned, unrolled)
    return scanned, unrolled


def test_unrolled_twin_places_every_layer_and_keeps_the_shared_blocks(pair):
    """`models.unrolled` of the scanned model: the parameters `transfer` places by
    `layout.where` (the shared blocks stay stacked over num_blocks)."""
    scanned, unrolled = pair
    twin = dict(nnx.to_flat_state(nnx.state(models.unrolled(scanned), nnx.Param)))
    want = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
    assert twin.keys() == want.keys()
    for path, var in want.items():
        np.testing.assert_array_equal(twin[path].get_value(), var.get_value(), err_msg=str(path))


def loss_fn(logits):
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + jnp.mean(logits ** 2) * 1e-2


def test_forward_equals_the_reference_scanned_and_unrolled(pair):
    scanned, unrolled = pair
    x = tokens()
    want = jax.jit(lambda t: reference(unrolled, t, tied(unrolled)))(x)
    for model in (unrolled, scanned):
        np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, x), want,
                                   rtol=2e-4, atol=2e-4)
    # The shared path matters: without it (each layer a plain Mamba-2 layer) the
    # logits differ.
    plain = jax.jit(lambda t: reference(unrolled, t, lambda u: jax.tree.map(
        jnp.zeros_like, tied(unrolled)(u))))(x)
    assert not np.allclose(plain, want, atol=1e-2)


def test_shared_gradients_are_the_sum_over_their_uses(pair):
    """Untie the reference (each use its own copy of its block's weights): the
    model's gradient of block m is the sum of the copies' gradients of its uses, in
    the scanned and the unrolled model alike; per-use weights get their own."""
    scanned, unrolled = pair
    x = tokens()
    M = ZAMBA["shared"]["num_blocks"]
    copies = [shared_arrays(unrolled, u % M) for u in range(len(USES))]
    g_copies = jax.jit(jax.grad(lambda cs: loss_fn(reference(unrolled, x, lambda u: cs[u]))))(
        copies)
    want = [jax.tree.map(lambda *g: sum(g), *g_copies[m::M]) for m in range(M)]
    assert all(float(jnp.abs(g["q"]).sum()) > 0 for g in g_copies)  # every use contributes

    grad = nnx.jit(lambda m, t: nnx.grad(lambda m: loss_fn(m(t)))(m))
    for model in (unrolled, scanned):
        g = grad(model, x)
        for m in range(M):
            got = shared_arrays(g, m)
            for name in want[m]:  # float32 through 7 layers: 1e-3 of the gradient's scale
                scale = float(jnp.abs(want[m][name]).max())
                np.testing.assert_allclose(got[name], want[m][name], rtol=1e-3,
                                           atol=1e-3 * scale, err_msg=f"block {m} {name}")
    # a use's own weights: the reference's gradient of use 1's (layer 2, unrolled)
    g_ref = jax.jit(jax.grad(lambda a: loss_fn(reference(unrolled, x, tied(unrolled),
                                                         own={1: a}))))(
        use_arrays(unrolled.layers.blocks[2]))
    got = use_arrays(grad(unrolled, x).layers.blocks[2])
    for name in ("q_b", "v_a", "mlp_b", "out"):
        np.testing.assert_allclose(got[name], g_ref[name], rtol=1e-3,
                                   atol=1e-3 * float(jnp.abs(g_ref[name]).max()), err_msg=name)


def _count(model):
    return sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_shared_weights_exist_once():
    """Parameters = the same model without shared blocks + num_blocks blocks + one
    use (adapters and output projection) per mamba2_shared layer."""
    cfg = model_config(ZAMBA)
    model = nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))
    plain = nnx.eval_shape(lambda: models.build(
        dict(ZAMBA, layer_pattern=("mamba2",), shared=dict(num_blocks=0)), rngs=nnx.Rngs(0)))
    D, F, r, M = cfg.d_model, cfg.d_ff, cfg.shared.adapter_rank, cfg.shared.num_blocks
    W, N, K, H = 2 * D, cfg.num_heads, cfg.kv_heads, cfg.head_size
    block = W + W * (N + 2 * K) * H + N * H * D + D + 3 * D * F  # norms, q k v o, MLP
    use = r * (3 * W + (N + 2 * K) * H) + r * (D + 2 * F) + D * D  # adapters, out
    assert _count(model) == _count(plain) + M * block + len(USES) * use
    # stacked over the blocks, with the sharding names of every stacked parameter
    assert model.layers.shared.attn.q.kernel.get_value().shape == (M, W, N, H)
    spec = nnx.get_partition_spec(nnx.state(model.layers.shared, nnx.Param))
    assert tuple(spec["attn"]["q"]["kernel"].get_value()) == (
        "layers", "embed", "heads", "head_dim")
    spec = nnx.get_partition_spec(nnx.state(model.layers.cycles, nnx.Param))
    assert tuple(spec["layers"][0]["mixer_input"]["q_b"].get_value()) == (
        "layers", None, "heads", "head_dim")


def test_no_concat_and_no_adapters():
    """concat_embedding=False: the block reads the hidden state alone (width D);
    adapter_rank=0: no adapters; model.shared.d_ff its own MLP width."""
    model = nnx.eval_shape(lambda: build(shared=dict(num_blocks=1, concat_embedding=False,
                                                     adapter_rank=0, d_ff=8)))
    assert model.layers.shared.in_norm.scale.get_value().shape == (1, ZAMBA["d_model"])
    assert model.layers.shared.ffn.wo.kernel.get_value().shape == (1, 8, ZAMBA["d_model"])
    use = model.layers.cycles.layers[0].mixer_input
    assert not use.has_attn_adapter and not use.has_mlp_adapter
    assert not hasattr(use, "q_a")
    out = nnx.eval_shape(lambda m, t: m(t), model, tokens())  # traced, not compiled
    assert out.shape == (2, 9, ZAMBA["vocab_size"])


@pytest.mark.parametrize("kw,field", [
    (dict(shared=dict(num_blocks=0)), "model.shared.num_blocks"),  # uses but no block
    (dict(shared=dict(num_blocks=5)), "model.shared.num_blocks"),  # 5 blocks, 4 uses
    (dict(layer_pattern=("mamba2",)), "model.shared.num_blocks"),  # blocks, no uses
    (dict(shared=dict(num_blocks=2, adapter_rank=-1)), "model.shared.adapter_rank"),
    (dict(shared=dict(num_blocks=2, adapter_rank=2, attn_adapter=False, mlp_adapter=False)),
     "model.shared.adapter_rank"),
    (dict(position="alibi"), "model.position"),
    (dict(norm_placement="post"), "model.shared.num_blocks"),
    (dict(mtp_depth=1), "model.mtp_depth"),
    (dict(shared=dict(num_block=2)), "model.shared.num_block"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}: "):
        nnx.eval_shape(lambda: models.build({**ZAMBA, **kw}))
