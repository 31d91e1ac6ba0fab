"""Position encodings and length extrapolation: train at 128, evaluate at 128..1024.

    .venv/bin/python experiments/positions.py            # full: ~6-8 CPU-minutes
    .venv/bin/python experiments/positions.py --quick    # seconds (CI)

Tiny byte-level decoders of the same size (d_model 64, 2 layers, 4 heads, d_ff 256,
RMSNorm, GELU) are trained on the stdlib corpus at length 128 with position =
sinusoidal, learned, rope, alibi, t5 (T5's learned bucketed bias: 32 buckets, max
distance 128, evaluated per tile by the blockwise attention) and none (max_len
1024, so the learned table has rows past 128 that never receive a gradient). Validation bits per byte is then
measured at lengths 128, 256, 512 and 1024 over the same validation bytes.

The RoPE model is then evaluated, unchanged weights, with the context-extension
scalings linear (position interpolation), ntk (NTK-aware base), dynamic_ntk and
yarn at factor 8 (original_max_len 128, so 1024 = 8 x 128), and again after a short
fine-tune at length 512 with each scaling (and with none, as the baseline).

The seed's claim (its positions table): ALiBi extrapolates "excellently",
sinusoidal and learned "poorly", RoPE "moderately", better with scaling. Press et
al. (2022) also found T5's bias to extrapolate well (distances past max_distance
share one bucket).
"""

from __future__ import annotations

from common import Experiment
from tinylm import best_of, bits_per_byte, build, corpus, load_average, n_params, train  # noqa: F401

from flax import nnx

from tfjax import models
from tfjax.config import model_config


def rescale(model, cfg, scaling: str, factor: float, original: int):
    """The same weights under another RoPE scaling (RoPE has no parameters)."""
    rope = dict(vars(cfg.rope), scaling=scaling, factor=factor, original_max_len=original)
    new_cfg = model_config(dict(vars(cfg), rope=rope))
    graphdef, _ = nnx.split(models.build(new_cfg, rngs=nnx.Rngs(0)))
    _, state = nnx.split(model)
    return new_cfg, nnx.merge(graphdef, state)


def main(argv=None):
    exp = Experiment("positions", __doc__, argv=argv)
    q = exp.quick
    steps, batch, train_len = (5, 4, 32) if q else (400, 16, 128)
    lengths = (32, 64) if q else (128, 256, 512, 1024)
    eval_tokens = 256 if q else 32768
    ft_steps, ft_len, ft_batch = (2, 64, 2) if q else (60, 512, 4)
    factor = lengths[-1] / train_len
    train_data = corpus("train", 100_000 if q else 4_000_000)
    val = corpus("validation", eval_tokens + lengths[-1] + 1)
    size = dict(d_model=32, num_layers=1, d_ff=64) if q else {}
    positions = ("rope",) if q else ("sinusoidal", "learned", "rope", "alibi", "t5", "none")
    scalings = ("yarn",) if q else ("none", "linear", "ntk", "dynamic_ntk", "yarn")
    tuned = () if q else scalings  # quick: no fine-tune (one more compile)
    exp.text(f"Training length {train_len}, {steps} steps of batch {batch}, lr 3e-3 (AdamW, "
             f"warmup + cosine); validation bits/byte over the same {eval_tokens} validation "
             f"bytes at each length. {load_average()} at start.")

    rows, curves, trained = [], {}, {}
    for pos in positions:
        cfg, model = build(position=pos, **size)
        model, losses = train(model, train_data, steps=steps, batch=batch, seq_len=train_len)
        bpb = [bits_per_byte(model, val, L, eval_tokens) for L in lengths]
        rows.append([pos, n_params(model), losses[-1]] + bpb)
        curves[pos] = (list(lengths), bpb)
        trained[pos] = (cfg, model)
    header = ["position", "params", "final train loss (nats)"] + [f"bpb @ {L}" for L in lengths]
    exp.table(header, rows, title=f"Trained at {train_len}: validation bits/byte by length")
    exp.plot(curves, xlabel="evaluation length", ylabel="bits / byte", logx=True,
             title=f"trained at {train_len}")

    cfg, rope_model = trained["rope"]
    rows, curves = [], {}
    for scaling in scalings:
        f = 1.0 if scaling == "none" else factor
        _, m = rescale(rope_model, cfg, scaling, f, train_len)
        bpb = [bits_per_byte(m, val, L, eval_tokens) for L in lengths]
        rows.append([scaling, f, "no"] + bpb)
        curves[f"{scaling} (no fine-tune)"] = (list(lengths), bpb)
    for scaling in tuned:
        f = 1.0 if scaling == "none" else factor
        _, m = rescale(rope_model, cfg, scaling, f, train_len)
        m, _ = train(m, train_data, steps=ft_steps, batch=ft_batch, seq_len=ft_len, lr=1e-3,
                     warmup=5, seed=1)
        bpb = [bits_per_byte(m, val, L, eval_tokens) for L in lengths]
        rows.append([scaling, f, f"{ft_steps} steps @ {ft_len}"] + bpb)
    exp.table(["rope scaling", "factor", "fine-tune"] + [f"bpb @ {L}" for L in lengths], rows,
              title="RoPE model with context-extension scaling (original_max_len "
                    f"{train_len})")
    exp.plot(curves, xlabel="evaluation length", ylabel="bits / byte", logx=True,
             title="RoPE scalings, no fine-tune", suffix="_rope")
    exp.text(f"{load_average()} at end.")
    exp.finish()


if __name__ == "__main__":
    main()
