# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Attention patterns
#
# In tfjax a mask is a lazy object (`tfjax.ops.masks`), not a `T x S` array. It has two
# views:
#
# * the **dense view** `mask.dense(T, S)`: a bool `[B|1, T, S]` array, what the
#   materialising reference uses;
# * the **block view** `mask.blocks(T, S, bq, bk)`: for each `bq x bk` tile, EMPTY /
#   PARTIAL / FULL, computed without building the dense array. Tiled kernels
#   (`blockwise`, `pallas`, ring attention) skip EMPTY tiles and drop the mask
#   arithmetic on FULL ones, so the cost of a sparse pattern is its number of
#   non-empty tiles.
#
# We draw every mask kind, their combinations with `&` (both allow) and `|` (either
# allows), their block views, and then real softmax attention maps of a tiny model.

# %%
# Setup. In Colab: clone the repository (the package and its configs/) and install it.
import os
import subprocess
import sys
from pathlib import Path

if "google.colab" in sys.modules:
    if not Path("tfjax-repo").exists():
        subprocess.run(["git", "clone", "--depth=1", "https://github.com/tfjax/tfjax",
                        "tfjax-repo"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./tfjax-repo"], check=True)
    os.chdir("tfjax-repo")
# Work from the repository root: the presets in configs/ are code.
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "configs").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from matplotlib.colors import ListedColormap

import tfjax
from tfjax.ops import masks, sparse_masks

T = 64  # sequence length of the drawings
BLOCK = 8  # tile size of the block views

# %% [markdown]
# ## Every mask kind
#
# Rows are queries, columns keys; a dark cell is a key the query may attend to.
# Data-dependent masks take per-example arrays: `padding(kv_lengths [B])`,
# `prefix_lm(prefix_lengths [B])`, `segments(segment_ids [B, T])` (packed documents).

# %%
segment_ids = jnp.asarray([[1] * 20 + [2] * 28 + [3] * 16])  # three packed documents
MASKS = {
    "causal()": masks.causal(),
    "sliding_window(8)": masks.sliding_window(8),
    "sliding_window(4, right=4)": masks.sliding_window(4, 4),
    "chunked_causal(16)": masks.chunked_causal(16),
    "padding([40])": masks.padding([40]),
    "segments(ids)": masks.segments(segment_ids),
    "prefix_lm([24])": masks.prefix_lm([24]),
    "longformer(4, global=[0, 32])": sparse_masks.longformer(window=4, global_positions=[0, 32]),
    "bigbird(3, 2 global, 2 random x 8)": sparse_masks.bigbird(window=3, num_global=2,
                                                         num_random_blocks=2, block_size=8,
                                                         seed=0, seq_len=T),
    # Combinations.
    "causal() & segments(ids)": masks.causal() & masks.segments(segment_ids),
    "causal() & sliding_window(8)\n& segments(ids)":
        masks.causal() & masks.sliding_window(8) & masks.segments(segment_ids),
    "causal() & longformer(4, [0])": masks.causal() & sparse_masks.longformer(4, [0]),
    "chunked_causal(16)\n| sliding_window(4)": masks.chunked_causal(16) | masks.sliding_window(4),
    "prefix_lm([24]) & padding([56])": masks.prefix_lm([24]) & masks.padding([56]),
    "causal() & (bigbird | segments)": masks.causal() & (
        sparse_masks.bigbird(3, 2, 2, 8, seed=1, seq_len=T) | masks.segments(segment_ids)),
}

dense = {name: np.asarray(m.dense(T, T))[0] for name, m in MASKS.items()}
cols = 5
rows = -(-len(MASKS) // cols)
fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.3 * rows))
for ax, (name, d) in zip(axes.flat, dense.items()):
    ax.imshow(d, cmap="Greys", interpolation="nearest")
    ax.set_title(f"{name}\n{d.mean():.0%} of pairs", fontsize=8)
    ax.set_xticks([]), ax.set_yticks([])
for ax in axes.flat[len(MASKS):]:
    ax.axis("off")
fig.suptitle(f"dense views, T = S = {T} (rows: queries, columns: keys)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Things to notice: `sliding_window(8)` is a band of 9 keys (8 before plus the query
# itself, Mistral's convention); `longformer` is symmetric, its global positions see
# and are seen by everything (full rows and columns); `bigbird` adds seeded random
# key blocks per query block; `padding` and `segments` depend on the data, so a
# packed batch of documents never attends across documents.

# %% [markdown]
# ## Block views: which tiles a kernel computes
#
# The same masks at tile size `8 x 8`: white tiles are EMPTY (skipped), grey PARTIAL
# (computed with the mask), black FULL (computed without it). The block view is
# derived from the mask's rule, never from the dense array, and it is conservative:
# a tile reported EMPTY or FULL is exactly that. We check that against the dense
# view below.

# %%
tile_cmap = ListedColormap(["white", "#a0a0a0", "black"])  # EMPTY, PARTIAL, FULL
fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.3 * rows))
for ax, (name, m) in zip(axes.flat, MASKS.items()):
    blocks = np.asarray(m.blocks(T, T, BLOCK, BLOCK))[0]
    computed = (blocks != masks.EMPTY).mean()
    ax.imshow(blocks, cmap=tile_cmap, vmin=0, vmax=2, interpolation="nearest")
    ax.set_title(f"{name}\n{computed:.0%} of tiles computed", fontsize=8)
    ax.set_xticks([]), ax.set_yticks([])
for ax in axes.flat[len(MASKS):]:
    ax.axis("off")
