# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · KV cache and generation
#
# Autoregressive decoding without a cache recomputes every layer over the whole prefix
# for each new token. With one, a step projects only the new token and attends over
# stored keys and values. `tfjax.inference.generate` does one jitted prefill over the
# prompt (filling per-layer caches), then a fixed-shape `lax.while_loop` that decodes
# one token per step. Here we check it against plain recomputation, size the caches of
# MHA / GQA / MQA and of a sliding-window rolling buffer, and look at the samplers.

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

import tfjax
from configs import llama, mistral
from tfjax.config import model_config
from tfjax.inference import filter_logits, generate, sample
from tfjax.models import cache_bytes

# %% [markdown]
# ## A tiny GQA decoder
#
# The `tiny` Llama preset: 4 query heads sharing 2 kv heads (G = 2), RoPE, SwiGLU, a
# byte vocabulary. Random weights are enough to compare two ways of decoding, but
# we raise `init_std` so the next-token distributions are not nearly flat and greedy
# decoding has clear winners.

# %%
cfg = llama.get_config("tiny").model
cfg.init_std = 0.2
cfg = model_config(cfg)
model = tfjax.models.build(cfg, rngs=nnx.Rngs(0))
print(f"N={cfg.num_heads} query heads, K={cfg.kv_heads} kv heads, H={cfg.head_size}, "
      f"{cfg.num_layers} layers, vocab {cfg.vocab_size}")
cache = model.init_cache(batch=2, max_len=48)
print("cache of 2 rows x 48 tokens:",
      jax.tree.map(lambda x: x.shape, cache.layers["cycles"][0]["attn"]))

# %% [markdown]
# ## Cached generation = recomputation
#
# The recomputing decoder runs the full model on a fixed-size buffer and reads the
# logits at the last real position (a causal model ignores what comes after it), one
# compiled program for all steps. Greedy decoding with the cache must produce the
# same tokens. Prompts have different lengths: they are right-padded and passed
# `prompt_lengths`, and each row generates what it would alone.

# %%
NEW = 24
prompts = [[257, *b"def f(x):"], [257, *b"import"]]
lengths = np.asarray([len(p) for p in prompts], np.int32)
batch = np.zeros((len(prompts), lengths.max()), np.int32)
for r, p in enumerate(prompts):
    batch[r, :len(p)] = p

cached = np.asarray(generate(model, batch, prompt_lengths=lengths, max_new_tokens=NEW))


@nnx.jit
def next_token(model, buf, cur):  # logits at position cur - 1 of each row
    logits = model(buf)
    return jnp.argmax(logits[jnp.arange(buf.shape[0]), cur - 1], -1).astype(jnp.int32)


buf = np.zeros((len(prompts), lengths.max() + NEW), np.int32)
buf[:, :batch.shape[1]] = batch
cur = lengths.copy()
recomputed = []
for _ in range(NEW):
    tok = np.asarray(next_token(model, jnp.asarray(buf), jnp.asarray(cur)))
    buf[np.arange(len(prompts)), cur] = tok
    cur += 1
    recomputed.append(tok)
recomputed = np.stack(recomputed, 1)

print("cached    :", cached.tolist())
print("recomputed:", recomputed.tolist())
assert (cached == recomputed).all()
alone = np.asarray(generate(model, batch[1:, :lengths[1]], max_new_tokens=NEW))
assert (alone[0] == cached[1]).all()  # the padded row = the row on its own
print("identical; and the padded row 1 equals row 1 generated on its own")

# %% [markdown]
# ## Cache sizes: MHA, GQA, MQA, sliding window
#
# `cache_bytes(cfg, batch, length)` counts a cache abstractly (`jax.eval_shape`,
# nothing allocated). At Llama-3.1-8B size in bf16: only the K kv heads are stored,
# so GQA (8 kv heads for 32 query heads) is 1/4 of MHA and MQA 1/32. Mistral's
# `local` layers keep a rolling buffer of W + 1 = 4097 slots, so their cache stops
# growing at the window.

# %%
variants = {
    "MHA (K = 32)": dict(num_kv_heads=32),
    "GQA (K = 8, Llama-3.1-8B)": dict(num_kv_heads=8),
    "MQA (K = 1)": dict(num_kv_heads=1),
}
lengths_axis = [1024, 4096, 16384, 32768, 131072]
table = {}
for name, over in variants.items():
    c = llama.get_config().model
    c.update(over)
    c = model_config(c)
    table[name] = [cache_bytes(c, 1, L, dtype=jnp.bfloat16) for L in lengths_axis]
