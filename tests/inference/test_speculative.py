"""Multi-token prediction (tfjax.models.mtp) and self-speculative decoding with it
(tfjax.inference.speculative): the modules' cached steps equal their full forward,
the decoded tokens equal plain greedy decoding, and a model trained with the MTP
loss on a predictable stream gets its drafts accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.inference import generate
from tfjax.inference.cache import rewind
from tfjax.inference.speculative import speculative_generate
from tfjax.models.mtp import mtp_predictions, shift_left
from tfjax.train.objectives import OBJECTIVES

TINY = dict(arch="decoder", vocab_size=61, d_model=32, num_layers=2, num_heads=4,
            num_kv_heads=2, d_ff=64, max_len=128, init_std=0.3, mtp_depth=2)


def _model(**kw):
    return models.build(model_config({**TINY, **kw}))


def test_shift_left():
    x = jnp.arange(6).reshape(1, 6)
    np.testing.assert_array_equal(shift_left(x, 2, fill=-1), [[2, 3, 4, 5, -1, -1]])


def test_mtp_targets_stay_inside_documents():
    model = _model()
    B, T = 2, 9
    inputs = jax.random.randint(jax.random.key(0), (B, T), 0, 61)
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1] * 7 + [0, 0]])
    mask = jnp.array([[1, 1, 1, 0, 1, 1, 1, 1, 1], [1] * 6 + [0, 0, 0]], jnp.float32)
    batch = dict(inputs=inputs, targets=jnp.roll(inputs, -1, 1), mask=mask, segment_ids=seg,
                 positions=jnp.broadcast_to(jnp.arange(T), (B, T)))
    preds = mtp_predictions(model, model.hidden(inputs, segment_ids=seg), batch)
    assert [p["features"].shape for p in preds] == [(B, T, 32)] * 2
    # depth 1: position i counts when i, i+1 share a document and target i+1 counts
    np.testing.assert_array_equal(preds[0]["mask"], [[1, 1, 0, 0, 1, 1, 1, 1, 0],
                                                     [1, 1, 1, 1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(preds[1]["mask"], [[1, 0, 0, 0, 1, 1, 1, 0, 0],
                                                     [1, 1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(preds[1]["targets"][:, :T - 2], batch["targets"][:, 2:])


def test_cached_module_steps_equal_the_full_forward():
    """Chunks appended to an MTP module's cache, with a rollback in between, give the
    hidden states of one forward over the whole sequence."""
    model = _model(layer_pattern=("global",), num_layers=3)
    B, T = 2, 12
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 61)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    h0 = model.hidden(tokens)
    module = model.mtp[0]
    e = model.embed(shift_left(tokens, 1), pos + 1)
    masks, biases = model.mtp_attention_inputs(tokens, pos, jnp.zeros_like(tokens))
    full = module(h0, e, masks=masks, biases=biases, positions=pos)
    cache = module.init_cache(B, 32)
    # 5 positions, then 4 wrong ones rolled back, then the other 7
    out1, cache = module.step(h0[:, :5], e[:, :5], cache, jnp.array([5, 5]))
    _, cache = module.step(h0[:, 5:9] * 3.0, e[:, 5:9], cache, jnp.array([4, 4]))
    keep = jnp.array([5, 5])
    cache = rewind(cache, keep)
    out2, cache = module.step(h0[:, 5:], e[:, 5:], cache, jnp.array([7, 7]))
    np.testing.assert_allclose(jnp.concatenate([out1, out2], 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(layer_pattern=("mla",), mla=dict(
    kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8))],
    ids=["gqa", "mla"])
def test_speculative_equals_greedy(kw):
    model = _model(mtp_depth=3, **kw)
    prompt = jax.random.randint(jax.random.key(2), (3, 7), 0, 61)
    lengths = jnp.array([7, 3, 5])
    ref = generate(model, prompt, max_new_tokens=24, prompt_lengths=lengths, eos_id=60)
    out, stats = speculative_generate(model, prompt, max_new_tokens=24, prompt_lengths=lengths,
                                      eos_id=60)
    np.testing.assert_array_equal(out, ref)
    assert stats["decoder_calls"] >= 1 and 0 <= stats["acceptance"] <= 1


def test_windowed_and_recurrent_layers_are_refused():
    model = _model(layer_pattern=("local",), attention=dict(sliding_window=4))
    with pytest.raises(ValueError, match="rolled back"):
        speculative_generate(model, jnp.zeros((1, 4), jnp.int32), max_new_tokens=4)
    with pytest.raises(ValueError, match="mtp_depth >= 1"):
        speculative_generate(_model(mtp_depth=0), jnp.zeros((1, 4), jnp.int32), max_new_tokens=4)
    with pytest.raises(ValueError, match="model.mtp_depth"):
        model_config({**TINY, "arch": "encoder"})
    longrope = _model(rope=dict(scaling="longrope", factor=2.0, original_max_len=8,
                                short_factor=(1.0,) * 4, long_factor=(2.0,) * 4))
    with pytest.raises(ValueError, match="crosses model.rope.original_max_len=8"):
        speculative_generate(longrope, jnp.zeros((1, 4), jnp.int32), max_new_tokens=8)


def test_trained_drafts_are_accepted_and_the_loss_trains_them():
    """On a stream where each token is a fixed function of the one before, the MTP
    modules trained by the causal-LM objective's loss predict tokens i+2.. as well as
    the head predicts i+1: their drafts are accepted and decoding needs few calls."""
    V, T, B = 61, 24, 8
    model = models.build(model_config({**TINY, "init_std": 0.02, "mtp_depth": 2}))
    perm = np.random.default_rng(0).permutation(V)

    def stream(start, n):
        out = [start]
        for _ in range(n - 1):
            out.append(perm[out[-1]])
        return out

    rows = np.array([stream(s, T + 1) for s in range(V)], np.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    forward = OBJECTIVES.get("causal_lm").forward
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    def batch(tokens):
        ones = jnp.ones((tokens.shape[0], T), jnp.float32)
        return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], mask=ones, target_bytes=ones,
                    segment_ids=jnp.zeros((tokens.shape[0], T), jnp.int32),
                    positions=jnp.broadcast_to(jnp.arange(T), (tokens.shape[0], T)))

    @jax.jit
    def step(params, opt, tokens):
        def loss(p):
            sums = forward(nnx.merge(graphdef, p, rest), batch(tokens))
            return (sums["nll"] + sums["mtp"]) / sums["tokens"], sums["mtp"] / sums["tokens"]
        (_, mtp), g = jax.value_and_grad(loss, has_aux=True)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, mtp

    rng = np.random.default_rng(1)
    first = None
    for _ in range(150):
        params, opt, mtp = step(params, opt, jnp.asarray(rows[rng.integers(0, V, B)]))
        first = float(mtp) if first is None else first
    assert float(mtp) < 0.05 * first  # the MTP loss reaches the modules' parameters
    model = nnx.merge(graphdef, params, rest)
    prompt = jnp.asarray(rows[[3, 17], :5])
    out, stats = speculative_generate(model, prompt, max_new_tokens=18)
    np.testing.assert_array_equal(out, generate(model, prompt, max_new_tokens=18))
    np.testing.assert_array_equal(out, rows[[3, 17], 5:23])
    assert stats["acceptance"] > 0.9 and stats["decoder_calls"] <= 7, stats
