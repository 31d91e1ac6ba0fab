"""Generation through recurrent layers (Mamba, linear attention, Gated DeltaNet),
hybrids (Jamba, Qwen3-Next-style, Zamba2-style shared blocks), prefix-LM prompts
and chunked prefill: cached
greedy decoding equals argmax decoding by full recomputation at every step; batched
prompts equal each alone; recurrent state does not grow with the length.

Tiny random models with a large init scale (so greedy decoding does not collapse
to one repeated token). Models are module-scoped; each generate shape compiles once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.inference import generate
from tfjax.inference.cache import logical_axes

from greedy_reference import recompute_greedy

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64,
            init_std=1.0, tie_embeddings=False, norm="rmsnorm", position="none",
            ssm=dict(d_state=4, d_conv=3, dt_rank=4))

GDN = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, chunk=4)

MAMBA2 = dict(d_state=4, head_dim=16, n_groups=2, d_conv=3, chunk=4)

CASES = {
    # Mamba-only (configs/mamba.py): mixer-only layers, scanned.
    "mamba": dict(layer_pattern=("mamba",), ffn_pattern=("none",)),
    # Mamba-2 only (4 heads of 16 in 2 groups; the 6-token prompt pads to chunks of 4), scanned.
    "mamba2": dict(layer_pattern=("mamba2",), ffn_pattern=("none",), mamba2=MAMBA2),
    # Mamba-2 + GQA RoPE attention with dense ffns, unscanned.
    "mamba2_hybrid": dict(layer_pattern=("mamba2", "global"), num_kv_heads=2, position="rope",
                          mamba2=MAMBA2, scan_layers=False),
    # Jamba-style: mamba + GQA attention + (dense, MoE) ffns; Jamba's dt/B/C norms;
    # unscanned (scanned recurrent caches: "mamba"; it builds and compiles faster).
    "jamba": dict(layer_pattern=("mamba", "global"), ffn_pattern=("dense", "moe"),
                  num_kv_heads=2, moe=dict(num_experts=4, experts_per_token=2,
                                           router_renormalize=False, impl="dense"),
                  ssm=dict(TINY["ssm"], inner_norm=True), activation="swiglu", scan_layers=False),
    # causal linear attention (GQA) with a RoPE sliding-window layer, unscanned.
    "linear": dict(layer_pattern=("linear", "local"), num_kv_heads=2,
                   position="rope", scan_layers=False, linear=dict(chunk=4),
                   attention=dict(sliding_window=3)),
    # Gated DeltaNet only (Hv = 2 Hk; the 6-token prompt pads to chunks of 4), scanned.
    "gdn": dict(layer_pattern=("gated_deltanet",), ffn_pattern=("none",), gdn=GDN),
    # Qwen3-Next-style (configs/qwen3_next.py): 3 Gated DeltaNet : 1 gated attention
    # (GQA, RoPE on half of each head, QK-norm, output gate), zero-centred norms, MoE
    # ffns with a sigmoid-gated shared expert, unscanned.
    "qwen3_next": dict(layer_pattern=3 * ("gated_deltanet",) + ("global",), num_layers=4,
                       ffn_pattern=("moe",), num_kv_heads=2, position="rope",
                       norm="rmsnorm_plus_one",
                       rope=dict(fraction=0.5),
                       moe=dict(num_experts=4, experts_per_token=2, shared_experts=1,
                                shared_gate=True, impl="dense"),
                       activation="swiglu", gdn=GDN, scan_layers=False,
                       attention=dict(qk_norm=True, output_gate=True)),
    # Zamba2-style (configs/zamba2.py): Mamba-2 layers, every other one also running a
    # use of one of 2 shared attention + MLP blocks on [hidden; embeddings] (RoPE, GQA
    # 4/2 heads of 2D/4, rank-4 adapters), each use with its own K/V cache; scanned
    # (2 cycles, the block of each traced) and one unrolled layer.
    "zamba2": dict(layer_pattern=("mamba2", "mamba2_shared"), num_layers=5, ffn_pattern=("none",),
                   num_kv_heads=2, head_dim=16, position="rope", activation="geglu",
                   ffn_bias=False, mamba2=MAMBA2, shared=dict(num_blocks=2, adapter_rank=4)),
}

NEW = 8
PROMPT_LENGTHS = [6, 3]  # right-padded to 6


def build(**kw):
    cfg = model_config({**TINY, **kw})
    return cfg, models.build(cfg, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def built():
    return {name: build(**kw) for name, kw in CASES.items()}


@pytest.fixture(scope="module")
def greedy(built):
    """name -> the batched cached greedy generation (shared by the tests below)."""
    x, lengths = prompts(), jnp.array(PROMPT_LENGTHS)
    return {name: np.asarray(generate(m, x, max_new_tokens=NEW, prompt_lengths=lengths))
            for name, (_, m) in built.items()}


def prompts(B=2, T=6, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, TINY["vocab_size"])



@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_greedy_equals_recomputation(built, greedy, name):
    got = greedy[name]
    want = recompute_greedy(built[name][1], prompts(), PROMPT_LENGTHS, NEW)
    assert got.shape == (2, NEW) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert len(set(got.ravel().tolist())) > 4, "degenerate model: pick another seed / init scale"


def test_batched_prompts_equal_each_alone(built, greedy):
    """Jamba's right-padded row (3 real tokens of 6) alone: the padded tail must not
    enter its mamba layers' conv / SSM state (nor the attention cache). (The padded
    row of every case also equals the unpadded recomputation above.)"""
    b, L = 1, PROMPT_LENGTHS[1]
    alone = np.asarray(generate(built["jamba"][1], prompts()[b:b + 1, :L], max_new_tokens=NEW))
    np.testing.assert_array_equal(greedy["jamba"][b], alone[0])


@pytest.mark.parametrize("name,chunk", [("jamba", 4), ("linear", 2), ("mamba", 1),
                                        ("mamba2_hybrid", 4),
                                        ("qwen3_next", 4), ("zamba2", 4)])
def test_chunked_prefill_equals_one_shot(built, greedy, name, chunk):
    """Chunks over the 6-token prompt: row 1 (3 tokens) ends early and takes no token
    in the last chunk(s); the attention caches (global; local W=3 with 4 slots), the
    conv window and the recurrent states carry across chunks (chunk 1: one-token
    chunks, rows without a token keep their state)."""
    chunked = generate(built[name][1], prompts(), max_new_tokens=NEW,
                       prompt_lengths=jnp.array(PROMPT_LENGTHS), prefill_chunk=chunk)
    np.testing.assert_array_equal(np.asarray(chunked), greedy[name])


def test_prefix_lm_generation_equals_recomputation():
    """A prefix-LM decoder's prompt is its bidirectional prefix: the prefill attends
    over it both ways, generated tokens causally (oracle: `prefix_lengths` = the
    prompt lengths at every recomputation)."""
    _, model = build(prefix_lm=True, position="rope", num_kv_heads=2, scan_layers=False)
    x, lengths = prompts(seed=9), jnp.array([6, 4])
    got = np.asarray(generate(model, x, max_new_tokens=NEW, prompt_lengths=lengths))
    np.testing.assert_array_equal(got, recompute_greedy(model, x, lengths, NEW, prefix_lm=True))
    with pytest.raises(ValueError, match="prefix-LM"):
        generate(model, x, max_new_tokens=2, prefill_chunk=3)


def test_bad_prefill_chunk(built):
    _, model = built["mamba"]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            generate(model, prompts(), max_new_tokens=2, prefill_chunk=bad)


def _allocated(model, B, n):
    tree = jax.eval_shape(lambda: model.init_cache(B, n))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
               if jnp.issubdtype(a.dtype, jnp.floating))


def test_recurrent_cache_size_does_not_grow(built):
    for name in ("mamba", "linear", "jamba", "gdn", "qwen3_next"):
        cfg, model = built[name]
        sizes = {n: models.cache_bytes(cfg, 2, n) for n in (16, 4096)}
        for n, b in sizes.items():
            assert _allocated(model, 2, n) == b  # cache_bytes counts what init_cache makes
        if name in ("jamba", "qwen3_next"):  # only the attention layer's K/V grows
            grow = 2 * 2 * cfg.kv_heads * cfg.head_size * 4 * (4096 - 16)
            assert sizes[4096] - sizes[16] == grow
        else:  # mamba; gdn; linear (+ a local layer's W+1 slots): flat
            assert sizes[16] == sizes[4096]
    cfg, model = built["mamba"]
    cache = jax.eval_shape(lambda: model.init_cache(2, 100))
    (c,) = cache.layers["cycles"]
    di = cfg.ssm.expand * cfg.d_model
    assert c["attn"].conv.shape == (2, 2, cfg.ssm.d_conv - 1, di)  # [cycles, B, d_conv-1, Di]
    assert c["attn"].ssm.shape == (2, 2, di, cfg.ssm.d_state)
    assert models.cache_bytes(cfg, 2, 16) == 2 * 2 * 4 * di * (cfg.ssm.d_conv - 1 + cfg.ssm.d_state)
    axes = logical_axes(cache)
    assert axes.layers["cycles"][0]["attn"].ssm == ("layers", "batch", "mlp", None)
    # Gated DeltaNet: q/k/v conv windows and S [B, Hv, dk, dv] per layer.
    cfg, model = built["gdn"]
    cache = jax.eval_shape(lambda: model.init_cache(2, 100))
    (c,) = cache.layers["cycles"]
    assert c["attn"].conv_k.shape == (2, 2, 3, 2, 8) and c["attn"].conv_v.shape == (2, 2, 3, 4, 6)
    assert c["attn"].S.shape == (2, 2, 4, 8, 6) and c["attn"].S.dtype == jnp.float32
    assert models.cache_bytes(cfg, 2, 16) == 2 * 2 * 4 * (3 * (2 * 2 * 8 + 4 * 6) + 4 * 8 * 6)
    axes = logical_axes(cache).layers["cycles"][0]["attn"]
    assert axes.S == ("layers", "batch", "heads", None, None)


def test_mamba2_cache_is_flat_in_the_length():
    """Mamba-2's state per layer: conv inputs `[B, d_conv - 1, Di + 2GN]` and the SSM
    state `[B, H, P, N]` float32; only the hybrid's attention K/V grows."""
    cases = {}
    for name in ("mamba2", "mamba2_hybrid"):
        cfg, model = build(**CASES[name])  # no compile: shapes only
        sizes = {n: models.cache_bytes(cfg, 2, n) for n in (16, 4096)}
        for n, b in sizes.items():
            assert _allocated(model, 2, n) == b
        cases[name] = cfg, model, sizes
    cfg, model, sizes = cases["mamba2_hybrid"]
    assert sizes[4096] - sizes[16] == 2 * 2 * cfg.kv_heads * cfg.head_size * 4 * (4096 - 16)
    cfg, model, sizes = cases["mamba2"]
    assert sizes[16] == sizes[4096]
    cache = jax.eval_shape(lambda: model.init_cache(2, 100))
    (c,) = cache.layers["cycles"]
    di, s = 2 * cfg.d_model, cfg.mamba2
    conv_dim = di + 2 * s.n_groups * s.d_state
    assert c["attn"].conv.shape == (2, 2, s.d_conv - 1, conv_dim)  # [cycles, B, d_conv-1, C]
    assert c["attn"].ssm.shape == (2, 2, di // s.head_dim, s.head_dim, s.d_state)
    assert c["attn"].ssm.dtype == jnp.float32
    assert sizes[16] == 2 * 2 * 4 * ((s.d_conv - 1) * conv_dim + di * s.d_state)
    axes = logical_axes(cache).layers["cycles"][0]["attn"]
    assert axes.ssm == ("layers", "batch", "heads", None, None)


def test_shared_block_uses_keep_their_own_kv_cache(built):
    """Zamba2-style: each use of a shared block caches its own K/V (its inputs
    differ), beside its Mamba-2 state; cache_bytes counts what init_cache makes and
    grows by the uses' K/V alone."""
    cfg, model = built["zamba2"]
    uses = 2  # layers 1 and 3, both in the scanned cycles
    sizes = {n: models.cache_bytes(cfg, 2, n) for n in (16, 4096)}
    for n, b in sizes.items():
        assert _allocated(model, 2, n) == b
    kv = cfg.kv_heads * (cfg.head_size + cfg.value_head_size) * 4  # K and V, float32
    assert sizes[4096] - sizes[16] == uses * 2 * kv * (4096 - 16)
    assert models.kv_bytes_per_token(cfg) == uses * kv
    cache = jax.eval_shape(lambda: model.init_cache(2, 100))
    plain, hybrid = cache.layers["cycles"]
    assert set(plain) == {"attn"} and set(hybrid) == {"attn", "shared"}
    assert hybrid["shared"].k.shape == (2, 2, cfg.kv_heads, 100, cfg.head_size)  # [cycles, ...]
    assert logical_axes(cache).layers["cycles"][1]["shared"].k == (
        "layers", "batch", "kv_heads", None, "head_dim")
    # after a prefill the two uses hold different keys
    x = prompts()
    _, filled = nnx.jit(lambda m, t: m.step(t, m.init_cache(2, 16)))(model, x)
    k = np.asarray(filled.layers["cycles"][1]["shared"].k)  # [2 uses, B, K, S, H]
    assert np.abs(k[:, :, :, :6]).max() > 0 and not k[:, :, :, 6:].any()  # 6 positions written
    assert not np.allclose(k[0, :, :, :6], k[1, :, :, :6])  # each use its own keys