m = model_config(mistral.get_config().model)  # every layer local, window 4096
table["GQA + sliding window 4096 (Mistral-7B)"] = [
    cache_bytes(m, 1, L, dtype=jnp.bfloat16) for L in lengths_axis]

GiB = 2 ** 30
print(f"{'batch 1, bf16':40}" + "".join(f"{L:>10,}" for L in lengths_axis) + "  tokens")
for name, row in table.items():
    print(f"{name:40}" + "".join(f"{b / GiB:>9.2f}G" for b in row))

fig, ax = plt.subplots(figsize=(6.5, 3.8))
for name, row in table.items():
    ax.loglog(lengths_axis, np.asarray(row) / GiB, "o-", label=name)
ax.set(xlabel="tokens in the cache", ylabel="KV cache (GiB, batch 1, bf16)",
       title="KV cache size against length")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The formula behind the GQA line: 2 (K and V) x 32 layers x 8 kv heads x 128 head
# dims x 2 bytes = 128 KiB per token, 16 GiB at 128k tokens; MHA would need 64 GiB.
# The sliding-window line is flat past 4k tokens at 4097 slots x 128 KiB.

# %%
m_tiny = model_config(mistral.get_config("tiny").model)
W = m_tiny.attention.sliding_window
tiny_model = nnx.eval_shape(lambda: tfjax.models.build(m_tiny, rngs=nnx.Rngs(0)))  # shapes only
rolling = tiny_model.init_cache(batch=1, max_len=512)
print(f"tiny Mistral, window {W}, a cache for 512 tokens: K is",
      rolling.layers["cycles"][0]["attn"].k.shape, "= [layers, batch, W + 1 slots, K, H]")
print("slot s holds position p - ((p - s) mod (W + 1)) after p tokens: a rolling buffer "
      "(tests/inference check it against recomputation past the window)")

# %% [markdown]
# ## Sampling: temperature, top-k, top-p
#
# `sample(key, logits, temperature, top_k, top_p)` applies, as Hugging Face does, the
# temperature, then top-k, then top-p (the smallest set of most likely tokens whose
# mass reaches p), renormalises and draws; temperature 0 is greedy. On a fixed toy
# distribution over 12 tokens, the empirical frequencies of 4,000 draws:

# %%
logits = jnp.asarray([3.0, 2.5, 2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
settings = {
    "T=1": dict(temperature=1.0),
    "T=0.5": dict(temperature=0.5),
    "T=2": dict(temperature=2.0),
    "T=1, top-k 3": dict(temperature=1.0, top_k=3),
    "T=1, top-p 0.8": dict(temperature=1.0, top_p=0.8),
}
keys = jax.random.split(jax.random.key(0), 4000)
# Settings are traced scalars (top_k=0 and top_p=1 mean off): one compiled sampler.
draw = jax.jit(jax.vmap(lambda k, t, tk, tp: sample(k, logits[None], t, tk, tp)[0],
                        in_axes=(0, None, None, None)))
fig, ax = plt.subplots(figsize=(9, 3.2))
width = 0.8 / len(settings)
for i, (name, kw) in enumerate(settings.items()):
    draws = draw(keys, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    freq = np.bincount(np.asarray(draws), minlength=logits.size) / keys.shape[0]
    ax.bar(np.arange(logits.size) + (i - len(settings) / 2 + 0.5) * width, freq, width,
           label=name)
ax.set(xlabel="token (sorted by logit)", ylabel="frequency", title="what each sampler draws")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
kept = np.isfinite(np.asarray(filter_logits(logits, top_p=0.8)))
print("top-p 0.8 keeps tokens", np.flatnonzero(kept).tolist(), "with softmax mass",
      f"{float(jax.nn.softmax(logits)[kept].sum()):.3f}")

# %% [markdown]
# The same settings in `generate` (traced scalars: one compiled decode loop serves all
# of them); different seeds give different continuations, greedy ignores the seed.

# %%
for kw in [dict(temperature=0.0), dict(temperature=1.0, seed=0), dict(temperature=1.0, seed=1),
           dict(temperature=0.8, top_k=5, seed=0), dict(temperature=1.0, top_p=0.5, seed=0)]:
    out = generate(model, batch[1:, :lengths[1]], max_new_tokens=NEW, **kw)  # compiled above
    print(f"{str(kw):45} {np.asarray(out)[0, :12].tolist()}")
