"""Fingerprints of the programs tfjax lowers, for refactors that must not change them.

    python experiments/hlo_fingerprint.py                  # print one sha256 per program
    python experiments/hlo_fingerprint.py --write F.json   # ... and save them
    python experiments/hlo_fingerprint.py --check F.json   # exit 1 on any difference
    python experiments/hlo_fingerprint.py --save-outputs F.npz      # decode outputs, then
    python experiments/hlo_fingerprint.py --compare-outputs F.npz   # bitwise, after a change

Each program is lowered (not compiled) on simulated CPU devices and its StableHLO
text, without debug locations, is hashed: the default preset's train and eval steps
on 2 devices, the same on a 2x2x2 mesh (data x fsdp x tensor, and data x sequence x
tensor: ring attention), and the prefill and decode steps of a hybrid decoder with
every decoding layer kind (global, local, mla, mamba, mamba2, linear,
gated_deltanet). A refactor that leaves every fingerprint as it was leaves the
computation exactly as it was. One that moves work between places (an index
computed once a step instead of in every layer) changes the text, not the values:
`--save-outputs` before and `--compare-outputs` after check the hybrid decoder's
logits (prefill, decode, chunk, scanned and unrolled) and `generate`'s tokens bit
for bit (on the same machine and jax).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import default  # noqa: E402
from tfjax import config as C  # noqa: E402
from tfjax.inference import generate  # noqa: E402
from tfjax.models import build  # noqa: E402
from tfjax.parallel.mesh import make_mesh  # noqa: E402
from tfjax.train.program import build_program  # noqa: E402


def _digest(lowered) -> str:
    return hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()[:16]


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def train_and_eval(name: str, mesh: dict, devices: int) -> dict[str, str]:
    preset = default.get_config()
    preset.mesh.update(mesh)
    cfg = C.run_config(preset).validate()
    p = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:devices]), build)
    state = _abstract(p.abstract_state, p.state_shardings)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=p.batch_shardings[k])
             for k, shape in p.batch_shapes.items()}
    return {f"{name}/train": _digest(p.step.lower(state, batch)),
            f"{name}/eval": _digest(p.eval.lower(state, batch))}


HYBRID = dict(vocab_size=64, d_model=32, num_layers=7, num_heads=4, num_kv_heads=2, d_ff=64,
              norm="rmsnorm", activation="swiglu", max_len=64,
              layer_pattern=("global", "local", "mla", "mamba", "mamba2", "linear",
                             "gated_deltanet"),
              mla=dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
              mamba2=dict(head_dim=8, d_state=8, chunk=4), gdn=dict(chunk=4),
              attention=dict(sliding_window=3))


def decode(scan_layers: bool) -> dict[str, str]:
    cfg = C.model_config({**HYBRID, "scan_layers": scan_layers})
    model = build(cfg, rngs=nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    B, T, L = 2, 5, 16
    cache = model.init_cache(B, L)

    def step(state, tokens, cache, lengths, extend=False):
        return nnx.merge(graphdef, state).step(tokens, cache, lengths, extend=extend)

    tokens, lengths = jnp.zeros((B, T), jnp.int32), jnp.array([T, 3], jnp.int32)
    tag = "scanned" if scan_layers else "unrolled"
    f = jax.jit(step, static_argnames="extend")
    return {f"hybrid_{tag}/prefill": _digest(f.lower(state, tokens, cache, lengths)),
            f"hybrid_{tag}/decode": _digest(f.lower(state, tokens[:, :1], cache, None)),
            f"hybrid_{tag}/chunk": _digest(f.lower(state, tokens, cache, lengths, extend=True))}


def decode_outputs() -> dict[str, np.ndarray]:
    """The hybrid decoder's logits through a prefill, decode steps and a chunk, and the
    tokens `generate` makes (greedy with chunked prefill, and sampled), scanned and
    unrolled."""
    out = {}
    for scan in (True, False):
        cfg = C.model_config({**HYBRID, "scan_layers": scan, "init_std": 0.3})
        model = build(cfg, rngs=nnx.Rngs(0))
        model.eval()
        x = jax.random.randint(jax.random.key(1), (2, 7), 0, HYBRID["vocab_size"])
        lengths = jnp.array([7, 4])
        logits, cache = model.step(x, model.init_cache(2, 24), lengths)
        tag = "scanned" if scan else "unrolled"
        out[f"{tag}/prefill"] = logits
        for i in range(3):
            logits, cache = model.step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
            out[f"{tag}/decode{i}"] = logits
        logits, cache = model.step(x[:, :3], cache, jnp.array([3, 0]), extend=True)
        out[f"{tag}/chunk"] = logits
        logits, cache = model.step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
        out[f"{tag}/after_chunk"] = logits
        out[f"{tag}/generate"] = generate(model, x, max_new_tokens=12, prompt_lengths=lengths,
                                          prefill_chunk=3)
        out[f"{tag}/generate_sampled"] = generate(model, x, max_new_tokens=12,
                                                  prompt_lengths=lengths, temperature=0.7,
                                                  top_k=20, seed=3)
    return {k: np.asarray(v) for k, v in out.items()}


def fingerprints() -> dict[str, str]:
    out = {}
    out.update(train_and_eval("default_2dev", dict(data=2), 2))
    out.update(train_and_eval("mesh_data_fsdp_tensor", dict(data=2, fsdp=2, tensor=2), 8))
    out.update(train_and_eval("mesh_data_sequence_tensor", dict(data=2, sequence=2, tensor=2), 8))
    out.update(decode(True))
    out.update(decode(False))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="save the fingerprints to this JSON file")
    ap.add_argument("--check", help="compare with the fingerprints in this JSON file")
    ap.add_argument("--save-outputs", help="save the decode outputs to this .npz file")
    ap.add_argument("--compare-outputs", help="compare the decode outputs with this .npz file")
    args = ap.parse_args()
    if args.save_outputs or args.compare_outputs:
        got = decode_outputs()
        if args.save_outputs:
            np.savez(args.save_outputs, **got)
            print(f"saved {len(got)} arrays to {args.save_outputs}")
            return 0
        want = np.load(args.compare_outputs)
        bad = [k for k in got if k not in want.files or not np.array_equal(got[k], want[k])]
        for k in got:
            print(f"{k:<28} {'CHANGED' if k in bad else 'bitwise equal'}")
        return 1 if bad else 0
    got = fingerprints()
    width = max(map(len, got))
    want = json.load(open(args.check)) if args.check else {}
    bad = 0
    for k, v in got.items():
        verdict = "" if not want else ("same" if want.get(k) == v else f"CHANGED (was {want.get(k)})")
        bad += bool(want) and want.get(k) != v
        print(f"{k:<{width}}  {v}  {verdict}")
    if args.write:
        with open(args.write, "w") as f:
            json.dump(got, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
