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
# # 07 · Induction heads
#
# An induction head (Olsson et al. 2022, "In-context learning and induction heads")
# completes a pattern it has seen earlier in the context: at a token `A` it looks back
# for the previous `A`, attends to the token that followed it, `B`, and copies `B`.
# It needs two heads in two layers: a **previous-token head** in layer 0 writes "my
# previous token was `A`" into each position, and the **induction head** in layer 1
# matches its query `A` against those keys.
#
# We train a tiny 2-layer model on sequences of random tokens repeated twice (the
# first half cannot be predicted, the second half can be copied), then find the heads
# with `tfjax.interp`: by their attention patterns (`run_with_cache`, `hook_pattern`)
# and by ablating each one (`run_with_hooks`, zeroing its `hook_z`). Last, we test
# the head we found on repeats of another length, and learn that a head can have the
# induction pattern without being an induction head.

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
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "configs").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.interp import run_with_cache, run_with_hooks

SEED = 0
VOCAB = 64  # random tokens are drawn from 1..VOCAB-1
HALF = 16  # each sequence: HALF random tokens, then the same HALF tokens again
T = 2 * HALF
STEPS, BATCH, LR = 300, 32, 3e-3

# Two layers of 4 heads; a small FFN (the induction circuit lives in the attention).
cfg = model_config(dict(vocab_size=VOCAB, d_model=64, num_layers=2, num_heads=4, d_ff=64,
                        max_len=T, position="rope", norm="rmsnorm", activation="gelu"))
L, N = cfg.num_layers, cfg.num_heads


def repeated_batch(key, batch=BATCH, length=HALF):
    """[batch, T] int32 tokens and [batch, T-1] bool mask of the copyable predictions.
    Each row: `length` random tokens, the same tokens again, then fresh random tokens
    up to T (none when length = HALF)."""
    fresh = jax.random.randint(key, (batch, T), 1, VOCAB)
    P = length
    idx = jnp.arange(T)[None]
    repeat = (idx >= P) & (idx < 2 * P)
    source = jnp.broadcast_to(jnp.where(repeat, idx - P, idx), (batch, T))
    tokens = jnp.take_along_axis(fresh, source, axis=1)
    copyable = repeat[:, 1:] & (idx[:, 1:] > P)  # target t in P+1 .. 2P-1
    return tokens, jnp.broadcast_to(copyable, (batch, T - 1))


