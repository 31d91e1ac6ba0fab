"""Recurrent mixers against softmax attention: training cost and decode cost vs length.

    .venv/bin/python experiments/recurrent_scaling.py            # full: ~10 CPU-minutes
    .venv/bin/python experiments/recurrent_scaling.py --quick    # seconds (CI)
    .venv/bin/python experiments/recurrent_scaling.py --part decode --lengths 256,1024,4096,16384

One layer of each mixer in a decoder (d_model 256, no feed-forward, byte vocabulary,
fp32, B=1, CPU), so the table is the mixer's cost plus a fixed embedding / head:
- "global": causal softmax attention, 4 heads of 64 (`attention.impl="auto"`: the
  tiled blockwise form at these lengths);
- "mamba": Mamba-1's selective scan (`tfjax.nn.ssm`, d_state 16, chunk 256);
- "mamba2": Mamba-2's chunked SSD (`tfjax.nn.mamba2`, d_state 64, head_dim 64, chunk 64);
- "gated_deltanet": the chunked WY form (`tfjax.nn.gated_deltanet`, 4 heads of 64,
  chunk 64);
- "linear": causal linear attention (elu+1, chunk 64).

1. Training: the loss's forward + backward, jitted, at T = 256 .. 8k: best process
   CPU time per token, and the compiled temporary memory
   (`memory_analysis().temp_size_in_bytes`). The claim: the recurrent forms are
   linear in T (flat time per token, memory ~ T), softmax attention quadratic in
   time (per-token time grows with T) and linear in memory when tiled.
2. Decoding: one cached `model.step` of one token after a prefix of P tokens (the
   cache sized P + 64), P = 256 .. 8k: best CPU time per token and the cache bytes
   (`tfjax.models.cache_bytes`). The claim: the recurrent caches are constant in P,
   the KV cache grows linearly, and so does attention's per-token read.
"""

from __future__ import annotations

from common import Experiment
from tinylm import load_average, timings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax import models
from tfjax.config import model_config

MIB = 2 ** 20
D, VOCAB = 256, 259
KINDS = ("global", "mamba", "mamba2", "gated_deltanet", "linear")


def build(kind: str, max_len: int):
    cfg = model_config(dict(
        vocab_size=VOCAB, d_model=D, num_layers=1, num_heads=4, num_kv_heads=4, d_ff=4 * D,
        norm="rmsnorm", position="rope" if kind == "global" else "none",
        layer_pattern=(kind,), ffn_pattern=("none",), max_len=max_len,
        ssm=dict(d_state=16, chunk=256), mamba2=dict(d_state=64, head_dim=64, chunk=64),
        gdn=dict(chunk=64), linear=dict(chunk=64)))
    return cfg, models.build(cfg, rngs=nnx.Rngs(0))


def train_cost(kind: str, T: int, reps: int) -> tuple[float, float]:
    """(CPU microseconds per token, compiled temporary MiB) of forward + backward."""
    cfg, model = build(kind, T)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(0), (1, T + 1), 0, VOCAB)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    f = jax.jit(jax.value_and_grad(loss))
    mem = f.lower(params).compile().memory_analysis().temp_size_in_bytes / MIB
    _, cpu = timings(lambda: f(params), reps)
    return 1e6 * cpu / T, mem


def decode_cost(kind: str, prefix: int, reps: int) -> tuple[float, float]:
    """(CPU microseconds for one cached token after `prefix`, cache MiB)."""
    cfg, model = build(kind, prefix + 64)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tok):
        return nnx.merge(graphdef, state).step(tok, cache)

    cache = model.init_cache(1, prefix + 64)
    cache = cache.replace(length=jnp.full((1,), prefix, jnp.int32))  # as after the prefix
    tok = jnp.ones((1, 1), jnp.int32)
    _, cpu = timings(lambda: step(state, cache, tok), reps)
    return 1e6 * cpu, models.cache_bytes(cfg, 1, prefix + 64) / MIB


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--part", choices=("train", "decode", "all"), default="all")
    parser.add_argument("--lengths", default="", help="comma-separated T / prefixes")
    exp = Experiment("recurrent_scaling", __doc__, parser=parser, argv=argv)
    q = exp.quick
    lengths = [128, 256] if q else [256, 1024, 4096, 8192]
    if exp.args.lengths:
        lengths = [int(x) for x in exp.args.lengths.split(",")]
    if exp.args.part != "all":
        exp.stem += "_" + exp.args.part
    reps = 2 if q else 5
    exp.text(f"d_model={D}, one mixer layer, fp32, B=1. {load_average()} at start.")
    rows, drows = [], []
    if exp.args.part in ("train", "all"):
        rows = train_table(exp, lengths, reps)
    if exp.args.part in ("decode", "all"):
        drows = decode_table(exp, lengths, reps)
    exp.finish()
    return rows, drows


def train_table(exp, lengths, reps):
    rows, per_token, memory = [], {}, {}
    for T in lengths:
        for kind in KINDS:
            us, mib = train_cost(kind, T, reps)
            rows.append((T, kind, us, mib))
            per_token.setdefault(kind, ([], []))[0].append(T)
            per_token[kind][1].append(us)
            memory.setdefault(kind, ([], []))[0].append(T)
            memory[kind][1].append(mib)
            print(f"  train T={T} {kind}: {us:.1f} us/token, {mib:.1f} MiB", flush=True)
    exp.table(["T", "mixer", "CPU us / token (fwd+bwd)", "temp MiB"], rows,
              title="1. Training: forward + backward")
    growth = [(k, per_token[k][1][-1] / per_token[k][1][0], memory[k][1][-1] / memory[k][1][0])
              for k in KINDS]
    exp.table(["mixer", f"time/token x (T {lengths[0]} -> {lengths[-1]})",
               f"memory x (T x{lengths[-1] // lengths[0]})"], growth,
              title="Growth from the shortest to the longest T")
    exp.plot(per_token, xlabel="T", ylabel="CPU us per token (fwd+bwd)", logx=True, logy=True,
             title="training cost per token")
    return rows


def decode_table(exp, lengths, reps):
    drows, dtime = [], {}
    for P in lengths:
        for kind in KINDS:
            us, mib = decode_cost(kind, P, reps * 4)
            drows.append((P, kind, us, mib))
            dtime.setdefault(kind, ([], []))[0].append(P)
            dtime[kind][1].append(us)
            print(f"  decode P={P} {kind}: {us:.1f} us/token, cache {mib:.3f} MiB", flush=True)
    exp.table(["prefix", "mixer", "CPU us / token", "cache MiB"], drows,
              title="2. Decoding: one cached token after the prefix")
    exp.plot(dtime, xlabel="prefix", ylabel="CPU us per decoded token", logx=True, logy=True,
             title="decode cost per token", suffix="_time")
    return drows


if __name__ == "__main__":
    main()
