"""KV-cache decoding: per-token time against prefix length, and cache sizes.

    .venv/bin/python experiments/bench_decode.py                 # ~8-10 min on 2 CPU cores
    .venv/bin/python experiments/bench_decode.py --d_model 1024 --layers 8 --max_prefix 8192

1. Per-token decode time at prefix lengths 128 .. 4k (B=1) of a small GQA decoder:
   with the cache (one jitted `model.step` of one token over a cache holding the
   prefix; the cache is preallocated to prefix + 64) and by recomputation (the full
   forward over the prefix, which is what generation without a cache does per token).
   The claim: cached decode costs O(prefix) memory reads per token (flat-ish while
   weights dominate), recomputation O(prefix) matmul FLOPs plus O(prefix^2) attention.
3. Per-token decode time at short prefixes in a cache preallocated to 2 x
   --max_prefix slots (what `generate` allocates for a long generation): the
   cache's mask (`masks.Positions`) gives the attention its block view, so tiles
   of empty slots are skipped, next to the same step with every tile reported
   PARTIAL (no block view: every slot's tile visited).
2. Cache bytes per token and for a 4k context from `tfjax.models.cache_bytes`
   (abstract: `model.init_cache` under `jax.eval_shape`), for a 70B-shaped model (80
   layers, 64 query heads, H=128, bf16) as MHA / GQA (K=8) / MQA, checked against
   2 x layers x K x H x tokens x bytes and the seed's figure (MHA: 2 x 80 x 64 x
   128 x 4096 x 2 bytes = 10.7 GB; GQA with G=8: 1/8 of it), and for the presets
   (a sliding window bounds Mistral's cache; Gemma 2's local layers halve it).
4. `generate` over the scanned stack (the presets' `scan_layers`) against the same
   model's `tfjax.models.unrolled` twin: ms per generated token (prefill included,
   the median of --reps alternating rounds), greedy tokens checked identical. A
   scanned stack slices every layer's cache out of the stacked caches and writes it
   back each step; unrolled layers update theirs in place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import models
from tfjax.inference import generate
from tfjax.config import model_config


def best_of(f, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t)
    return min(times)


def _small_decoder(args, max_len):
    cfg = model_config(dict(vocab_size=512, d_model=args.d_model, num_layers=args.layers,
                            num_heads=8, num_kv_heads=2, d_ff=4 * args.d_model,
                            norm="rmsnorm", activation="swiglu", max_len=max_len))
    return cfg, models.build(cfg, rngs=nnx.Rngs(0))


def decode_timing(args):
    cfg, model = _small_decoder(args, args.max_prefix + 64)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tok):
        return nnx.merge(graphdef, state).step(tok, cache)

    @jax.jit
    def recompute(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)
        return jnp.argmax(logits[:, -1], -1)

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"\n## per-token decode time, B=1, d_model={cfg.d_model}, {cfg.num_layers} layers, "
          f"GQA {cfg.num_heads}/{cfg.kv_heads}, H={cfg.head_size}, {n_params / 1e6:.1f}M params, "
          f"fp32, {jax.devices()[0].platform}")
    print("| prefix | cached ms/token | recompute ms/token | speed-up | cache MiB |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    prefix = 128
    while prefix <= args.max_prefix:
        cache = model.init_cache(1, prefix + 64)
        cache = cache.replace(length=jnp.full((1,), prefix, jnp.int32))  # a full prefix
        tok = jnp.ones((1, 1), jnp.int32)
        out = step(state, cache, tok)  # compile
        jax.block_until_ready(out)
        box = [out[1]]

        def one(box=box, tok=tok):
            _, box[0] = step(state, box[0], tok)
            return box[0].length

        t_cache = best_of(one, args.reps)
        tokens = jnp.ones((1, prefix), jnp.int32)
        jax.block_until_ready(recompute(state, tokens))  # compile
        t_full = best_of(lambda tokens=tokens: recompute(state, tokens), max(1, args.reps // 4))
        mib = models.cache_bytes(cfg, 1, prefix + 64) / 2 ** 20
        rows.append((prefix, t_cache, t_full))
        print(f"| {prefix} | {1e3 * t_cache:.2f} | {1e3 * t_full:.1f} | {t_full / t_cache:.0f}x | "
              f"{mib:.1f} |", flush=True)
        prefix *= 2
    (p0, c0, f0), (p1, c1, f1) = rows[0], rows[-1]
    print(f"\nfrom prefix {p0} to {p1} ({p1 // p0}x): cached per-token time x{c1 / c0:.1f}, "
          f"recompute x{f1 / f0:.1f}")


def preallocated_cache(args):
    """Section 3 of the module docstring."""
    from tfjax.ops import masks as M

    slots = 2 * args.max_prefix
    cfg, model = _small_decoder(args, slots)
    graphdef, state = nnx.split(model)

    def every_tile_partial(self, qs, qe, ks, ke, **_):  # the peer: no block view
        shape = (self.q_positions.shape[0], qs.shape[0], ks.shape[1])
        return jnp.zeros(shape, bool), jnp.zeros(shape, bool)

    steps = {}
    for variant in ("block view", "every tile partial"):
        real = M.Positions._tiles  # the cache's decode mask (tfjax.models.attention_inputs)
        if variant != "block view":
            M.Positions._tiles = every_tile_partial
        try:
            # Compiled here, under this variant's `_tiles`: the tile tables' own jit
            # (`tfjax.ops.tiles`) would otherwise reuse the other variant's trace.
            jax.clear_caches()
            cache, tok = model.init_cache(1, slots), jnp.ones((1, 1), jnp.int32)
            steps[variant] = jax.jit(lambda state, cache, tok: nnx.merge(graphdef, state).step(
                tok, cache)).lower(state, cache, tok).compile()
            jax.block_until_ready(steps[variant](state, cache, tok))
        finally:
            M.Positions._tiles = real
    assert M.Positions._tiles is real
    print(f"\n## per-token decode time in a cache of {slots} slots (B=1, d_model={cfg.d_model}, "
          f"{cfg.num_layers} layers, GQA {cfg.num_heads}/{cfg.kv_heads}, fp32, "
          f"{jax.default_backend()}; attention: {cfg.attention.impl})")
    print("| prefix | block view ms/token | every tile partial ms/token | speed-up |")
    print("|---:|---:|---:|---:|")
    for prefix in sorted({128, slots // 8, slots - 64}):
        cache = model.init_cache(1, slots)
        cache = cache.replace(length=jnp.full((1,), prefix, jnp.int32))
        tok = jnp.ones((1, 1), jnp.int32)
        t = {}
        for variant, step in steps.items():
            box = [cache]

            def one(box=box, step=step):
                _, box[0] = step(state, box[0], tok)
                return box[0].length

            t[variant] = best_of(one, args.reps)
        a, b = t["block view"], t["every tile partial"]
        print(f"| {prefix} | {1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.1f}x |", flush=True)


def cache_sizes():
    T = 4096
    base = dict(arch="decoder", vocab_size=32000, d_model=8192, num_heads=64, head_dim=128,
                num_layers=80, d_ff=28672, dtype="bfloat16")
    print("\n## cache bytes (bf16), from tfjax.models.cache_bytes; 70B shape: 80 layers, "
          "64 query heads, H=128")
    print("| attention | K | bytes/token | 4k-token cache | vs MHA | formula 2*L*K*H*T*2 |")
    print("|---|---:|---:|---:|---:|---:|")
    mha_bytes = None
    for name, k in (("MHA", 64), ("GQA G=8", 8), ("MQA", 1)):
        cfg = model_config(dict(base, num_kv_heads=k))
        got = models.cache_bytes(cfg, 1, T)
        formula = 2 * 80 * k * 128 * T * 2
        assert got == formula, (name, got, formula)
        assert models.kv_bytes_per_token(cfg) * T == got
        mha_bytes = mha_bytes or got
        print(f"| {name} | {k} | {got // T:,} | {got / 1e9:.3f} GB | 1/{mha_bytes / got:.0f} | "
              f"{formula / 1e9:.3f} GB |")
    print(f"seed's example 2 x 80 x 64 x 128 x 4096 x 2 = {2 * 80 * 64 * 128 * 4096 * 2:,} bytes "
          f"= {2 * 80 * 64 * 128 * 4096 * 2 / 1e9:.2f} GB (MHA with 64 kv heads). Llama-2-70B "
          f"itself is GQA with 8 kv heads: {2 * 80 * 8 * 128 * 4096 * 2 / 1e9:.2f} GB at 4k.")

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from configs import gemma2, llama, mistral

    print("\n## presets: one sequence, bf16 cache")
    print("| preset | layers (pattern) | K x H | bytes/token (all global) | 4k | 32k |")
    print("|---|---|---:|---:|---:|---:|")
    for name, mod in (("llama (3.1-8B)", llama), ("mistral (7B, window 4096)", mistral),
                      ("gemma2 (2B, local/global)", gemma2)):
        cfg = model_config(mod.get_config().model)
        cfg = model_config(dict(vars(cfg), dtype="bfloat16", rope=vars(cfg.rope)))
        per = models.kv_bytes_per_token(cfg)
        sizes = [models.cache_bytes(cfg, 1, n) for n in (4096, 32768)]
        print(f"| {name} | {cfg.num_layers} {cfg.layer_pattern} | {cfg.kv_heads} x "
              f"{cfg.head_size} | {per / 1024:.0f} KiB | {sizes[0] / 2 ** 30:.2f} GiB | "
              f"{sizes[1] / 2 ** 30:.2f} GiB |")


def scanned_vs_unrolled(args, prompt=64):
    """Section 4 of the module docstring."""
    cfg, scanned = _small_decoder(args, prompt + args.max_prefix)
    twin = models.unrolled(scanned)
    print(f"\n## `generate`, scanned layers against `models.unrolled(model)`, B=1, "
          f"d_model={cfg.d_model}, {cfg.num_layers} layers, GQA {cfg.num_heads}/{cfg.kv_heads}, "
          f"fp32, a {prompt}-token prompt, {jax.devices()[0].platform}")
    print("| new tokens | scanned ms/token | unrolled ms/token | scanned / unrolled |")
    print("|---:|---:|---:|---:|")
    x = jax.random.randint(jax.random.key(0), (1, prompt), 0, cfg.vocab_size)
    n = 256
    while n <= args.max_prefix:
        runs = {name: (lambda m=m, n=n: generate(m, x, max_new_tokens=n))
                for name, m in (("scanned", scanned), ("unrolled", twin))}
        outs = {name: jax.block_until_ready(f()) for name, f in runs.items()}  # compile
        if not bool((outs["scanned"] == outs["unrolled"]).all()):
            raise AssertionError(f"scanned and unrolled tokens differ at {n} new tokens")
        times = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, f in runs.items():
                t = time.perf_counter()
                jax.block_until_ready(f())
                times[name].append((time.perf_counter() - t) / n)
        a, b = (statistics.median(times[k]) for k in ("scanned", "unrolled"))
        print(f"| {n} | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.2f}x |", flush=True)
        n *= 4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max_prefix", type=int, default=4096)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--sizes_only", action="store_true")
    p.add_argument("--only_unrolled", action="store_true", help="section 4 alone")
    args = p.parse_args()
    if args.only_unrolled:
        return scanned_vs_unrolled(args)
    cache_sizes()
    if not args.sizes_only:
        decode_timing(args)
        preallocated_cache(args)
        scanned_vs_unrolled(args)


if __name__ == "__main__":
    main()
