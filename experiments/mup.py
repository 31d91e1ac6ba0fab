"""μP: does the best learning rate transfer across width?

    .venv/bin/python experiments/mup.py            # full: ~15-25 min on 2 CPU cores
    .venv/bin/python experiments/mup.py --quick    # seconds (CI)

Decoders of width 64, 128, 256, 512 (2 layers, 4 heads: the head dim grows with the
width, FFN 4x, GELU, RMSNorm, RoPE, untied head, byte vocabulary) trained on the
stdlib corpus (the trainer's default data) with AdamW (b1 0.9, b2 0.95, weight decay
0.1, clipping 1.0, 20 warmup steps then cosine to 10 %), random crops of 64 bytes,
batch 8, for 200 steps, at learning rates 2^-10 .. 2^-5, in the
standard parametrization and in μP with base width 64 (`model.mup_base_width=64`:
`tfjax.models.mup`; identical to the standard model at width 64). Reported:
validation bits per byte (the first 32k validation bytes) after training, and the
best learning rate per width.

The claim (Yang et al. 2022, Tensor Programs V): in the standard parametrization
the best learning rate shrinks as the model widens; in μP it stays put, so it can be
tuned on the small model. One seed per point (the curves are smooth in lr).
"""

from __future__ import annotations

import math

from common import Experiment
from tinylm import corpus, load_average

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax import models
from tfjax.config import TrainConfig, model_config
from tfjax.train.losses import LN2
from tfjax.train.optim import make_optimizer

BASE_WIDTH = 64


def model_cfg(width: int, mup: bool):
    return model_config(dict(vocab_size=256, d_model=width, num_layers=2, num_heads=4,
                             d_ff=4 * width, norm="rmsnorm", activation="gelu", position="rope",
                             max_len=128, tie_embeddings=False,
                             mup_base_width=BASE_WIDTH if mup else 0))


def train_and_eval(width: int, mup: bool, lrs, data, val, *, steps: int, batch: int, seq: int):
    """Validation bits per byte after `steps` at each learning rate (one compilation:
    the schedule's shape at lr 1, times the traced lr)."""
    cfg = model_cfg(width, mup)
    t = TrainConfig(lr=1.0, steps=steps, warmup_steps=min(20, steps // 4), schedule="cosine",
                    lr_min_ratio=0.1, b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0)
    tx = make_optimizer(t, cfg)

    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def run(lr, crops, val_rows):
        model = models.build(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def step(carry, tokens):
            p, s = carry
            value, g = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, rest), tokens))(p)
            u, s = tx.update(g, s, p)
            u = jax.tree.map(lambda x: x * lr, u)
            return (optax.apply_updates(p, u), s), value

        (p, _), losses = jax.lax.scan(step, (params, tx.init(params)), crops)
        val_loss = loss(nnx.merge(graphdef, p, rest), val_rows)
        return val_loss / LN2, losses[-1]

    rng = np.random.default_rng(0)  # the same crops for every lr and width
    idx = rng.integers(0, len(data) - seq - 1, (steps, batch))
    crops = jnp.asarray(data[idx[..., None] + np.arange(seq + 1)])
    n = len(val) // (seq + 1)
    val_rows = jnp.asarray(val[:n * (seq + 1)].reshape(n, seq + 1))
    out = []
    for lr in lrs:
        bpb, last = run(jnp.float32(lr), crops, val_rows)
        bpb = float(bpb)
        out.append(bpb if math.isfinite(bpb) else float("nan"))
    return out


def main(argv=None):
    exp = Experiment("mup", __doc__, argv=argv)
    q = exp.quick
    widths = [64, 128] if q else [64, 128, 256, 512]
    lrs = [2.0 ** e for e in ([-8, -6] if q else range(-10, -4))]
    steps, batch, seq = (10, 4, 32) if q else (200, 8, 64)
    data = corpus("train", 400_000 if not q else 20_000)
    val = corpus("validation", 32_768 if not q else 4_096)
    exp.text(f"{steps} steps x {batch} x {seq} bytes; validation {len(val):,} bytes. "
             f"{load_average()} at start.")
    rows, curves, best = [], {"standard": {}, "μP": {}}, []
    for width in widths:
        for mup in (False, True):
            name = "μP" if mup else "standard"
            bpbs = train_and_eval(width, mup, lrs, data, val, steps=steps, batch=batch, seq=seq)
            for lr, bpb in zip(lrs, bpbs):
                rows.append((width, name, f"2^{round(math.log2(lr))}", bpb))
            curves[name][f"width {width}"] = ([math.log2(lr) for lr in lrs], bpbs)
            finite = [(b, lr) for b, lr in zip(bpbs, lrs) if math.isfinite(b)]
            b, lr = min(finite) if finite else (float("nan"), float("nan"))
            best.append((width, name, f"2^{round(math.log2(lr))}" if finite else "-", b))
            print(f"  width {width} {name}: " + " ".join(f"{x:.3f}" for x in bpbs), flush=True)
    exp.table(["width", "parametrization", "lr", "val bits/byte"], rows,
              title="Validation bits per byte after training")
    exp.table(["width", "parametrization", "best lr", "val bits/byte at it"], best,
              title="Best learning rate per width")
    for name, suffix in (("standard", "_standard"), ("μP", "_mup")):
        exp.plot(curves[name], xlabel="log2 learning rate", ylabel="validation bits/byte",
                 title=f"{name}: bits/byte vs lr", suffix=suffix)
    exp.finish()
    return best


if __name__ == "__main__":
    main()
