"""Sliding-window receptive field: L layers of window W reach L*W tokens back (issue 9 item 5).

    python experiments/window_receptive_field.py [--quick]

The seed's claim: a stack of L sliding-window layers of window W has an effective
receptive field of L*W tokens (Longformer, Mistral), so information farther back
than W still arrives, relayed through intermediate positions; one layer cannot see
past W. Task (`tfjax.data.synthetic.delayed_copy`): at every position t >= d output
the token exactly d positions back (random tokens, so nothing but the token at t-d
predicts the answer; chance = 1/(vocab-1)). Tiny decoders whose every layer is a
"local" layer (a query sees itself and the W keys before it), trained with the
same steps for each (layers, distance); a one-layer global-attention decoder is
the reference that sees everything. Prediction: accuracy ~1 when d <= L*W, ~chance
when d > L*W.
"""

from __future__ import annotations

import time

from common import Experiment

from synthetic_tasks import BASE, quick_mode, trainer

from tfjax.data import synthetic


def main(argv=None):
    exp = Experiment("window_receptive_field", __doc__, argv=argv)
    base = dict(BASE)
    if exp.quick:
        quick_mode()
        base.update(d_model=32, d_ff=64)
        W, layers, distances = 4, [1, 2], [2, 6]
        steps, batch, T, n_eval, reference = 8, 8, 24, 1, False
    else:
        W, layers, distances = 4, [1, 2, 3], [2, 4, 6, 8, 12]
        steps, batch, T, n_eval, reference = 250, 32, 48, 2, True
    vocab, lr = 16, 3e-3
    models = [(f"{L} x local W={W}", dict(layer_pattern=("local",), num_layers=L,
                                          attention=dict(sliding_window=W)), L * W) for L in layers]
    if reference:
        models.append(("1 x global", dict(layer_pattern=("global",), num_layers=1), None))
    acc = {}
    rows = []
    for label, over, reach in models:
        tr = trainer(dict(base, vocab_size=vocab, **over), steps=steps, lr=lr)
        for d in distances:
            def data(i, d=d):
                return synthetic.delayed_copy(i, batch=batch, seq_len=T, distance=d,
                                              vocab_size=vocab)
            t0 = time.perf_counter()
            params, rest, hist = tr.fit(data, seed=d)
            a = tr.accuracy(params, rest, [data(10_000 + i) for i in range(n_eval)])
            acc[label, d] = a
            solvable = "yes" if reach is None or d <= reach else "no"
            rows.append([label, d, reach if reach else "all", solvable, hist[-1][1], a,
                         time.perf_counter() - t0])
            print(rows[-1], flush=True)
    exp.text(f"delayed_copy, vocab {vocab} (chance {1 / (vocab - 1):.3f}), seq_len {T}; "
             f"decoders d_model={base['d_model']}, {base['num_heads']} heads, RoPE; AdamW lr "
             f"{lr}, batch {batch}, {steps} steps per cell; accuracy over {n_eval * batch} "
             f"held-out sequences (all positions t >= d).")
    exp.table(["model", "distance d", "reach L*W", "d <= L*W", "final train loss",
               "accuracy", "seconds"], rows, title="Accuracy by (layers, distance)")
    grid = [[label] + [acc[label, d] for d in distances] for label, _, _ in models]
    exp.table(["model"] + [f"d={d}" for d in distances], grid, title="Accuracy grid")
    exp.plot({label: (distances, [acc[label, d] for d in distances]) for label, _, _ in models},
             xlabel="distance d (tokens back)", ylabel="accuracy",
             title=f"Delayed copy: receptive field of L layers of window {W}")
    return exp.finish()


if __name__ == "__main__":
    main()
