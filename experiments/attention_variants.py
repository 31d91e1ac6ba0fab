"""Differential attention and value-residual learning vs a baseline decoder, at equal
parameter count, on the stdlib corpus (validation bits/byte, three seeds).

    .venv/bin/python experiments/attention_variants.py            # full: ~11 CPU-minutes (18 wall on 2 shared cores)
    .venv/bin/python experiments/attention_variants.py --quick    # seconds (the test)

Models (tiny byte-level decoders, `tinylm.TINY` at 4 layers: d_model 64, d_ff 256,
RoPE, RMSNorm, GELU):

- baseline: 4 heads of head_dim 16;
- differential attention (`model.attention.differential`, Ye et al. 2024): 2 heads of head_dim
  32, each split into two half-heads of 16: the paper's matching (half the heads,
  each softmax over the baseline's head dim), so the q/k/v/o projections have the
  same shapes as the baseline's; it adds lambda's 4 x 16 and the head norm's 32
  parameters per layer (+0.2%);
- differential attention with the baseline's 4 heads of 16, split into half-heads
  of 8 (the same projection shapes again; lambda 4 x 8 and the norm 16 per layer):
  the reference code's README advises against halving few heads, and 4 -> 2 is the
  fewest;
- value residual (`model.attention.value_residual="fixed"`, ResFormer, Zhou et al. 2024):
  the baseline with v_n <- (v_n + v_1) / 2 for layers n > 1; no parameters added.

Each is trained the same way (`tinylm.train`: AdamW, warmup + cosine, lr 3e-3,
batch 16 x 128 random crops of the train split) from three seeds (the model init
and the crop order), then evaluated on fixed windows of the validation split.
"""

from __future__ import annotations

import argparse

from common import Experiment
from tinylm import bits_per_byte, corpus, load_average, n_params, train

import numpy as np
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tinylm import TINY

VARIANTS = {
    "baseline": dict(),
    "differential attention (2 heads of 32)": dict(num_heads=2, attention=dict(differential=True)),
    "differential attention (4 heads of 16)": dict(attention=dict(differential=True)),
    "value residual (fixed 0.5/0.5)": dict(attention=dict(value_residual="fixed")),
}


def build(seed, **overrides):
    return models.build(model_config(dict(TINY, **overrides)), rngs=nnx.Rngs(seed))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: the mode's)")
    parser.add_argument("--seeds", type=int, default=0, help="seeds (0: the mode's)")
    exp = Experiment("attention_variants", __doc__, parser=parser, argv=argv)
    q = exp.quick
    steps = exp.args.steps or (3 if q else 300)
    seeds = exp.args.seeds or (1 if q else 3)
    batch, seq_len = (2, 32) if q else (16, 128)
    size = dict(d_model=32, num_layers=2, d_ff=64) if q else dict(num_layers=4)
    exp.text(f"{load_average()} at start.")
    data = corpus("train", 100_000 if q else 4_000_000)
    val = corpus("validation", 40_000)
    eval_tokens = 256 if q else 16384

    rows, curves, per_seed = [], {}, {}
    for name, over in VARIANTS.items():
        bpbs, finals, count = [], [], None
        for seed in range(seeds):
            model = build(seed, **size, **over)
            count = n_params(model)
            model, losses = train(model, data, steps=steps, batch=batch, seq_len=seq_len,
                                  seed=seed)
            finals.append(losses[-1])
            bpbs.append(bits_per_byte(model, val, seq_len, eval_tokens))
            if seed == 0:  # a smoothed training curve of the first seed
                w = max(1, min(20, len(losses) // 5))
                smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
                xs = list(range(w, len(losses) + 1))
                curves[name] = (xs[::max(1, len(xs) // 30)], list(smooth[::max(1, len(xs) // 30)]))
        per_seed[name] = bpbs
        rows.append([name, count, np.mean(finals), np.mean(bpbs), np.std(bpbs),
                     ", ".join(f"{b:.4f}" for b in bpbs)])
    base = rows[0][3]
    for r in rows:
        r.insert(5, r[3] - base)
    exp.table(["model", "params", "final train loss (nats, mean)", "val bits/byte (mean)",
               "std over seeds", "vs baseline", "per seed"], rows,
              title=f"{steps} steps of batch {batch} x {seq_len}, {seeds} seed(s), "
                    f"{TINY['d_model'] if not q else size['d_model']}-wide, "
                    f"{size['num_layers']} layers")
    exp.plot(curves, xlabel="step", ylabel="train loss (nats, moving mean)",
             title="attention variants (seed 0)")
    exp.text(f"{load_average()} at end.")
    exp.finish()
    return per_seed


if __name__ == "__main__":
    main()
