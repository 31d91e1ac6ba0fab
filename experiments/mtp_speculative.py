"""Multi-token prediction (DeepSeek-V3's MTP modules, `model.mtp_depth`) on the stdlib
corpus: what the extra loss does to the next-token model, and how many tokens per
decoder call self-speculative decoding with the modules as the draft gives.

    .venv/bin/python experiments/mtp_speculative.py            # full: ~10 CPU-minutes
    .venv/bin/python experiments/mtp_speculative.py --quick    # seconds (the test)

Models: tiny byte-level decoders (`tinylm.TINY` at 4 layers: d_model 64, RoPE,
RMSNorm, GELU) with D = 0 (the baseline), 1, 2 and 3 MTP modules (each one layer
of the decoder's kind plus a [2d, d] projection and two norms; the embedding and
head are shared), trained the same way (AdamW, warmup + cosine, lr 3e-3, batch 16
x 128 random crops) on the trainer's own loss (`tfjax.train.objectives`'
causal_lm: next-token cross-entropy + model.mtp_loss_weight / D x the MTP
cross-entropies), from three seeds.

Measured per model: validation bits/byte of the next-token head (fixed windows of
the validation split), and on 8 validation prompts of 64 bytes, greedy decoding of
64 bytes by `tfjax.inference.speculative.speculative_generate`: identical to plain
`generate` (checked), the draft acceptance rate (accepted / proposed drafts: a
verification yields 1 + D x acceptance tokens on average), the decoder calls after
the prefill (plain greedy: one per token after the first; speculative: one per
verification, until the slowest row is done) and the wall time of both (best of 3;
on CPU with tiny models an MTP pass costs about what the decoder call it saves
does, so the wall ratio is not the claim measured here, calls are).

DeepSeek-V3's claims (arXiv 2412.19437, 2.2 and 5.4.3): MTP training improves the
main model's benchmarks, and the second token's acceptance is 85-90 %, giving 1.8x
tokens per second.
"""

from __future__ import annotations

import argparse
import math

from common import Experiment
from tinylm import TINY, bits_per_byte, corpus, load_average, n_params, timings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.inference import generate
from tfjax.inference.speculative import speculative_generate
from tfjax.train.objectives import OBJECTIVES

DEPTHS = (0, 1, 2, 3)


def _batch(tokens):
    x = tokens[:, :-1]
    B, T = x.shape
    ones = jnp.ones((B, T), jnp.float32)
    return dict(inputs=x, targets=tokens[:, 1:], mask=ones, target_bytes=ones,
                segment_ids=jnp.zeros((B, T), jnp.int32),
                positions=jnp.broadcast_to(jnp.arange(T), (B, T)))


def train(model, data, *, steps, batch, seq_len, seed, lr=3e-3):
    """The trainer's causal-LM loss (next token + weighted MTP) under AdamW."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    forward = OBJECTIVES.get("causal_lm").forward
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, 30, max(steps, 31), lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, tokens):
        def f(p):
            sums = forward(nnx.merge(graphdef, p, rest), _batch(tokens))
            return (sums["nll"] + sums.get("mtp", 0.0)) / sums["tokens"], sums
        (_, sums), g = jax.value_and_grad(f, has_aux=True)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, sums["nll"] / sums["tokens"]

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(data) - seq_len - 1, batch)
        tokens = jnp.asarray(np.stack([data[i:i + seq_len + 1] for i in idx]))
        params, opt, loss = step(params, opt, tokens)
        losses.append(float(loss))
    return nnx.merge(graphdef, params, rest), losses


def decode(model, prompts, new):
    ref = generate(model, prompts, max_new_tokens=new)
    out, stats = speculative_generate(model, prompts, max_new_tokens=new)
    same = bool(np.array_equal(np.asarray(out), np.asarray(ref)))
    plain = timings(lambda: generate(model, prompts, max_new_tokens=new), reps=3)[0]
    spec = timings(lambda: speculative_generate(model, prompts, max_new_tokens=new)[0],
                   reps=3)[0]
    return same, stats, stats["decoder_calls"], plain, spec


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: the mode's)")
    parser.add_argument("--seeds", type=int, default=0, help="seeds (0: the mode's)")
    exp = Experiment("mtp_speculative", __doc__, parser=parser, argv=argv)
    q = exp.quick
    steps = exp.args.steps or (3 if q else 400)
    seeds = exp.args.seeds or (1 if q else 3)
    batch, seq_len = (2, 32) if q else (16, 128)
    size = dict(d_model=32, num_layers=2, d_ff=64) if q else dict(num_layers=4)
    n_prompts, plen, new = (2, 8, 8) if q else (8, 64, 64)
    exp.text(f"{load_average()} at start.")
    data = corpus("train", 100_000 if q else 4_000_000)
    val = corpus("validation", 40_000)
    prompts = jnp.asarray(np.stack([val[20_000 + i * 997:][:plen] for i in range(n_prompts)]))
    eval_tokens = 256 if q else 16384

    rows, results = [], {}
    for depth in DEPTHS:
        bpbs, accs, calls, ratio, count, same_all = [], [], [], [], None, True
        for seed in range(seeds):
            cfg = model_config(dict(TINY, **size, mtp_depth=depth))
            model = models.build(cfg, rngs=nnx.Rngs(seed))
            count = n_params(model)
            model, _ = train(model, data, steps=steps, batch=batch, seq_len=seq_len, seed=seed)
            bpbs.append(bits_per_byte(model, val, seq_len, eval_tokens))
            if depth:
                same, stats, n_calls, plain, spec = decode(model, prompts, new)
                same_all &= same
                accs.append(stats["acceptance"])
                calls.append(n_calls)
                ratio.append(plain / spec)
        results[depth] = dict(bpb=bpbs, acceptance=accs, decoder_calls=calls)
        mean = (lambda v: float(np.mean(v)) if v else math.nan)
        rows.append([depth, count, mean(bpbs), float(np.std(bpbs)),
                     mean(accs), mean(calls), mean(ratio),
                     "yes" if depth and same_all else ("-" if not depth else "NO")])
    exp.table(["MTP depth D", "params", "val bits/byte (mean)", "std over seeds",
               "draft acceptance", f"decoder calls (plain: {new - 1})",
               "plain / speculative wall",
               "= greedy"], rows,
              title=f"{steps} steps of batch {batch} x {seq_len}, {seeds} seed(s); decoding "
                    f"{n_prompts} prompts of {plen} bytes, {new} new")
    exp.text("Reading: greedy continuations of models this small fall into repeated "
             "patterns, which the modules draft well, so the acceptance here is an upper "
             "end of what text with more variety would give; the bits/byte column is the "
             "next-token head alone at equal training steps (the MTP models have more "
             "parameters, all in the modules).")
    exp.text(f"{load_average()} at end.")
    exp.finish()
    return results


if __name__ == "__main__":
    main()
