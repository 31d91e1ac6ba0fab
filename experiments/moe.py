"""Mixture of Experts: total vs active parameters, throughput, expert load (issue 9 item 7).

    python experiments/moe.py [--quick]

1. Parameters of the full-size Mixtral 8x7B and Jamba v0.1 presets, counted from
   abstract shapes (`nnx.eval_shape`: nothing is allocated). Active parameters per
   token = total - (1 - k/E) x the routed experts' weights (the router, shared
   experts, attention, Mamba and dense layers are always active). Published:
   Mixtral 46.7B total / 12.9B active (Jiang et al. 2024); Jamba 52B / 12B
   (Lieber et al. 2024).
2. Tiny models on the Python standard library's bytes (the corpus tfjax trains on
   by default): a top-2-of-8 MoE decoder against a dense decoder of equal active
   parameters (its FFN width = k x the expert width); training throughput (tokens/s
   of the jitted train step, after compilation) and validation loss.
3. Expert load (`tfjax.nn.moe.moe_aux`: each expert's share of the routed
   assignments, mean over layers, on held-out batches) after training without
   (weight 0) and with the Switch load-balancing loss: balanced is 1/E per expert
   and load_balance_loss 1.0. The claim: without the auxiliary loss routing drifts
   towards a few experts; with it the load stays near uniform.
"""

from __future__ import annotations

import time

import numpy as np
from common import Experiment, preset_config

import jax
from flax import nnx

from synthetic_tasks import quick_mode, trainer

from tfjax.config import model_config
from tfjax.data.sources import stdlib_files
from tfjax.models import build
from tfjax.nn.moe import MoE

ROUTED = ("wi_gate", "wi_up", "wi", "wo", "bi_gate", "bi_up", "bi", "bo")
PUBLISHED = {"mixtral": (46.7e9, 12.9e9), "jamba": (52e9, 12e9)}


def count_params(model_cfg) -> tuple[int, int, int]:
    """(total, active per token, routed expert) parameters from abstract shapes."""
    cfg = model_config(model_cfg)
    abstract = nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    routed = inactive = 0
    for _, m in nnx.iter_graph(abstract):
        if isinstance(m, MoE):
            size = sum(int(np.prod(getattr(m, n).shape)) for n in ROUTED if hasattr(m, n))
            routed += size
            inactive += size - size * m.k // m.num_experts
    return total, total - inactive, routed


def byte_corpus(split: str, max_bytes: int) -> np.ndarray:
    out, n = [], 0
    for path in stdlib_files(split):
        with open(path, "rb") as f:
            out.append(f.read())
        n += len(out[-1])
        if n >= max_bytes:
            break
    return np.frombuffer(b"".join(out)[:max_bytes], np.uint8).astype(np.int32)


def crops(data: np.ndarray, seed: int, batch: int, T: int):
    """Next-byte prediction on random crops: (tokens, targets, loss_mask) like synthetic."""
    start = np.random.default_rng(seed).integers(0, len(data) - T - 1, size=batch)
    idx = start[:, None] + np.arange(T + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:], np.ones((batch, T), bool)