fig.suptitle(f"block views, {BLOCK} x {BLOCK} tiles (white empty, grey partial, black full)")
fig.tight_layout()
plt.show()

# %%
# The block view agrees with the dense view: EMPTY tiles hold no allowed pair, FULL
# tiles only allowed pairs.
nb = T // BLOCK
for name, m in MASKS.items():
    tiles = dense[name].reshape(nb, BLOCK, nb, BLOCK).transpose(0, 2, 1, 3)
    blocks = np.asarray(m.blocks(T, T, BLOCK, BLOCK))[0]
    assert not tiles[blocks == masks.EMPTY].any(), name
    assert tiles[blocks == masks.FULL].all(), name
print("block views consistent with dense views for", len(MASKS), "masks")

# %% [markdown]
# At long lengths the saving is the whole point. The block view of a 128k-token
# sliding-window mask is computed from tile ranges alone (no `T x T` array); the
# fraction of tiles a kernel touches falls as `~(W + tile) / T`:

# %%
for L in (4096, 32768, 131072):
    c = masks.causal().blocks(L, L, 512, 512)
    w = (masks.causal() & masks.sliding_window(4096)).blocks(L, L, 512, 512)
    print(f"T = {L:>7,}: causal computes {float((c != masks.EMPTY).mean()):6.1%} of the "
          f"512 x 512 tiles, causal & sliding_window(4096) {float((w != masks.EMPTY).mean()):6.1%}")

# %% [markdown]
# ## Real attention maps
#
# Masks say where attention *may* go; the softmax says where it *does*. We build the
# tiny Gemma 2 preset (alternating `local` sliding-window and `global` layers, logit
# soft-capping, sandwich norms) with a short window, feed it a packed batch of two
# documents, and compute the softmax probabilities of its first two layers from the
# layer's own projections (`attn.project` gives q, k, v after RoPE). The maps are
# checked against `tfjax.ops.attention_reference`: `probs @ v` must equal the
# attention output. A freshly initialised model attends almost uniformly over what
# the mask allows, so we raise `init_std` to get less flat (still random) maps.

# %%
from configs import gemma2
from tfjax.models.attention_inputs import layer_masks

cfg = gemma2.get_config("tiny").model
cfg.update(scan_layers=False, init_std=0.3, attention=dict(sliding_window=6))
model = tfjax.models.build(cfg, rngs=nnx.Rngs(0))
text = b"def add(a, b):\n    return a + b\n" + b"import os\nos.getcwd()\n"
tokens = jnp.asarray(np.frombuffer(text, np.uint8).astype(np.int32))[None]
L = tokens.shape[1]
doc = jnp.asarray([[1] * 32 + [2] * (L - 32)])  # the two documents of the packed row
positions = jnp.concatenate([jnp.arange(32), jnp.arange(L - 32)])[None]  # per document
kind_masks = layer_masks(model.config, model.mask(tokens, segment_ids=doc))


def attention_probs(attn, h, mask):
    """Softmax probabilities [B, N, T, S] of one attention layer on its input h, and
    (probs @ v, the reference op's output) to check them."""
    q, k, v = attn.project(h, positions=positions)
    B, T, N, H = q.shape
    K = k.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(B, T, K, N // K, H), k) * attn.scale
    if attn.softcap:
        logits = attn.softcap * jnp.tanh(logits / attn.softcap)
    allowed = masks.dense(mask, T, k.shape[1])[:, None, None]
    probs = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, N, H)
    ref = tfjax.ops.attention_reference(q, k, v, mask, scale=attn.scale, softcap=attn.softcap)
    return probs.reshape(B, N, T, -1), (out, ref)


@nnx.jit  # one compilation for the whole walk through the first two layers
def first_layers_maps(model, tokens):
    x = model.embed(tokens, positions)
    maps, checks = [], []
    for i, block in enumerate(model.layers.blocks[:2]):
        mask = kind_masks[model.layers.layout.kind(i)]  # layer i's kind
        probs, check = attention_probs(block.attn, block.attn_norm(x), mask)
        maps.append(probs[0])
        checks.append(check)
        x = block(x, mask=mask, positions=positions)  # the next layer's input
    return maps, checks


maps, checks = first_layers_maps(model, tokens)
for out, ref in checks:
    np.testing.assert_allclose(out, ref, atol=1e-5)  # the maps are the op's probabilities
maps = [(i, model.layers.pattern[i % len(model.layers.pattern)], p) for i, p in enumerate(maps)]

N = maps[0][2].shape[0]
fig, axes = plt.subplots(2, N, figsize=(3.2 * N, 6.6))
labels = [chr(c) if 32 < c < 127 else "·" for c in text]
for row, (i, kind, p) in enumerate(maps):
    for n in range(N):
        ax = axes[row, n]
        ax.imshow(np.asarray(p[n]), cmap="viridis", interpolation="nearest")
        ax.set_title(f"layer {i} ({kind}), head {n}", fontsize=9)
        ax.set_xticks(range(0, L, 8), labels[::8], fontsize=6)
        ax.set_yticks([])
fig.suptitle("softmax attention of the tiny Gemma 2 on a packed row of two documents")
fig.tight_layout()
plt.show()

# %% [markdown]
# Layer 0 is `local`: each query sees at most 7 keys (window 6 plus itself), within its
# own document. Layer 1 is `global`: the whole causal prefix of its document. No
# probability crosses the document boundary at position 32, and the rows sum to 1
# over exactly the keys the dense mask allows.
