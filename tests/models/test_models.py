"""Properties every architecture must have, on tiny models."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models, ops
from tfjax.config import ModelConfig, model_config
from tfjax.models import attention_inputs
from tfjax.nn import positions as pos_lib

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64)


def tiny(**kw) -> ModelConfig:
    return model_config({**TINY, **kw})


@nnx.jit
def run(model, *args, **kwargs):
    """Jitted forward: one compile per call signature instead of op-by-op dispatch."""
    return model(*args, **kwargs)


def tokens(B, T, seed=0, vocab=61):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


DECODERS = {
    "gpt2": dict(position="learned", norm="layernorm", activation="gelu_tanh"),
    "llama_gqa": dict(position="rope", norm="rmsnorm", activation="swiglu", num_kv_heads=2,
                      ffn_bias=False, tie_embeddings=False),
    "mqa_interleaved_partial": dict(num_kv_heads=1, rope=dict(layout="interleaved", fraction=0.5)),
    "alibi": dict(position="alibi", embed_norm=True),
    "t5bias": dict(position="t5", norm="rmsnorm", t5=dict(num_buckets=8, max_distance=16)),
    "sinusoidal_post": dict(position="sinusoidal", norm_placement="post", activation="relu",
                            scale_embeddings=True),
    "gemma2_like": dict(layer_pattern=("local", "global"), num_layers=3,
                        norm="rmsnorm_plus_one", norm_placement="sandwich", final_softcap=15.0,
                        activation="geglu_tanh", scale_embeddings=True,
                        attention=dict(sliding_window=3, softcap=20.0, qk_norm=True)),
    "neox_parallel": dict(block="parallel", parallel_shared_norm=False, rope=dict(fraction=0.25)),
    "unscanned": dict(scan_layers=False, position="none"),
    "remat": dict(remat="full", num_layers=3),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_is_causal_and_differentiable(name):
    cfg = tiny(**DECODERS[name])
    model = models.build(cfg, rngs=nnx.Rngs(1))
    x = tokens(2, 11, seed=1)
    y = x.at[:, 7:].set((x[:, 7:] + 5) % cfg.vocab_size)  # change the future of position 6
    ab = nnx.jit(lambda m, t: m(t))(model, jnp.concatenate([x, y]))
    a, b = ab[:2], ab[2:]
    assert a.shape == (2, 11, cfg.vocab_size) and a.dtype == jnp.float32
    np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-5)
    assert not np.allclose(a[:, 7:], b[:, 7:], atol=1e-3), "later logits must see later tokens"

    def loss(m):
        logits = m(x)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0


def test_sliding_window_receptive_field():
    # One local layer of window W: position t sees t-W..t, not t-W-1.
    W = 3
    cfg = tiny(layer_pattern=("local",), num_layers=1, position="none",
               attention=dict(sliding_window=W))
    model = models.build(cfg)
    x = tokens(1, 10)
    t = 8
    far = x.at[:, t - W - 1].set((x[:, t - W - 1] + 1) % 61)
    near = x.at[:, t - W].set((x[:, t - W] + 1) % 61)
    np.testing.assert_allclose(run(model, x)[:, t], run(model, far)[:, t], atol=1e-6)
    assert not np.allclose(run(model, x)[:, t], run(model, near)[:, t], atol=1e-4)


def test_packed_documents_equal_separate_documents():
    cfg = tiny(**DECODERS["llama_gqa"])
    model = models.build(cfg)
    a, b = tokens(1, 5, seed=2), tokens(1, 6, seed=3)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 5 + [2] * 6])
    pos = jnp.array([list(range(5)) + list(range(6))])
    out = run(model, packed, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(out[:, :5], run(model, a), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], run(model, b), atol=1e-5)


@pytest.mark.parametrize("position,impl", [("alibi", "auto"), ("t5", "auto"), ("t5", "pallas")])
def test_position_bias_in_kernel_equals_the_materialised_bias(monkeypatch, position, impl):
    """ALiBi and T5's bias reach attention as a `tfjax.ops.Alibi` / `RelativeBias`
    (evaluated per tile): on a packed batch (positions restart per document) the
    logits and gradients (T5's table included) equal those of the materialised
    `[B,N,T,S]` bias (`alibi_bias`; T5's table gathered at the bucketed
    relative positions). `impl`: the attention implementation ("auto": blockwise
    on CPU; "pallas": the TPU kernels, interpreted)."""
    extra = dict(t5=dict(num_buckets=8, max_distance=16)) if position == "t5" else {}
    cfg = tiny(position=position, num_kv_heads=2, num_layers=1, **extra, attention=dict(impl=impl))
    model = models.build(cfg)
    x = tokens(2, 11, seed=4)
    seg = jnp.array([[1] * 4 + [2] * 7, [1] * 11])
    # positions in steps of 2 in places, so the distances differ from the index ones
    pos = jnp.array([list(range(4)) + list(range(0, 14, 2)), list(range(0, 22, 2))])

    def loss_and_logits(m):
        logits = m(x, positions=pos, segment_ids=seg)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    f = lambda: nnx.jit(nnx.value_and_grad(loss_and_logits, has_aux=True))(model)
    (_, kernel_logits), kernel_grads = f()
    spec = attention_inputs.position_bias(cfg, model.rel_bias, pos, pos)
    assert isinstance(spec, ops.Alibi if position == "alibi" else ops.RelativeBias)

    def materialised(cfg, rel_bias, q_positions, kv_positions):
        if position == "t5":  # bucketed [B,T,S] relative positions, gathered
            buckets = pos_lib.relative_position_bucket(
                kv_positions[:, None, :] - q_positions[:, :, None], bidirectional=False,
                num_buckets=8, max_distance=16)
            return jnp.moveaxis(rel_bias.embedding[...][buckets], -1, 1)
        return pos_lib.alibi_bias(q_positions, kv_positions, pos_lib.alibi_slopes(cfg.num_heads))

    monkeypatch.setattr(attention_inputs, "position_bias", materialised)
    (_, dense_logits), dense_grads = f()
    np.testing.assert_allclose(kernel_logits, dense_logits, atol=1e-5)
    leaves = jax.tree.leaves(kernel_grads)
    for a, b in zip(leaves, jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    if position == "t5":  # the table is learned: its gradient is there and not zero
        assert np.abs(np.asarray(kernel_grads.rel_bias.embedding[...])).max() > 1e-4


def test_prefix_lm():
    cfg = tiny(prefix_lm=True)
    model = models.build(cfg)
    x = tokens(2, 8)
    prefix = jnp.array([4, 4])
    out = run(model, x, prefix_lengths=prefix)
    # A prefix position sees later prefix tokens, but nothing after the prefix.
    y = x.at[:, 3].set((x[:, 3] + 1) % 61)
    assert not np.allclose(run(model, y, prefix_lengths=prefix)[:, 1], out[:, 1], atol=1e-4)
    z = x.at[:, 5:].set((x[:, 5:] + 1) % 61)
    np.testing.assert_allclose(run(model, z, prefix_lengths=prefix)[:, :5], out[:, :5], atol=1e-5)
    with pytest.raises(ValueError, match="prefix_lengths"):
        run(model, x)
    with pytest.raises(ValueError, match="prefix_lm"):
        run(models.build(tiny()), x, prefix_lengths=prefix)


@pytest.mark.parametrize("pattern,layers", [(("global",), 3), (("local", "global"), 5)])
def test_scan_equals_unrolled(pattern, layers):
    kw = dict(layer_pattern=pattern, num_layers=layers, norm="rmsnorm",
              attention=dict(sliding_window=2))
    scanned = models.build(tiny(dropout_rate=0.1, **kw))
    scanned.eval()
    unrolled = models.unrolled(scanned)
    assert unrolled.config.scan_layers is False and unrolled.layers.cycles is None
    assert len(unrolled.layers.blocks) == layers
    # the same variables, parameters and RNG state alike, now per layer
    count = lambda m, kind: sum(x.size for x in jax.tree.leaves(nnx.state(m, kind)))
    assert count(unrolled, nnx.Param) == count(scanned, nnx.Param)
    assert count(unrolled, nnx.RngState) == count(scanned, nnx.RngState)
    x = tokens(2, 9)
    np.testing.assert_allclose(scanned(x), unrolled(x), atol=1e-5)  # dropout still off
    # a fresh unrolled model differs: the comparison above can fail
    fresh = models.build(tiny(scan_layers=False, **kw), rngs=nnx.Rngs(1))
    assert np.abs(np.asarray(fresh(x) - scanned(x))).max() > 1e-2
    assert models.unrolled(unrolled) is unrolled

    class Wrapper(nnx.Module):  # as interop.hf.HFEncoder wraps an EncoderModel
        def __init__(self, model):
            self.model, self.config = model, model.config

    with pytest.raises(ValueError, match="tfjax.models.build"):
        models.unrolled(Wrapper(scanned))


def test_unrolled_moves_both_stacks_of_an_encoder_decoder():
    model = models.build(tiny(arch="encoder_decoder", position="t5", num_layers=2,
                              num_encoder_layers=3, t5=dict(num_buckets=8, max_distance=16)))
    twin = models.unrolled(model)
    assert twin.encoder.cycles is None and twin.decoder.cycles is None
    x = tokens(2, 7)
    np.testing.assert_allclose(model(x, x[:, :5]), twin(x, x[:, :5]), atol=1e-5)


def test_scanned_params_carry_the_layers_axis_name():
    model = models.build(tiny())
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    flat = dict(nnx.to_flat_state(specs))
    q = flat[("layers", "cycles", "layers", 0, "attn", "q", "kernel")]
    assert tuple(q.get_value()) == ("layers", "embed", "heads", "head_dim")
    emb = flat[("embed", "tokens", "embedding")]
    assert tuple(emb.get_value()) == ("vocab", "embed")


def test_encoder_is_permutation_equivariant_without_positions():
    cfg = tiny(arch="encoder", position="none", norm_placement="post", final_norm=False)
    model = models.build(cfg)
    x = tokens(2, 7)
    perm = jnp.array([3, 0, 6, 1, 5, 2, 4])
    np.testing.assert_allclose(run(model, x)[:, perm], run(model, x[:, perm]), atol=1e-5)


def test_bert_padding_token_types_pooler_classifier():
    cfg = tiny(arch="encoder", position="learned", norm_placement="post", embed_norm=True,
               type_vocab_size=2, num_classes=3, activation="gelu")
    model = models.build(cfg)
    x = tokens(2, 8)
    mask = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
    types = jnp.array([[0] * 4 + [1] * 4, [0] * 8])
    out = run(model, x, token_type_ids=types, attention_mask=mask)
    assert out.shape == (2, 8, 61)
    # Real tokens do not see padding: changing the padding changes nothing for them.
    y = x.at[1, 5:].set(7)
    np.testing.assert_allclose(run(model, y, token_type_ids=types, attention_mask=mask)[1, :5],
                               out[1, :5], atol=1e-5)
    # Token types matter.
    assert not np.allclose(run(model, x, attention_mask=mask)[0], out[0], atol=1e-4)
    logits = nnx.jit(lambda m, *a: m.classify(*a))(model, x, types, mask)
    assert logits.shape == (2, 3)
    hidden = nnx.jit(lambda m, *a: m.encode(*a))(model, x, types, mask)
    np.testing.assert_allclose(
        model.pool(hidden), jnp.tanh(hidden[:, 0] @ model.pooler.kernel[...] + model.pooler.bias[...]),
        atol=1e-5)


@pytest.mark.parametrize("kw", [
    dict(position="sinusoidal", norm_placement="post", activation="relu", scale_embeddings=True,
         final_norm=False),
    dict(position="t5", norm="rmsnorm", activation="geglu", t5=dict(num_buckets=8, max_distance=16),
         num_encoder_layers=3),
])
def test_encoder_decoder(kw):
    cfg = tiny(arch="encoder_decoder", **kw)
    model = models.build(cfg)
    src, tgt = tokens(2, 6, seed=4), tokens(2, 9, seed=5)
    out = run(model, src, tgt)
    assert out.shape == (2, 9, 61)
    # Decoder is causal.
    tgt2 = tgt.at[:, 5:].set((tgt[:, 5:] + 1) % 61)
    np.testing.assert_allclose(run(model, src, tgt2)[:, :5], out[:, :5], atol=1e-5)
    # Every decoder position sees the whole source.
    src2 = src.at[:, -1].set((src[:, -1] + 1) % 61)
    assert not np.allclose(run(model, src2, tgt)[:, 0], out[:, 0], atol=1e-4)
    # Encoder padding (segment 0) is invisible to the decoder.
    seg = jnp.array([[1] * 6, [1] * 4 + [0] * 2])
    padded = run(model, src, tgt, encoder_segment_ids=seg)
    src3 = src.at[1, 4:].set(3)
    np.testing.assert_allclose(run(model, src3, tgt, encoder_segment_ids=seg)[1], padded[1],
                               atol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m: m(src, tgt).mean()))(model)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(nnx.state(grads)))


def test_gqa_with_k_equal_n_is_mha_and_bad_inputs():
    model = models.build(tiny(num_kv_heads=4))
    mha = models.build(tiny())
    x = tokens(1, 5)
    np.testing.assert_allclose(run(model, x), run(mha, x), atol=1e-6)  # same init, same params
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        mha(x[0])