def main(argv=None):
    exp = Experiment("moe", __doc__, argv=argv)
    # 1. Full-size presets (abstract shapes: seconds, no memory).
    rows = []
    for name in ("mixtral", "jamba"):
        m = preset_config(name).model
        total, active, routed = count_params(m)
        pt, pa = PUBLISHED[name]
        rows.append([name, m.moe.num_experts, m.moe.experts_per_token, total, active, routed,
                     f"{total / 1e9:.1f}B / {active / 1e9:.1f}B", f"{pt / 1e9:g}B / {pa / 1e9:g}B"])
    exp.table(["preset", "E", "k", "total params", "active params", "routed expert params",
               "total / active", "published"], rows,
              title="Total vs active parameters (nnx.eval_shape, no allocation)")

    # 2-3. Tiny trained models.
    if exp.quick:
        quick_mode()
        E, k, F, D, L = 4, 2, 32, 32, 1
        steps, batch, T, n_eval, timed = 6, 4, 32, 1, 3
        aux_weights = [0.01]  # one MoE model (one compile): the same code path as several
    else:
        E, k, F, D, L = 8, 2, 64, 64, 2
        steps, batch, T, n_eval, timed = 150, 8, 64, 4, 10
        aux_weights = [0.0, 0.01, 0.1]
    lr = 3e-3
    train = byte_corpus("train", 2_000_000 if not exp.quick else 100_000)
    val = byte_corpus("validation", 200_000 if not exp.quick else 20_000)
    base = dict(arch="decoder", vocab_size=256, d_model=D, num_layers=L, num_heads=4,
                position="rope", norm="rmsnorm", activation="swiglu", ffn_bias=False,
                max_len=1024)
    models = {"dense (F = k x expert width)": dict(base, d_ff=k * F)}
    for w in aux_weights:
        models[f"MoE {E}x top-{k}, aux weight {w:g}"] = dict(
            base, d_ff=F, ffn_pattern=("moe",),
            moe=dict(num_experts=E, experts_per_token=k, impl="ragged", aux_loss_weight=w,
                     z_loss_weight=0.0))
    rows, loads = [], {}
    evals = [crops(val, 10_000 + i, batch, T) for i in range(n_eval)]
    for name, cfg in models.items():
        total, active, _ = count_params(cfg)
        tr = trainer(cfg, steps=steps, lr=lr)
        params, rest, hist = tr.fit(lambda i: crops(train, i, batch, T))
        ev = tr.evaluate(params, rest, evals)
        # throughput: the same compiled step, timed after compilation
        p, r, o = tr.init(0)
        b = crops(train, 0, batch, T)
        jax.block_until_ready(tr.train_step(p, r, o, *b))
        t0 = time.perf_counter()
        for _ in range(timed):
            p, r, o, st = tr.train_step(p, r, o, *b)
        jax.block_until_ready(st)
        tps = timed * batch * T / (time.perf_counter() - t0)
        load = ev.get("expert_load")
        lb = float(ev["load_balance_loss"]) if load is not None else float("nan")
        if load is not None:
            loads[name] = np.asarray(load)
        rows.append([name, total, active, tps, float(ev["loss"]), lb,
                     float(np.max(load) * len(load)) if load is not None else "-",
                     float(np.min(load) * len(load)) if load is not None else "-"])
        print(rows[-1], flush=True)
    exp.text(f"Byte-level LM on stdlib .py files: {L} layers, d_model={D}, 4 heads, SwiGLU; "
             f"MoE: {E} experts of width {F}, top-{k}, renormalised, dropless (ragged_dot); "
             f"dense: width {k * F} (equal active parameters). AdamW lr {lr}, batch {batch} x "
             f"{T} tokens, {steps} steps; validation loss (nats/byte) and expert load on "
             f"{n_eval * batch} held-out crops; tokens/s over {timed} timed train steps on "
             f"{jax.devices()[0].platform} (a shared machine: treat as rough).")
    exp.table(["model", "total params", "active params", "train tokens/s", "val loss",
               "load_balance_loss", "max load x E", "min load x E"], rows,
              title="Tiny MoE vs dense, and expert load with/without the auxiliary loss")
    if loads:
        exp.table(["model"] + [f"expert {e}" for e in range(E)],
                  [[n] + [float(x) for x in v] for n, v in loads.items()],
                  title="Expert load: share of routed assignments per expert (balanced = "
                        f"{1 / E:.3g})")
        exp.plot({n: (list(range(E)), sorted(v.tolist(), reverse=True))
                  for n, v in loads.items()},
                 xlabel="expert (sorted by load)", ylabel="share of assignments",
                 title="Expert load")
    return exp.finish()


if __name__ == "__main__":
    main()
