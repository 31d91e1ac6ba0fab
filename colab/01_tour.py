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
# # 01 · A tour of tfjax's presets
#
# Every file in `configs/` is a preset: `get_config(arg)` returns an `ml_collections`
# ConfigDict whose `.model` section `tfjax.models.build` turns into a Flax NNX module.
# Here we
#
# 1. count the parameters of every preset at its **real size** (Llama-3.1-8B,
#    Mixtral-8x7B, Jamba ...) *abstractly*, with `nnx.eval_shape`: shapes only,
#    no memory is allocated, so a 52B model is counted on a laptop;
# 2. compare them with the published checkpoint sizes;
# 3. build every `tiny` variant for real and run it on a small batch.

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
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tfjax
from tfjax.config import model_config

print("jax", jax.__version__, "| devices:", jax.devices())

# %% [markdown]
# ## Every preset at full size, counted abstractly
#
# `nnx.eval_shape(lambda: build(cfg))` traces the constructor and returns a model whose
# parameters are `ShapeDtypeStruct`s. The published sizes below are the parameter
# counts of the reference checkpoints that the presets' docstrings (and the table of
# `docs/presets.md`) name; `tests/test_presets.py` asserts they match exactly.

# %%
PRESETS = sorted(p.stem for p in Path("configs").glob("*.py") if not p.stem.startswith("_"))

# Published sizes (Hugging Face checkpoints, counted from their weights / config.json).
PUBLISHED = {
    "gpt2": ("gpt2 (small)", 124_439_808),
    "llama": ("Llama-3.1-8B", 8_030_261_248),
    "mistral": ("Mistral-7B-v0.1", 7_241_732_096),
    "gemma2": ("gemma-2-2b", 2_614_341_888),
    "neox": ("pythia-1.4b", 1_414_647_808),
    "bloom": ("bloom-560m", 559_214_592),
    "bert": ("bert-base + MLM head + pooler + 2-way classifier", 110_106_428),
    "t5": ("t5-base", 222_903_552),
    "mixtral": ("Mixtral-8x7B-v0.1", 46_702_792_704),
    "mamba": ("mamba-130m", 129_135_360),
    "jamba": ("Jamba-v0.1", 51_570_323_328),
    "mamba2": ("mamba2-130m", 128_989_632),
    "qwen3_next": ("Qwen3-Next-80B-A3B", 79_674_391_296),
    "gpt_oss": ("gpt-oss-20b", 20_914_757_184),
    "deepseek_v3": ("DeepSeek-V3 (without MTP)", 671_026_404_352),
    "llama4": ("Llama-4-Scout-17B-16E, text", 107_769_861_120),
    "transformer": ("Vaswani et al. base (paper: '65M')", None),
    "default": ("tfjax's `make train` model (docstring: 0.82M)", None),
}


def preset(name):
    return importlib.import_module(f"configs.{name}")


def count(model_cfg):
    abstract = nnx.eval_shape(lambda: tfjax.models.build(model_cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


rows = []
t0 = time.perf_counter()
for name in PRESETS:
    cfg = model_config(preset(name).get_config().model)
    what, published = PUBLISHED.get(name, ("?", None))
    rows.append((name, cfg.arch, count(cfg), published, what))
print(f"counted {len(rows)} presets abstractly in {time.perf_counter() - t0:.1f} s\n")

print(f"{'preset':12} {'arch':16} {'tfjax params':>16} {'published':>16}  match  reference")
for name, arch, n, published, what in rows:
    match = "-" if published is None else ("yes" if n == published else "NO")
    pub = f"{published:,}" if published else ""
    print(f"{name:12} {arch:16} {n:>16,} {pub:>16}  {match:5}  {what}")
assert all(n == published for _, _, n, published, _ in rows if published)

# %% [markdown]
# Every published count is matched to the parameter. The MoE presets (Mixtral,
# Jamba, Qwen3-Next, gpt-oss, DeepSeek-V3, Llama 4) are sparse:
# their *total* counts include all experts, while a token only runs through
# `moe.experts_per_token` of them.

# %% [markdown]
# ## What the presets differ in
#
# A few of the knobs each preset sets (the full list is `tfjax.config.ModelConfig`).

# %%
KNOBS = ("position", "norm", "norm_placement", "activation", "block", "layer_pattern",
         "ffn_pattern", "num_heads", "num_kv_heads")
print(f"{'preset':12} " + " ".join(f"{k:>15}" for k in KNOBS))
for name in PRESETS:
    m = model_config(preset(name).get_config().model)
    vals = [m.kv_heads if k == "num_kv_heads" else getattr(m, k) for k in KNOBS]
    vals = ["/".join(v[:2]) + ("/..." if len(v) > 2 else "") if isinstance(v, tuple) else v
            for v in vals]
    print(f"{name:12} " + " ".join(f"{str(v):>15}" for v in vals))

# %% [markdown]
# ## Every tiny variant: output shapes, then real runs
#
# The `tiny` variants keep each architecture's recipe at toy size. Decoders take
# `tokens [B, T]`; the encoder (BERT) also takes token types and an attention mask;
# encoder-decoders (T5, the original Transformer) take encoder and decoder tokens.
# First every preset's forward pass abstractly (`jax.eval_shape`: traced, not
# compiled), then real runs under `nnx.jit` with finite logits. Compiling 13 models
# takes about a minute on a laptop CPU, so `QUICK` runs two of them (`QUICK = False`: all).

# %%
QUICK = True
RUN = ["llama", "t5"] if QUICK else PRESETS  # a decoder, an encoder-decoder
B, T = 2, 16


def forward(model, cfg, tokens):
    if cfg.audio.n_mels:  # a speech encoder-decoder: log-mel features in, text out
        features = jnp.zeros((tokens.shape[0], cfg.audio.n_mels, cfg.audio.max_frames))
        return model(tokens[:, :7], input_features=features)
    if cfg.arch == "encoder_decoder":
        return model(tokens, tokens[:, :7])  # encoder tokens, decoder tokens
    if cfg.arch == "encoder":
        return model(tokens, jnp.zeros_like(tokens), jnp.ones_like(tokens))
    return model(tokens)


tokens = jnp.zeros((B, T), jnp.int32)
print(f"{'preset':12} {'params':>10}  {'arch':16} tokens {tokens.shape} -> output")
tiny = {}
for name in PRESETS:
    cfg = model_config(preset(name).get_config("tiny").model)
    tiny[name] = cfg

    def build_and_run(cfg=cfg):
        model = tfjax.models.build(cfg, rngs=nnx.Rngs(0))
        return nnx.state(model, nnx.Param), forward(model, cfg, tokens)

    params, out = jax.eval_shape(build_and_run)  # traced once, nothing compiled or allocated
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"{name:12} {n:>10,}  {cfg.arch:16} logits {out.shape} {out.dtype}")

# %%
for name in RUN:
    cfg = tiny[name]
    model = tfjax.models.build(cfg, rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)
    logits = nnx.jit(lambda m, x, cfg=cfg: forward(m, cfg, x))(model, x)
    probs = jax.nn.softmax(logits, -1)
    assert np.isfinite(np.asarray(logits)).all()
    print(f"{name:8} ({cfg.arch}): logits {logits.shape}, mean max-probability "
          f"{float(probs.max(-1).mean()):.4f} (uniform would be {1 / cfg.vocab_size:.4f})")

# %% [markdown]
# Logits are `[B, T, V]` (for encoder-decoders `T` is the decoder length); the
# vocabularies are byte-level (259) or small (512) in the tiny variants. The next
# notebooks look inside: `02` the attention masks, `03` training, `04` ring
# attention, `05` KV-cached generation.
