"""A paged cache (the engine's) gives the logits of the whole-sequence forward: ragged
rows taking 0..chunk tokens per step through randomly placed pages, for every kind of
cached layer (global and sliding-window K/V, chunked attention, MLA latents, a Mamba-2
state per row), and the engine's ragged step (one token a row, runs of one sequence)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.inference.cache import logical_axes

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64,
            init_std=1.0, tie_embeddings=False, num_kv_heads=2)
CASES = {
    "window_global_sinks": dict(layer_pattern=("local", "global"),
                                attention=dict(sliding_window=3, sinks=True, softcap=20.0)),
    "chunked_local_nope": dict(layer_pattern=("chunked", "local", "nope"), num_layers=3,
                               attention=dict(chunk=4, sliding_window=3)),
    "mla": dict(layer_pattern=("mla",), mla=dict(kv_lora_rank=16, q_lora_rank=0,
                                                qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                v_head_dim=8)),
    "mamba2_global_unscanned": dict(layer_pattern=("mamba2", "global"), scan_layers=False),
}
B, PAGE, CHUNK, MAX_LEN, L = 3, 4, 5, 40, 23


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_paged_steps_equal_the_full_forward(case):
    model = models.build(model_config({**TINY, **CASES[case]}), rngs=nnx.Rngs(3))
    geometries = model.page_geometries(MAX_LEN, page_size=PAGE, chunk=CHUNK)
    rng = np.random.default_rng(0)
    num_pages = {s: B * n + 3 for s, n in geometries.items()}
    cache = model.init_paged_cache(B, MAX_LEN, page_size=PAGE, chunk=CHUNK, num_pages=num_pages)
    tables = {s: jnp.asarray(rng.permutation(num_pages[s])[:B * n].reshape(B, n), jnp.int32)
              for s, n in geometries.items()}  # pages anywhere in the pool
    cache = cache.replace(pages=cache.pages.replace(tables=tables))
    axes = logical_axes(cache)  # pools belong to no row; the tables are the rows'
    assert all(names[0] == "batch" for names in axes.pages.tables.values())
    tokens = rng.integers(0, 61, (B, L)).astype(np.int32)
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    step = nnx.jit(lambda m, t, c, n: m.step(t, c, n, all_logits=True))
    done, got, i = np.zeros(B, int), np.zeros_like(full), 0
    while (done < L).any():
        n = np.array([min(L - done[b], (CHUNK, 0, 1, 3)[(b + i) % 4]) for b in range(B)])
        T = CHUNK if n.max() > 1 else 1
        chunk = np.zeros((B, T), np.int32)
        for b in range(B):
            chunk[b, :n[b]] = tokens[b, done[b]:done[b] + n[b]]
        logits, cache = step(model, jnp.asarray(chunk), cache, jnp.asarray(n, jnp.int32))
        for b in range(B):
            got[b, done[b]:done[b] + n[b]] = np.asarray(logits)[b, :n[b]]
        done, i = done + n, i + 1
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4 * np.abs(full).max())


@pytest.mark.parametrize("case", [c for c in CASES if "mamba" not in c])
def test_ragged_steps_of_one_token_a_row_equal_the_full_forward(case):
    """The engine's ragged step (`PageTables.runs`): each step one token a row, two rows'
    next 0..chunk tokens as runs of one sequence, then one token (or padding) for every
    row; its logits are the full forward's (chunked attention's masks and MLA's latents,
    which each token gathers, included)."""
    model = models.build(model_config({**TINY, **CASES[case]}), rngs=nnx.Rngs(3))
    geometries = model.page_geometries(MAX_LEN, page_size=PAGE, chunk=CHUNK)
    rng = np.random.default_rng(2)
    num_pages = {s: B * n + 3 for s, n in geometries.items()}
    cache = model.init_paged_cache(B, MAX_LEN, page_size=PAGE, chunk=CHUNK, num_pages=num_pages)
    tables = {s: rng.permutation(num_pages[s])[:B * n].reshape(B, n).astype(np.int32)
              for s, n in geometries.items()}
    tokens = rng.integers(0, 61, (B, L)).astype(np.int32)
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))

    @nnx.jit
    def step(m, t, c, valid):
        return m.step(t[:, None], c, valid, all_logits=True)

    done, got, i = np.zeros(B, int), np.zeros_like(full), 0
    while (done < L).any():
        runs, single = [i % B, (i + 1) % B], (i + 2) % B
        n = np.minimum(L - done, [(CHUNK, 3, 0, 1)[(i + b) % 4] for b in range(B)])
        n[single] = min(n[single], 1)
        slot_of = np.repeat(runs, CHUNK).tolist() + list(range(B))
        position = np.concatenate([done[b] + np.arange(CHUNK) for b in runs] + [done])
        valid = np.concatenate([np.arange(CHUNK) < n[b] for b in runs]
                               + [(np.arange(B) == single) & (n > 0)])
        position = np.minimum(position, L - 1)  # (padding)
        ids = tokens[slot_of, position] * valid
        ragged = cache.replace(length=jnp.asarray(position, jnp.int32), pages=cache.pages.replace(
            tables={s: jnp.asarray(t[slot_of]) for s, t in tables.items()}, runs=(2, CHUNK)))
        logits, new = step(model, jnp.asarray(ids, jnp.int32), ragged,
                           jnp.asarray(valid, jnp.int32))
        cache = cache.replace(layers=new.layers)
        for j in np.flatnonzero(valid):
            got[slot_of[j], position[j]] = np.asarray(logits)[j, 0]
        done, i = done + n, i + 1
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4 * np.abs(full).max())


def test_a_step_longer_than_the_chunk_is_refused():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    cache = model.init_paged_cache(1, MAX_LEN, page_size=PAGE, chunk=2, num_pages={40: 11})
    with pytest.raises(ValueError, match="at most chunk=2"):
        model.step(jnp.zeros((1, 3), jnp.int32), cache)


def test_prefix_lm_models_are_refused_by_the_engine_cache():
    model = models.build(model_config({**TINY, "prefix_lm": True}), rngs=nnx.Rngs(3))
    with pytest.raises(ValueError, match="prefix-LM"):
        model.init_paged_cache(1, MAX_LEN, page_size=PAGE, chunk=2, num_pages={40: 11})


def test_a_global_table_cut_to_the_pages_held_gives_the_same_logits():
    """The engine cuts a call's global page tables to the pages its rows hold
    (`EngineConfig.table_widths`): the steps' logits stay the full forward's; a ring's
    table (a window's slots wrap at its paged size) cut so is refused by name."""
    model = models.build(model_config({**TINY, **CASES["window_global_sinks"]}),
                         rngs=nnx.Rngs(3))
    geometries = model.page_geometries(MAX_LEN, page_size=PAGE, chunk=CHUNK)
    glob, ring = max(geometries), min(geometries)
    num_pages = {s: B * n + 1 for s, n in geometries.items()}
    cache = model.init_paged_cache(B, MAX_LEN, page_size=PAGE, chunk=CHUNK, num_pages=num_pages)
    tables = {s: 1 + jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
              for s, n in geometries.items()}
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 61, (B, L)).astype(np.int32)
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    step = nnx.jit(lambda m, t, c, n: m.step(t, c, n, all_logits=True))
    done, got, widths = np.zeros(B, int), np.zeros_like(full), set()
    while (done < L).any():
        n = np.minimum(L - done, (CHUNK, 2, 1))
        half = geometries[glob] // 2  # two widths, as the engine's halvings
        width = half if -(-(done + n).max() // PAGE) <= half else geometries[glob]
        widths.add(width)
        cut = {**tables, glob: tables[glob][:, :width]}
        chunk = np.zeros((B, CHUNK), np.int32)
        for b in range(B):
            chunk[b, :n[b]] = tokens[b, done[b]:done[b] + n[b]]
        logits, cache = step(model, jnp.asarray(chunk),
                             cache.replace(pages=cache.pages.replace(tables=cut)),
                             jnp.asarray(n, jnp.int32))
        for b in range(B):
            got[b, done[b]:done[b] + n[b]] = np.asarray(logits)[b, :n[b]]
        done = done + n
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4 * np.abs(full).max())
    assert widths == {geometries[glob] // 2, geometries[glob]}
    cut = {**tables, ring: tables[ring][:, :1]}
    with pytest.raises(ValueError, match="the page table of a ring of .* was cut"):
        model.step(jnp.zeros((B, 1), jnp.int32), cache.replace(
            pages=cache.pages.replace(tables=cut)), jnp.ones(B, jnp.int32))
