"""Components: LayerNorm vs RMSNorm, GELU vs SwiGLU, sequential vs parallel blocks,
pre- vs post-norm as depth grows.

    .venv/bin/python experiments/components.py            # full: ~5 CPU-minutes
    .venv/bin/python experiments/components.py --quick    # seconds (CI; a subset)

1. Speed (jitted, best of N, fp32, CPU; process CPU time, which preemption by other
   jobs does not inflate, next to wall time): the norm op alone on
   [8, 512, 512] (forward, and forward+backward w.r.t. input and scale), and a whole
   small decoder (d_model 256, 2 layers, 4 heads, d_ff 1024, T 256, B 8) forward +
   backward of the loss with norm = layernorm vs rmsnorm and block = sequential vs
   parallel (one shared norm, PaLM/GPT-J). Seed: RMSNorm "~10-15% faster"; parallel
   block "~15% faster".
2. Loss (tiny byte-level decoders on the stdlib corpus, d_model 64, 2 layers): GELU
   with d_ff 256 vs SwiGLU with d_ff 170 (2/3 of it, matched parameters), and
   sequential vs parallel, validation bits/byte after the same steps.
3. Stability: pre- vs post-norm at depth 2, 8 and 16 with the same (deliberately
   high) peak lr 1e-2, a short warmup and batch 8: final validation bits/byte, or where the
   loss diverged.
"""

from __future__ import annotations

from common import Experiment
from tinylm import bits_per_byte, build, corpus, load_average, n_params, timings, train

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.nn.norms import make_norm


def norm_speed(exp, shape, reps):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    rows = []
    for kind in ("layernorm", "rmsnorm"):
        norm = make_norm(kind, shape[-1], rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(norm)

        def fwd(params, x):
            return nnx.merge(graphdef, params)(x)

        f = jax.jit(fwd)
        g = jax.jit(jax.grad(lambda p, x: (fwd(p, x) ** 2).sum(), (0, 1)))
        fw, fc = timings(lambda: f(params, x), reps)
        gw, gc = timings(lambda: g(params, x), reps)
        rows.append([kind, 1e3 * fc, 1e3 * gc, 1e3 * fw, 1e3 * gw])
    base = rows[0]
    for r in rows:
        r += [r[1] / base[1], r[2] / base[2]]
    exp.table(["norm", "fwd CPU ms", "fwd+bwd CPU ms", "fwd wall ms", "fwd+bwd wall ms",
               "fwd CPU vs layernorm", "fwd+bwd CPU vs layernorm"], rows,
              title=f"Norm op alone, x {list(shape)} fp32")


def model_speed(exp, variants, size, batch, seq_len, reps):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)))
    rows = []
    for name, over in variants:
        cfg, model = build(**size, **over)
        graphdef, state = nnx.split(model)

        def loss(state, tokens):
            logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            lp = jax.nn.log_softmax(logits, -1)
            return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

        g = jax.jit(jax.value_and_grad(loss))
        fwd = jax.jit(loss)
        fw, fc = timings(lambda: fwd(state, tokens), reps)
        gw, gc = timings(lambda: g(state, tokens), reps)
        rows.append([name, n_params(model), 1e3 * fc, 1e3 * gc, 1e3 * fw, 1e3 * gw])
    exp.table(["model", "params", "fwd CPU ms", "fwd+bwd CPU ms", "fwd wall ms",
               "fwd+bwd wall ms"], rows,
              title=f"Whole decoder {size}, B={batch}, T={seq_len}")
    return rows


