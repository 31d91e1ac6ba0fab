"""Lost in the middle: passkey accuracy by the needle's depth (issue 9 item 8).

    python experiments/lost_in_middle.py [--quick]

The claim (Liu et al. 2023, "Lost in the Middle"): language models retrieve
information at the start or the end of a long context better than in the middle
(a U-shaped accuracy curve over the position of the relevant passage). Here a tiny
decoder is trained on `tfjax.data.synthetic.passkey` (a number of `num_digits`
digits hidden at a uniformly random depth in random filler, asked for at the
end), then evaluated with the needle placed at fixed depths 0, 0.1, ..., 1
(0 = start of the context, 1 = right before the question). Accuracy is over the
answer digits (chance 0.1; after the first digit the rest can be copied by
induction once the needle is found, so the first-digit accuracy is the purest
retrieval measure and is reported too). The seed's models are pretrained LLMs on
natural text; a tiny model trained on uniformly placed needles has no reason to
prefer the ends, so a flat curve is the expected, honest outcome here.
"""

from __future__ import annotations

import time

import numpy as np
from common import Experiment

from synthetic_tasks import BASE, quick_mode, trainer

from tfjax.data import synthetic


def main(argv=None):
    exp = Experiment("lost_in_middle", __doc__, argv=argv)
    base = dict(BASE)
    if exp.quick:
        quick_mode()
        base.update(num_layers=1, d_model=32, d_ff=64)
        steps, batch, T, n_eval, depths = 10, 8, 32, 1, [0.0, 0.5, 1.0]
    else:
        steps, batch, T, n_eval, depths = 400, 32, 96, 2, [i / 10 for i in range(11)]
    vocab, digits, lr = 32, 3, 3e-3
    kw = dict(seq_len=T, vocab_size=vocab, num_digits=digits)
    models = {"dense attention": dict(layer_pattern=("global",)),
              "mamba": dict(layer_pattern=("mamba",))}
    rows, curves, first = [], {}, {}
    for name, over in models.items():
        tr = trainer(dict(base, vocab_size=vocab, **over), steps=steps, lr=lr)
        t0 = time.perf_counter()
        params, rest, hist = tr.fit(lambda i: synthetic.passkey(i, batch=batch, **kw))
        train_s = time.perf_counter() - t0
        accs, firsts = [], []
        for depth in depths:
            evals = [synthetic.passkey(10_000 + i, batch=batch, depth=depth, **kw)
                     for i in range(n_eval)]
            accs.append(tr.accuracy(params, rest, evals))
            # the first answer digit alone: mask every answer position but the first
            firsts.append(tr.accuracy(params, rest, [(t, y, _first_only(m)) for t, y, m in evals]))
        curves[name], first[name] = accs, firsts
        rows += [[name, d, a, f] for d, a, f in zip(depths, accs, firsts)]
        print(name, "final train loss", hist[-1][1], "train s", train_s, flush=True)
        exp.text(f"{name}: final train loss {hist[-1][1]:.4g} after {steps} steps "
                 f"({train_s:.0f} s incl. compile)")
    exp.text(f"passkey: seq_len {T}, {digits} digits, vocab {vocab}; decoders "
             f"{base['num_layers']} layers, d_model={base['d_model']}, AdamW lr {lr}, batch "
             f"{batch}, {steps} steps on uniformly random depths; each depth evaluated on "
             f"{n_eval * batch} held-out sequences.")
    exp.table(["model", "depth", "answer-digit accuracy", "first-digit accuracy"], rows,
              title="Passkey accuracy by needle depth")
    spread = [[n, min(c), max(c), float(np.mean(c[1:-1])) if len(c) > 2 else float("nan"),
               (c[0] + c[-1]) / 2] for n, c in curves.items()]
    exp.table(["model", "min over depths", "max over depths", "mean of middle depths",
               "mean of depth 0 and 1"], spread, title="U-shape check (ends vs middle)")
    curves_all = {f"{n} (all digits)": (depths, c) for n, c in curves.items()}
    curves_all.update({f"{n} (first digit)": (depths, c) for n, c in first.items()})
    exp.plot(curves_all, xlabel="needle depth (0 = start, 1 = end)", ylabel="accuracy",
             title="Passkey retrieval by depth")
    return exp.finish()


def _first_only(mask):
    m = np.asarray(mask)
    first = m & (np.cumsum(m, axis=1) == 1)
    return first


if __name__ == "__main__":
    main()