def token_losses(logits, tokens):
    """[B, T-1] cross entropy of predicting tokens[:, 1:] from logits[:, :-1]."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:])


def split_losses(logits, tokens, copyable):
    """(mean loss of the unpredictable targets, mean loss of the copyable ones)."""
    ce, m = token_losses(logits, tokens), copyable.astype(jnp.float32)
    return (ce * (1 - m)).sum() / (1 - m).sum(), (ce * m).sum() / m.sum()


# %% [markdown]
# ## Train
#
# A plain AdamW loop over the model's parameters (`nnx.split` / `nnx.merge` around one
# jitted step): the data is generated on the fly, so there is no corpus for
# `tfjax.train.Trainer` to pack. The loss is on every next-token prediction; we
# track it separately on the first half (random tokens: about `ln(63) = 4.14`, a
# little below since its last target, the repeat's first token, is a copy) and on the
# rest of the repeated half (copyable: it can fall to 0).

# %%
model = models.build(cfg, rngs=nnx.Rngs(SEED))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, LR, 30, STEPS, LR * 0.1), weight_decay=0.01))
opt = tx.init(params)


@jax.jit
def train_step(params, rest, opt, key):
    tokens, copyable = repeated_batch(key)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return token_losses(logits, tokens).mean(), split_losses(logits, tokens, copyable)

    (loss, halves), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, halves


key = jax.random.key(SEED)
history = []
start = time.perf_counter()
for step in range(STEPS):
    params, opt, halves = train_step(params, rest, opt, jax.random.fold_in(key, step))
    history.append([float(h) for h in halves])
history = np.asarray(history)
print(f"{STEPS} steps in {time.perf_counter() - start:.0f} s; loss first half "
      f"{history[-10:, 0].mean():.2f}, repeated half {history[-10:, 1].mean():.3f}")
model = nnx.merge(graphdef, params, rest)

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(history[:, 0], label="first half (random)")
ax.plot(history[:, 1], label="repeated half (copyable)")
ax.axhline(np.log(VOCAB - 1), color="grey", ls=":", label="ln(63): uniform guess")
ax.set_xlabel("step"), ax.set_ylabel("cross entropy (nats)"), ax.legend()
ax.set_title("training on random tokens repeated twice")
plt.show()

# %% [markdown]
# The first half stays near the uniform guess (nothing there can be predicted); the
# repeated half falls towards 0, typically after a plateau: the moment the two-layer
# circuit forms (the "phase change" of Olsson et al.).

# %%
assert history[-10:, 1].mean() < 0.5 * history[-10:, 0].mean(), "the model did not learn to copy"

# %% [markdown]
# ## Attention patterns
#
# `run_with_cache` keeps every layer's `hook_pattern` `[B, N, T, S]`. On a fresh
# repeated sequence we draw each head's pattern, then score it:
#
# * **previous-token score**: the mean attention from position `i` to `i - 1`;
# * **induction score**: the mean attention from a position `i` of the repeated half
#   to `i - (HALF - 1)`, the token after `i`'s earlier occurrence (the diagonal at
#   offset `HALF - 1`).

# %%
tokens, copyable = repeated_batch(jax.random.key(SEED + 1), batch=64)
logits, cache = run_with_cache(model, tokens, names=lambda n: n.endswith("hook_pattern"))
patterns = np.stack([np.asarray(cache[f"blocks.{l}.attn.hook_pattern"]) for l in range(L)])
# patterns: [L, B, N, T, S]
print("pattern shape per layer:", patterns.shape[1:])

fig, axes = plt.subplots(L, N, figsize=(2.6 * N, 2.6 * L))
for l in range(L):
    for n in range(N):
        ax = axes[l, n]
        ax.imshow(patterns[l, 0, n], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"L{l} H{n}", fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
fig.suptitle("attention patterns on one repeated sequence (rows: queries, columns: keys)")
fig.tight_layout()
plt.show()

# %%
rows = np.arange(HALF, T)
induction = patterns[..., rows, rows - (HALF - 1)].mean(axis=(1, 3))  # [L, N]
rows = np.arange(1, T)
previous = patterns[..., rows, rows - 1].mean(axis=(1, 3))  # [L, N]

fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
for ax, (name, score) in zip(axes, [("previous-token score", previous),
                                    ("induction score", induction)]):
    im = ax.imshow(score, cmap="Blues", vmin=0, vmax=1)
    for l in range(L):
        for n in range(N):
            ax.text(n, l, f"{score[l, n]:.2f}", ha="center", va="center", fontsize=9,
                    color="white" if score[l, n] > 0.6 else "black")
    ax.set_xticks(range(N)), ax.set_yticks(range(L))
    ax.set_xlabel("head"), ax.set_ylabel("layer"), ax.set_title(name)
    fig.colorbar(im, ax=ax)
fig.tight_layout()
plt.show()
top_induction = np.unravel_index(induction.argmax(), induction.shape)
top_previous = np.unravel_index(previous.argmax(), previous.shape)
print(f"strongest induction head: layer {top_induction[0]} head {top_induction[1]} "
      f"({induction.max():.2f}); strongest previous-token head: layer {top_previous[0]} "
      f"head {top_previous[1]} ({previous.max():.2f})")

# %% [markdown]
# Layer 1's heads (with this seed, several of them) draw a sharp stripe `HALF - 1`
# below the diagonal in the repeated half: each query attends to the token after its
# earlier copy, the induction pattern; layer 0's heads do not. What is missing is the textbook partner: no layer-0 head is a
# previous-token head (their scores stay near the ~0.1 of spread-out attention). We
# come back to that at the end.

# %%
assert top_induction[0] == 1 and induction.max() > 0.5, induction

# %% [markdown]
# ## Patching: ablate each head
#
# Attention patterns are correlational; ablation tests what a head *does*. With
# `run_with_hooks` we zero one head's output (`hook_z` `[B, T, N, H]`, what the output
# projection reads) and measure the loss on the repeated half. One jitted function
# serves all heads: the hook multiplies `hook_z` by a keep-mask `[L, N]` that is an
# argument, indexed by `hook.layer` (a Python int, also inside a scanned stack).

# %%
@nnx.jit
def loss_with_heads_kept(model, keep):
    def scale_heads(z, hook):
        return z * keep[hook.layer][None, None, :, None].astype(z.dtype)

    logits = run_with_hooks(model, tokens,
                            fwd_hooks=[(lambda n: n.endswith("attn.hook_z"), scale_heads)])
    return split_losses(logits, tokens, copyable)[1]


base = float(loss_with_heads_kept(model, jnp.ones((L, N))))
ablated = np.zeros((L, N))
for l in range(L):
    for n in range(N):
        ablated[l, n] = float(loss_with_heads_kept(model, jnp.ones((L, N)).at[l, n].set(0.0)))
increase = ablated - base
print(f"repeated-half loss: {base:.3f} with every head, "
      f"{float(split_losses(logits, tokens, copyable)[1]):.3f} without hooks (the same)")

fig, ax = plt.subplots(figsize=(4.8, 2.8))
im = ax.imshow(increase, cmap="Reds", vmin=0)
for l in range(L):
    for n in range(N):
        ax.text(n, l, f"{increase[l, n]:+.2f}", ha="center", va="center", fontsize=9)
ax.set_xticks(range(N)), ax.set_yticks(range(L))
ax.set_xlabel("head"), ax.set_ylabel("layer")
ax.set_title("repeated-half loss increase when the head is zeroed")
fig.colorbar(im, ax=ax)
fig.tight_layout()
plt.show()

# %% [markdown]
# Zeroing a layer-1 head with a high induction score raises the repeated-half loss far
# more than zeroing any layer-0 head: the pattern and the ablation agree on where the
# copying happens. Where several heads share the stripe, each one's ablation hurts
# (their outputs add up in the residual stream; without one, the copy is garbled).

# %%
np.testing.assert_allclose(base, float(split_losses(logits, tokens, copyable)[1]), rtol=1e-4)
worst = np.unravel_index(increase.argmax(), increase.shape)
assert worst[0] == 1 and induction[worst] > 0.5, (increase, induction)
assert increase[1].max() > 10 * max(increase[0].max(), 0.05), increase

# %% [markdown]
# ## Is it really an induction head?
#
# Every training sequence repeats at the same distance, `HALF`. With RoPE a single
# head can find "the token after the earlier copy" by relative position alone (query
# `i` attends to key `i - HALF + 1`) without comparing tokens, and that needs no
# previous-token head. A real induction head matches tokens, so it copies at any
# distance. We test the model on repeats of other lengths (the copyable targets of
# each length, the loss of a uniform guess is `ln(63) = 4.14`):

# %%
for length in (8, 10, 12, HALF):
    tk, cp = repeated_batch(jax.random.key(SEED + 2), batch=64, length=length)
    print(f"repeat length {length:2d}: loss on the copyable tokens "
          f"{float(split_losses(model(tk), tk, cp)[1]):.2f}")
tk, cp = repeated_batch(jax.random.key(SEED + 2), batch=64, length=10)
other_length = float(split_losses(model(tk), tk, cp)[1])

# %% [markdown]
# It is not: at any length but 16 the loss is no better than a guess (often worse:
# the head confidently copies the wrong token). The head with the induction *pattern*
# on this data is a fixed-offset head. The pattern score and the ablation are the
# right tools, and they found the head that does the copying, but the data decides
# which mechanism gets learned: the attention pattern on one kind of input cannot
# tell them apart, a change of input can. To grow real induction heads, vary the
# repeat distance (or train on text) so that no positional rule works; in our tries
# that needs far more than this notebook's few hundred CPU steps (with the distance
# drawn from 8..16 per row, 600 steps brought the copyable loss only to 2-2.5 nats).

# %%
assert other_length > 3.0, other_length  # the fixed-offset head does not generalise