def main(argv=None):
    exp = Experiment("components", __doc__, argv=argv)
    q = exp.quick
    reps = 2 if q else 10
    exp.text(f"{load_average()} at start (2 cores shared with other jobs: times are noisy; "
             "each is the best of the repetitions).")

    # 1. speed
    norm_speed(exp, (2, 64, 64) if q else (8, 512, 512), reps)
    size = (dict(d_model=32, num_layers=1, d_ff=64) if q else
            dict(d_model=256, num_layers=2, num_heads=4, d_ff=1024))
    variants = [("layernorm, sequential", dict(norm="layernorm"))]
    if not q:
        variants += [("rmsnorm, sequential", dict(norm="rmsnorm")),
                     ("layernorm, parallel", dict(norm="layernorm", block="parallel")),
                     ("rmsnorm, parallel", dict(norm="rmsnorm", block="parallel"))]
    rows = model_speed(exp, variants, size, 2 if q else 8, 32 if q else 256, reps)
    if not q:
        t = {r[0]: r[3] for r in rows}
        exp.text("fwd+bwd CPU-time ratios: rmsnorm/layernorm (sequential) "
                 f"{t['rmsnorm, sequential'] / t['layernorm, sequential']:.3f}, parallel/sequential "
                 f"(layernorm) {t['layernorm, parallel'] / t['layernorm, sequential']:.3f}, "
                 f"(rmsnorm) {t['rmsnorm, parallel'] / t['rmsnorm, sequential']:.3f}.")

    # 2. loss at matched parameters
    steps, batch, seq_len = (3, 2, 32) if q else (200, 16, 128)
    data = corpus("train", 100_000 if q else 4_000_000)
    val = corpus("validation", 40_000)
    eval_tokens = 256 if q else 16384
    tiny = dict(d_model=32, num_layers=1, d_ff=64) if q else {}
    runs = [] if q else [("gelu, d_ff 256, sequential", dict(activation="gelu", d_ff=256)),
                         ("swiglu, d_ff 170, sequential", dict(activation="swiglu", d_ff=170)),
                         ("gelu, d_ff 256, parallel",
                          dict(activation="gelu", d_ff=256, block="parallel"))]
    rows = []
    for name, over in runs:
        _, model = build(**dict(over, **tiny))
        model, losses = train(model, data, steps=steps, batch=batch, seq_len=seq_len)
        rows.append([name, n_params(model), losses[-1],
                     bits_per_byte(model, val, seq_len, eval_tokens)])
    if rows:  # (quick mode skips this section: the same train() as section 3)
        exp.table(["model (d_model 64, 2 layers)", "params", "final train loss (nats)",
                   "val bits/byte"], rows,
                  title=f"Loss after {steps} steps, batch {batch} x {seq_len}, lr 3e-3")

    # 3. pre vs post norm stability
    depths = (1,) if q else (2, 8, 16)
    batch_s = 2 if q else 8
    steps_s = 3 if q else 150
    rows, curves = [], {}
    for placement in ("pre",) if q else ("pre", "post"):
        for depth in depths:
            _, model = build(**dict(tiny, num_layers=depth, norm_placement=placement))
            model, losses = train(model, data, steps=steps_s, batch=batch_s, seq_len=seq_len,
                                  lr=1e-2, warmup=10)
            # diverged: a non-finite loss, or ending above where the first step started
            diverged = not np.isfinite(losses[-1]) or losses[-1] >= losses[0]
            bpb = float("nan") if not np.isfinite(losses[-1]) else \
                bits_per_byte(model, val, seq_len, eval_tokens)
            rows.append([placement, depth, len(losses), losses[-1], min(losses), bpb, diverged])
            curves[f"{placement}-norm, {depth} layers"] = (
                list(range(1, len(losses) + 1)), [min(v, 8.0) for v in losses])
    exp.table(["norm placement", "layers", "steps run", "final train loss", "best train loss",
               "val bits/byte", "diverged (non-finite, or final >= first-step loss)"], rows,
              title=f"Pre vs post norm, peak lr 1e-2, warmup 10, {steps_s} steps of batch {batch_s} x {seq_len}")
    exp.plot(curves, xlabel="step", ylabel="train loss (nats, clipped at 8)",
             title="pre vs post norm, lr 1e-2")
    exp.text(f"{load_average()} at end.")
    exp.finish()


if __name__ == "__main__":
    main()
