"""Cached generation equals full recomputation; batching, windows, sampling, EOS.

Tiny random models with a large init scale (so greedy decoding does not collapse
to one repeated token); each case compiles prefill + decode loop once, and the
recomputation once (a fixed-shape buffer, logits read at each row's position).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.inference import generate, stream

from greedy_reference import recompute_greedy

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64,
            init_std=1.0, tie_embeddings=False)

# Each case is ~3 compilations; they are combined to keep the file fast.
CASES = {
    # Llama-like GQA + RoPE + QK-norm, NeoX-like parallel block (two norms).
    "gqa_rope": dict(num_kv_heads=2, norm="rmsnorm", activation="swiglu", block="parallel",
                     parallel_shared_norm=False, attention=dict(qk_norm=True)),
    # ALiBi on a sliding window (W=3) with MQA: 12 new tokens after a 6-token prompt
    # generate well past the window, through the rolling buffer.
    "alibi_window": dict(position="alibi", layer_pattern=("local",), num_kv_heads=1,
                         embed_norm=True, attention=dict(sliding_window=3)),
    # T5 bias on a local/global hybrid, 3 layers = one scanned cycle + one unrolled
    # block; Gemma-2-like sandwich norms and soft-caps (the "reference" attention path).
    "t5_hybrid": dict(position="t5", t5=dict(num_buckets=8, max_distance=16),
                      layer_pattern=("local", "global"), num_layers=3,
                      num_kv_heads=2, norm="rmsnorm_plus_one", norm_placement="sandwich",
                      final_softcap=15.0, attention=dict(sliding_window=3, softcap=20.0)),
    # learned positions, unscanned layers.
    "learned_unscanned": dict(position="learned", scan_layers=False),
    # gpt-oss-like: learned sinks on local (W=3, rolling buffer) and global layers,
    # values of a head dim of their own (12 against 8), GQA 4/2.
    "sinks_value_head_dim": dict(v_head_dim=12, num_kv_heads=2,
                                 layer_pattern=("local", "global"),
                                 attention=dict(sinks=True, sliding_window=3)),
    # Llama 4 / Gemma 3 / OLMo 2 attention: chunked layers (a one-chunk rolling cache),
    # a local layer with its own RoPE base, a NoPE layer with the query temperature,
    # QK-norm over the whole projection.
    "chunked_local_nope": dict(layer_pattern=("chunked", "local", "nope"), num_layers=3,
                               num_kv_heads=2, norm="rmsnorm",
                               attention=dict(chunk=4, sliding_window=3, local_rope_theta=50.0,
                                              temperature_floor=3, temperature_scale=0.5,
                                              qk_norm=True, qk_norm_over="projection")),
}

PROMPT_LENGTHS = [6, 3]  # right-padded to 6
NEW = 12


def build(**kw):
    return models.build(model_config({**TINY, **kw}), rngs=nnx.Rngs(3))


def prompts(B=2, T=6, seed=0, vocab=61):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)



@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_greedy_equals_recomputation(name):
    model = build(**CASES[name])
    x, lengths = prompts(), jnp.array(PROMPT_LENGTHS)
    got = np.asarray(generate(model, x, max_new_tokens=NEW, prompt_lengths=lengths))
    want = recompute_greedy(model, x, lengths, NEW)
    assert got.shape == (2, NEW) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert len(set(got.ravel().tolist())) > 4, "degenerate model: pick another seed / init scale"


def test_encoder_decoder_cached_equals_recomputation():
    model = build(arch="encoder_decoder", position="t5", norm="rmsnorm",
                  t5=dict(num_buckets=8, max_distance=16), num_kv_heads=2)
    x, lengths = prompts(T=7, seed=4), jnp.array([7, 4])
    got = np.asarray(generate(model, x, max_new_tokens=NEW, prompt_lengths=lengths,
                              decoder_start_id=0))
    seg = (np.arange(7)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    buf = np.zeros((2, NEW + 1), np.int32)  # decoder input: start token, then the outputs
    f = nnx.jit(lambda m, e, d, s: m(e, d, encoder_segment_ids=s))
    for i in range(NEW):
        logits = np.asarray(f(model, x, jnp.asarray(buf), jnp.asarray(seg)))
        buf[:, i + 1] = logits[:, i].argmax(-1)
    np.testing.assert_array_equal(got, buf[:, 1:])
    assert len(set(got.ravel().tolist())) > 4


def test_pallas_kernels_serve_the_cache_masks():
    """`attention.impl="pallas"` (the TPU kernels, interpreted on CPU) takes the
    cache's masks (`masks.Positions`: explicit positions, empty slots): chunked
    prefill over `[cache; fresh keys]`, then decode over a window layer's ring
    buffer and a global layer's linear cache. An explicit implementation that
    cannot serve a mask raises, so this also checks the kernels were used."""
    kw = dict(num_kv_heads=2, layer_pattern=("local", "global"), norm="rmsnorm")
    x, lengths = prompts(seed=7), jnp.array(PROMPT_LENGTHS)
    got = np.asarray(generate(build(**kw, attention=dict(sliding_window=3, impl="pallas")), x,
                              max_new_tokens=NEW, prompt_lengths=lengths, prefill_chunk=4))
    want = recompute_greedy(build(**kw, attention=dict(sliding_window=3, impl="reference")), x,
                            lengths, NEW)
    np.testing.assert_array_equal(got, want)
    assert len(set(got.ravel().tolist())) > 4


MLA = dict(layer_pattern=("mla", "local"), num_layers=3, norm="rmsnorm",
           mla=dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=6), attention=dict(sliding_window=3))


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_latent_attention_decodes_absorbed_from_its_latent_cache(prefill_chunk):
    """DeepSeek's MLA layers (one scanned cycle of mla + local, one mla block): the
    cache holds only the latent and the rotary key per token, prefill is
    materialised, decode steps and prefill chunks run the absorbed form; cached
    greedy decoding equals recomputation."""
    model = build(**MLA)
    cache = jax.eval_shape(lambda: model.init_cache(2, 40))
    (mla, _), = [cache.layers["cycles"]]
    assert mla["attn"].latent.shape == (1, 2, 40, 16 + 4)  # [cycles, B, S, r + dr]
    x, lengths = prompts(seed=5), jnp.array(PROMPT_LENGTHS)
    got = np.asarray(generate(model, x, max_new_tokens=NEW, prompt_lengths=lengths,
                              prefill_chunk=prefill_chunk))
    np.testing.assert_array_equal(got, recompute_greedy(model, x, lengths, NEW))
    assert len(set(got.ravel().tolist())) > 4


@pytest.fixture(scope="module")
def gqa():
    return build(**CASES["gqa_rope"])


def test_batched_prompts_equal_each_alone(gqa):
    x, lengths = prompts(seed=5), [6, 1]  # alone, a 1-token prompt is a decode step
    batched = np.asarray(generate(gqa, x, max_new_tokens=NEW, prompt_lengths=jnp.array(lengths)))
    for b, L in enumerate(lengths):
        alone = np.asarray(generate(gqa, x[b:b + 1, :L], max_new_tokens=NEW))
        np.testing.assert_array_equal(batched[b], alone[0])


def test_eos_stops_and_pads(gqa):
    x = prompts(seed=5)
    greedy = np.asarray(generate(gqa, x, max_new_tokens=NEW))
    eos = int(greedy[0, 2])
    out = np.asarray(generate(gqa, x, max_new_tokens=NEW, eos_id=eos, pad_id=60))
    for b in range(2):
        row, ref = out[b].tolist(), greedy[b].tolist()
        stop = ref.index(eos) if eos in ref else NEW
        assert row[:stop + 1] == ref[:stop + 1]
        assert all(t == 60 for t in row[stop + 1:])
    # streaming yields the same tokens, one step at a time
    streamed = np.stack(list(stream(gqa, x, max_new_tokens=NEW, eos_id=eos, pad_id=60)), 1)
    np.testing.assert_array_equal(streamed, out[:, :streamed.shape[1]])
    assert streamed.shape[1] == max(r.index(eos) + 1 if eos in r else NEW
                                    for r in greedy.tolist())


def test_sampling_is_seeded(gqa):
    x = prompts(seed=6)
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=10, top_p=0.9)
    a = np.asarray(generate(gqa, x, seed=1, **kw))
    b = np.asarray(generate(gqa, x, seed=1, **kw))
    c = np.asarray(generate(gqa, x, seed=2, **kw))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = np.asarray(generate(gqa, x, max_new_tokens=NEW, temperature=0.0, seed=2))
    assert (a != greedy).any()


def test_window_cache_is_bounded():
    cfg = model_config({**TINY, **CASES["t5_hybrid"]})
    model = build(**CASES["t5_hybrid"])
    W = cfg.attention.sliding_window
    for max_len in (16, 4096):
        cache = jax.eval_shape(lambda n=max_len: model.init_cache(2, n))
        (local, glob), = [cache.layers["cycles"]]
        assert local["attn"].k.shape == (1, 2, 2, W + 1, cfg.head_size)  # [cycles, B, K, W+1, H]
        assert glob["attn"].k.shape == (1, 2, 2, max_len, cfg.head_size)
        assert cache.layers["blocks"][0]["attn"].k.shape == (2, 2, W + 1, cfg.head_size)
    # cache_bytes counts what init_cache allocates
    real = jax.eval_shape(lambda: model.init_cache(2, 100))
    n = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(real)
            if jnp.issubdtype(a.dtype, jnp.floating))
    assert models.cache_bytes(cfg, 2, 100) == n
    # 2 local layers of W+1 slots, one global of 100: 2 (K,V) * B * K * H * 4 bytes each
    assert n == 2 * 2 * 2 * cfg.head_size * 4 * (2 * (W + 1) + 100)


def test_cache_bytes_gqa_mqa_and_70b():
    base = dict(arch="decoder", d_model=8192, num_heads=64, head_dim=128, num_layers=80,
                vocab_size=32000, d_ff=28672, dtype="bfloat16")
    mha = model_config(dict(base))
    gqa8 = model_config(dict(base, num_kv_heads=8))
    mqa = model_config(dict(base, num_kv_heads=1))
    T = 4096
    b_mha = models.cache_bytes(mha, 1, T)
    assert b_mha == 2 * 80 * 64 * 128 * T * 2  # the seed's 70B example, ~10.7 GB
    assert abs(b_mha / 1e9 - 10.7) < 0.05
    assert models.cache_bytes(gqa8, 1, T) * 8 == b_mha
    assert models.cache_bytes(mqa, 1, T) * 64 == b_mha
    assert models.kv_bytes_per_token(gqa8) == 2 * 80 * 8 * 128 * 2
    # values of their own head dim (DeepSeek-V3's MHA form: K 192, V 128 per head)
    split = model_config(dict(base, head_dim=192, v_head_dim=128, attention=dict(sinks=True)))
    assert models.cache_bytes(split, 1, T) == 80 * 64 * (192 + 128) * T * 2
    assert models.kv_bytes_per_token(split) == 80 * 64 * (192 + 128) * 2
    # DeepSeek-V3's latent cache: (kv_lora_rank + qk_rope_head_dim) per token per layer
    v3 = model_config(dict(base, num_layers=61, d_model=7168, num_heads=128, layer_pattern=("mla",),
                           mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                    qk_rope_head_dim=64, v_head_dim=128)))
    assert models.cache_bytes(v3, 1, T) == 61 * (512 + 64) * T * 2
    assert models.kv_bytes_per_token(v3) == 61 * (512 + 64) * 2


def test_unrolled_twin_generates_the_same_tokens():
    # 3 layers of a local/global cycle: one scanned cycle and one unrolled block
    model = build(**CASES["t5_hybrid"])
    twin = models.unrolled(model)
    x, lengths = prompts(), jnp.array(PROMPT_LENGTHS)
    got = generate(twin, x, max_new_tokens=NEW, prompt_lengths=lengths)
    want = generate(model, x, max_new_tokens=NEW, prompt_lengths=lengths)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert twin.layers.cycles is None and len(twin.layers.blocks) == 3


@pytest.mark.xla_optimized
def test_a_decode_step_writes_the_heads_major_cache_in_place():
    """`stream`'s decode step writes each layer's K and V into the stored `[B, K, S, H]`
    cache in place: no op of the compiled step makes a cache-sized array in the
    attention op's `[B, S, K, H]` view (a scatter on the view relaid each cache out
    and back on XLA:CPU; `tfjax.ops.paged.write_entries`)."""
    model = build(num_kv_heads=2, scan_layers=False)
    gen = importlib.import_module("tfjax.inference.generate")
    graphdef, state = nnx.split(model)
    _, step, _, _ = gen._programs(graphdef, None)
    B, S = 3, 40
    cache = jax.eval_shape(lambda: model.init_cache(B, S))
    layer = jax.tree.leaves(cache.layers)[0]
    K, H = layer.shape[1], layer.shape[3]
    assert layer.shape == (B, K, S, H)  # stored heads-major
    settings = dict(temperature=jnp.float32(0), top_k=jnp.int32(0), top_p=jnp.float32(1))
    hlo = step.lower(state, cache, jnp.zeros((B,), jnp.int32), jax.random.key(0),
                     jnp.int32(1), settings).compile().as_text()
    view = f"f32[{B},{S},{K},{H}]"
    assert hlo.count(f"= {view}") == 0, [line.strip()[:120] for line in hlo.splitlines()
                                         if f"= {view}" in line]
